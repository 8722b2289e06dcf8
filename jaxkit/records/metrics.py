"""The run directory: resolved config, batch plan, metrics as JSON lines and TensorBoard
scalars, summary. Only process 0 writes one. Where a Weights & Biases run follows it
(jaxkit/records/wandb_log.py), the same scalars under the same tags and the summary go there too.

The directory may be a URL (`gs://bucket/run`). Object stores cannot append, so there the
two files that grow line by line, metrics.jsonl and the TensorBoard event file, are written
in a local staging directory and uploaded whole: with the first record, then at most every
`UPLOAD_EVERY_S` seconds, and when the run ends.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Sequence
from typing import Protocol

import tensorboardX

from jaxkit.workdir import as_path, is_local, make_dirs, write_text_atomic

# metrics.jsonl key -> TensorBoard tag, for train records and eval records.
TRAIN_TAGS = {
    "loss": "train/loss",
    "learning_rate": "train/learning_rate",
    "grad_norm": "train/grad_norm",
    "skipped_micro_batches": "train/skipped_micro_batches",
    "examples_per_s": "throughput/examples_per_s",
    "tokens_per_s": "throughput/tokens_per_s",
    "step_time_s": "throughput/step_time_s",
    "flops_per_s": "throughput/flops_per_s",
    "mfu": "throughput/mfu",
    "hfu": "throughput/hfu",
    "noise_scale": "noise_scale/b_simple",
    "global_batch_size": "batch/global_batch_size",
    "grad_accum_steps": "batch/grad_accum_steps",
    "grad_sq_estimate": "noise_scale/grad_sq",
    "grad_var_estimate": "noise_scale/grad_var",
}
EVAL_TAGS = {"eval_loss": "eval/loss", "eval_accuracy": "eval/accuracy"}

# Seconds between uploads of the growing files to an object store. An upload blocks the
# loop for a round trip (process 0 only, but the others wait at the next collective), and
# GCS takes about one write per second to the same object: 30 s keeps that well under 1%.
UPLOAD_EVERY_S = 30.0


class Follower(Protocol):
    """A run elsewhere that follows the run directory (wandb_log.WandbRun)."""

    def log(self, values: dict[str, float], step: int) -> None: ...

    def summary(self, summary: dict) -> None: ...

    def finish(self, *, failed: bool = False, stopped: bool = False) -> None: ...


def scalars(record: dict) -> dict[str, float]:
    """A train or eval record's scalars by tag, as TensorBoard and W&B get them: the values
    it measured (None: not, e.g. no grad_norm for a skipped step), also as metrics.jsonl
    gives them back (a non-finite value as its string)."""
    tags = EVAL_TAGS if "eval_loss" in record else TRAIN_TAGS
    out = {tag: float(record[key]) for key, tag in tags.items() if record.get(key) is not None}
    for name, loss in (record.get("eval_loss_by_source") or {}).items():  # a mixture's
        out[f"eval/loss/{name}"] = float(loss)
    return out


def _jsonable(value: object) -> object:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf; keep them readable rather than invalid
    return value


class RunDir:
    """Writes a run's files; every metrics line is flushed as soon as it is written (and
    uploaded within `upload_every_s` when the run directory is a URL)."""

    def __init__(
        self,
        workdir: str | os.PathLike,
        resume_after_step: int | None = None,
        *,
        saved_events: Sequence[dict] = (),
        upload_every_s: float = UPLOAD_EVERY_S,
        wandb_run: Follower | None = None,
    ):
        """`resume_after_step`: drop what was logged after that step (a resumed run logs it
        again, from its checkpoint), and the events logged at it that the checkpoint does
        not hold (`saved_events`: an attempt that died before saving logged them).
        `wandb_run`: a W&B run that also gets the scalars and the summary (its opener ends
        it)."""
        self.wandb_run = wandb_run
        self.path = as_path(workdir)
        make_dirs(self.path)
        metrics = self.path / "metrics.jsonl"
        self._kept: list[dict] = []  # what earlier attempts logged, up to the resumed step
        if resume_after_step is not None and metrics.exists():
            self._kept = truncate_metrics(self.path, resume_after_step, saved_events)
        self._remote = not is_local(self.path)
        self._upload_every_s = upload_every_s
        self._uploaded_at = -math.inf
        self._uploaded_sizes: dict[str, int] = {}
        # Where metrics.jsonl and tensorboard/ grow: the run directory itself, or for a URL a
        # local copy that starts from what the run directory holds.
        self._local = tempfile.mkdtemp(prefix="jaxkit-run-") if self._remote else str(self.path)
        local_metrics = os.path.join(self._local, "metrics.jsonl")
        if self._remote and metrics.exists():
            with open(local_metrics, "w", encoding="utf-8") as f:
                f.write(metrics.read_text(encoding="utf-8"))
            self._uploaded_sizes["metrics.jsonl"] = os.path.getsize(local_metrics)
        # Held open for the run and flushed per line; close() ends it.
        self._metrics = open(local_metrics, "a", encoding="utf-8")  # noqa: SIM115
        # tensorboardX writes TensorBoard event files without TensorFlow; purge_step makes
        # TensorBoard hide what an earlier attempt logged past the resumed step (the earlier
        # attempt's event files stay, a new file is added).
        # Event files are named by the second and the host; the suffix keeps two attempts in
        # the same second from writing one file over the other.
        self._tensorboard = tensorboardX.SummaryWriter(
            os.path.join(self._local, "tensorboard"),
            purge_step=None if resume_after_step is None else resume_after_step + 1,
            filename_suffix=f".{os.getpid()}.{uuid.uuid4().hex[:8]}",
        )

    def log_once(self, record: dict) -> None:
        """Logs `record` unless the run's history (as its checkpoint holds it) has it."""
        if _as_logged(record) not in self._kept:
            self.log(record)

    def write_lines(self, name: str, lines: list[str]) -> None:
        # A crash never leaves half a file: see write_text_atomic for local paths and URLs.
        write_text_atomic(self.path / name, "".join(line + "\n" for line in lines))

    def write_json(self, name: str, obj: dict) -> None:
        self.write_lines(name, [json.dumps(obj, indent=2)])

    def write_summary(self, summary: dict) -> None:
        """summary.json, and the W&B run's summary."""
        self.write_json("summary.json", summary)
        if self.wandb_run:
            self.wandb_run.summary(summary)

    def write_text(self, tag: str, markdown: str) -> None:
        """Text for TensorBoard's text tab (the plan table, the resolved config)."""
        self._tensorboard.add_text(tag, markdown, global_step=0)

    def log(self, record: dict) -> None:
        clean = {k: _jsonable(v) for k, v in record.items()}
        self._metrics.write(json.dumps(clean) + "\n")
        self._metrics.flush()
        if "event" in record:  # a plan or batch change, a redone half-step: text, not curves
            text = "    " + json.dumps(clean, indent=2).replace("\n", "\n    ")
            self._tensorboard.add_text(f"events/{record['event']}", text, record["step"])
        else:
            values = scalars(record)
            for tag, value in values.items():
                self._tensorboard.add_scalar(tag, value, global_step=record["step"])
            if self.wandb_run and values:
                self.wandb_run.log(values, record["step"])
        self._tensorboard.flush()
        if self._remote and time.monotonic() - self._uploaded_at >= self._upload_every_s:
            self._upload()

    def _upload(self) -> None:
        """Copies what grew in the local staging directory to the run directory, whole."""
        for root, _, files in os.walk(self._local):
            for file in files:
                local = os.path.join(root, file)
                name = os.path.relpath(local, self._local)
                size = os.path.getsize(local)
                if self._uploaded_sizes.get(name) == size:
                    continue  # both files only grow: an unchanged size is an unchanged file
                with open(local, "rb") as f:
                    (self.path / name).write_bytes(f.read())
                self._uploaded_sizes[name] = size
        self._uploaded_at = time.monotonic()

    def close(self) -> None:
        self._metrics.close()
        self._tensorboard.close()
        if self._remote:
            self._upload()  # if this fails, the staging directory is left for a manual copy
            shutil.rmtree(self._local, ignore_errors=True)


def _as_logged(record: dict) -> dict:
    """`record` as metrics.jsonl gives it back."""
    return json.loads(json.dumps({k: _jsonable(v) for k, v in record.items()}))


def truncate_metrics(
    workdir: str | os.PathLike, step: int, saved_events: Sequence[dict] = ()
) -> list[dict]:
    """Drops what was logged past optimizer step `step` (a resumed run logs it again), and
    events at `step` but those in `saved_events`; returns the records kept."""
    saved = [_as_logged(e) for e in saved_events]

    def kept(record: dict) -> bool:
        if record.get("step", 0) == step and "event" in record:
            return record in saved  # logged at a resume that its checkpoint outlived
        return record.get("step", 0) <= step

    kept_records = [r for r in read_metrics(workdir) if kept(r)]
    write_text_atomic(
        as_path(workdir) / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in kept_records)
    )
    return kept_records


def read_metrics(workdir: str | os.PathLike) -> list[dict]:
    """Every record of a run's metrics.jsonl, train and eval interleaved.

    Works on a run that is still writing or was killed: a last line cut short is skipped.
    """
    text = (as_path(workdir) / "metrics.jsonl").read_text(encoding="utf-8")
    lines = text.splitlines()
    records = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if i != len(lines) - 1:
                raise
    return records

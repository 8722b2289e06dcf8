"""The run directory: resolved config, batch plan, metrics as JSON lines and TensorBoard
scalars, summary. Only process 0 writes one."""

from __future__ import annotations

import json
import math
import os
import pathlib

import tensorboardX

# metrics.jsonl key -> TensorBoard tag, for train records and eval records.
TRAIN_TAGS = {
    "loss": "train/loss",
    "learning_rate": "train/learning_rate",
    "grad_norm": "train/grad_norm",
    "skipped_micro_batches": "train/skipped_micro_batches",
    "examples_per_s": "throughput/examples_per_s",
    "tokens_per_s": "throughput/tokens_per_s",
    "step_time_s": "throughput/step_time_s",
}
EVAL_TAGS = {"eval_loss": "eval/loss", "eval_accuracy": "eval/accuracy"}


def _jsonable(value: object) -> object:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf; keep them readable rather than invalid
    return value


class RunDir:
    """Writes a run's files; every metrics line is flushed as soon as it is written."""

    def __init__(self, workdir: str | os.PathLike, resume_after_step: int | None = None):
        """`resume_after_step`: drop what was logged after that step (a resumed run logs it
        again, from its checkpoint)."""
        self.path = pathlib.Path(workdir)
        self.path.mkdir(parents=True, exist_ok=True)
        metrics = self.path / "metrics.jsonl"
        if resume_after_step is not None and metrics.exists():
            kept = [r for r in read_metrics(self.path) if r.get("step", 0) <= resume_after_step]
            self.write_lines("metrics.jsonl", [json.dumps(r) for r in kept])
        # Held open for the run and flushed per line; close() ends it.
        self._metrics = open(metrics, "a", encoding="utf-8")  # noqa: SIM115
        # tensorboardX writes TensorBoard event files without TensorFlow; purge_step makes
        # TensorBoard hide what an earlier attempt logged past the resumed step.
        self._tensorboard = tensorboardX.SummaryWriter(
            str(self.path / "tensorboard"),
            purge_step=None if resume_after_step is None else resume_after_step + 1,
        )

    def write_lines(self, name: str, lines: list[str]) -> None:
        tmp = self.path / f".{name}.tmp"
        tmp.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
        tmp.replace(self.path / name)  # atomic: a crash never leaves half a file

    def write_json(self, name: str, obj: dict) -> None:
        self.write_lines(name, [json.dumps(obj, indent=2)])

    def write_text(self, tag: str, markdown: str) -> None:
        """Text for TensorBoard's text tab (the plan table, the resolved config)."""
        self._tensorboard.add_text(tag, markdown, global_step=0)

    def log(self, record: dict) -> None:
        clean = {k: _jsonable(v) for k, v in record.items()}
        self._metrics.write(json.dumps(clean) + "\n")
        self._metrics.flush()
        tags = EVAL_TAGS if "eval_loss" in record else TRAIN_TAGS
        for key, tag in tags.items():
            if key in record:
                self._tensorboard.add_scalar(tag, record[key], global_step=record["step"])
        self._tensorboard.flush()

    def close(self) -> None:
        self._metrics.close()
        self._tensorboard.close()


def read_metrics(workdir: str | os.PathLike) -> list[dict]:
    """Every record of a run's metrics.jsonl, train and eval interleaved.

    Works on a run that is still writing or was killed: a last line cut short is skipped.
    """
    lines = (pathlib.Path(workdir) / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
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

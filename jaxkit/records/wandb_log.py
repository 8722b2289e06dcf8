"""Weights & Biases: a run followed in a W&B run as well as in its run directory.

Off unless `wandb.project` is set, and `wandb` is imported only then. Process 0 opens the
W&B run with the resolved config and the batch plan as its config; `metrics.RunDir` hands it
the scalars it writes to TensorBoard, under the same tags, at optimizer steps, and the
summary. A run without a workdir (an experiment's runs) logs nothing there.

A resume continues the W&B run whose id WORKDIR/wandb.json keeps, on any device count or
machine. W&B's rewind, `resume_from="ID?_step=N"`, keeps the history up to the
checkpoint's step N and takes what is logged from N + 1 on, so what an abandoned attempt
logged past the checkpoint is superseded there as it is in metrics.jsonl. Where that run
cannot be continued (none was recorded, the project or entity changed, or W&B refused the
rewind), a new W&B run starts with metrics.jsonl's scalars up to the checkpoint, and one
line names it and says why.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import jax

from jaxkit.distributed import process_0_refusal
from jaxkit.keys import ConfigError
from jaxkit.records.metrics import read_metrics, scalars
from jaxkit.sections import RunConfig
from jaxkit.workdir import as_path, write_text_atomic

# In the workdir: the W&B run that follows it, and where it is ({"id", "project", "entity"}).
ID_FILE = "wandb.json"
INSTALL = "pip install 'jaxkit[wandb]'"


def project(config: RunConfig) -> str | None:
    """The W&B project a run logs to; None: off (also for a config saved before the key,
    which reads as it ran: config.ADDED_DEFAULTS)."""
    return config.wandb.project


def check(
    config: RunConfig,
    workdir: str | os.PathLike | None,
    echo: Callable[[str], None],
) -> None:
    """Before any work: a set project without a wandb that imports is refused (ConfigError,
    process 0's answer on every process: only process 0 logs); a run without a workdir logs
    nothing to W&B, and says so."""
    name = project(config)
    if name is None:
        return
    if workdir is None:
        if jax.process_index() == 0:
            echo(f"note: wandb.project={name!r} is ignored: only a run with a workdir logs to W&B")
        return
    refusal = None
    if jax.process_index() == 0:
        try:
            import wandb  # noqa: F401
        except ImportError:
            refusal = f"wandb.project={name!r} logs to Weights & Biases, which needs {INSTALL}"
        except Exception as err:  # a broken install (a protobuf it cannot load, ...)
            refusal = f"wandb.project={name!r}: wandb fails to import ({_said(err)}): {INSTALL}"
    refusal = process_0_refusal(refusal)
    if refusal is not None:
        raise ConfigError(refusal)


class WandbRun:
    """The W&B run that process 0 logs to."""

    def __init__(self, run: Any) -> None:
        self._run = run

    @property
    def id(self) -> str:
        return str(self._run.id)

    def log(self, values: dict[str, float], step: int) -> None:
        self._run.log(values, step=step)

    def summary(self, summary: dict) -> None:
        self._run.summary.update(summary)

    def finish(self, *, failed: bool = False, stopped: bool = False) -> None:
        """Ends the run: with exit code 1 where the attempt failed; marked as preempting
        first where it stopped to be resumed (SIGTERM, Ctrl-C), as W&B asks of such runs."""
        if stopped:
            self._run.mark_preempting()
        self._run.finish(exit_code=1 if failed else 0)


def open_run(
    config: RunConfig,
    workdir: str | os.PathLike | None,
    step: int,
    run_config: dict,
    echo: Callable[[str], None],
) -> WandbRun | None:
    """The W&B run that follows this attempt from optimizer step `step` (its checkpoint's; 0
    for a start) on process 0; None elsewhere, or with no project or workdir. A run W&B will
    not start is refused (ConfigError) on every process, before the run's files change."""
    if project(config) is None or workdir is None:
        return None
    run, refusal = None, None
    if jax.process_index() == 0:
        import wandb

        try:
            run = _open(wandb, config, workdir, step, run_config, echo)
        except wandb.errors.Error as err:
            refusal = f"wandb.project={project(config)!r}: W&B did not start a run: {_said(err)}"
    refusal = process_0_refusal(refusal)
    if refusal is not None:
        raise ConfigError(refusal)
    return run


def _open(
    wandb: Any,
    config: RunConfig,
    workdir: str | os.PathLike,
    step: int,
    run_config: dict,
    echo: Callable[[str], None],
) -> WandbRun:
    where = {"project": config.wandb.project, "entity": config.wandb.entity}
    init = {
        **where,
        "name": config.wandb.run_name or as_path(workdir).name,
        "config": run_config,
        # The kit's console stays as it is: W&B would otherwise wrap stdout and stderr.
        "settings": wandb.Settings(console="off"),
    }
    saved = _saved(workdir)
    if saved is None:
        why = "no W&B run was recorded in the workdir"
    elif {key: saved.get(key) for key in where} != where:
        why = f"run {saved['id']} is in {_place(saved)}, this one logs to {_place(where)}"
    else:
        try:
            run = wandb.init(**init, resume_from=f"{saved['id']}?_step={step}")
        except wandb.errors.Error as err:
            why = f"W&B did not rewind run {saved['id']} to step {step}: {_said(err)}"
        else:
            run.name = init["name"]  # a rewind takes the name W&B has: this attempt's goes
            return WandbRun(run)
    run = WandbRun(wandb.init(**init))
    write_text_atomic(as_path(workdir) / ID_FILE, json.dumps({"id": run.id, **where}) + "\n")
    if step > 0:  # a resume: the new run gets the history that the run's files keep
        for record in _history(workdir, step):
            run.log(scalars(record), record["step"])
        echo(f"W&B: run {run.id} is new, with metrics.jsonl's scalars up to step {step}: {why}")
    return run


def _saved(workdir: str | os.PathLike) -> dict | None:
    path = as_path(workdir) / ID_FILE
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else None


def _history(workdir: str | os.PathLike, step: int) -> list[dict]:
    """metrics.jsonl's train and eval records up to optimizer step `step`, as a resume keeps
    them (events are TensorBoard text, not scalars)."""
    if not (as_path(workdir) / "metrics.jsonl").exists():
        return []
    records = read_metrics(workdir)
    return [r for r in records if "event" not in r and r.get("step", 0) <= step and scalars(r)]


def _place(where: dict) -> str:
    entity = where.get("entity")
    return f"project {where.get('project')!r}" + (f" of {entity!r}" if entity else "")


def _said(err: BaseException) -> str:
    """An error's first line, for a refusal's one line."""
    lines = str(err).strip().splitlines()
    return lines[0] if lines else type(err).__name__

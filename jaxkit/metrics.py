"""The run directory: resolved config, batch plan, metrics as JSON lines, summary."""

from __future__ import annotations

import json
import math
import os
import pathlib


def _jsonable(value: object) -> object:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf; keep them readable rather than invalid
    return value


class RunDir:
    """Writes a run's files; every metrics line is flushed as soon as it is written."""

    def __init__(self, workdir: str | os.PathLike):
        self.path = pathlib.Path(workdir)
        self.path.mkdir(parents=True, exist_ok=True)
        # Held open for the run and flushed per line; close() ends it.
        self._metrics = open(self.path / "metrics.jsonl", "a", encoding="utf-8")  # noqa: SIM115

    def write_json(self, name: str, obj: dict) -> None:
        tmp = self.path / f".{name}.tmp"
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n", encoding="utf-8")
        tmp.replace(self.path / name)  # atomic: a crash never leaves half a file

    def log(self, record: dict) -> None:
        clean = {k: _jsonable(v) for k, v in record.items()}
        self._metrics.write(json.dumps(clean) + "\n")
        self._metrics.flush()

    def close(self) -> None:
        self._metrics.close()


def read_metrics(workdir: str | os.PathLike) -> list[dict]:
    """Every record of a run's metrics.jsonl (train and eval records interleaved)."""
    lines = (pathlib.Path(workdir) / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]

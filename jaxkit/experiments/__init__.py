"""`jaxkit experiment NAME CONFIG ...`: each seed claim as a command that measures and draws it.

Every experiment writes OUT/report.md with Markdown tables and PNG plots beside it, and
rewrites the report after each unit of work (a split, a batch size, ...), so Ctrl-C leaves
a partial report that says how far it got. Every unit is checked before the first starts
(`check_units`): a request the kit refuses creates no OUT, whichever unit it concerns.

This module is the table of experiments; what they share is `jaxkit.experiments.common`.

May import: train and everything below it.
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable

import ml_collections

from jaxkit.experiments import (
    batch_ramp,
    batch_size,
    equivalence,
    memory,
    noise,
    normalisation,
    throughput,
)
from jaxkit.experiments.common import ExperimentError, Interrupted, Options, Request, Split

__all__ = ["ExperimentError", "Interrupted", "Options", "Split", "run"]

_RUNNERS: dict[str, Callable[[Request], pathlib.Path]] = {
    "equivalence": equivalence.run,
    "memory": memory.run,
    "throughput": throughput.run,
    "batch-size": batch_size.run,
    "noise-scale": noise.run,
    "batch-ramp": batch_ramp.run,
    "normalisation": normalisation.run,
}


def run(
    name: str,
    config: ml_collections.ConfigDict,
    out: pathlib.Path,
    options: Options,
    echo: Callable[[str], None] = print,
) -> pathlib.Path:
    """Runs experiment `name`, writing OUT/report.md; Interrupted leaves a partial report."""
    if name not in _RUNNERS:
        raise ExperimentError(f"no experiment {name!r}; choose one of {', '.join(_RUNNERS)}")
    return _RUNNERS[name](Request(config, out, options, echo))

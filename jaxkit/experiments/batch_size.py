"""Larger global batches mean fewer updates: the same examples at several global batches.

Each global batch B trains on the same number of examples (the config's global batch ×
--steps), so it makes proportionally fewer optimizer steps, with its learning rate scaled
from the config's by the chosen rule (linear: × B/B₀, sqrt: × √(B/B₀), none). Warmup keeps
the same fraction of each run. Plotted against examples seen and against optimizer steps.
"""

from __future__ import annotations

import pathlib
from typing import Any, NamedTuple

import ml_collections
import numpy as np

from jaxkit.batch.plan import BatchPlanError
from jaxkit.batch.schedule import plan_from_config
from jaxkit.config import run_config
from jaxkit.experiments.common import (
    ExperimentError,
    Report,
    Request,
    check_units,
    drive,
    loss_figures,
    lr_scaling,
    params_note,
    preamble,
    train_unit,
    unit_config,
)

DEFAULT_STEPS = 40


class _Run(NamedTuple):
    """One global batch's run: its batch, its optimizer steps and its config."""

    g: int
    steps: int
    config: ml_collections.ConfigDict

    def __str__(self) -> str:  # the progress bar's label (not the whole config)
        return f"global batch {self.g}"


def _sizes(text: str | None, base: int) -> list[int]:
    if text is None:
        return [base // 2, base, base * 2, base * 4] if base % 2 == 0 else [base, base * 2]
    try:
        given = [int(x) for x in text.split(",")]
    except ValueError:
        raise ExperimentError(
            f"--global-batch-sizes={text!r} is not a list like 16,32,64"
        ) from None
    if min(given) <= 0:
        raise ExperimentError("--global-batch-sizes must be positive")
    for g in given:  # trained twice, it would show once in every table and figure
        if given.count(g) > 1:
            raise ExperimentError(f"--global-batch-sizes: {g} is given twice")
    return sorted(given)


def run(request: Request) -> pathlib.Path:
    config, options = request.config, request.options
    devices, shape, base, steps = preamble(request, DEFAULT_STEPS)
    rule = lr_scaling(request)
    budget = steps * base.global_batch_size  # examples every run sees
    runs: dict[int, dict[str, Any]] = {}
    skipped: list[str] = []
    units: list[_Run] = []
    for g in _sizes(options.global_batch_sizes, base.global_batch_size):
        c = ml_collections.ConfigDict(config.to_dict())
        c.batch.global_batch_size, c.batch.grad_accum_steps = g, None
        c.optimizer.lr_scaling = rule
        c.optimizer.reference_batch_size = base.global_batch_size
        c.optimizer.learning_rate = base.learning_rate  # the config's peak, at its own batch
        try:
            plan_from_config(run_config(c), shape)
        except BatchPlanError:  # the per-device batch does not divide it: no accumulation
            c.batch.per_device_batch_size, c.batch.grad_accum_steps = None, 1
            try:
                plan_from_config(run_config(c), shape)
            except BatchPlanError as err:
                if options.global_batch_sizes is not None:  # asked for: not dropped unsaid
                    raise ExperimentError(f"--global-batch-sizes: {g}: {err}") from None
                skipped.append(f"{g}: {err}")
                request.echo(f"left out global batch {g}: {err}")
                continue
        run_steps = max(budget // g, 1)
        c.optimizer.warmup_steps = round(config.optimizer.warmup_steps * run_steps / steps)
        units.append(_Run(g, run_steps, c))
    if not units:
        raise ExperimentError("no global batch size fits the mesh: " + "; ".join(skipped))
    check_units([(f"global batch {g}", unit_config(c, n), devices) for g, n, c in units])

    def do_unit(unit: _Run) -> None:
        g, run_steps, c = unit
        result = train_unit(c, devices, run_steps)
        records = [r for r in result.records if "loss" in r]
        runs[g] = {
            "plan": result.plan,
            "steps": np.array([r["step"] for r in records]),
            "examples": np.array([r["examples_seen"] for r in records]),
            "loss": np.array([r["loss"] for r in records], dtype=float),  # null: NaN
        }

    def render(report: Report) -> None:
        g0 = base.global_batch_size
        budget_text = f"{budget:,} examples (= {steps} steps × the config's global batch {g0})"
        if all(n * g == budget for g, n, _ in units):
            seen = f"Every run sees {budget_text}"
        else:  # a batch that does not divide the budget trains whole steps of its own
            seen = (
                f"Each run is given {budget_text}, rounded down to whole steps of its "
                "batch (at least one): "
                + ", ".join(f"{g}: {n} steps, {n * g:,} examples" for g, n, _ in units)
            )
        report.text(
            f"Config `{config.get('name')}` on {len(devices)} {devices[0].platform} devices. "
            f"{seen}; learning rate scaled from "
            f"{base.learning_rate:g} at {g0} by the `{rule}` rule."
        )
        note = params_note(config)
        if note:
            report.text(note)
        if skipped:
            report.text("Left out (no exact plan on this mesh): " + "; ".join(skipped))
        if not runs:
            return
        rows = []
        for g, r in sorted(runs.items()):
            p = r["plan"]
            tail = r["loss"][-max(1, len(r["loss"]) // 10) :]
            rows.append(
                (
                    g,
                    f"{p.data_parallel_size}×{p.per_device_batch_size}×{p.grad_accum_steps}",
                    len(r["loss"]),
                    f"{p.learning_rate:.4g}",
                    f"{float(np.nanmean(tail)):.4f}",  # steps that scored something
                )
            )
        report.table(
            (
                "global_batch_size",
                "split",
                "optimizer steps",
                "peak learning rate",
                "final loss (mean of last 10% of steps)",
            ),
            rows,
        )
        loss_figures(report, {f"global batch {g}": r for g, r in sorted(runs.items())})

    report = Report(request.out, "Batch size: the same examples at several global batches")
    return drive(report, units, do_unit, render, "batch sizes", request.echo)

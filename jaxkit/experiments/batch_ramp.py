"""Does a growing batch pay? Fixed small, fixed large, a scheduled ramp and the auto ramp,
each on the same number of examples.

The small batch is the config's global batch G; the large one 4G; the scheduled ramp runs
G for the first quarter of the examples, 2G for the second and 4G for the rest; the auto
ramp starts at G and doubles K (up to 4G) when the smoothed noise scale B_simple stays
above the batch for batch.auto_patience samples of it. Every run keeps the per-device batch
(only K changes), so they share one micro-batch and one compiled step shape; each stage's
peak learning rate follows --lr-scaling (default: the config's rule) from the config's rate
at G. Reported: loss against examples and against optimizer steps, the optimizer steps each
run took to reach the small-batch run's final loss, and wall time.
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

import ml_collections
import numpy as np

from jaxkit.batch.plan import BatchPlanError
from jaxkit.batch.schedule import check_auto_samples, plan_from_config, schedule_from_config
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
    stopped_by,
)
from jaxkit.train.loop import train

DEFAULT_STEPS = 200  # optimizer steps of the small-batch run: the examples every run sees
LARGEST = 4  # the large batch, and the ramps' top, as a multiple of the small one


@dataclasses.dataclass(frozen=True)
class Arm:
    name: str
    config: ml_collections.ConfigDict

    def __str__(self) -> str:
        return self.name


def _arms(
    config: ml_collections.ConfigDict, shape: dict[str, int], rule: str, budget: int
) -> tuple[list[Arm], list[str], int]:
    """The four runs, the ones left out and why, and the small global batch."""
    base = plan_from_config(run_config(config), shape)
    g, b = base.global_batch_size, base.per_device_batch_size
    notes: list[str] = []

    def variant(**batch: Any) -> ml_collections.ConfigDict:
        c = ml_collections.ConfigDict(config.to_dict())
        c.batch.global_batch_size, c.batch.per_device_batch_size = g, b
        c.batch.grad_accum_steps, c.batch.schedule = None, ""
        c.batch.max_global_batch_size = None
        for key, value in batch.items():
            c.batch[key] = value
        c.optimizer.lr_scaling, c.optimizer.reference_batch_size = rule, g
        c.optimizer.learning_rate = base.learning_rate  # the config's peak at its own batch
        c.train.steps, c.train.examples = None, budget
        c.train.log_every, c.train.eval_every, c.train.eval_examples = 1, 0, 32
        c.train.profile_steps = ""
        return c

    quarter = budget // 4
    candidates = [
        Arm(f"fixed {g}", variant()),
        Arm(f"fixed {LARGEST * g}", variant(global_batch_size=LARGEST * g)),
        Arm(
            f"ramp {g}→{2 * g}→{4 * g}",
            variant(
                global_batch_size=None,
                schedule=f"0:{g},{quarter}:{2 * g},{2 * quarter}:{4 * g}",
            ),
        ),
        Arm(
            f"auto {g}→≤{LARGEST * g}",
            variant(schedule="auto", max_global_batch_size=LARGEST * g),
        ),
    ]
    try:  # a train.noise_scale_every the auto ramp cannot decide on is the user's to fix
        check_auto_samples(run_config(candidates[-1].config), g)
    except BatchPlanError as err:
        raise ExperimentError(f"{candidates[-1].name}: {err}") from None
    arms = []
    for arm in candidates:
        try:
            schedule_from_config(run_config(arm.config), shape)  # every stage divides, auto reads
        except BatchPlanError as err:
            notes.append(f"left out {arm.name}: {err}")
            continue
        arms.append(arm)
    return arms, notes, g


def _reached(steps: np.ndarray, loss: np.ndarray, target: float, window: int) -> int | None:
    """The first optimizer step at which the mean of the last `window` losses is ≤ target."""
    for i in range(len(loss)):
        if np.nanmean(loss[max(0, i - window + 1) : i + 1]) <= target:
            return int(steps[i])
    return None


def run(request: Request) -> pathlib.Path:
    config = request.config
    devices, shape, base, steps = preamble(request, DEFAULT_STEPS)
    rule = lr_scaling(request)
    # The examples every run sees: --steps of the small batch, rounded up to whole steps of
    # every stage (a multiple of 8 small steps), so no run stops part-way into a batch.
    unit = 2 * LARGEST * base.global_batch_size
    budget = -(-steps * base.global_batch_size // unit) * unit
    arms, notes, small = _arms(config, shape, rule, budget)
    if not arms:
        raise ExperimentError("no run fits the mesh:\n" + "\n".join(notes))
    for note in notes:  # a run the mesh cannot take: the others still compare
        request.echo(note)
    check_units([(arm.name, arm.config, devices) for arm in arms])
    runs: dict[str, dict[str, Any]] = {}

    def do_unit(arm: Arm) -> None:
        result = train(arm.config, None, devices=devices, progress=False, echo=lambda *a: None)
        stopped_by(result)
        records = [r for r in result.records if "loss" in r]
        runs[arm.name] = {
            "steps": np.array([r["step"] for r in records]),
            "examples": np.array([r["examples_seen"] for r in records]),
            "loss": np.array([r["loss"] for r in records], dtype=float),  # null: NaN
            "batch": np.array([r["global_batch_size"] for r in records]),
            "noise_scale": result.summary.get("noise_scale"),  # the last sample's
            "wall_s": result.summary["wall_time_s"],
        }

    def render(report: Report) -> None:
        report.text(
            f"Config `{config.get('name')}` on {len(devices)} {devices[0].platform} devices. "
            f"Every run trains on {budget:,} examples (= {budget // base.global_batch_size} "
            f"steps × the config's global batch {base.global_batch_size}, --steps {steps} "
            "rounded up to a multiple of 8); the per-device batch is the same for all, only "
            f"K changes. Peak learning rate {base.learning_rate:g} at batch {small}, scaled "
            f"per stage by the `{rule}` rule; warmup and decay are laid over examples."
        )
        for note in [params_note(config), *notes]:
            if note:
                report.text(note)
        if not runs:
            return
        first = next(iter(runs.values()))
        # The small-batch run's final loss: the mean of its last 10% of steps; a run reaches
        # it when the mean of its last as many steps does (the small run at the latest at
        # its end).
        window = max(1, len(first["loss"]) // 10)
        target = float(np.nanmean(first["loss"][-window:]))
        rows = []
        for name, r in runs.items():
            reached = _reached(r["steps"], r["loss"], target, window)
            r_tail = r["loss"][-max(1, len(r["loss"]) // 10) :]
            batches = "→".join(str(int(g)) for g in dict.fromkeys(r["batch"].tolist()))
            rows.append(
                (
                    name,
                    batches,
                    int(r["steps"][-1]),
                    f"{int(r['examples'][-1]):,}",
                    f"{float(np.nanmean(r_tail)):.4f}",
                    "not reached" if reached is None else reached,
                    "—" if r["noise_scale"] is None else f"{r['noise_scale']:,.0f}",
                    f"{r['wall_s']:.1f}",
                )
            )
        report.table(
            (
                "run",
                "global batch",
                "optimizer steps",
                "examples",
                "final loss (mean of last 10% of steps)",
                f"steps to reach {target:.4f} (the {next(iter(runs))} run's final loss)",
                "B_simple at the end (rows)",
                "wall time (s)",
            ),
            rows,
        )
        report.text(
            f"'Steps to reach' is the first step at which the mean of the last {window} "
            "losses is at or below the target. On a model this small the critical batch is "
            "small too, so the larger batches may need as many examples or more to reach a "
            "loss: the table says what happened, win or lose."
        )
        loss_figures(report, runs, target)

    report = Report(request.out, "Batch ramp: fixed, scheduled and automatic global batch")
    return drive(report, arms, do_unit, render, "runs", request.echo)

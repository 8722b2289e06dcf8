"""Exact against naive loss normalisation, over several splits of one global batch.

Each split (devices × per-device batch × accumulation K) trains twice from the same start on
the same data order: train.loss_normalisation=exact (a step's loss is Σ weight × loss /
Σ weight over its whole global batch) and naive (the mean of its K micro-batch means). The
exact runs agree to round-off whatever the split; the naive ones move with K wherever rows
weigh differently (padded documents, masked prompts). With K = 1, or rows that all weigh
the same, naive is exact, and the report says so instead of showing a drift.

Default splits, for D live devices and a global batch G = D × b: D×b×1, D×b/2×2, D×b/4×4,
and D/2×b/4×8 (fewer devices, larger K). The exact and naive runs of a split compile the
same programs: with JAX_COMPILATION_CACHE_DIR set, the second one reuses the first's.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
from collections.abc import Callable, Sequence
from typing import Any

import jax
import ml_collections
import numpy as np
from etils import epath
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from jaxkit.config import run_config
from jaxkit.data.sources import NORMALISATIONS, make_sources, row_weight_sums, stream_rows
from jaxkit.experiments.common import (
    ExperimentError,
    Report,
    Request,
    Split,
    check_global_batch,
    check_splits,
    drive,
    params_note,
    parse_splits,
    preamble,
    relative_difference,
    split_mesh,
    train_split,
)
from jaxkit.records.viz import FLOOR
from jaxkit.workdir import write_text_atomic

DEFAULT_STEPS = 20
F32_EPS = float(np.finfo(np.float32).eps)
JSON_NAME = "normalisation.json"


@dataclasses.dataclass(frozen=True)
class Unit:
    """One training run: a split under one normalisation."""

    split: Split
    normalisation: str

    def __str__(self) -> str:
        return f"{self.split.name} {self.normalisation}"


def default_splits(global_batch: int, live_devices: int) -> list[Split]:
    """K = 1, 2, 4 on the most live devices D for which G / D is a multiple of 4, then half
    as many devices with K = 8 (or one device, where D is odd), the same per-device batch."""
    fits = [d for d in range(live_devices, 0, -1) if global_batch % (4 * d) == 0]
    if not fits:
        raise ExperimentError(
            f"global_batch_size={global_batch} is not divisible by 4: give --splits, "
            "e.g. --splits 8x4x1,8x1x4,4x1x8"
        )
    d = fits[0]
    b = global_batch // d
    splits = [Split(d, b, 1), Split(d, b // 2, 2), Split(d, b // 4, 4)]
    if d > 1:
        fewer = d // 2 if d % 2 == 0 else 1
        splits.append(Split(fewer, b // 4, 4 * d // fewer))
    return splits


def trained_row_weights(config: ml_collections.ConfigDict, steps: int, g: int) -> np.ndarray:
    """Σ weight of each row the runs train on (every run reads the same stream)."""
    train_source, _ = make_sources(run_config(config))
    rows = stream_rows(0, steps * g, len(train_source), config.train.seed)
    return row_weight_sums(train_source, rows)


def step_losses(records: Sequence[dict]) -> np.ndarray:
    """A run's per-step training losses; NaN for a step whose global batch scored no
    target (logged as null: it has no loss), which every comparison below skips."""
    return np.array(
        [np.nan if r["loss"] is None else r["loss"] for r in records if "loss" in r], dtype=float
    )


def _max(values: np.ndarray) -> float:
    """Max over the scored steps (all runs read the same rows: unscored in all alike)."""
    scored = values[np.isfinite(values)]
    return float(scored.max()) if scored.size else 0.0


def _spread(curves: Sequence[np.ndarray], ref: np.ndarray) -> dict[str, Any] | None:
    """Max over steps of max − min across `curves`, absolute and relative to `ref`."""
    if len(curves) < 2:
        return None
    stacked = np.stack(curves)
    spread = stacked.max(axis=0) - stacked.min(axis=0)  # NaN on unscored steps
    return {"abs": _max(spread), "rel": relative_difference(spread, ref)}


def _loss_or_none(value: float) -> float | None:
    return float(value) if np.isfinite(value) else None  # JSON has no NaN: null, as logged


def _final_text(loss: float | None) -> str:
    return "none (no scored target)" if loss is None else f"{loss:.6f}"


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.2e}"


def _rel_text(value: float | None) -> str:
    return "" if value is None else f" ({value:.1e} relative)"


def summarise(
    losses: dict[Unit, np.ndarray], eval_losses: dict[Unit, float], reference: Split
) -> dict[str, Any]:
    """The report's numbers from each finished run's per-step training losses.

    `losses` holds the runs done so far, the reference split's exact run first.
    """
    ref = losses[Unit(reference, "exact")]
    by_norm = {n: [c for u, c in losses.items() if u.normalisation == n] for n in NORMALISATIONS}
    exact_spread = _spread(by_norm["exact"], ref)
    naive_spread = _spread(by_norm["naive"], ref)
    runs = []
    for unit, curve in losses.items():
        diff = np.abs(curve - ref)
        runs.append(
            {
                "split": unit.split.name,
                "devices": unit.split.devices,
                "per_device_batch_size": unit.split.per_device,
                "grad_accum_steps": unit.split.accum,
                "normalisation": unit.normalisation,
                "final_loss": _loss_or_none(curve[-1]),
                "eval_loss": eval_losses[unit],
                "max_abs_diff_vs_reference": _max(diff),
                "max_rel_diff_vs_reference": relative_difference(diff, ref),
                "losses": [_loss_or_none(x) for x in curve],
            }
        )
    # Naive against the exact run of its own split: the same rows, the same programs, so
    # any difference is the normalisation's (zero, bit for bit, where micro-batches weigh
    # the same). Judged against the exact runs' own spread, or a float32 ulp of the loss.
    gaps = [
        _max(np.abs(c - losses[Unit(u.split, "exact")]))
        for u, c in losses.items()
        if u.normalisation == "naive" and Unit(u.split, "exact") in losses
    ]
    round_off = max(exact_spread["abs"] if exact_spread else 0.0, F32_EPS * _max(ref))
    naive_gap = max(gaps) if gaps else None
    ratio = None
    if naive_spread and exact_spread and exact_spread["abs"] > 0:
        ratio = naive_spread["abs"] / exact_spread["abs"]
    return {
        "reference": f"{reference.name} exact",
        "exact_spread": exact_spread,
        "naive_spread": naive_spread,
        "naive_spread_over_exact_spread": ratio,
        "max_naive_diff_vs_own_split_exact": naive_gap,
        "naive_equals_exact": naive_gap is not None and naive_gap <= round_off,
        "runs": runs,
    }


def _weights_phrase(weights: np.ndarray) -> str:
    if np.all(weights == weights[0]):
        return f"all {len(weights):,} rows the runs train on weigh {weights[0]:g} targets each"
    return (
        f"the {len(weights):,} rows the runs train on weigh {weights.min():g} to "
        f"{weights.max():g} targets (mean {weights.mean():.2f})"
    )


def verdict(numbers: dict[str, Any], splits: Sequence[Split], weights: np.ndarray) -> str:
    """One paragraph: how far naive drifts, in units of the exact runs' round-off."""
    if numbers["max_naive_diff_vs_own_split_exact"] is None:
        return "No naive run has finished yet."
    exact = numbers["exact_spread"]
    exact_said = (
        "there is one exact run, so no spread of exact runs to compare"
        if exact is None
        else "the exact runs agree bit for bit"
        if exact["abs"] == 0
        else f"the exact runs' own spread is {exact['abs']:.1e} (round-off: the splits sum "
        "the same terms in another order)"
    )
    if numbers["naive_equals_exact"]:
        gap = numbers["max_naive_diff_vs_own_split_exact"]
        said = (
            f"**Naive equals exact here:** every naive run is within {gap:.1e} of its own "
            f"split's exact run, and {exact_said}."
        )
        one_micro_batch = (
            "a step's one micro-batch is its whole global batch, and the mean of "
            "micro-batch means is the global mean"
        )
        if all(s.accum == 1 for s in splits):
            return (
                f"{said} It must: every split has K = 1, so {one_micro_batch}. Splits with "
                "K > 1 (--splits) compare the two."
            )
        naive_k = [r["grad_accum_steps"] for r in numbers["runs"] if r["normalisation"] == "naive"]
        if all(k == 1 for k in naive_k):
            return (
                f"{said} So far only naive runs with K = 1 have finished, where {one_micro_batch}."
            )
        if np.all(weights == weights[0]):
            return (
                f"{said} The rows of this config all weigh the same ({weights[0]:g} targets "
                "each), so every micro-batch weighs the same and the mean of micro-batch "
                "means is the global batch's mean: there is no drift to show. Rows that "
                "weigh differently (padded documents: data.source=tokens, "
                "data.rows=documents) would show one."
            )
        return (
            f"{said} Although {_weights_phrase(weights)}, the micro-batches of every step "
            "weighed the same, to round-off."
        )
    runs = [r for r in numbers["runs"] if r["normalisation"] == "naive"]
    worst = max(runs, key=lambda r: r["max_abs_diff_vs_reference"])
    far = (
        f"The farthest naive run, {worst['split']} (K = {worst['grad_accum_steps']}), is "
        f"{worst['max_abs_diff_vs_reference']:.2e}"
        f"{_rel_text(worst['max_rel_diff_vs_reference'])} from the exact reference "
        f"{numbers['reference']}"
    )
    naive = numbers["naive_spread"]
    if naive is None:
        head = f"**Naive drifts from exact:** {far}; {exact_said}."
    else:
        times = numbers["naive_spread_over_exact_spread"]
        head = (
            f"**Naive curves differ by up to {naive['abs']:.2e}{_rel_text(naive['rel'])}"
            + (f", {times:,.0f}× the exact runs' spread" if times is not None else "")
            + f"**; {exact_said}. {far}."
        )
    return (
        f"{head} Rows here weigh {weights.min():g} to {weights.max():g} targets: a naive "
        "step weighs each micro-batch's rows by that micro-batch's own weight, so its loss "
        "and gradient change with K."
    )


@dataclasses.dataclass
class _Runs:
    """The runs of one experiment and each one's losses so far: each unit adds its curve,
    and the report is rendered from them after every unit."""

    config: ml_collections.ConfigDict
    devices: list[jax.Device]
    steps: int  # optimizer steps per run
    global_batch: int
    splits: list[Split]
    reference: Split  # its exact run is the curve every other run is measured against
    weights: np.ndarray  # the weight (targets) of each row the runs train on
    planned: int  # runs in all
    echo: Callable[[str], None]
    losses: dict[Unit, np.ndarray] = dataclasses.field(default_factory=dict)
    eval_losses: dict[Unit, float] = dataclasses.field(default_factory=dict)


def run(request: Request) -> pathlib.Path:
    """Trains every split exact, then naive, rewriting the report after each run."""
    runs, units = _plan(request)
    title = f"Loss normalisation: exact against naive over splits of {runs.global_batch}"
    report = Report(request.out, title, replaces=[JSON_NAME])
    return drive(
        report,
        units,
        functools.partial(_do_unit, runs),
        functools.partial(_render, runs),
        "runs",
        request.echo,
    )


def _plan(request: Request) -> tuple[_Runs, list[Unit]]:
    """The runs and their units, the reference's first; every split is refused or
    accepted here, before any training."""
    config, options = request.config, request.options
    devices, _, plan, steps = preamble(request, DEFAULT_STEPS, own_meshes=True)
    g = plan.global_batch_size
    splits = (
        default_splits(g, len(devices)) if options.splits is None else parse_splits(options.splits)
    )
    _check_splits_fit(config, splits, g, devices)
    weights = trained_row_weights(config, steps, g)
    # The reference, the exact run at K = 1 (or of the first split), trains first: every
    # partial report then measures against the same curve.
    reference = next((s for s in splits if s.accum == 1), splits[0])
    ordered = [reference, *(s for s in splits if s != reference)]
    units = [Unit(s, n) for s in ordered for n in NORMALISATIONS]
    check_splits(config, splits, devices, steps)  # the normalisation changes no check
    runs = _Runs(config, devices, steps, g, splits, reference, weights, len(units), request.echo)
    return runs, units


def _check_splits_fit(
    config: ml_collections.ConfigDict, splits: list[Split], g: int, devices: list[jax.Device]
) -> None:
    """Each split cuts the global batch `g` on devices there are (parse_splits has refused
    a split given twice)."""
    for split in splits:
        check_global_batch(split, g)
        if split.devices > len(devices):
            raise ExperimentError(
                f"split {split.name} needs {split.devices} devices; {len(devices)} are "
                "available (--host-devices N simulates more on the CPU)"
            )
    for split in splits:  # all refused before any training
        split_mesh(config, split)


def _do_unit(runs: _Runs, unit: Unit) -> None:
    c = ml_collections.ConfigDict(runs.config.to_dict())
    c.train.loss_normalisation = unit.normalisation
    result = train_split(c, unit.split, runs.devices, runs.steps)
    runs.losses[unit] = step_losses(result.records)
    runs.eval_losses[unit] = float(
        next(r["eval_loss"] for r in reversed(result.records) if "eval_loss" in r)
    )
    runs.echo(f"  {unit}: final loss {_final_text(_loss_or_none(runs.losses[unit][-1]))}")


def _render(runs: _Runs, report: Report) -> None:
    """The report of the runs done so far, and their numbers as JSON beside it."""
    report.text(
        f"Config `{runs.config.get('name')}`, global batch {runs.global_batch}, {runs.steps} "
        "optimizer steps per run, same seed and data order. Each split (devices × "
        "per-device batch × accumulation K) trains twice from the same initial parameters: "
        "**exact** (a step's loss is Σ weight × loss / Σ weight over its whole global batch) "
        "and **naive** (the mean of its K micro-batch means, as other kits compute it). A "
        "naive run's training loss is that mean; the eval loss, weighted exactly on "
        f"the same held-out rows, compares every run on one objective. Here "
        f"{_weights_phrase(runs.weights)}. Reference: the exact run of {runs.reference.name}."
    )
    note = params_note(runs.config)
    if note:
        report.text(note)
    if not runs.losses:
        return
    numbers = _numbers(runs)
    report.text(verdict(numbers, runs.splits, runs.weights))
    _tables(report, numbers)
    _figure(report, runs.losses, runs.reference, runs.splits)
    path = epath.Path(report.out / JSON_NAME)
    write_text_atomic(path, json.dumps(numbers, indent=1) + "\n")
    report.text(f"The numbers, each run's per-step losses included: `{JSON_NAME}`.")


def _numbers(runs: _Runs) -> dict[str, Any]:
    """What the JSON file holds: the summary of the runs done, and what they were."""
    weights = runs.weights
    numbers = summarise(runs.losses, runs.eval_losses, runs.reference)
    numbers |= {
        "config": runs.config.get("name"),
        "global_batch_size": runs.global_batch,
        "steps": runs.steps,
        "runs_done": len(runs.losses),
        "runs_planned": runs.planned,
        "row_weights": {
            "rows": len(weights),
            "min": float(weights.min()),
            "max": float(weights.max()),
            "mean": float(weights.mean()),
        },
    }
    return numbers


def _tables(report: Report, numbers: dict[str, Any]) -> None:
    """Each run against the reference, then the spread of each normalisation's runs."""
    report.table(
        (
            "split",
            "K",
            "normalisation",
            "final loss",
            "eval loss (first 32 held-out rows)",
            "max abs Δloss vs reference",
            "max rel Δloss vs reference",
        ),
        [
            (
                r["split"],
                r["grad_accum_steps"],
                r["normalisation"],
                _final_text(r["final_loss"]),
                f"{r['eval_loss']:.6f}",
                f"{r['max_abs_diff_vs_reference']:.2e}",
                _number(r["max_rel_diff_vs_reference"]),
            )
            for r in numbers["runs"]
        ],
    )
    report.table(
        ("spread across splits (max over steps of max − min)", "abs", "rel"),
        [
            (
                f"{n} runs" + (" (round-off)" if n == "exact" else ""),
                f"{s['abs']:.2e}" if s else "-",
                _number(s["rel"]) if s else "-",
            )
            for n, s in (("exact", numbers["exact_spread"]), ("naive", numbers["naive_spread"]))
        ],
    )


def _figure(
    report: Report, losses: dict[Unit, np.ndarray], reference: Split, splits: Sequence[Split]
) -> None:
    """Loss against step for every run (exact solid, naive dashed, one colour per split),
    and each run's |loss − reference| on a log scale (bitwise equal on the bottom edge)."""
    fig = Figure(figsize=(12, 4.4), layout="constrained")
    curves_ax, diff_ax = fig.subplots(1, 2)
    ref = losses[Unit(reference, "exact")]
    colour = {s: f"C{i}" for i, s in enumerate(splits)}
    for unit, curve in losses.items():
        style = {"color": colour[unit.split], "ls": "-" if unit.normalisation == "exact" else "--"}
        steps = np.arange(1, len(curve) + 1)
        label = f"{unit.split.name} {unit.normalisation}"
        curves_ax.plot(steps, curve, label=label, **style)
        if unit != Unit(reference, "exact"):
            diff = np.maximum(np.abs(curve - ref), FLOOR)
            diff_ax.plot(steps, diff, marker=".", lw=0.9, label=label, **style)
    for ax in (curves_ax, diff_ax):
        ax.set_xlabel("optimizer step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    curves_ax.set_ylabel("training loss")
    curves_ax.legend(fontsize=8, title="devices × per-device × K")
    diff_ax.set_yscale("log")
    diff_ax.set_ylim(bottom=FLOOR / 3)
    diff_ax.set_ylabel(f"|loss − {reference.name} exact|\n(bottom edge: bitwise equal)")
    if len(losses) > 1:
        diff_ax.legend(fontsize=8)
    report.figure(
        fig,
        "loss_curves.png",
        "Training loss of every run (exact solid, naive dashed), and its distance from the "
        "exact reference",
    )

"""Speed against the per-device batch, accumulation steps and (language models) remat.

Sweeps on the live devices, each point a short training run (the first step, which
includes warm-up, is left out of the timing): the per-device batch at K = 1, K at the
configured per-device batch, and for a language model each remat policy at the configured
per-device batch. Iteration time follows the micro-batch; accumulation multiplies the time
per optimizer step and leaves examples/s nearly where it was; recomputation costs time.

The planner's order (costs.recommend: fewest hardware FLOPs per model FLOP, then the
largest per-device batch, then the fewest steps) is set beside the measured order of model
FLOP/s, so a reader sees where the prediction holds on this hardware.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
from typing import Any

import jax
import ml_collections
from matplotlib.figure import Figure

from jaxkit.config import run_config
from jaxkit.experiments.common import (
    Report,
    Request,
    check_units,
    drive,
    params_note,
    powers_of_two,
    preamble,
    random_params,
    train_unit,
    unit_config,
)
from jaxkit.models import contract
from jaxkit.models.layers import REMAT_POLICIES
from jaxkit.plan.costs import predicted_speed, split_batch

DEFAULT_STEPS = 6
ACCUM_SWEEP = (1, 2, 4, 8)
Unit = tuple[int, int, str | None]  # per-device batch, K, remat policy (None: no remat key)


@dataclasses.dataclass
class _Sweep:
    """The points of one throughput sweep and each run's summary so far: each unit adds
    its row, and the report is rendered from them after every unit."""

    config: ml_collections.ConfigDict
    devices: list[jax.Device]
    shape: dict[str, int]
    steps: int  # optimizer steps per point, the first one (warm-up) untimed
    b0: int  # the config's per-device batch: the K and remat sweeps run at it
    own: str | None  # the config's remat policy (None: not a language model)
    rows: dict[Unit, dict[str, Any]] = dataclasses.field(default_factory=dict)


def run(request: Request) -> pathlib.Path:
    """Trains the sweep's points one by one, rewriting the report after each."""
    sweep, units = _plan(request)
    report = Report(request.out, "Throughput: examples/s, tokens/s and time per optimizer step")
    return drive(
        report,
        units,
        functools.partial(_do_unit, sweep),
        functools.partial(_render, sweep),
        "runs",
        request.echo,
    )


def _plan(request: Request) -> tuple[_Sweep, list[Unit]]:
    """The sweep and its units, every one checked before any trains."""
    config, options = request.config, request.options
    devices, shape, plan, steps = preamble(request, DEFAULT_STEPS)
    b0 = plan.per_device_batch_size
    top = options.max_per_device_batch or 4 * b0
    batches = powers_of_two(top)
    typed = run_config(config)
    own = typed.model.remat if contract(typed).READS_LM_OPTIONS else None
    units: list[Unit] = [(b, 1, own) for b in batches]
    units += [(b0, k, own) for k in ACCUM_SWEEP if k > 1]
    if own is not None:  # each policy at the configured batch, K = 1
        units += [(b0, 1, r) for r in REMAT_POLICIES if (b0, 1, r) not in units]
    steps = max(steps, 2)  # one warm-up step, then timed ones
    check_units([(_label(u), unit_config(_unit_config(config, u), steps), devices) for u in units])
    return _Sweep(config, devices, shape, steps, b0, own), units


def _unit_config(config: ml_collections.ConfigDict, unit: Unit) -> ml_collections.ConfigDict:
    """A point's config. Speed does not depend on the params' values, so a run from
    model.init_from measures random params of its shape: the weights are not read."""
    b, k, remat = unit
    c = ml_collections.ConfigDict(random_params(config).to_dict())
    c.batch.update(split_batch(b, k))
    if remat is not None:
        c.model.remat = remat
    return c


def _label(unit: Unit) -> str:
    b, k, remat = unit
    return f"per_device_batch_size={b} grad_accum_steps={k}" + (
        f" remat={remat}" if remat is not None else ""
    )


def _do_unit(sweep: _Sweep, unit: Unit) -> None:
    result = train_unit(_unit_config(sweep.config, unit), sweep.devices, sweep.steps)
    sweep.rows[unit] = {"plan": result.plan, **result.summary}


def _render(sweep: _Sweep, report: Report) -> None:
    """The report of the points run so far: their table, the ranks' agreement, the figure."""
    rows = sweep.rows
    report.text(
        f"Config `{sweep.config.get('name')}` on {len(sweep.devices)} "
        f"{sweep.devices[0].platform} devices (mesh {sweep.shape}), {sweep.steps} optimizer "
        "steps per point, median step time after the first step. MFU is model FLOP/s (the "
        "architecture's FLOPs per step / step time), HFU the compiled matmuls' "
        "(recomputation included), each over the device's peak."
    )
    note = params_note(sweep.config, "speed")
    if note:
        report.text(note)
    if not rows:
        return
    header = (
        "per_device_batch_size",
        "grad_accum_steps",
        "global_batch_size",
        "ms per optimizer step",
        "examples/s",
        "tokens/s",
        "MFU",
        "remat",
        "HFU",
        "predicted rank",
        "measured rank",
    )
    predicted, measured = _ranks(rows)
    table = []
    own = sweep.own
    ordered = sorted(rows.items(), key=lambda item: (item[0][1], item[0][2] != own, item[0]))
    for unit, r in ordered:
        b, k, remat = unit
        step_s = r.get("median_step_time_s")
        table.append(
            (
                b,
                k,
                r["plan"].global_batch_size,
                f"{step_s * 1e3:.1f}" if step_s else "-",
                f"{r['examples_per_s']:,.1f}" if r.get("examples_per_s") else "-",
                f"{r['tokens_per_s']:,.0f}" if r.get("tokens_per_s") else "-",
                _percent(r["mfu"]) if "mfu" in r else "-",
                remat or "-",
                _percent(r["hfu"]) if "hfu" in r else "-",
                predicted.get(unit, "-"),
                measured.get(unit, "-"),
            )
        )
    report.table(header, table)
    agree, pairs = _agreement(predicted, measured)
    if pairs:
        report.text(
            "Ranks order model FLOP/s (1 = fastest): predicted by the planner's rule, "
            "measured as model FLOPs per step / median step time; points the rule cannot "
            "tell apart share a rank. The two orders agree on "
            f"{agree} of the {pairs} pairs of points the prediction orders."
        )
    report.figure(
        _figure(sweep), "throughput.png", "Throughput against per-device batch and accumulation"
    )


def _percent(fraction: float) -> str:
    """Three significant figures: a CPU's MFU of 0.2% keeps the digits that tell HFU apart."""
    return f"{fraction * 100:.3g}%"


def _figure(sweep: _Sweep) -> Figure:
    """Examples/s against the per-device batch (K = 1), and step time against K."""
    rows, own, b0 = sweep.rows, sweep.own, sweep.b0
    fig = Figure(figsize=(11, 4.2))
    left, right = fig.subplots(1, 2)
    sweep_b = sorted((b, r) for (b, k, m), r in rows.items() if k == 1 and m == own)
    if sweep_b:
        left.plot([b for b, _ in sweep_b], [r["examples_per_s"] or 0 for _, r in sweep_b], "o-")
        left.set_xscale("log", base=2)
        left.set_xlabel("per-device batch size (K = 1)")
        left.set_ylabel("examples/s")
        left.grid(alpha=0.3)
    sweep_k = sorted((k, r) for (b, k, m), r in rows.items() if b == b0 and m == own)
    if sweep_k:
        right.plot(
            [k for k, _ in sweep_k],
            [(r["median_step_time_s"] or 0) * 1e3 for _, r in sweep_k],
            "o-",
        )
        right.set_xscale("log", base=2)
        right.set_xlabel(f"grad_accum_steps (per-device batch {b0})")
        right.set_ylabel("ms per optimizer step")
        right.grid(alpha=0.3)
    return fig


def _ranks(rows: dict[Unit, dict[str, Any]]) -> tuple[dict[Unit, int], dict[Unit, int]]:
    """Each point's rank (1 = most model FLOP/s) as predicted and as measured."""
    timed = {u: r for u, r in rows.items() if r.get("median_step_time_s")}

    def predicted_key(unit: Unit) -> tuple[float, int, int]:  # ascending: fastest first
        r = timed[unit]
        ratio = r["hardware_flops_per_step"] / r["model_flops_per_step"]
        overhead, batch, fewer_steps = predicted_speed(ratio, unit[0], unit[1])
        return (-overhead, -batch, -fewer_steps)

    def measured_key(unit: Unit) -> float:
        r = timed[unit]
        return -r["model_flops_per_step"] / r["median_step_time_s"]

    usable = [u for u in timed if timed[u].get("model_flops_per_step")]
    # Points the rule cannot tell apart (remat policies that recompute no matmul, at one
    # split) share a rank: 1 + the points predicted strictly faster.
    keys = {u: predicted_key(u) for u in usable}
    predicted = {u: 1 + sum(keys[v] < keys[u] for v in usable) for u in usable}
    measured = {u: i + 1 for i, u in enumerate(sorted(usable, key=measured_key))}
    return predicted, measured


def _agreement(predicted: dict[Unit, int], measured: dict[Unit, int]) -> tuple[int, int]:
    """Pairs of points the two orders put the same way round, of the pairs the prediction
    orders (not those it ranks equal)."""
    units = sorted(predicted)
    pairs = [
        (a, b) for i, a in enumerate(units) for b in units[i + 1 :] if predicted[a] != predicted[b]
    ]
    agree = sum((predicted[a] < predicted[b]) == (measured[a] < measured[b]) for a, b in pairs)
    return agree, len(pairs)

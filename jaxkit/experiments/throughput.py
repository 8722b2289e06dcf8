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

import pathlib
from typing import Any

import ml_collections
from matplotlib.figure import Figure

from jaxkit.config import LM_KINDS
from jaxkit.costs import predicted_speed, split_config, with_remat
from jaxkit.experiments.common import (
    Report,
    Request,
    check_units,
    drive,
    powers_of_two,
    preamble,
    train_unit,
    unit_config,
)
from jaxkit.layers import REMAT_POLICIES, lm_option

DEFAULT_STEPS = 6
ACCUM_SWEEP = (1, 2, 4, 8)
Unit = tuple[int, int, str | None]  # per-device batch, K, remat policy (None: no remat key)


def run(request: Request) -> pathlib.Path:
    config, options = request.config, request.options
    devices, shape, plan, steps = preamble(request, DEFAULT_STEPS)
    b0 = plan.per_device_batch_size
    top = options.max_per_device_batch or 4 * b0
    batches = powers_of_two(top)
    own = lm_option(config.model, "remat") if config.model.kind in LM_KINDS else None
    units: list[Unit] = [(b, 1, own) for b in batches]
    units += [(b0, k, own) for k in ACCUM_SWEEP if k > 1]
    if own is not None:  # each policy at the configured batch, K = 1
        units += [(b0, 1, r) for r in REMAT_POLICIES if (b0, 1, r) not in units]
    steps = max(steps, 2)  # one warm-up step, then timed ones
    rows: dict[Unit, dict[str, Any]] = {}

    def unit_of(unit: Unit) -> ml_collections.ConfigDict:
        b, k, remat = unit
        return split_config(with_remat(config, remat), b, k)

    def label(unit: Unit) -> str:
        b, k, remat = unit
        return f"per_device_batch_size={b} grad_accum_steps={k}" + (
            f" remat={remat}" if remat is not None else ""
        )

    check_units([(label(u), unit_config(unit_of(u), steps), devices) for u in units])

    def do_unit(unit: Unit) -> None:
        result = train_unit(unit_of(unit), devices, steps)
        rows[unit] = {"plan": result.plan, **result.summary}

    def render(report: Report) -> None:
        report.text(
            f"Config `{config.get('name')}` on {len(devices)} {devices[0].platform} devices "
            f"(mesh {shape}), {steps} optimizer steps per point, median step time after the "
            "first step. MFU is model FLOP/s (the architecture's FLOPs per step / step "
            "time), HFU the compiled matmuls' (recomputation included), each over "
            "the device's peak."
        )
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
                    f"{r['mfu']:.1%}" if "mfu" in r else "-",
                    remat or "-",
                    f"{r['hfu']:.1%}" if "hfu" in r else "-",
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
        report.figure(fig, "throughput.png", "Throughput against per-device batch and accumulation")

    report = Report(request.out, "Throughput: examples/s, tokens/s and time per optimizer step")
    return drive(report, units, do_unit, render, "runs", request.echo)


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

"""Speed against the per-device batch and against accumulation steps.

Two sweeps on the live devices, each point a short training run (the first step, which
includes warm-up, is left out of the timing): the per-device batch at K = 1, and K at the
configured per-device batch. Iteration time follows the micro-batch; accumulation
multiplies the time per optimizer step and leaves examples/s nearly where it was.
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable
from typing import Any

import ml_collections
from matplotlib.figure import Figure

from jaxkit.batch_schedule import plan_from_config
from jaxkit.costs import split_config
from jaxkit.experiments import Options, Report, drive, live_mesh, powers_of_two, train_unit

DEFAULT_STEPS = 6
ACCUM_SWEEP = (1, 2, 4, 8)


def run(
    config: ml_collections.ConfigDict,
    out: pathlib.Path,
    options: Options,
    echo: Callable[[str], None],
) -> pathlib.Path:
    devices, shape = live_mesh(config)
    b0 = plan_from_config(config, shape).per_device_batch_size
    top = options.max_per_device_batch or 4 * b0
    batches = powers_of_two(top)
    units = [(b, 1) for b in batches] + [(b0, k) for k in ACCUM_SWEEP if k > 1]
    steps = max(options.steps or DEFAULT_STEPS, 2)  # one warm-up step, then timed ones
    rows: dict[tuple[int, int], dict[str, Any]] = {}

    def do_unit(unit: tuple[int, int]) -> None:
        b, k = unit
        result = train_unit(split_config(config, b, k), devices, steps)
        rows[(b, k)] = {"plan": result.plan, **result.summary}

    def render(report: Report) -> None:
        report.text(
            f"Config `{config.get('name')}` on {len(devices)} {devices[0].platform} devices "
            f"(mesh {shape}), {steps} optimizer steps per point, median step time after the "
            "first step. MFU is achieved FLOP/s (compiled FLOPs per step / step time) over "
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
        )
        table = []
        for (b, k), r in sorted(rows.items(), key=lambda item: (item[0][1], item[0][0])):
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
                )
            )
        report.table(header, table)
        fig = Figure(figsize=(11, 4.2))
        left, right = fig.subplots(1, 2)
        sweep_b = sorted((b, r) for (b, k), r in rows.items() if k == 1)
        if sweep_b:
            left.plot([b for b, _ in sweep_b], [r["examples_per_s"] or 0 for _, r in sweep_b], "o-")
            left.set_xscale("log", base=2)
            left.set_xlabel("per-device batch size (K = 1)")
            left.set_ylabel("examples/s")
            left.grid(alpha=0.3)
        sweep_k = sorted((k, r) for (b, k), r in rows.items() if b == b0)
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

    report = Report(out, "Throughput: examples/s, tokens/s and time per optimizer step")
    return drive(report, units, do_unit, render, "runs")

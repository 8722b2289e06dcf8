"""Every split of one global batch trains the same model: loss curves, differences, costs.

The seeds' example by default: 32 = 1×32×1 = 4×8×1 = 2×8×2 = 1×8×4, and for another
global batch G the same pattern, 1×G×1, 4×G/4×1, 2×G/4×2, 1×G/4×4.
"""

from __future__ import annotations

import pathlib
from typing import Any

import jax
import numpy as np

from jaxkit.experiments.common import (
    ExperimentError,
    Report,
    Request,
    Split,
    check_global_batch,
    check_splits,
    drive,
    markdown_table,
    new_figure,
    params_note,
    parse_splits,
    preamble,
    relative_difference,
    split_mesh,
    train_split,
)
from jaxkit.plan.costs import format_bytes
from jaxkit.records.viz import loss_curve

DEFAULT_STEPS = 20
F32_EPS = float(np.finfo(np.float32).eps)


def default_splits(global_batch: int) -> list[Split]:
    if global_batch % 4:
        raise ExperimentError(
            f"global_batch_size={global_batch} is not divisible by 4: give --splits, "
            "e.g. --splits 1x32x1,4x8x1,2x8x2,1x8x4"
        )
    q = global_batch // 4
    return [Split(1, global_batch, 1), Split(4, q, 1), Split(2, q, 2), Split(1, q, 4)]


def run(request: Request) -> pathlib.Path:
    config, options, echo = request.config, request.options, request.echo
    devices, _, plan, steps = preamble(request, DEFAULT_STEPS, own_meshes=True)
    g = plan.global_batch_size
    splits = default_splits(g) if options.splits is None else parse_splits(options.splits)
    for split in splits:
        check_global_batch(split, g)
    meshes = {split: split_mesh(config, split) for split in splits}  # all refused up front
    check_splits(config, splits, devices, steps)
    results: dict[Split, dict[str, Any]] = {}
    summary = ""  # the report's table of splits, which the command also prints

    def do_unit(split: Split) -> None:
        result = train_split(config, split, devices, steps)
        results[split] = {
            "losses": loss_curve(result.records)[1],
            "params": jax.device_get(result.state.params),
            "step_s": result.summary.get("median_step_time_s"),
            "memory": result.summary.get("memory_bytes"),
        }
        echo(f"  {split.name}: final loss {results[split]['losses'][-1]:.6f}")

    def render(report: Report) -> None:
        nonlocal summary
        report.text(
            f"Config `{config.get('name')}`, global batch {g}, {steps} optimizer steps per "
            "split, same seed and data order. A split is devices × per_device_batch_size × "
            "grad_accum_steps; each trains from the same initial parameters. Meshes "
            "(data × fsdp × tensor): "
            + ", ".join(
                f"{split.name} on {shape['data']}×{shape['fsdp']}×{shape['tensor']}"
                for split, shape in meshes.items()
            )
            + "."
        )
        note = params_note(config)
        if note:
            report.text(note)
        if not results:
            return
        ref_split = next(iter(results))
        summary, worst_loss, worst_param = _splits_table(results, ref_split)
        report.text(summary)
        compute = config.model.get("compute_dtype", "float32")
        eps = F32_EPS if compute == "float32" else 2.0**-7  # bfloat16: 8 significant bits
        report.text(
            f"**Largest difference between splits:** relative loss {worst_loss:.2e} and "
            f"parameter {worst_param:.2e} after {steps} steps (matmuls in {compute}, whose "
            f"epsilon is {eps:.1e}). The splits reduce the same sums in different orders, "
            "so they agree to round-off, not bit for bit; memory and step time are what "
            "differ."
        )
        fig, ax = new_figure()
        styles = ["-", "--", ":", "-."]
        for i, (split, r) in enumerate(results.items()):
            steps_axis = np.arange(1, len(r["losses"]) + 1)
            ax.plot(steps_axis, r["losses"], styles[i % 4], label=split.name, lw=2 - 0.3 * (i % 4))
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("training loss (mean over the global batch)")
        ax.legend(title="devices × per-device × accum")
        ax.grid(alpha=0.3)
        report.figure(fig, "loss_curves.png", f"Loss curves of every split of {g}, overlaid")

    report = Report(request.out, f"Equivalence: the splits of a global batch of {g}")
    path = drive(report, splits, do_unit, render, "splits", echo)
    echo(summary)
    return path


def _splits_table(
    results: dict[Split, dict[str, Any]], ref_split: Split
) -> tuple[str, float, float]:
    """The report's table of splits (each against `ref_split`), with the largest relative
    loss and absolute parameter differences in it."""
    ref = results[ref_split]
    rows, worst_loss, worst_param = [], 0.0, 0.0
    for split, r in results.items():
        diff = np.abs(r["losses"] - ref["losses"])
        d_loss = float(np.max(diff))
        rel = relative_difference(diff, ref["losses"])  # each step's, not the curve's
        rel = float("nan") if rel is None else rel  # no finite loss to compare
        d_param = max(
            float(np.max(np.abs(a - b)))
            for a, b in zip(
                jax.tree.leaves(r["params"]), jax.tree.leaves(ref["params"]), strict=True
            )
        )
        worst_loss, worst_param = max(worst_loss, rel), max(worst_param, d_param)
        rows.append(
            (
                split.name,
                f"{r['losses'][-1]:.6f}",
                f"{d_loss:.2e}",
                f"{rel:.2e}",
                f"{d_param:.2e}",
                f"{r['step_s'] * 1e3:.1f}" if r["step_s"] else "-",
                format_bytes(r["memory"]) if r["memory"] else "-",
            )
        )
    header = (
        "split",
        "final loss",
        f"max abs Δloss vs {ref_split.name}",
        "max rel Δloss",
        "max abs Δparam",
        "median step ms",
        "compiled memory/device",
    )
    return markdown_table(header, rows), worst_loss, worst_param

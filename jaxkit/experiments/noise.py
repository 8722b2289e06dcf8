"""The critical batch size, from the gradient noise scale measured while training.

Trains the config as it is and reads the B_simple estimate every run logs (see
jaxkit/batch/noise_scale.py): |G|² and tr Σ from the small-batch and the accumulated gradient,
smoothed. B_simple is the batch at which gradient noise equals signal; well below it a
bigger batch cuts the steps needed almost in proportion, well above it it mostly wastes
examples (McCandlish et al. 2018).
"""

from __future__ import annotations

import pathlib
from typing import Any

from jaxkit.batch.noise_scale import SMALL_BATCH_ROWS, has_two_batch_sizes
from jaxkit.experiments.common import (
    ExperimentError,
    Report,
    Request,
    check_units,
    drive,
    new_figure,
    params_note,
    preamble,
    train_unit,
    unit_config,
)

DEFAULT_STEPS = 100


def run(request: Request) -> pathlib.Path:
    # Every step samples: the experiment is about the estimate, which gets the most samples
    # this way (a run trains with one in train.noise_scale_every steps, for speed).
    config = request.config.copy_and_resolve_references()
    asked = config.train.noise_scale_every
    config.train.noise_scale_every = 1
    ignored = f"Sampled every step; train.noise_scale_every={asked} ignored." if asked != 1 else ""
    devices, _, plan, steps = preamble(request, DEFAULT_STEPS)
    if not has_two_batch_sizes(plan.global_batch_size):
        raise ExperimentError(
            f"the noise scale needs two batch sizes, but the small one ({SMALL_BATCH_ROWS} "
            f"row(s)) is the whole global batch ({plan.global_batch_size}): use a larger "
            "batch.global_batch_size"
        )
    check_units([("the run", unit_config(config, steps), devices)])
    if ignored:
        request.echo(ignored)
    found: dict[str, Any] = {}

    def do_unit(unit: str) -> None:
        result = train_unit(config, devices, steps)
        found["records"] = [r for r in result.records if "loss" in r]
        found["summary"] = result.summary

    def render(report: Report) -> None:
        tokens = plan.seq_len
        report.text(
            f"Config `{config.get('name')}`, plan {plan.data_parallel_size}×"
            f"{plan.per_device_batch_size}×{plan.grad_accum_steps} = global batch "
            f"{plan.global_batch_size}, {steps} optimizer steps. Small batch: the first "
            f"{SMALL_BATCH_ROWS} row(s) of each global batch, the same for every split; "
            f"big batch: the {plan.global_batch_size}-row accumulated gradient, both at "
            f"every step. Estimates smoothed with decay {config.train.noise_scale_decay}."
        )
        for note in (ignored, params_note(config)):
            if note:
                report.text(note)
        if "records" not in found:
            return
        records: list[dict] = found["records"]
        pts = [(r["step"], r["noise_scale"]) for r in records if "noise_scale" in r]
        summary: dict = found["summary"]
        b_simple = summary.get("noise_scale")
        if b_simple is None:
            report.text(
                "The smoothed |G|² estimate is not positive yet: the gradient is still "
                "within its own noise. Train longer (--steps) for a critical batch size."
            )
        else:
            ratio = plan.global_batch_size / b_simple
            verdict = (
                "below it: a larger global batch would still cut the optimizer steps "
                "nearly in proportion"
                if ratio < 0.5
                else "near it: larger batches buy less and less"
                if ratio < 2
                else "above it: much of each batch is spent beyond the point of diminishing "
                "returns; a smaller global batch would use examples better"
            )
            rows = [
                ("critical batch size ≈ B_simple (rows)", f"{b_simple:,.1f}"),
                ("configured global batch (rows)", plan.global_batch_size),
                ("global batch / B_simple", f"{ratio:.2f}"),
                ("‖G‖² estimate", f"{summary['grad_sq_estimate']:.4g}"),
                ("tr Σ estimate (per row)", f"{summary['grad_var_estimate']:.4g}"),
            ]
            if tokens:
                rows.insert(1, ("critical batch size (tokens)", f"{b_simple * tokens:,.0f}"))
            report.table(("quantity", "value"), rows)
            report.text(f"The configured global batch is {verdict}.")
        if pts:
            fig, ax = new_figure()
            xs, ys = zip(*pts, strict=True)
            ax.plot(xs, ys, label="B_simple (smoothed)")
            ax.axhline(plan.global_batch_size, color="gray", ls="--", label="global batch")
            ax.set_yscale("log")
            ax.set_xlabel("optimizer step")
            ax.set_ylabel("rows")
            ax.grid(alpha=0.3)
            ax.legend()
            report.figure(fig, "noise_scale.png", "Gradient noise scale during training")
            # Steps that scored no target have no loss (null): left out.
            losses = [r["loss"] for r in records if r["loss"] is not None]
            if losses:
                report.text(f"Training loss went from {losses[0]:.4f} to {losses[-1]:.4f}.")

    report = Report(request.out, "Noise scale: the critical batch size")
    return drive(report, ["training"], do_unit, render, "run", request.echo)

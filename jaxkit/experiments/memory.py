"""Memory depends on the micro-batch, not on accumulation: compiled, and measured on CPU.

Three views of one claim: the compiled per-device memory as the per-device batch grows
(K = 1), the same as accumulation grows at a fixed per-device batch (MultiSteps and fused),
and where the state's bytes go (params, optimizer moments, and MultiSteps' accumulator: one
params-sized buffer, held between calls at K > 1 only). On CPU under Linux a few points are
also measured as resident-memory growth in a fresh process, next to the estimate.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
from typing import Any, cast

import jax
import ml_collections
import numpy as np

from jaxkit import mesh as mesh_lib
from jaxkit.batch.plan import Accumulation
from jaxkit.batch.schedule import plan_from_config
from jaxkit.config import run_config
from jaxkit.experiments.common import (
    Report,
    Request,
    drive,
    new_figure,
    params_note,
    powers_of_two,
    preamble,
)
from jaxkit.plan import costs
from jaxkit.records import rss
from jaxkit.step.train_step import abstract_state, accumulator_layout, build

ACCUM_SWEEP = (1, 2, 4, 8)


def state_breakdown(config: ml_collections.ConfigDict, devices: list) -> list[tuple[str, int]]:
    """Per-device bytes of each part of the train state, from its shardings."""
    mesh = mesh_lib.make_mesh(config.mesh.to_dict(), devices)
    typed = run_config(config)
    setup = build(typed, plan_from_config(typed, mesh_lib.mesh_shape(mesh)), mesh)
    state = abstract_state(setup)
    # Held between calls only in MultiSteps mode at K > 1 (none at K = 1 or fused): its size
    # there, whatever K this config's plan has.
    accumulator = accumulator_layout(state, held=True).opt_state.acc_grads
    size = mesh_lib.bytes_per_device
    return [
        ("params", size(state.params)),
        ("optimizer state (inner: moments, counters)", size(state.opt_state.inner_opt_state)),
        ("MultiSteps accumulator (acc_grads), at K > 1", size(accumulator)),
    ]


MIB = 2**20
Unit = tuple[str, int]  # ("batch", per-device batch), (mode, K) or ("rss", per-device batch)


@dataclasses.dataclass
class _Sweep:
    """The points of one memory sweep and what has been compiled or measured of them so far:
    each unit adds to it, and the report is rendered from it after every unit."""

    config: ml_collections.ConfigDict
    devices: list[jax.Device]
    shape: dict[str, int]
    target: str | None  # the described TPU slice the devices are (--target), if any
    b0: int  # the config's per-device batch
    batches: list[int]  # the per-device batches of the batch sweep
    measure: bool  # resident memory can be measured here (CPU under Linux)
    breakdown: list[tuple[str, int]]
    by_batch: dict[int, costs.StepCost] = dataclasses.field(default_factory=dict)
    by_accum: dict[Unit, costs.StepCost] = dataclasses.field(default_factory=dict)
    measured: dict[int, dict] = dataclasses.field(default_factory=dict)
    refused: dict[Unit, costs.OutOfMemory] = dataclasses.field(default_factory=dict)


def run(request: Request) -> pathlib.Path:
    """Compiles the sweep's points one by one, rewriting the report after each."""
    sweep, units = _plan(request)
    report = Report(request.out, "Memory: what the micro-batch costs")
    return drive(
        report,
        units,
        functools.partial(_do_unit, sweep),
        functools.partial(_render, sweep),
        "compiles/measurements",
        request.echo,
    )


def _plan(request: Request) -> tuple[_Sweep, list[Unit]]:
    """The sweep and its units in the order they run: the batch units first, since the
    accumulation sweep takes its per-device batch from those that compiled."""
    config, options = request.config, request.options
    devices, shape, base, _ = preamble(request)  # it compiles, trains nothing: no steps
    b0 = base.per_device_batch_size
    top = options.max_per_device_batch or 4 * b0
    # The config's own batch is one of the points, where the sweep reaches it.
    batches = sorted(set(powers_of_two(top)) | ({b0} if b0 <= top else set()))
    units: list[Unit] = [("batch", b) for b in batches]
    units += [(mode, k) for mode in Accumulation for k in ACCUM_SWEEP]
    measure = supported_rss(devices)
    rss_batches = _spread(batches, options.rss_points) if measure else []
    units += [("rss", b) for b in rss_batches]
    breakdown = state_breakdown(config, devices)
    sweep = _Sweep(config, devices, shape, options.target, b0, batches, measure, breakdown)
    return sweep, units


def _do_unit(sweep: _Sweep, unit: Unit) -> None:
    try:
        _cost_unit(sweep, unit)
    except costs.OutOfMemory as err:  # a TPU compiler will not compile past its HBM
        sweep.refused[unit] = err


def _accum_batch(sweep: _Sweep) -> int | None:
    """The per-device batch of the accumulation sweep: the config's, unless the batch
    sweep stopped below it (--max-per-device-batch) or the compiler refused it; then
    the largest below it that compiled (None: none did, and the sweep is skipped)."""
    return max((b for b in sweep.by_batch if b <= sweep.b0), default=None)


def _cost_unit(sweep: _Sweep, unit: Unit) -> None:
    config, shape, devices = sweep.config, sweep.shape, sweep.devices
    kind, n = unit
    if kind == "batch":
        c = costs.split_config(run_config(config), n, 1)
        sweep.by_batch[n] = costs.step_cost(c, plan_from_config(c, shape), devices)
    elif kind == "rss":
        sweep.measured[n] = rss.measure_in_subprocess(config.to_dict(), n, devices=1)
    elif (b := _accum_batch(sweep)) is not None:  # the batch units ran first
        c = costs.split_config(run_config(config), b, n)
        mode = Accumulation(kind).value  # the unit's mode: multisteps or fused
        c = dataclasses.replace(c, train=dataclasses.replace(c.train, accumulation=cast(Any, mode)))
        sweep.by_accum[(kind, n)] = costs.step_cost(c, plan_from_config(c, shape), devices)


def _render(sweep: _Sweep, report: Report) -> None:
    """The report of what is done so far: each section appears once it has a point."""
    devices = sweep.devices
    where = (
        f"the TPU slice {sweep.target}, compiled by the TPU compiler ({len(devices)} "
        f"{devices[0].device_kind} devices)"
        if sweep.target
        else f"{len(devices)} {devices[0].platform} devices"
    )
    report.text(
        f"Config `{sweep.config.get('name')}` on {where} (mesh {sweep.shape}). Compiled "
        "per-device memory = argument + output − alias + temp bytes of the train step "
        "(`memory_analysis()`; nothing executed)."
    )
    note = params_note(sweep.config, "the memory a step needs")
    if note:
        report.text(note)
    if sweep.refused:
        report.text(
            "The compiler refused these (out of memory on the device): "
            + "; ".join(
                f"{'per_device_batch_size' if kind == 'batch' else kind + ' K'}={n} ({err})"
                for (kind, n), err in sweep.refused.items()
            )
        )
    report.text("## Where the state's bytes go (per device)")
    report.table(("part", "bytes/device"), [(p, costs.format_bytes(b)) for p, b in sweep.breakdown])
    if sweep.by_batch:
        _render_batches(sweep, report)
    swept = _accum_batch(sweep)
    if all(("batch", n) in sweep.refused for n in sweep.batches):
        report.text("No per-device batch compiled, so accumulation was not compiled either.")
    if sweep.by_accum and swept is not None:
        _render_accumulation(sweep, report, swept)
    if sweep.measured:
        _render_measured(sweep, report)
    elif not sweep.measure:
        report.text("Resident memory is measured only on CPU under Linux; not here.")


def _render_batches(sweep: _Sweep, report: Report) -> None:
    """Memory against the per-device batch at K = 1: table and figure."""
    by_batch, measured = sweep.by_batch, sweep.measured
    report.text("## Against the per-device batch (grad_accum_steps = 1)")
    rows: list[tuple[object, ...]] = [
        (
            b,
            costs.format_bytes(c.memory_bytes),
            costs.format_bytes(c.argument_bytes),
            costs.format_bytes(c.temp_bytes),
        )
        for b, c in sorted(by_batch.items())
    ]
    report.table(("per_device_batch_size", "memory", "arguments", "temp"), rows)
    fig, ax = new_figure()
    xs = sorted(by_batch)
    ax.plot(
        xs,
        [by_batch[b].memory_bytes / MIB for b in xs],
        "o-",
        label=f"compiled, {len(sweep.devices)} devices",
    )
    if measured:  # measured on one device: against that device count's estimate
        mx = sorted(measured)
        for key, marker, label in (
            ("estimate_bytes", "x", "compiled, 1 device"),
            ("measured_bytes", "s", "measured RSS growth, 1 CPU device"),
        ):
            ax.plot(mx, [measured[b][key] / MIB for b in mx], marker, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("per-device batch size")
    ax.set_ylabel("MiB per device")
    ax.grid(alpha=0.3)
    ax.legend()
    report.figure(fig, "memory_vs_batch.png", "Memory grows with the per-device batch")


def _render_accumulation(sweep: _Sweep, report: Report, swept: int) -> None:
    """Memory against K at the per-device batch `swept`, MultiSteps beside fused."""
    by_accum, b0 = sweep.by_accum, sweep.b0
    why = (
        ""
        if swept == b0
        else f": the config's {b0} "
        + ("did not compile" if ("batch", b0) in sweep.refused else "is beyond the sweep")
    )
    report.text(f"## Against accumulation steps (per_device_batch_size = {swept}{why})")
    ks = sorted({k for _, k in by_accum})
    rows = [
        (
            k,
            *(
                costs.format_bytes(by_accum[(m, k)].memory_bytes) if (m, k) in by_accum else "-"
                for m in Accumulation
            ),
        )
        for k in ks
    ]
    report.table(("grad_accum_steps", "multisteps memory", "fused memory"), rows)
    fig, ax = new_figure()
    for mode, marker in zip(Accumulation, ("o-", "s--"), strict=True):
        pts = sorted((k, c.memory_bytes / MIB) for (m, k), c in by_accum.items() if m == mode)
        if pts:
            ax.plot(*zip(*pts, strict=True), marker, label=mode)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("grad_accum_steps")
    ax.set_ylabel("MiB per device")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    report.figure(fig, "memory_vs_accum.png", "Memory against accumulation steps")
    report.text(
        "MultiSteps runs one micro-batch per call, so for every K > 1 its program, and "
        "its memory, are the same; it carries the params-sized accumulator of the table "
        "above between calls. At K = 1 every call is a whole optimizer step: no "
        "accumulator, and no update computed and masked on each call, so K = 1 costs "
        "less (a run whose batch schedule reaches K > 1 keeps the accumulator at every "
        "K). Fused holds no accumulator between steps and takes the whole (K, "
        "micro-batch) batch in one call, so its input grows with K (a few bytes per "
        "token), and at K > 1 it sums the gradients in a params-sized buffer of its own."
    )


def _render_measured(sweep: _Sweep, report: Report) -> None:
    """The one-device estimate beside the resident-memory growth measured for it."""
    report.text("## Estimate against measured resident memory (CPU, one device)")
    rows = []
    for b, m in sorted(sweep.measured.items()):
        err = m["measured_bytes"] / m["estimate_bytes"] - 1
        rows.append(
            (
                b,
                costs.format_bytes(m["estimate_bytes"]),
                costs.format_bytes(m["measured_bytes"]),
                f"{err:+.1%}",
            )
        )
    report.table(
        ("per_device_batch_size", "compiled estimate", "measured RSS growth", "error"),
        rows,
    )


def supported_rss(devices: list) -> bool:
    return devices[0].platform == "cpu" and rss.supported()


def _spread(values: list[int], count: int) -> list[int]:
    """Up to `count` values spread over `values`, its largest included."""
    if count <= 0:
        return []
    picks = np.linspace(0, len(values) - 1, min(count, len(values))).round().astype(int)
    return sorted({values[i] for i in picks})

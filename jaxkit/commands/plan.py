"""`jaxkit plan`: prints what `jaxkit.plan.planning` answers, as tables or as one JSON object."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from jaxkit.commands import common

if TYPE_CHECKING:
    import jax
    import ml_collections

    from jaxkit.plan import costs, planning


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    plan = sub.add_parser("plan", help="print the batch plan without training")
    common.add_common(plan)
    plan.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    plan.add_argument(
        "--all-splits",
        action="store_true",
        help="every valid (devices, per-device batch, accumulation) for the global batch, each "
        "with its compiled per-device memory and FLOPs (compiles, runs nothing)",
    )
    plan.add_argument(
        "--device-counts",
        metavar="N,N,...",
        help="device counts --all-splits considers (default: every divisor of the live count)",
    )
    plan.add_argument(
        "--memory-budget",
        metavar="SIZE",
        help="per-device memory to fit, e.g. 16GiB (default: the device's own, where JAX "
        "reports it; CPUs report none)",
    )
    plan.add_argument(
        "--max-per-device-batch",
        action="store_true",
        help="find the largest per-device batch under the memory budget by compile-only search",
    )
    plan.add_argument(
        "--remat",
        metavar="POLICY,...",
        help="with --all-splits or --max-per-device-batch: the activation-recompute policies "
        "to compare, of none, dots, full (default: the config's model.remat)",
    )
    plan.add_argument("--target", metavar="TARGET", help=common.TARGET_HELP)
    plan.add_argument(
        "--slices",
        type=common.int_at_least(1),
        metavar="N",
        help="with --target: plan for N such slices joined by the data-centre network "
        "(multi-slice), the data axis spanning them unless mesh.dcn_data/mesh.dcn_fsdp say "
        "otherwise (default 1)",
    )
    plan.add_argument(
        "--usd-per-chip-hour",
        type=price,
        metavar="USD",
        help="with --target and --all-splits or --max-per-device-batch: what a chip costs an "
        "hour, to price a billion tokens at each split's predicted step time",
    )
    return plan


def price(text: str) -> float:
    """An argparse type: planning.parse_price's, refused as a usage error (exit 2)."""
    from jaxkit.plan.planning import parse_price

    try:
        return parse_price(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def ignored_option(opts: argparse.Namespace) -> str | None:
    """A plan option this command line would ignore, said as a usage error."""
    if opts.all_splits and opts.max_per_device_batch:
        return "--all-splits and --max-per-device-batch are two modes: give one"
    if opts.device_counts is not None and not opts.all_splits:
        return "--device-counts applies only with --all-splits"
    if opts.memory_budget is not None and not (opts.all_splits or opts.max_per_device_batch):
        return "--memory-budget applies only with --all-splits or --max-per-device-batch"
    if opts.remat is not None and not (opts.all_splits or opts.max_per_device_batch):
        return "--remat applies only with --all-splits or --max-per-device-batch"
    if opts.slices is not None and opts.target is None:
        return "--slices applies only with --target (the slices of a described TPU target)"
    if opts.usd_per_chip_hour is not None and opts.target is None:
        return "--usd-per-chip-hour applies only with --target (it prices predicted steps)"
    if opts.usd_per_chip_hour is not None and not (opts.all_splits or opts.max_per_device_batch):
        return "--usd-per-chip-hour applies only with --all-splits or --max-per-device-batch"
    return None


def model_line(m: dict[str, object]) -> str:
    from jaxkit.plan import costs

    line = f"model: {m['kind']}, {m['param_count']:,} params"
    if "param_dtype" in m:
        layout = "scanned layers" if m["scan_layers"] else "unrolled layers"
        line += (
            f" in {m['param_dtype']}, matmuls in {m['compute_dtype']}, remat {m['remat']}, {layout}"
        )
        if "attention" in m:
            line += f", attention {m['attention']}"
    per_device, every = (
        costs.format_flops(float(m[key]))  # type: ignore[arg-type]
        for key in ("model_flops_per_step", "model_flops_per_step_all_devices")
    )
    return line + f"; {per_device}FLOPs per optimizer step per device (model; {every}FLOPs on all)"


def run(
    config: ml_collections.ConfigDict,
    shape: dict[str, int],
    opts: argparse.Namespace,
    devices: Sequence[jax.Device],
) -> int:
    from jaxkit.config import run_config
    from jaxkit.plan import planning

    request = planning.request(
        run_config(config),
        devices,
        shape,
        target=opts.target,
        memory_budget=opts.memory_budget,
        remat=opts.remat,
        usd_per_chip_hour=opts.usd_per_chip_hour,
    )
    if request.target is not None and not opts.json:
        plan = request.plan
        print(f"target: {request.target.describe()}")
        print(
            f"each host loads {request.batch_shards_per_host} of the {plan.data_parallel_size} "
            f"per-device batches of a micro-step: rows per host per micro-step: "
            f"{request.rows_per_host} (of {plan.micro_batch_size})"
        )
    if opts.max_per_device_batch:
        return _max_batch(request, opts.json)
    if opts.all_splits:
        return _all_splits(request, opts)
    summary = planning.summary(request)
    if opts.json:
        print(json.dumps(summary.to_json()))
    else:
        _print_summary(summary)
    return 0


def _print_summary(summary: planning.Summary) -> None:
    config, schedule = summary.request.config, summary.request.schedule
    print(schedule.first.table())
    print(model_line(summary.model))
    if config.train.examples is not None:
        print(
            f"run: {schedule.total_steps} optimizer steps, {schedule.total_examples:,} "
            f"examples (train.examples={config.train.examples:,}, to a whole step)"
            if schedule.kind != "auto"
            else f"run: until {config.train.examples:,} examples (steps as the batch grows)"
        )
    if schedule.kind != "fixed":
        print(f"\nbatch schedule ({schedule.kind}; K changes, the per-device batch does not):")
        print(schedule.table())


def _all_splits(request: planning.Request, opts: argparse.Namespace) -> int:
    import tqdm

    from jaxkit.batch.plan import format_table
    from jaxkit.plan import costs, planning

    candidates = planning.candidate_splits(request, opts.device_counts)
    total = len(candidates.splits)
    with tqdm.tqdm(total=total, unit="compile", file=sys.stderr, disable=opts.json) as bar:

        def compiled(split: costs.Split) -> None:
            remat = f" remat={split.remat}" if split.remat else ""
            bar.set_postfix_str(f"devices={split.devices} per_device={split.key[1]}{remat}")
            bar.update(1)

        result = planning.cost_splits(request, candidates, progress=compiled)
    if opts.json:
        print(json.dumps(result.to_json()))
        return 0
    devices, budget, chosen = request.devices, request.budget, result.recommended
    kind = devices[0].device_kind if request.target is not None else devices[0].platform
    print(
        f"global_batch_size={request.plan.global_batch_size}: every split on "
        f"{', '.join(map(str, result.counts))} {kind} devices, compiled per-device memory "
        "(argument + output − alias + temp) and FLOPs per optimizer step"
    )
    compared = opts.remat is not None
    print(
        format_table(
            costs.split_header(compared),
            costs.splits_cost_table(result.splits, budget, chosen, compared),
        )
    )
    print(
        "model FLOPs: the architecture's (flops.py), the basis of MFU; hardware FLOPs: the "
        "compiled matmuls, recomputation included (× model), the basis of HFU"
    )
    if result.predictions:
        _print_predictions(result)
    elif request.target is not None:
        g = request.target.generation
        print(
            f"no predicted step time: it needs {g.name}'s HBM, ICI and DCN bandwidths "
            f"(plan/targets.py) and its peak for {request.config.model.compute_dtype} "
            "matmuls (plan/peak.py), and the kit's tables lack one"
        )
    for n, why in result.left_out.items():
        print(f"left out: {n} devices ({why})")
    if budget is None:
        print(f"{devices[0].platform} devices report no memory limit: give --memory-budget SIZE")
    elif chosen is None:
        print(
            f"no split on {len(devices)} devices fits {costs.format_bytes(budget)}: "
            "a smaller model, a smaller global batch or more devices"
        )
    else:
        p = chosen.plan
        remat = f" model.remat={chosen.remat}" if chosen.remat else ""
        unit = next((t.unit for t in result.predictions.values()), "tokens")
        why = (
            f"the most predicted {unit} per second per device of those that fit; ties: the "
            "fewest hardware FLOPs per model FLOP, the largest per-device batch, the fewest "
            "accumulation steps"
            if result.predictions
            else "the most model FLOPs per second predicted: the fewest hardware FLOPs per "
            "model FLOP, then the largest per-device batch that fits, then the fewest "
            "accumulation steps"
        )
        print(
            f"recommended on {len(devices)} devices within {costs.format_bytes(budget)}: "
            f"per_device_batch_size={p.per_device_batch_size} "
            f"grad_accum_steps={p.grad_accum_steps}{remat} ({why})"
        )
    return 0


def _print_predictions(result: planning.AllSplits) -> None:
    """The predicted step of each compiled split on the target: a lower bound, its bound."""
    from jaxkit.batch.plan import format_table
    from jaxkit.plan import costs

    request = result.request
    assert request.target is not None and request.chip is not None
    priced = request.usd_per_chip_hour is not None
    rows = []
    for s in result.splits:
        p, t = s.plan, result.predicted(s)
        if t is None:
            continue
        row: list[object] = [p.per_device_batch_size, p.grad_accum_steps]
        row += [s.remat or ""] if len(request.policies) > 1 else []
        row += [costs.format_seconds(t.step_s), t.bound]
        row += [costs.format_seconds(x) for x in (t.compute_s, t.hbm_s, t.ici_s, t.dcn_s)]
        row += [f"{t.tokens_per_s_per_device:,.0f}", f"{100 * t.mfu:.1f}%"]
        row += [f"{t.usd_per_billion_tokens:,.3g}"] if priced else []
        rows.append(tuple(row))
    header = ["per_device_batch_size", "grad_accum_steps"]
    header += ["remat"] if len(request.policies) > 1 else []
    header += ["step", "bound", "compute", "hbm", "ici", "dcn"]
    unit = next(iter(result.predictions.values())).unit  # tokens, or a classifier's examples
    header += [f"{unit}/s/device", "MFU"] + ([f"USD/1B {unit}"] if priced else [])
    chip = request.chip
    print(
        f"\npredicted step on {request.target.describe()} (a lower bound: the slowest of "
        f"compute at {chip.peak_flops_per_s / 1e12:g} TFLOP/s, HBM at "
        f"{chip.hbm_bytes_per_s / 1e9:g} GB/s, ICI at {chip.ici_link_bytes_per_s / 1e9:g} GB/s "
        f"a link each way, DCN at {chip.dcn_bytes_per_s / 1e9:g} GB/s a chip; see "
        "docs/tpu-planning.md):"
    )
    print(format_table(tuple(header), rows))


def _max_batch(request: planning.Request, as_json: bool) -> int:
    from jaxkit.plan import costs, planning

    several = len(request.policies) > 1
    began = time.perf_counter()

    # Each compile is announced as it starts (on stderr, so --json's stdout stays one
    # document): for a TPU slice one can take minutes, and silence looks like a hang.
    def starting(policy: str | None, b: int) -> None:
        label = f"  remat={policy} " if several else "  "
        elapsed = time.perf_counter() - began
        print(
            f"{label}per_device_batch_size={b}: compiling ({elapsed:.1f} s into the search)",
            file=sys.stderr,
            flush=True,
        )

    def progress(policy: str | None, b: int, memory: int | None) -> None:
        label = f"  remat={policy} " if several else "  "
        said = (
            costs.format_bytes(memory)
            if memory is not None
            else "more than the device has (the compiler refused it)"
        )
        print(f"{label}per_device_batch_size={b}: {said}", file=sys.stderr, flush=True)

    result = planning.max_batch(request, starting, progress)
    if as_json:  # a search that found nothing still says what each size needed
        print(json.dumps(result.to_json()))
    result.check()
    if as_json:
        return 0
    n, budget = len(request.devices), result.budget
    for policy, search in result.searches:
        remat = f" with remat={policy}" if several else ""
        if search.cost is None:
            print(f"max per_device_batch_size{remat}: none fits")
            continue
        ratio = search.cost.hardware_flops_per_step / search.cost.model_flops_per_step
        print(
            f"max per_device_batch_size={search.per_device_batch_size}{remat} on "
            f"{n} devices: {costs.format_bytes(search.cost.memory_bytes)} of "
            f"{costs.format_bytes(budget)}, {ratio:.2f} hardware FLOPs per model FLOP "
            f"({search.compiles} compiles, {search.seconds:.1f} s, nothing executed)"
        )
        timed = result.predictions.get(policy)
        if timed is not None:
            priced = timed.usd_per_billion_tokens
            print(
                f"  predicted step (K = 1): at least {costs.format_seconds(timed.step_s)}, "
                f"bound by {timed.bound}; {timed.tokens_per_s_per_device:,.0f} {timed.unit}/s per "
                f"device, MFU {100 * timed.mfu:.1f}%"
                + (f", {priced:,.3g} USD per billion {timed.unit}" if priced is not None else "")
            )
    if several:
        policy, best = result.best
        print(
            f"recommended: model.remat={policy} "
            f"per_device_batch_size={best.per_device_batch_size} (the fewest hardware "
            "FLOPs per model FLOP, then the largest per-device batch)"
        )
    return 0

"""`jaxkit plan` and `jaxkit train`: a thin layer over importable functions."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import jax
    import ml_collections

DEFAULT_HOST_DEVICES = 8  # CPU devices simulated when no accelerator is present


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "args",
        nargs="*",
        metavar="[CONFIG] [key=value ...]",
        help="a config name in configs/ or a path to one (default lm_tiny), then overrides",
    )
    parser.add_argument(
        "--host-devices",
        type=int,
        metavar="N",
        help=f"simulate N devices on the CPU and run there (default: {DEFAULT_HOST_DEVICES} "
        "CPU devices, used when JAX finds no accelerator)",
    )


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jaxkit",
        description="Sharded JAX training where global_batch = data_parallel_size × "
        "per_device_batch × grad_accum_steps is a first-class object.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    plan = sub.add_parser("plan", help="print the batch plan without training")
    _common(plan)
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
    train = sub.add_parser("train", help="train and write config, plan and metrics to a workdir")
    _common(train)
    train.add_argument(
        "--workdir",
        metavar="DIR",
        help="where to write: a path or gs://BUCKET/PATH (default runs/CONFIG-TIMESTAMP)",
    )
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    multi = train.add_argument_group(
        "multi-process (automatic on Cloud TPU VMs; or JAXKIT_COORDINATOR etc.)"
    )
    multi.add_argument("--coordinator", metavar="HOST:PORT", help="process 0's address")
    multi.add_argument("--num-processes", type=int, metavar="P", help="processes in the run")
    multi.add_argument("--process-id", type=int, metavar="I", help="this process, 0..P-1")
    train.add_argument(
        "--allow-batch-change",
        action="store_true",
        help="resume even if the global batch changes (learning rate rescaled by the policy)",
    )
    experiment = sub.add_parser(
        "experiment",
        help="measure a seed claim on a config: a Markdown report with tables and plots",
    )
    experiment.add_argument(
        "name",
        choices=("equivalence", "memory", "throughput", "batch-size", "noise-scale"),
        help="equivalence: every split of the global batch trains the same model; memory: "
        "compiled (and measured) memory against per-device batch and accumulation; "
        "throughput: speed against the same; batch-size: several global batches on the same "
        "examples; noise-scale: the critical batch size from the gradient noise scale",
    )
    _common(experiment)
    experiment.add_argument("--out", metavar="DIR", help="default runs/experiment-NAME-CONFIG-TIME")
    experiment.add_argument("--steps", type=int, metavar="N", help="optimizer steps per run")
    experiment.add_argument(
        "--splits", metavar="DxBxK,...", help="equivalence: e.g. 1x32x1,4x8x1,2x8x2,1x8x4"
    )
    experiment.add_argument(
        "--global-batch-sizes", metavar="G,G,...", help="batch-size: e.g. 16,32,64,128"
    )
    experiment.add_argument(
        "--lr-scaling", choices=("none", "linear", "sqrt"), help="batch-size: scaling rule"
    )
    experiment.add_argument(
        "--max-per-device-batch",
        type=int,
        metavar="B",
        help="memory, throughput: the largest per-device batch swept (powers of two up to B)",
    )
    experiment.add_argument(
        "--rss-points", type=int, default=3, metavar="N", help="memory: measured points (CPU)"
    )
    report = sub.add_parser(
        "report", help="plots and a Markdown summary of one or more run directories"
    )
    report.add_argument("workdirs", nargs="+", metavar="WORKDIR")
    report.add_argument(
        "--out", metavar="DIR", help="where to write (default: WORKDIR/report of the first run)"
    )
    return parser


def _report(opts: argparse.Namespace) -> int:
    from jaxkit.report import ReportError, write_report

    try:
        out = write_report(opts.workdirs, opts.out)
    except ReportError as err:
        print(f"jaxkit: error: {err}", file=sys.stderr)
        return 2
    print(f"report: {out / 'report.md'}")
    return 0


def _split_args(args: list[str]) -> tuple[str, list[str]]:
    from jaxkit.config import DEFAULT_CONFIG

    if args and "=" not in args[0]:
        return args[0], args[1:]
    return DEFAULT_CONFIG, args


def _start_jax(host_devices: int | None) -> None:
    """Sets the device count before JAX starts its backend (it cannot change afterwards)."""
    import jax

    if host_devices is not None:
        if host_devices < 1:
            raise SystemExit(f"jaxkit: --host-devices must be at least 1, got {host_devices}")
        jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", host_devices or DEFAULT_HOST_DEVICES)


def main(argv: list[str] | None = None) -> int:
    parser = make_parser()
    opts = parser.parse_args(argv)
    if opts.command == "report":
        return _report(opts)  # reads files only: JAX need not start
    _start_jax(opts.host_devices)
    if opts.command == "train":
        from jaxkit.distributed import DistributedError, initialize

        try:
            initialize(opts.coordinator, opts.num_processes, opts.process_id)
        except DistributedError as err:
            print(f"jaxkit: error: {err}", file=sys.stderr)
            return 2

    from jaxkit import mesh as mesh_lib
    from jaxkit.batch_plan import BatchPlanError
    from jaxkit.checkpoint import CheckpointError
    from jaxkit.config import ConfigError, apply_overrides, load_config
    from jaxkit.data import DataError
    from jaxkit.distributed import DistributedError

    name, overrides = _split_args(opts.args)
    try:
        config = load_config(name)
        apply_overrides(config, overrides)
        if opts.command == "plan":
            return _plan(config, opts)
        if opts.command == "experiment":
            return _experiment(config, opts)
        return _train(config, opts)
    except (
        ConfigError,
        BatchPlanError,
        mesh_lib.MeshError,
        DataError,
        CheckpointError,
        DistributedError,
        PlanError,
    ) as err:
        print(f"jaxkit: error: {err}", file=sys.stderr)
        return 2


def _plan(config: ml_collections.ConfigDict, opts: argparse.Namespace) -> int:
    import jax
    import tqdm

    from jaxkit import costs
    from jaxkit import mesh as mesh_lib
    from jaxkit.batch_plan import format_table, plan_from_config

    devices = jax.devices()
    shape = mesh_lib.resolve_mesh_shape(config.mesh.to_dict(), len(devices))
    plan = plan_from_config(config, shape)  # the configured plan must hold on the live mesh
    if not (opts.all_splits or opts.max_per_device_batch):
        print(json.dumps(plan.to_json()) if opts.json else plan.table())
        return 0
    budget = _memory_budget(opts.memory_budget, devices[0])
    if opts.max_per_device_batch:
        if budget is None:
            raise PlanError(
                f"{devices[0].platform} devices report no memory limit: give --memory-budget, "
                "e.g. --memory-budget 2GiB"
            )
        return _max_batch(config, devices, budget, opts.json)
    counts = _device_counts(opts.device_counts, len(devices))
    splits = costs.enumerate_splits(config, counts)
    if not splits:
        raise PlanError(
            f"no device count in {counts} divides global_batch_size={plan.global_batch_size} "
            "with this mesh"
        )
    with tqdm.tqdm(total=len(splits), unit="compile", file=sys.stderr, disable=opts.json) as bar:

        def compiled(split: costs.Split) -> None:
            bar.set_postfix_str(f"devices={split.devices} per_device={split.key[1]}")
            bar.update(1)

        splits = costs.with_costs(config, splits, devices, progress=compiled)
    chosen = costs.recommend(splits, budget, len(devices)) if budget is not None else None
    if opts.json:
        print(
            json.dumps(
                {
                    "memory_budget_bytes": budget,
                    "recommended": chosen.plan.to_json() if chosen else None,
                    "splits": [
                        {"devices": s.devices, **s.plan.to_json(), **s.cost.to_json()}
                        for s in splits
                        if s.cost is not None
                    ],
                }
            )
        )
        return 0
    print(
        f"global_batch_size={plan.global_batch_size}: every split on {', '.join(map(str, counts))} "
        f"{devices[0].platform} devices, compiled per-device memory "
        "(argument + output − alias + temp) and FLOPs per optimizer step"
    )
    print(format_table(costs.SPLIT_HEADER, costs.splits_cost_table(splits, budget, chosen)))
    if budget is None:
        print(f"{devices[0].platform} devices report no memory limit: give --memory-budget SIZE")
    elif chosen is None:
        print(
            f"no split on {len(devices)} devices fits {costs.format_bytes(budget)}: "
            "a smaller model, a smaller global batch or more devices"
        )
    else:
        p = chosen.plan
        print(
            f"recommended on {len(devices)} devices within {costs.format_bytes(budget)}: "
            f"per_device_batch_size={p.per_device_batch_size} "
            f"grad_accum_steps={p.grad_accum_steps} (the largest per-device batch that fits, "
            "then the fewest accumulation steps)"
        )
    return 0


class PlanError(ValueError):
    """A `jaxkit plan` request that cannot be answered."""


def _memory_budget(text: str | None, device: jax.Device) -> int | None:
    from jaxkit import costs

    if text is None:
        return costs.device_memory_bytes(device)
    try:
        return costs.parse_bytes(text)
    except ValueError as err:
        raise PlanError(f"--memory-budget: {err}") from None


def _device_counts(text: str | None, live: int) -> list[int]:
    if text is None:
        return [n for n in range(live, 0, -1) if live % n == 0]
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        raise PlanError(f"--device-counts={text!r} is not a comma-separated list") from None
    bad = [n for n in counts if not 1 <= n <= live]
    if bad:
        raise PlanError(f"--device-counts: {bad} outside 1..{live} (the live device count)")
    return counts


def _max_batch(config: ml_collections.ConfigDict, devices: list, budget: int, as_json: bool) -> int:
    from jaxkit import costs

    result = costs.max_per_device_batch(
        config,
        devices,
        budget,
        progress=lambda b, memory: (
            None
            if as_json
            else print(
                f"  per_device_batch_size={b}: {costs.format_bytes(memory)}", file=sys.stderr
            )
        ),
    )
    if as_json:
        print(
            json.dumps(
                {
                    "memory_budget_bytes": budget,
                    "max_per_device_batch_size": result.per_device_batch_size,
                    "memory_bytes": result.cost.memory_bytes if result.cost else None,
                    "compiles": result.compiles,
                    "seconds": result.seconds,
                    "tried": {str(b): m for b, m in sorted(result.tried.items())},
                }
            )
        )
        return 0
    if result.cost is None:
        print(
            f"even per_device_batch_size=1 needs "
            f"{costs.format_bytes(result.tried[1])} > {costs.format_bytes(budget)} per device"
        )
        return 1
    print(
        f"max per_device_batch_size={result.per_device_batch_size} on {len(devices)} devices: "
        f"{costs.format_bytes(result.cost.memory_bytes)} of {costs.format_bytes(budget)} "
        f"({result.compiles} compiles, {result.seconds:.1f} s, nothing executed)"
    )
    return 0


def _default_dir(name: str) -> str:
    """runs/NAME-TIMESTAMP, where a run or an experiment writes unless told otherwise."""
    return os.path.join("runs", f"{name}-{datetime.datetime.now():%Y%m%d-%H%M%S}")


def _experiment(config: ml_collections.ConfigDict, opts: argparse.Namespace) -> int:
    import pathlib

    from jaxkit import experiments

    out = opts.out or _default_dir(f"experiment-{opts.name}-{config.name}")
    options = experiments.Options(
        steps=opts.steps,
        splits=opts.splits,
        global_batch_sizes=opts.global_batch_sizes,
        lr_scaling=opts.lr_scaling,
        max_per_device_batch=opts.max_per_device_batch,
        rss_points=opts.rss_points,
    )
    print(f"experiment {opts.name}: writing {pathlib.Path(out).resolve()}/report.md")
    try:
        path = experiments.run(opts.name, config, pathlib.Path(out), options)
    except experiments.ExperimentError as err:
        print(f"jaxkit: error: {err}", file=sys.stderr)
        return 2
    except experiments.Interrupted:
        print(f"interrupted: partial report at {pathlib.Path(out).resolve()}/report.md")
        return 130
    print(f"report: {path.resolve()}")
    return 0


def _train(config: ml_collections.ConfigDict, opts: argparse.Namespace) -> int:
    from jaxkit.loop import train
    from jaxkit.records import NonFiniteLossError
    from jaxkit.workdir import absolute

    workdir = opts.workdir or _default_dir(config.name)
    print(f"workdir: {absolute(workdir)}")  # a gs:// URL as given
    try:
        train(
            config,
            workdir,
            progress=not opts.no_progress,
            allow_batch_change=opts.allow_batch_change,
        )
    except NonFiniteLossError as err:
        print(f"jaxkit: error: {err}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`jaxkit plan` and `jaxkit train`: a thin layer over importable functions."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
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
    from jaxkit.batch_plan import BatchPlanError, plan_from_config
    from jaxkit.checkpoint import CheckpointError
    from jaxkit.config import ConfigError, apply_overrides, load_config
    from jaxkit.data import DataError
    from jaxkit.distributed import DistributedError

    name, overrides = _split_args(opts.args)
    try:
        config = load_config(name)
        apply_overrides(config, overrides)
        if opts.command == "plan":
            import jax

            shape = mesh_lib.resolve_mesh_shape(config.mesh.to_dict(), jax.device_count())
            plan = plan_from_config(config, shape)
            if opts.json:
                print(json.dumps(plan.to_json()))
            else:
                print(plan.table())
            return 0
        return _train(config, opts)
    except (
        ConfigError,
        BatchPlanError,
        mesh_lib.MeshError,
        DataError,
        CheckpointError,
        DistributedError,
    ) as err:
        print(f"jaxkit: error: {err}", file=sys.stderr)
        return 2


def _train(config: ml_collections.ConfigDict, opts: argparse.Namespace) -> int:
    from jaxkit.loop import train
    from jaxkit.records import NonFiniteLossError
    from jaxkit.workdir import absolute

    workdir = opts.workdir
    if workdir is None:
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        workdir = os.path.join("runs", f"{config.name}-{stamp}")
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

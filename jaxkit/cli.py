"""`jaxkit plan`, `train`, `experiment`, `report` and `data prepare`: a thin layer over
importable functions.

Every refusal, from a usage error to a config value out of range, is one line on stderr
and exit status 2, given before JAX compiles or trains anything.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import io
import json
import math
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import jax
    import ml_collections

    from jaxkit import costs
    from jaxkit.batch_plan import BatchPlan
    from jaxkit.targets import Target

DEFAULT_HOST_DEVICES = 8  # CPU devices simulated when no accelerator is present
COMMANDS = ("plan", "train", "experiment", "report", "data")
EXPERIMENTS = (
    "equivalence",
    "memory",
    "throughput",
    "batch-size",
    "noise-scale",
    "batch-ramp",
    "normalisation",
)
# The experiments that read each experiment option: elsewhere a value would be ignored.
EXPERIMENT_OPTIONS = {
    "steps": (
        "equivalence",
        "throughput",
        "batch-size",
        "noise-scale",
        "batch-ramp",
        "normalisation",
    ),
    "splits": ("equivalence", "normalisation"),
    "global_batch_sizes": ("batch-size",),
    "lr_scaling": ("batch-size", "batch-ramp"),
    "max_per_device_batch": ("memory", "throughput"),
    "rss_points": ("memory",),
    "target": ("memory",),
}
TARGET_HELP = (
    "a Cloud TPU slice to plan for, from any machine: an accelerator type (v5litepod-16, "
    "v4-32, v5p-8, v6e-8) or a topology (v5e:4x4, v4:2x2x4). The TPU compiler (libtpu) "
    "compiles for its chips; nothing runs; the memory budget defaults to a chip's HBM"
)


def _int_at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an integer ≥ `low`, refused as a usage error (exit status 2)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    return parse


MAX_HOST_DEVICES = 1024  # simulated devices share this machine's cores and memory


def _host_devices(text: str) -> int:
    """An argparse type: a simulated device count a machine can hold (100,000 ran out of
    memory after minutes instead of being refused)."""
    value = _int_at_least(1)(text)
    if value > MAX_HOST_DEVICES:
        raise argparse.ArgumentTypeError(
            f"{value} simulated devices is more than {MAX_HOST_DEVICES}: they share this "
            "machine's cores and memory; plan a bigger slice with --target"
        )
    return value


def _fraction(text: str) -> float:
    """An argparse type: a number strictly between 0 and 1."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {text}")
    return value


def _directory(text: str) -> str:
    """An argparse type: a path or URL; an empty one would quietly mean the default."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path: name a directory (or a gs:// URL)")
    return text


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "args",
        nargs="*",
        metavar="[CONFIG] [key=value ...]",
        help="a config name in configs/ or a path to one (default lm_tiny), then overrides",
    )
    parser.add_argument(
        "--host-devices",
        type=_host_devices,
        metavar="N",
        help=f"simulate N devices on the CPU and run there (default: {DEFAULT_HOST_DEVICES} "
        "CPU devices, used when JAX finds no accelerator)",
    )
    parser.add_argument(
        "--no-compile-cache",
        action="store_true",
        help="compile every program afresh: do not read or write the persistent compilation "
        "cache ($JAXKIT_CACHE_DIR/xla, or JAX_COMPILATION_CACHE_DIR; --target plans: "
        "$JAXKIT_CACHE_DIR/plans)",
    )


def _add_plan(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
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
    plan.add_argument(
        "--remat",
        metavar="POLICY,...",
        help="with --all-splits or --max-per-device-batch: the activation-recompute policies "
        "to compare, of none, dots, full (default: the config's model.remat)",
    )
    plan.add_argument("--target", metavar="TARGET", help=TARGET_HELP)
    return plan


def _add_train(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    train = sub.add_parser("train", help="train and write config, plan and metrics to a workdir")
    _common(train)
    train.add_argument(
        "--workdir",
        type=_directory,
        metavar="DIR",
        help="where to write: a path or gs://BUCKET/PATH (default runs/CONFIG-TIMESTAMP)",
    )
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    multi = train.add_argument_group(
        "multi-process (automatic on Cloud TPU VMs and SLURM, Open MPI or Kubernetes "
        "clusters; or JAXKIT_COORDINATOR etc.)"
    )
    multi.add_argument("--coordinator", metavar="HOST:PORT", help="process 0's address")
    multi.add_argument(
        "--num-processes", type=_int_at_least(1), metavar="P", help="processes in the run"
    )
    multi.add_argument(
        "--process-id", type=_int_at_least(0), metavar="I", help="this process, 0..P-1"
    )
    train.add_argument(
        "--allow-batch-change",
        action="store_true",
        help="resume even if the global batch changes (learning rate rescaled by the policy)",
    )
    train.add_argument(
        "--allow-longer",
        action="store_true",
        help="extend a finished or running run to a larger train.steps; the learning-rate "
        "schedule is re-laid over the new length",
    )
    return train


def _add_experiment(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    experiment = sub.add_parser(
        "experiment",
        help="measure a seed claim on a config: a Markdown report with tables and plots",
    )
    experiment.add_argument(
        "name",
        choices=EXPERIMENTS,
        help="equivalence: every split of the global batch trains the same model; memory: "
        "compiled (and measured) memory against per-device batch and accumulation; "
        "throughput: speed against the same; batch-size: several global batches on the same "
        "examples; noise-scale: the critical batch size from the gradient noise scale; "
        "batch-ramp: fixed small, fixed large, scheduled and automatic growing batches on the "
        "same examples; normalisation: exact against naive loss normalisation over splits "
        "that vary the accumulation steps",
    )
    _common(experiment)
    experiment.add_argument(
        "--out", type=_directory, metavar="DIR", help="default runs/experiment-NAME-CONFIG-TIME"
    )
    experiment.add_argument(
        "--steps",
        type=_int_at_least(1),
        metavar="N",
        help="optimizer steps per run (batch-ramp: of the small-batch run; the others train on "
        "as many examples)",
    )
    experiment.add_argument(
        "--splits",
        metavar="DxBxK,...",
        help="equivalence, normalisation: e.g. 1x32x1,4x8x1,2x8x2,1x8x4",
    )
    experiment.add_argument(
        "--global-batch-sizes", metavar="G,G,...", help="batch-size: e.g. 16,32,64,128"
    )
    experiment.add_argument(
        "--lr-scaling",
        choices=("none", "linear", "sqrt"),
        help="batch-size, batch-ramp: scaling rule",
    )
    experiment.add_argument(
        "--max-per-device-batch",
        type=_int_at_least(1),
        metavar="B",
        help="memory, throughput: the largest per-device batch swept (powers of two up to B)",
    )
    experiment.add_argument(
        "--rss-points",
        type=_int_at_least(0),
        metavar="N",
        help="memory: measured points (CPU; default 3, 0 = none)",
    )
    experiment.add_argument("--target", metavar="TARGET", help="memory: " + TARGET_HELP)
    return experiment


def _add_report(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    report = sub.add_parser(
        "report", help="plots and a Markdown summary of one or more run directories"
    )
    report.add_argument("workdirs", nargs="+", metavar="WORKDIR")
    report.add_argument(
        "--out",
        type=_directory,
        metavar="DIR",
        help="where to write (default: WORKDIR/report of the first run)",
    )
    return report


def _add_data(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from jaxkit import prepare

    data = sub.add_parser(
        "data",
        help="prepare text into token shards for training",
        usage="%(prog)s prepare INPUT [INPUT ...] --tokenizer {bytes,PATH} --out DIR [options]",
    )
    data.add_argument(
        "action",
        choices=("prepare",),
        help="prepare: tokenize INPUTs into train and eval shards in DIR (see token_format.py)",
    )
    data.add_argument(
        "inputs",
        nargs="+",
        metavar="INPUT",
        help='files, directories (recursively) and globs: a .jsonl line holds a "text" or '
        'a "prompt" and a "completion", a .parquet row a "text"; any other file is one document',
    )
    data.add_argument(
        "--tokenizer",
        required=True,
        metavar="{bytes,PATH}",
        help="bytes (a token per byte) or a Hugging Face tokenizer.json, loaded offline",
    )
    data.add_argument("--out", required=True, type=_directory, metavar="DIR")
    data.add_argument(
        "--eod-token",
        metavar="TEXT",
        help="the tokenizer.json's end-of-document token (default: the first of "
        f"{', '.join(prepare.EOD_CANDIDATES)} in its vocabulary)",
    )
    data.add_argument(
        "--eval-fraction",
        type=_fraction,
        default=prepare.DEFAULT_EVAL_FRACTION,
        metavar="F",
        help="of the documents, held out whole (default %(default)s)",
    )
    data.add_argument(
        "--seed", type=_int_at_least(0), default=0, help="draws the held-out documents"
    )
    data.add_argument(
        "--shard-tokens",
        type=_int_at_least(1),
        default=prepare.DEFAULT_SHARD_TOKENS,
        metavar="N",
        help="the most tokens in a shard, which ends at a document's end (default %(default)s)",
    )
    data.add_argument(
        "--workers",
        type=_int_at_least(1),
        metavar="N",
        help="tokenizing processes (default: one per CPU)",
    )
    data.add_argument(
        "--overwrite", action="store_true", help="replace a prepared DIR once the new one is done"
    )
    data.add_argument("--no-progress", action="store_true", help="no progress bar")
    return data


def make_parsers() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The top-level parser (for `jaxkit --help`) and each command's own parser."""
    parser = argparse.ArgumentParser(
        prog="jaxkit",
        description="Sharded JAX training where global_batch = data_parallel_size × "
        "per_device_batch × grad_accum_steps is a first-class object.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    adders = (_add_plan, _add_train, _add_experiment, _add_report, _add_data)
    commands = {name: add(sub) for name, add in zip(COMMANDS, adders, strict=True)}
    return parser, commands


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """A command's options anywhere on its line: before CONFIG, between overrides, at the end.

    argparse cannot intermix options and positionals under subparsers, so the command word
    (always first) picks its own parser, which parses the rest intermixed.
    """
    argv = sys.argv[1:] if argv is None else argv
    top, commands = make_parsers()
    if not argv or argv[0] not in commands:
        top.parse_args(argv)  # --help, or the usage error that lists the commands
        top.error(f"the command comes first: jaxkit {{{','.join(COMMANDS)}}} ...")
    parser = commands[argv[0]]
    opts = parser.parse_intermixed_args(argv[1:])
    opts.command = argv[0]
    problem = _ignored_option(opts)
    if problem:
        parser.error(problem)
    return opts


def _ignored_option(opts: argparse.Namespace) -> str | None:
    """An option this command line would ignore, said as a usage error."""
    if getattr(opts, "target", None) is not None:
        if opts.host_devices is not None:
            return "--host-devices does not apply with --target: the plan is for the slice's chips"
        if getattr(opts, "device_counts", None) is not None:
            return (
                "--device-counts does not apply with --target: the plan is for the whole "
                "slice (plan a smaller slice as a target of its own)"
            )
    if opts.command == "plan":
        if opts.all_splits and opts.max_per_device_batch:
            return "--all-splits and --max-per-device-batch are two modes: give one"
        if opts.device_counts is not None and not opts.all_splits:
            return "--device-counts applies only with --all-splits"
        if opts.memory_budget is not None and not (opts.all_splits or opts.max_per_device_batch):
            return "--memory-budget applies only with --all-splits or --max-per-device-batch"
        if opts.remat is not None and not (opts.all_splits or opts.max_per_device_batch):
            return "--remat applies only with --all-splits or --max-per-device-batch"
    if opts.command == "experiment":
        for option, users in EXPERIMENT_OPTIONS.items():
            if getattr(opts, option) is not None and opts.name not in users:
                flag = "--" + option.replace("_", "-")
                return f"{flag} applies to experiment {' and '.join(users)}, not {opts.name}"
    return None


def _error(err: Exception) -> int:
    """A user-facing refusal: one line on stderr, exit status 2, no traceback."""
    print(f"jaxkit: error: {err}", file=sys.stderr)
    return 2


def _report(opts: argparse.Namespace) -> int:
    from jaxkit.report import ReportError, write_report

    try:
        if opts.out is not None:
            _check_can_write(opts.out, "--out")
        out = write_report(opts.workdirs, opts.out)
    except (ReportError, UsageError) as err:
        return _error(err)
    print(f"report: {out / 'report.md'}")
    return 0


def _data(opts: argparse.Namespace) -> int:
    from jaxkit.prepare import PrepareError, prepare, summary

    try:
        _check_can_write(opts.out, "--out")
        meta = prepare(
            opts.inputs,
            opts.tokenizer,
            opts.out,
            eval_fraction=opts.eval_fraction,
            seed=opts.seed,
            shard_tokens=opts.shard_tokens,
            eod_token=opts.eod_token,
            workers=opts.workers,
            overwrite=opts.overwrite,
            progress=not opts.no_progress,
        )
    except (PrepareError, UsageError) as err:
        return _error(err)
    print(summary(meta, opts.out))
    return 0


def _split_args(args: list[str]) -> tuple[str, list[str]]:
    from jaxkit.config import DEFAULT_CONFIG

    if args and "=" not in args[0]:
        return args[0], args[1:]
    return DEFAULT_CONFIG, args


def _load_config(args: list[str]) -> ml_collections.ConfigDict:
    """CONFIG with its overrides applied and every value checked (before JAX starts)."""
    from jaxkit.config import apply_overrides, load_config
    from jaxkit.validate import validate

    name, overrides = _split_args(args)
    config = load_config(name)
    apply_overrides(config, overrides)
    validate(config)
    return config


def _start_jax(host_devices: int | None, cpu_only: bool = False, cache: bool = True) -> None:
    """Sets the device count before JAX starts its backend (it cannot change afterwards),
    and the compilation cache before the first compile.

    `cpu_only`: the command compiles for a described TPU slice and needs no live
    accelerator (nor libtpu's search for one). Its programs cannot be read back from JAX's
    cache, so they skip it and use the kit's plan cache instead.
    """
    import jax

    from jaxkit import compile_cache

    if host_devices is not None or cpu_only:
        jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", host_devices or DEFAULT_HOST_DEVICES)
    compile_cache.enable(cache and not cpu_only)
    compile_cache.plans_enabled = cache


INTERRUPTED = 130  # the shell's status for a Ctrl-C
TERMINATED = 143  # and for SIGTERM (128 + 15)


def _leave_on_ctrl_c(signum: int, frame: object) -> None:
    """SIGINT before a run trains (the loop takes it over while it trains) or while `plan`
    compiles: nothing to save, so the process leaves now, with status 130.

    Python's default raises KeyboardInterrupt wherever the interpreter next looks for
    signals, and that may be inside a garbage-collection callback (jax registers one, to
    free XLA's buffers), where an exception is printed as "Exception ignored" and dropped:
    the run then trained on. Whether a Ctrl-C landed there was a matter of timing, not of
    stdout's buffering (which only moved when a test pressed it); leaving from the handler
    cannot be dropped.
    """
    del frame
    # The signal may have come in the middle of a write to stdout: flush what can be.
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    if signum == signal.SIGTERM:  # a preemption before training: nothing to save yet
        os.write(2, b"jaxkit: terminated (SIGTERM) before training started: nothing to save\n")
        os._exit(TERMINATED)
    os.write(2, b"jaxkit: interrupted\n")
    os._exit(INTERRUPTED)


def main(argv: list[str] | None = None) -> int:
    # Each line as it is printed, also into a pipe or a file (`| tee`, a job's log): the
    # plan and the step records should not wait for a block to fill.
    if isinstance(sys.stdout, io.TextIOWrapper):
        sys.stdout.reconfigure(line_buffering=True)
    # model.kind="mymodel:make" imports ./mymodel.py. `python -m jaxkit` searches the current
    # directory, but the `jaxkit` script's sys.path starts at its own bin/ instead: the cwd
    # goes last, so a file there never shadows an installed module.
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = _main(argv)
    except KeyboardInterrupt:  # Ctrl-C in an experiment, which writes its partial report
        print("jaxkit: interrupted", file=sys.stderr)
        code = INTERRUPTED
    finally:  # called in-process (tests, notebooks): the caller's handlers come back
        if threading.current_thread() is threading.main_thread():
            for sig, handler in previous.items():
                if handler is not None:
                    signal.signal(sig, handler)
    if code == INTERRUPTED:
        # XLA's threads can crash the interpreter's teardown after a Ctrl-C (status 139 or
        # -11 instead of 130): leave now, with what was printed flushed.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _main(argv: list[str] | None) -> int:
    opts = parse_args(argv)
    if opts.command in ("train", "plan") and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _leave_on_ctrl_c)
        # SIGTERM's default dumped a native stack trace mid-compile. With several processes
        # JAX's preemption service takes SIGTERM over when it starts, as it must.
        signal.signal(signal.SIGTERM, _leave_on_ctrl_c)
    if opts.command == "report":
        return _report(opts)  # reads files only: JAX need not start
    if opts.command == "data":
        return _data(opts)  # nor here
    from jaxkit.config import ConfigError

    try:
        config = _load_config(opts.args)
    except ConfigError as err:
        return _error(err)
    target = getattr(opts, "target", None)
    if target is not None:
        from jaxkit.targets import TargetError, parse_target

        try:
            opts.target = parse_target(target)
        except TargetError as err:
            return _error(err)
    _start_jax(opts.host_devices, cpu_only=target is not None, cache=not opts.no_compile_cache)
    if opts.command == "train":
        from jaxkit.distributed import DistributedError, initialize

        try:
            initialize(opts.coordinator, opts.num_processes, opts.process_id)
        except DistributedError as err:
            return _error(err)

    import jax

    from jaxkit import mesh as mesh_lib
    from jaxkit.batch_plan import BatchPlanError
    from jaxkit.checkpoint import CheckpointError
    from jaxkit.data import DataError
    from jaxkit.distributed import DistributedError
    from jaxkit.targets import TargetError, target_devices
    from jaxkit.train_step import check_on_mesh

    try:
        # Every command runs the config's mesh on its devices (the live ones, or a described
        # TPU slice's): its shards must be even.
        devices = target_devices(opts.target) if target is not None else jax.devices()
        try:
            shape = mesh_lib.resolve_mesh_shape(config.mesh.to_dict(), len(devices))
        except mesh_lib.MeshError as err:
            if target is None:
                raise
            raise mesh_lib.MeshError(
                f"--target {opts.target.name} has {len(devices)} chips: {err}"
            ) from None
        check_on_mesh(config, shape)
        if opts.command == "plan":
            return _plan(config, shape, opts, devices)
        if opts.command == "experiment":
            return _experiment(config, opts, devices)
        return _train(config, opts)
    except (
        TargetError,
        ConfigError,
        BatchPlanError,
        mesh_lib.MeshError,
        DataError,
        CheckpointError,
        DistributedError,
        UsageError,
    ) as err:
        return _error(err)


def _plan(
    config: ml_collections.ConfigDict,
    shape: dict[str, int],
    opts: argparse.Namespace,
    devices: Sequence[jax.Device],
) -> int:
    import tqdm

    from jaxkit import costs
    from jaxkit.batch_plan import format_table
    from jaxkit.batch_schedule import schedule_from_config

    target = opts.target
    policies = _remat_policies(opts.remat, config)
    schedule = schedule_from_config(config, shape)  # every stage must hold on this mesh
    plan = schedule.first
    if config.data.source == "tokens":
        # Token files are the one source the config does not describe: train's checks of
        # them (ids against model.vocab_size, rows, scored targets) apply to the plan too.
        from jaxkit.data import checked_sources

        checked_sources(config, schedule.largest)
    ramp = {"batch_schedule": schedule.to_json()} if schedule.kind != "fixed" else {}
    budget = _memory_budget(opts.memory_budget, devices[0], target)
    slice_info: dict[str, object] = {}
    if target is not None:
        from jaxkit.targets import batch_shards_per_host

        shards = batch_shards_per_host(devices, shape)
        slice_info = {
            "target": target.name,
            "topology": target.topology,
            "device_kind": target.generation.device_kind,
            "num_devices": target.chips,
            "num_hosts": target.hosts,
            "memory_budget_bytes": budget,
            "batch_shards_per_host": shards,
        }
        if not opts.json:
            print(f"target: {target.describe()}")
            print(
                f"each host loads {shards} of the {plan.data_parallel_size} per-device "
                f"batches of a micro-step: rows per host per micro-step: "
                f"{shards * plan.per_device_batch_size} (of {plan.micro_batch_size})"
            )
    if not (opts.all_splits or opts.max_per_device_batch):
        model = _model_json(config, plan)
        if opts.json:
            rows = {"rows_per_host": shards * plan.per_device_batch_size} if target else {}
            print(json.dumps({**plan.to_json(), **slice_info, **rows, **ramp, "model": model}))
        else:
            print(plan.table())
            print(_model_line(model))
            if config.train.get("examples") is not None:
                print(
                    f"run: {schedule.total_steps} optimizer steps, {schedule.total_examples:,} "
                    f"examples (train.examples={config.train.examples:,}, to a whole step)"
                    if schedule.kind != "auto"
                    else f"run: until {config.train.examples:,} examples (steps as the batch grows)"
                )
            if ramp:
                print(
                    f"\nbatch schedule ({schedule.kind}; K changes, the per-device batch does not):"
                )
                print(schedule.table())
        return 0
    if opts.max_per_device_batch:
        if budget is None:
            raise PlanError(
                f"{devices[0].platform} devices report no memory limit: give --memory-budget, "
                "e.g. --memory-budget 2GiB"
            )
        return _max_batch(config, devices, budget, opts.json, slice_info, policies)
    counts = (
        [len(devices)] if target is not None else _device_counts(opts.device_counts, len(devices))
    )
    _check_counts_shard_evenly(config, counts)
    splits = costs.enumerate_splits(config, counts)
    dropped = costs.left_out(config, counts, splits)
    if not splits:
        raise PlanError(
            "no split on any of the device counts: "
            + "; ".join(f"{n} devices: {why}" for n, why in dropped.items())
        )
    counts = sorted({s.devices for s in splits}, reverse=True)
    splits = [dataclasses.replace(s, remat=r) for r in policies for s in splits]
    with tqdm.tqdm(total=len(splits), unit="compile", file=sys.stderr, disable=opts.json) as bar:

        def compiled(split: costs.Split) -> None:
            remat = f" remat={split.remat}" if split.remat else ""
            bar.set_postfix_str(f"devices={split.devices} per_device={split.key[1]}{remat}")
            bar.update(1)

        splits = costs.with_costs(config, splits, devices, progress=compiled)
    chosen = costs.recommend(splits, budget, len(devices)) if budget is not None else None
    if opts.json:
        print(
            json.dumps(
                {
                    **slice_info,
                    "memory_budget_bytes": budget,
                    "left_out_device_counts": {str(n): why for n, why in dropped.items()},
                    "recommended": (
                        {**chosen.plan.to_json(), "remat": chosen.remat} if chosen else None
                    ),
                    "splits": [_split_json(s) for s in splits],
                }
            )
        )
        return 0
    kind = devices[0].device_kind if target is not None else devices[0].platform
    print(
        f"global_batch_size={plan.global_batch_size}: every split on {', '.join(map(str, counts))} "
        f"{kind} devices, compiled per-device memory "
        "(argument + output − alias + temp) and FLOPs per optimizer step"
    )
    compared = opts.remat is not None
    print(
        format_table(
            costs.split_header(compared),
            costs.splits_cost_table(splits, budget, chosen, compared),
        )
    )
    print(
        "model FLOPs: the architecture's (flops.py), the basis of MFU; hardware FLOPs: the "
        "compiled matmuls, recomputation included (× model), the basis of HFU"
    )
    for n, why in dropped.items():
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
        print(
            f"recommended on {len(devices)} devices within {costs.format_bytes(budget)}: "
            f"per_device_batch_size={p.per_device_batch_size} "
            f"grad_accum_steps={p.grad_accum_steps}{remat} (the most model FLOPs per second "
            "predicted: the fewest hardware FLOPs per model FLOP, then the largest per-device "
            "batch that fits, then the fewest accumulation steps)"
        )
    return 0


class UsageError(ValueError):
    """A command line that cannot be run as given (exit status 2)."""


class PlanError(UsageError):
    """A `jaxkit plan` request that cannot be answered."""


def _check_can_write(path: str, flag: str) -> None:
    """Fails before any work when a local directory can be neither found nor created.

    Nothing is created here: a run refused later must leave nothing on disk. URLs are
    left to the code that opens them.
    """
    from jaxkit.workdir import is_local

    if not is_local(path):
        return
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise UsageError(f"{flag} {path}: {probe} is a file, not a directory")
    try:  # a file made and removed: os.access answers yes to root where writes still fail
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as err:
        raise UsageError(f"{flag} {path}: {probe} is not writable ({err.strerror})") from None


def _model_json(config: ml_collections.ConfigDict, plan: BatchPlan) -> dict[str, object]:
    """The model's size, precision and layout, and its model FLOPs per optimizer step: per
    device, as records and summaries give them, and on all devices together."""
    from jaxkit.flops import model_flops_per_example
    from jaxkit.records import model_facts

    facts = {"kind": config.model.kind, **model_facts(config)}
    every = model_flops_per_example(config) * plan.global_batch_size
    facts["model_flops_per_step"] = every / math.prod(plan.mesh_shape.values())
    facts["model_flops_per_step_all_devices"] = every
    return facts


def _model_line(m: dict[str, object]) -> str:
    from jaxkit import costs

    line = f"model: {m['kind']}, {m['param_count']:,} params"
    if "param_dtype" in m:
        layout = "scanned layers" if m["scan_layers"] else "unrolled layers"
        line += (
            f" in {m['param_dtype']}, matmuls in {m['compute_dtype']}, remat {m['remat']}, {layout}"
        )
    per_device, every = (
        costs.format_flops(float(m[key]))  # type: ignore[arg-type]
        for key in ("model_flops_per_step", "model_flops_per_step_all_devices")
    )
    return line + f"; {per_device}FLOPs per optimizer step per device (model; {every}FLOPs on all)"


def _remat_policies(text: str | None, config: ml_collections.ConfigDict) -> list[str | None]:
    """--remat's policies; without it the config's own (None for a model without remat)."""
    from jaxkit.config import LM_KINDS
    from jaxkit.layers import REMAT_POLICIES, lm_option

    has_remat = config.model.kind in LM_KINDS
    if text is None:
        return [lm_option(config.model, "remat") if has_remat else None]
    if not has_remat:
        raise PlanError(
            f"--remat: model.kind={config.model.kind!r} has no activation recompute policies "
            "(the transformer and llama kinds do)"
        )
    policies = [part.strip() for part in text.split(",")]
    bad = [p for p in policies if p not in REMAT_POLICIES]
    if bad or not policies:
        raise PlanError(
            f"--remat {text!r}: {', '.join(map(repr, bad)) or 'nothing'} is not a policy; give "
            f"a comma-separated list of {', '.join(REMAT_POLICIES)}"
        )
    return list(dict.fromkeys(policies))


def _split_json(split: costs.Split) -> dict[str, object]:
    out: dict[str, object] = {"devices": split.devices, **split.plan.to_json()}
    out["remat"] = split.remat
    if split.cost is not None:
        out |= split.cost.to_json()
    if split.out_of_memory is not None:  # the compiler refused it
        out |= {
            "memory_bytes": None,
            "out_of_memory": str(split.out_of_memory),
            "needed_bytes": split.out_of_memory.needed_bytes,
        }
    return out


def _memory_budget(text: str | None, device: jax.Device, target: Target | None) -> int | None:
    """--memory-budget, else a target chip's HBM, else what the live device reports."""
    from jaxkit import costs

    if text is None and target is not None:
        return target.generation.hbm_bytes
    if text is None:
        return costs.device_memory_bytes(device)
    try:
        budget = costs.parse_bytes(text)
    except (ValueError, OverflowError):  # 1e999 overflows int()
        budget = 0
    if budget < 1:
        raise PlanError(
            f"--memory-budget {text!r} is not a memory size of at least one byte; write e.g. "
            "16GiB, 512MiB, 2GB or a byte count"
        )
    return budget


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
    return sorted(set(counts), reverse=True)


def _check_counts_shard_evenly(config: ml_collections.ConfigDict, counts: list[int]) -> None:
    """The mesh on each device count (where it fits) must shard the parameters evenly."""
    from jaxkit import mesh as mesh_lib
    from jaxkit.config import ConfigError
    from jaxkit.models import check_mesh_divides

    for n in counts:
        try:
            shape = mesh_lib.resolve_mesh_shape(config.mesh.to_dict(), n)
        except mesh_lib.MeshError:
            continue  # enumerate_splits leaves out the counts this mesh cannot use
        try:
            check_mesh_divides(config, shape)
        except ConfigError as err:
            raise PlanError(f"--device-counts {n}: {err}") from None


def _max_batch(
    config: ml_collections.ConfigDict,
    devices: Sequence[jax.Device],
    budget: int,
    as_json: bool,
    slice_info: dict[str, object],
    policies: Sequence[str | None] = (None,),
) -> int:
    """The largest per-device batch under `budget`, searched for each remat policy; with
    several, the one with the most model FLOPs per second predicted is recommended."""
    from jaxkit import costs

    searches: list[tuple[str | None, costs.BatchSearch]] = []
    began = time.perf_counter()
    # Each compile is announced as it starts (on stderr, so --json's stdout stays one
    # document): for a TPU slice one can take minutes, and silence looks like a hang.
    for policy in policies:
        label = f"  remat={policy} " if len(policies) > 1 else "  "

        def starting(b: int, label: str = label) -> None:
            elapsed = time.perf_counter() - began
            print(
                f"{label}per_device_batch_size={b}: compiling ({elapsed:.1f} s into the search)",
                file=sys.stderr,
                flush=True,
            )

        def progress(b: int, memory: int | None, label: str = label) -> None:
            said = (
                costs.format_bytes(memory)
                if memory is not None
                else "more than the device has (the compiler refused it)"
            )
            print(f"{label}per_device_batch_size={b}: {said}", file=sys.stderr, flush=True)

        found = costs.max_per_device_batch(
            costs.with_remat(config, policy), devices, budget, progress=progress, starting=starting
        )
        searches.append((policy, found))

    def as_dict(policy: str | None, result: costs.BatchSearch) -> dict[str, object]:
        c = result.cost
        return {
            "remat": policy,
            "max_per_device_batch_size": result.per_device_batch_size,
            "memory_bytes": c.memory_bytes if c else None,
            "model_flops_per_step": c.model_flops_per_step if c else None,
            "hardware_flops_per_step": c.hardware_flops_per_step if c else None,
            "compiles": result.compiles,
            "seconds": result.seconds,
            "tried": {str(b): m for b, m in sorted(result.tried.items())},
            "out_of_memory": {str(b): str(e) for b, e in sorted(result.refused.items())},
        }

    fitting = [(p, r) for p, r in searches if r.cost is not None]
    best = max(fitting, key=lambda pr: _predicted(pr[1]), default=searches[0])
    if as_json:  # a search that found nothing still says what each size needed
        print(
            json.dumps(
                {
                    **slice_info,
                    "memory_budget_bytes": budget,
                    **as_dict(*best),
                    "by_remat": [as_dict(p, r) for p, r in searches],
                }
            )
        )
    if not fitting:
        policy, result = searches[0]
        one = result.tried[1]
        needs = (
            costs.format_bytes(one)
            if one is not None
            else f"more than the device has (the compiler: {result.refused[1]})"
        )
        raise PlanError(
            f"even per_device_batch_size=1 needs {needs} per device on {len(devices)} "
            f"devices, more than the budget of {costs.format_bytes(budget)}: a smaller "
            "model, a larger budget, "
            + ("model.remat=full, " if policy not in (None, "full") else "")
            + "or more devices (mesh.fsdp shards the state)"
        )
    if as_json:
        return 0
    for policy, result in searches:
        remat = f" with remat={policy}" if len(policies) > 1 else ""
        if result.cost is None:
            print(f"max per_device_batch_size{remat}: none fits")
            continue
        ratio = result.cost.hardware_flops_per_step / result.cost.model_flops_per_step
        print(
            f"max per_device_batch_size={result.per_device_batch_size}{remat} on "
            f"{len(devices)} devices: {costs.format_bytes(result.cost.memory_bytes)} of "
            f"{costs.format_bytes(budget)}, {ratio:.2f} hardware FLOPs per model FLOP "
            f"({result.compiles} compiles, {result.seconds:.1f} s, nothing executed)"
        )
    if len(policies) > 1:
        print(
            f"recommended: model.remat={best[0]} "
            f"per_device_batch_size={best[1].per_device_batch_size} (the fewest hardware "
            "FLOPs per model FLOP, then the largest per-device batch)"
        )
    return 0


def _predicted(result: costs.BatchSearch) -> tuple[float, int, int]:
    """The order of predicted model FLOP/s (costs.recommend's): less recompute, wider."""
    from jaxkit import costs

    assert result.cost is not None
    c = result.cost
    ratio = c.hardware_flops_per_step / c.model_flops_per_step
    return costs.predicted_speed(ratio, result.per_device_batch_size, 1)


def _default_dir(name: str) -> str:
    """runs/NAME-TIMESTAMP, where a run or an experiment writes unless told otherwise."""
    return os.path.join("runs", f"{name}-{datetime.datetime.now():%Y%m%d-%H%M%S}")


def _experiment(
    config: ml_collections.ConfigDict, opts: argparse.Namespace, devices: Sequence[jax.Device]
) -> int:
    import pathlib

    from jaxkit import experiments

    out = opts.out or _default_dir(f"experiment-{opts.name}-{config.name}")
    _check_can_write(out, "--out")
    options = experiments.Options(
        steps=opts.steps,
        splits=opts.splits,
        global_batch_sizes=opts.global_batch_sizes,
        lr_scaling=opts.lr_scaling,
        max_per_device_batch=opts.max_per_device_batch,
        devices=devices,
        target=opts.target.describe() if opts.target is not None else None,
    )
    if opts.rss_points is not None:  # None: the option was not given, the default holds
        options.rss_points = opts.rss_points
    # Where the report goes is said by the experiment once every unit has passed its
    # checks: a refused request writes nothing.
    try:
        path = experiments.run(opts.name, config, pathlib.Path(out), options)
    except experiments.ExperimentError as err:
        print(f"jaxkit: error: {err}", file=sys.stderr)
        return 2
    except experiments.Interrupted:
        print(f"interrupted: partial report at {pathlib.Path(out).resolve()}/report.md")
        return INTERRUPTED
    print(f"report: {path.resolve()}")
    return 0


def _train(config: ml_collections.ConfigDict, opts: argparse.Namespace) -> int:
    from jaxkit.loop import train
    from jaxkit.records import NonFiniteLossError
    from jaxkit.workdir import absolute

    workdir = opts.workdir or _default_dir(config.name)
    _check_can_write(workdir, "--workdir")
    print(f"workdir: {absolute(workdir)}")  # a gs:// URL as given
    try:
        train(
            config,
            workdir,
            progress=not opts.no_progress,
            allow_batch_change=opts.allow_batch_change,
            allow_longer=opts.allow_longer,
        )
    except NonFiniteLossError as err:
        print(f"jaxkit: error: {err}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())

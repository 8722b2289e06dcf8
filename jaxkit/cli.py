"""`jaxkit plan`, `train`, `experiment`, `report` and `data prepare`: a thin layer over
importable functions.

Every refusal, from a usage error to a config value out of range, is one line on stderr
and exit status 2, given before JAX compiles or trains anything.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import os
import signal
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import jax
    import ml_collections


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

    from jaxkit import mesh as mesh_lib
    from jaxkit import planning
    from jaxkit.batch_plan import BatchPlanError
    from jaxkit.checkpoint import CheckpointError
    from jaxkit.data import DataError
    from jaxkit.distributed import DistributedError
    from jaxkit.targets import TargetError

    try:
        # Every command runs the config's mesh on its devices (the live ones, or a described
        # TPU slice's): its shards must be even.
        described = opts.target if target is not None else None  # the parsed TPU slice
        devices = planning.devices_for(described)
        shape = planning.mesh_shape(config, devices, described)
        if opts.command == "plan":
            from jaxkit.commands import plan

            return plan.run(config, shape, opts, devices)
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
        planning.PlanError,
    ) as err:
        return _error(err)


class UsageError(ValueError):
    """A command line that cannot be run as given (exit status 2)."""


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

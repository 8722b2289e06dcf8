"""`jaxkit plan`, `train`, `experiment`, `report`, `data prepare`, `export`, `sample` and `eval`: a
thin layer over importable functions. Each command's options and output live in its module of
`jaxkit.commands`; this one parses the line, starts JAX and hands over.

Every refusal, from a usage error to a config value out of range, is one line on stderr
and exit status 2, given before JAX compiles or trains anything.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import signal
import sys
import threading

from jaxkit.commands import data, evaluate, experiment, export, plan, report, sample, train
from jaxkit.commands.common import DEFAULT_HOST_DEVICES, INTERRUPTED, TERMINATED, error
from jaxkit.config import UsageError
from jaxkit.generate.source import load_config as _load_config

COMMANDS = ("plan", "train", "experiment", "report", "data", "export", "sample", "eval")


def make_parsers() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The top-level parser (for `jaxkit --help`) and each command's own parser."""
    parser = argparse.ArgumentParser(
        prog="jaxkit",
        description="Sharded JAX training where global_batch = data_parallel_size × "
        "per_device_batch × grad_accum_steps is a first-class object.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    modules = (plan, train, experiment, report, data, export, sample, evaluate)
    commands = {name: m.add_parser(sub) for name, m in zip(COMMANDS, modules, strict=True)}
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
        return plan.ignored_option(opts)
    if opts.command == "experiment":
        return experiment.ignored_option(opts)
    return None


def _start_jax(host_devices: int | None, cpu_only: bool = False, cache: bool = True) -> None:
    """Sets the device count before JAX starts its backend (it cannot change afterwards),
    and the compilation cache before the first compile.

    `cpu_only`: the command compiles for a described TPU slice and needs no live
    accelerator (nor libtpu's search for one). Its programs cannot be read back from JAX's
    cache, so they skip it and use the kit's plan cache instead.
    """
    import jax

    from jaxkit.notebook import platforms_to_start
    from jaxkit.plan import compile_cache

    if host_devices is not None or cpu_only:
        jax.config.update("jax_platforms", "cpu")
    elif not jax.config.jax_platforms and (platforms := platforms_to_start()):  # type: ignore[attr-defined,unused-ignore]
        jax.config.update("jax_platforms", platforms)  # no TPU here: libtpu stays unstarted
    jax.config.update("jax_num_cpu_devices", host_devices or DEFAULT_HOST_DEVICES)
    compile_cache.enable(cache and not cpu_only)
    compile_cache.plans_enabled = cache


def _leave_on_ctrl_c(signum: int, frame: object) -> None:
    """SIGINT before a run trains (the loop takes it over while it trains), while `plan`
    compiles, or before an experiment's first unit (its report takes it over from there):
    nothing to save, so the process leaves now, with status 130.

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
    if code in (INTERRUPTED, TERMINATED):
        # XLA's threads can crash the interpreter's teardown after a Ctrl-C (status 139 or
        # -11 instead of 130): leave now, with what was printed flushed.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    if argv is None and threading.current_thread() is threading.main_thread():
        # The process's own command (the console script, `python -m jaxkit`) is done and
        # `code` is its status. The interpreter's teardown after it takes about a second
        # (XLA's objects go), and Python puts the default handlers back as it starts: a
        # Ctrl-C or SIGTERM then (a job's time limit just after a run's summary) killed a
        # finished run with status 143 or printed a KeyboardInterrupt: both are ignored here.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
    return code


def _main(argv: list[str] | None) -> int:
    opts = parse_args(argv)
    # An experiment's drive takes both signals over as it starts writing its report; before
    # that (its checks, the first compile) it has nothing to save either.
    if (
        opts.command in ("train", "plan", "experiment")
        and threading.current_thread() is threading.main_thread()
    ):
        signal.signal(signal.SIGINT, _leave_on_ctrl_c)
        # SIGTERM's default dumped a native stack trace mid-compile. With several processes
        # JAX's preemption service takes SIGTERM over when it starts, as it must.
        signal.signal(signal.SIGTERM, _leave_on_ctrl_c)
    if opts.command == "report":
        return report.run(opts)  # reads files only: JAX need not start
    if opts.command == "data":
        return data.run(opts)  # nor here
    if opts.command == "export":
        return export.run(opts)  # no config: the checkpoint's own
    if opts.command == "sample":  # the checkpoint's config, or hf:DIR's: JAX starts there
        return sample.run(opts, _load_config, _start_jax)
    if opts.command == "eval":  # likewise
        return evaluate.run(opts, _load_config, _start_jax)
    from jaxkit.config import ConfigError

    notes: list[str] = []  # values the config took from elsewhere, said before the plan
    try:
        config = _load_config(opts.args, getattr(opts, "workdir", None), notes)
    except ConfigError as err:
        return error(err)
    for note in notes:  # stdout, unless that holds JSON alone
        print(note, file=sys.stderr if getattr(opts, "json", False) else sys.stdout)
    target = getattr(opts, "target", None)
    if target is not None:
        from jaxkit.plan.targets import TargetError, parse_target

        try:
            opts.target = parse_target(target, getattr(opts, "slices", None) or 1)
        except TargetError as err:
            return error(err)
        mesh = config.mesh
        if opts.target.slices > 1 and mesh.dcn_data * mesh.dcn_fsdp == 1:
            mesh.dcn_data = opts.target.slices  # the data axis spans the slices by default
    _start_jax(opts.host_devices, cpu_only=target is not None, cache=not opts.no_compile_cache)
    if opts.command == "train":
        from jaxkit.distributed import DistributedError, initialize

        try:
            initialize(opts.coordinator, opts.num_processes, opts.process_id)
        except DistributedError as err:
            return error(err)

    from jaxkit import mesh as mesh_lib
    from jaxkit.batch.plan import BatchPlanError
    from jaxkit.config import run_config
    from jaxkit.data.sources import DataError
    from jaxkit.distributed import DistributedError
    from jaxkit.plan import planning
    from jaxkit.plan.targets import TargetError
    from jaxkit.train.checkpoint import CheckpointError
    from jaxkit.train.lock import WorkdirInUseError

    try:
        # Every command runs the config's mesh on its devices (the live ones, or a described
        # TPU slice's): its shards must be even.
        described = opts.target if target is not None else None  # the parsed TPU slice
        devices = planning.devices_for(described)
        shape = planning.mesh_shape(run_config(config), devices, described)
        if opts.command == "plan":
            return plan.run(config, shape, opts, devices)
        if opts.command == "experiment":
            return experiment.run(config, opts, devices)
        return train.run(config, opts)
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
        WorkdirInUseError,
    ) as err:
        return error(err)


if __name__ == "__main__":
    sys.exit(main())

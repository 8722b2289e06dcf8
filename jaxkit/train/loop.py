"""The training loop: data in, micro-steps dispatched, metrics out.

`train` sets up (mesh, plan, data, the compiled step, a resume), then steps: before and
after each optimizer step and after each micro-step it hands over to the pieces of
loop_pieces.py, one per concern (log, eval, checkpoints, profile, stop requests, the batch
schedule, the input's prefetch), each saying when it is due.

The loop stays one micro-step ahead of the devices: it dispatches micro-step n, then
fetches micro-step n−1's metrics. Unbounded dispatch deadlocks simulated CPU devices, and
that fetch is where non-finite losses are caught.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

import jax
import ml_collections

from jaxkit import mesh as mesh_lib
from jaxkit.batch.plan import BatchPlan
from jaxkit.batch.schedule import schedule_from_config
from jaxkit.config import config_to_json, run_config, validate
from jaxkit.data import sources as data_lib
from jaxkit.data.token_files import take_vocabulary
from jaxkit.distributed import check_agreement, process_0_refusal
from jaxkit.plan import peak as peak_lib
from jaxkit.plan.costs import StepPrograms
from jaxkit.plan.planning import model_json
from jaxkit.records import wandb_log
from jaxkit.records.metrics import RunDir
from jaxkit.records.steps import StepInfo, StepTracker, format_summary, summarize
from jaxkit.sections import RunConfig
from jaxkit.step.train_step import Setup, TrainState, build, check_on_mesh, with_kernel
from jaxkit.train.checkpoint import Checkpointer, Restored, resume
from jaxkit.train.lock import WorkdirInUseError, run_lock
from jaxkit.train.loop_pieces import (
    AutoRampDecision,
    BatchChange,
    Batches,
    Checkpoints,
    Evaluation,
    Log,
    NewProgram,
    Run,
    StopRequests,
    profiling,
)
from jaxkit.train.loop_pieces import evaluate as evaluate  # importable from here, as before
from jaxkit.train.resume import Start, finished_summary, resume_events, saved_plan, starting_point
from jaxkit.workdir import as_path


@dataclasses.dataclass
class RunResult:
    plan: BatchPlan
    state: TrainState
    records: list[dict]  # every train and eval record, as written to metrics.jsonl
    summary: dict
    stopped: bool = False  # by SIGTERM/SIGINT (or stop_after_micro_steps), after saving
    # Every stop asked for, by name, first first: also one at the last step, which only
    # finishes the run (stopped stays False). A caller that trains on afterwards (an
    # experiment's next unit) must not drop it.
    stop_requests: tuple[str, ...] = ()


def train(
    config: ml_collections.ConfigDict,
    workdir: str | os.PathLike | None = None,
    *,
    devices: Sequence[jax.Device] | None = None,
    progress: bool = True,
    echo: Callable[[str], None] = print,
    allow_batch_change: bool = False,
    allow_longer: bool = False,
    stop_after_micro_steps: int | None = None,
) -> RunResult:
    """Trains `config` on a mesh of `devices` (default: all), writing to `workdir`.

    With a workdir, the run checkpoints (every `checkpoint.every` optimizer steps, on SIGTERM
    or SIGINT, and at the end) and resumes from the workdir's latest checkpoint, also on
    another device count. `stop_after_micro_steps` stops as a preemption would, once the
    run's micro-steps in all (counted across resumes) reach it (for tests and notebooks).
    Another run on the same workdir meanwhile is refused (WorkdirInUseError) before any work.
    """
    taken = take_vocabulary(config)  # model.vocab_size=null: the token files' (the CLI's: set)
    if taken is not None:
        echo(taken)
    validate(config)  # every value, before any work (the CLI has checked them already)
    # a W&B project without the package: refused here
    wandb_log.check(run_config(config, checked=True), workdir, echo)
    with _one_run(workdir, echo):  # a second run on the workdir is refused here, before any work
        return _train(
            config,
            workdir,
            devices=devices,
            progress=progress,
            echo=echo,
            allow_batch_change=allow_batch_change,
            allow_longer=allow_longer,
            stop_after_micro_steps=stop_after_micro_steps,
        )


@contextlib.contextmanager
def _one_run(workdir: str | os.PathLike | None, echo: Callable[[str], None]) -> Iterator[None]:
    """The workdir's lock, held by process 0 while the run lasts (workdir.run_lock); when
    another run holds it, every process of this one is refused."""
    with contextlib.ExitStack() as stack:
        refusal = None
        if workdir is not None and jax.process_index() == 0:
            try:
                unlocked = stack.enter_context(run_lock(workdir))
            except WorkdirInUseError as err:
                refusal = str(err)
            else:
                if unlocked:
                    echo(f"warning: {unlocked}")
        refusal = process_0_refusal(refusal) if workdir is not None else None
        if refusal is not None:
            raise WorkdirInUseError(refusal)
        yield


def _train(
    config_dict: ml_collections.ConfigDict,
    workdir: str | os.PathLike | None,
    *,
    devices: Sequence[jax.Device] | None,
    progress: bool,
    echo: Callable[[str], None],
    allow_batch_change: bool,
    allow_longer: bool,
    stop_after_micro_steps: int | None,
) -> RunResult:
    profile = profiling(run_config(config_dict, checked=True), workdir)
    if jax.process_index() != 0:  # one voice: only process 0 prints and writes
        echo, progress = (lambda *args: None), False
    # The attention kernel these devices run, for auto: the run's config, checkpoints and
    # summary name the one that ran.
    config_dict = _with_kernel(config_dict, devices or jax.devices(), echo)
    # What the pieces below read: the typed sections. The config as the run saves it
    # (config.json, each checkpoint's record) keeps the keys as the config file gives them.
    config, saved_as = run_config(config_dict, checked=True), config_to_json(config_dict)
    parts = _set_up(config, saved_as, devices, echo)
    checkpointer, restored = _resume(
        config, saved_as, workdir, parts, echo, allow_batch_change, allow_longer
    )
    tracker = StepTracker(config, parts.plan, parts.setup, None, _peak(config, parts.mesh))
    start = starting_point(config, parts.shape, parts.setup, parts.plan, restored, tracker, echo)
    saved_events = restored.meta["loop"].get("events", []) if restored else []
    finished = start.position.step >= start.schedule.total_steps
    if finished and workdir is not None and restored is not None:  # a run done before
        if checkpointer:
            checkpointer.close()
        summary = finished_summary(
            config, start, workdir, restored.meta, tracker, parts.eval_source, echo
        )
        return RunResult(plan=start.plan, state=start.state, records=[], summary=summary)
    # Compiled once, ahead of time (once per K in fused mode), after the resume's checks so
    # that a refused resume, or a finished run's rerun, costs no compile: the loop calls
    # these executables, and their cost analysis gives the FLOPs behind throughput and MFU.
    programs = StepPrograms(config, parts.setup)
    tracker.cost = programs.get(parts.plan)[1]
    # What changed at this resume: logged once, and kept in the checkpoints saved at this
    # step, so that a later resume from one of them keeps them in the log.
    events = resume_events(restored, config, start.schedule, parts.shape) if restored else []
    run_dir = _open_run_dir(workdir, config, config_dict, start, saved_events, events, echo)
    checkpoints = Checkpoints(checkpointer, config, saved_as, parts.data_facts, start.hf_source)
    t = config.train
    pieces = [
        Log(t.log_every),
        NewProgram(),
        *profile,
        StopRequests(stop_after_micro_steps),
        Evaluation(t.eval_every, t.eval_examples, parts.eval_source),
        AutoRampDecision(t.noise_scale_every),
        BatchChange(),
        checkpoints,
    ]
    batches = Batches(config, start.setup, parts.train_source)
    run = Run(config, start, programs, tracker, batches, echo, progress, run_dir, events, pieces)
    # The loop's stop requests hold until the summary is written: a stop after the last
    # step (SIGTERM, Ctrl-C) is noted, not taken for one before training started. With
    # several processes, JAX's preemption service takes SIGTERM (StopRequests).
    stops = stop_requests(handle_sigterm=jax.process_count() == 1)
    with stops as run.stop_requests, _wandb_run_ends(run):
        _train_steps(run)
        if run.stop_signal:
            echo(checkpoints.stop_message(run.stop_signal, run.step_plan.grad_accum_steps))
            return RunResult(
                plan=start.plan,
                state=run.state,
                records=run.records,
                summary={},
                stopped=True,
                stop_requests=tuple(run.stop_requests),
            )
        summary = _summary(run, parts.eval_source, checkpoints)
    return RunResult(
        plan=start.plan,
        state=run.state,
        records=run.records,
        summary=summary,
        stop_requests=tuple(run.stop_requests),
    )


class _Parts(NamedTuple):
    """What set-up makes before a resume is considered."""

    mesh: jax.sharding.Mesh
    shape: dict[str, int]
    plan: BatchPlan  # the schedule's first
    setup: Setup
    train_source: data_lib.Source
    eval_source: data_lib.Source
    data_facts: dict  # what a checkpoint must be resumed on


def _with_kernel(
    config: ml_collections.ConfigDict, devices: Sequence[jax.Device], echo: Callable[[str], None]
) -> ml_collections.ConfigDict:
    """`config` with model.attention the kernel that runs on `devices` (a copy where that
    differs from what it says: train_step.with_kernel)."""
    typed = run_config(config, checked=True)
    chosen = with_kernel(typed, devices, echo)
    if chosen is typed:
        return config
    out = ml_collections.ConfigDict(config.to_dict())
    out.model.attention = chosen.model.attention
    return out


def _set_up(
    config: RunConfig,
    saved_as: dict,
    devices: Sequence[jax.Device] | None,
    echo: Callable[[str], None],
) -> _Parts:
    """The mesh, the batch schedule's first plan (printed), the data and the step, checked
    to agree across processes."""
    mesh = mesh_lib.make_mesh(dataclasses.asdict(config.mesh), devices)
    shape = mesh_lib.mesh_shape(mesh)
    check_on_mesh(config, shape)
    schedule = schedule_from_config(config, shape)
    plan = schedule.first
    train_source, eval_source = data_lib.checked_sources(config, schedule.largest)
    # What a checkpoint must be resumed on: the same rows, and for token files the same
    # tokens (re-prepared data is other data).
    data_facts = data_lib.data_facts(train_source, eval_source, data_lib.input_paths(config))
    setup = build(config, plan, mesh, schedule)
    check_agreement({"config": saved_as, "plan": plan.to_json()})
    echo(f"batch plan ({len(mesh.devices.flat)} {mesh.devices.flat[0].platform} devices):")
    echo(plan.table())
    note = getattr(train_source, "note", None)  # how token files were read, where it matters
    if note:
        echo(note)
    return _Parts(mesh, shape, plan, setup, train_source, eval_source, data_facts)


def _resume(
    config: RunConfig,
    saved_as: dict,
    workdir: str | os.PathLike | None,
    parts: _Parts,
    echo: Callable[[str], None],
    allow_batch_change: bool,
    allow_longer: bool,
) -> tuple[Checkpointer | None, Restored | None]:
    """The workdir's checkpoints, and the latest restored onto this run's mesh and plan (None:
    a fresh start), as `checkpoint.resume` allows."""
    if workdir is None:
        return None, None
    keep = config.checkpoint.keep
    checkpointer = Checkpointer(as_path(workdir) / "checkpoints", keep, warn=echo)
    plan_at = functools.partial(saved_plan, config, parts.shape)
    restored = resume(
        checkpointer,
        parts.setup,
        config,
        plan_at,
        saved_as=saved_as,
        allow_batch_change=allow_batch_change,
        allow_longer=allow_longer,
        echo=echo,
        data=parts.data_facts,
    )
    return checkpointer, restored


def _peak(config: RunConfig, mesh: jax.sharding.Mesh) -> peak_lib.Peak | None:
    """The devices' peak FLOP/s behind MFU, on process 0 (only it reports)."""
    if jax.process_index() != 0:
        return None
    # A table peak in the matmuls' dtype (CPUs measure their own, in float32).
    return peak_lib.device_peak(mesh.local_devices, config.model.compute_dtype)


def _open_run_dir(
    workdir: str | os.PathLike | None,
    config: RunConfig,
    config_dict: ml_collections.ConfigDict,
    start: Start,
    saved_events: Sequence[dict],
    events: Sequence[dict],
    echo: Callable[[str], None],
) -> RunDir | None:
    """The run's files, on process 0: the config and the plan as this attempt runs them,
    and the log up to where it starts; and the W&B run that follows them, if any."""
    if workdir is None:
        return None
    plan, schedule = start.plan, start.schedule
    ramped = schedule.kind != "fixed"
    # As `jaxkit plan --json` prints it, the model block included (the kernel that runs).
    plan_json = plan.to_json() | ({"batch_schedule": schedule.to_json()} if ramped else {})
    plan_json["model"] = model_json(config, plan)
    # Opened first: a run W&B refuses leaves the run's files as they were.
    step = start.position.step
    wandb_config = {"config": config_to_json(config_dict), "plan": plan_json}
    wandb_run = wandb_log.open_run(config, workdir, step, wandb_config, echo)
    if jax.process_index() != 0:
        return None
    # Whatever an earlier attempt logged past the step this run starts from goes.
    run_dir = RunDir(
        workdir, resume_after_step=step, saved_events=saved_events, wandb_run=wandb_run
    )
    run_dir.write_json("config.json", config_to_json(config_dict))
    run_dir.write_json("plan.json", plan_json)
    table = plan.table() + ("\n\n" + schedule.table() if ramped else "")
    run_dir.write_text("plan", "\n".join("    " + line for line in table.splitlines()))
    run_dir.write_text("config", "```\n" + config_dict.to_json_best_effort(indent=2) + "\n```")
    for event in events:
        run_dir.log_once(event)  # not twice: the checkpoint may hold it already
    # A summary belongs to a finished run; this one is not (again, or yet).
    (as_path(workdir) / "summary.json").unlink(missing_ok=True)
    return run_dir


def _summary(run: Run, eval_source: data_lib.Source, checkpoints: Checkpoints) -> dict:
    """The finished attempt's summary: written to summary.json and printed."""
    schedule = run.schedule
    summary = summarize(
        run.config,
        run.step_plan,
        run.records,
        run.tracker,
        eval_source,
        time.perf_counter() - run.started,
        run.total,
        schedule.to_json() if schedule.changes_batch else None,
    )
    summary |= run.batches.summary() | checkpoints.summary()
    by_source = getattr(run.batches.source, "by_source", None)  # a mixture's (mixture.py)
    if by_source is not None:
        summary |= by_source(run.examples, run.batches.seed)
    # `steps` counts the run's optimizer steps in all; the timings are this attempt's.
    summary["steps_this_attempt"] = run.total - run.start.position.step
    if run.run_dir:
        run.run_dir.write_summary(summary)
    run.echo(format_summary(summary))
    return summary


@contextlib.contextmanager
def _wandb_run_ends(run: Run) -> Iterator[None]:
    """The W&B run, if any, ends once the attempt has: after the summary went to it, as
    preempted where the attempt stopped to be resumed, as crashed where it failed."""
    wandb_run = run.run_dir.wandb_run if run.run_dir else None
    if wandb_run is None:
        yield
        return
    try:
        yield
    except BaseException:
        wandb_run.finish(failed=True)
        raise
    wandb_run.finish(stopped=bool(run.stop_signal))


def _train_steps(run: Run) -> None:
    """Optimizer steps until the last or a stop, each concern handed to its piece."""
    run.tracker.restart_clock()  # the first step's time starts here, not at set-up
    try:
        while run.step < run.total:
            run.step_plan = run.schedule.plan_at(run.examples)
            run.hand_over("start")
            if not _optimizer_step(run):
                break  # stopped between two micro-steps of the step, saved there
            run.step += 1
            run.examples += run.step_plan.global_batch_size
            run.hand_over("end")
            if run.stop_signal:
                break
    finally:
        run.close()


def _optimizer_step(run: Run) -> bool:
    """Dispatches optimizer step `run.step`'s micro-steps (fused: one call), each a
    micro-step ahead of the fetch of its metrics; False if a stop came between them."""
    plan, setup = run.step_plan, run.setup
    accum_steps = plan.grad_accum_steps
    step_fn, cost = run.programs.get(plan)
    hyper = setup.hyper(plan, run.examples)
    info = StepInfo(plan, float(hyper.learning_rate), cost, run.batches.scored(run.examples, plan))
    with jax.profiler.StepTraceAnnotation("train", step_num=run.step):
        first_micro = run.start.position.micro if run.step == run.start.position.step else 0
        # Fused accumulation makes a whole optimizer step in one call.
        micros = [accum_steps - 1] if run.batches.fused else range(first_micro, accum_steps)
        for micro in micros:
            run.micro = micro
            batch = run.batches.get(run)
            small = None
            if micro == accum_steps - 1:  # None where this step does not sample
                small = run.batches.small_batch_grad_sq(run)
            run.state, metrics = step_fn(run.state, batch, hyper)
            if small is not None:  # the step's last call carries it
                metrics = dict(metrics, small_grad_sq=small)
            if run.pending is not None:
                run.take(run.pending)
            run.pending = (run.step, micro, metrics, info)
            run.micro_steps += accum_steps if run.batches.fused else 1
            run.hand_over("micro")
            if run.stop_signal:
                return False
    return True


@contextlib.contextmanager
def stop_requests(handle_sigterm: bool = True, interrupt: bool = False) -> Iterator[list[str]]:
    """A list that SIGTERM (what a Cloud TPU preemption sends) or SIGINT appends to.

    The loop checks it after every micro-step and then saves and returns; a second signal
    while saving is absorbed, so the checkpoint is finished rather than torn.

    `interrupt`: the first signal is also raised as KeyboardInterrupt, for code that has no
    loop to check the list (an experiment between its runs). The list outlives the
    exception, which Python may raise inside a garbage-collection callback (jax registers
    one) and drop there: such code looks at the list too, and the dropped exception is not
    printed (it was, as "Exception ignored" and a traceback of the handler, for a stop that
    went on to be handled as any other).
    """
    requests: list[str] = []
    if threading.current_thread() is not threading.main_thread():
        yield requests  # signals reach only the main thread
        return

    def handler(signum: int, frame: object) -> None:
        del frame
        requests.append(signal.Signals(signum).name)
        if interrupt and len(requests) == 1:
            raise KeyboardInterrupt

    hook = sys.unraisablehook

    def unraisable(args: sys.UnraisableHookArgs) -> None:
        if not (requests and isinstance(args.exc_value, KeyboardInterrupt)):
            hook(args)

    signals = (signal.SIGTERM, signal.SIGINT) if handle_sigterm else (signal.SIGINT,)
    previous = {sig: signal.signal(sig, handler) for sig in signals}
    if interrupt:
        sys.unraisablehook = unraisable
    try:
        yield requests
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
        if interrupt:
            sys.unraisablehook = hook

"""The training loop: data in, micro-steps dispatched, metrics out.

The loop stays one micro-step ahead of the devices: it dispatches micro-step n, then
fetches micro-step n−1's metrics. Unbounded dispatch deadlocks simulated CPU devices, and
that fetch is where non-finite losses are caught.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import ml_collections
import tqdm
from jax.experimental.multihost_utils import reached_preemption_sync_point

from jaxkit import data as data_lib
from jaxkit import mesh as mesh_lib
from jaxkit import peak as peak_lib
from jaxkit.batch_plan import BatchPlan
from jaxkit.batch_schedule import AUTO, AutoRamp, BatchSchedule, schedule_from_config
from jaxkit.checkpoint import Checkpointer, position_of, resume
from jaxkit.config import ConfigError, config_to_json, parse_profile_steps
from jaxkit.costs import StepPrograms
from jaxkit.distributed import check_agreement
from jaxkit.metrics import RunDir
from jaxkit.noise_scale import SMALL_BATCH_ROWS, has_two_batch_sizes
from jaxkit.prefetch import Prefetcher
from jaxkit.records import (
    StepInfo,
    StepTracker,
    eval_record,
    format_record,
    format_summary,
    summarize,
)
from jaxkit.resume import finished_summary, resume_events, saved_schedule
from jaxkit.train_step import (
    Setup,
    TrainState,
    build,
    check_on_mesh,
)
from jaxkit.validate import validate
from jaxkit.workdir import as_path, is_local, profiler_can_write


@dataclasses.dataclass
class RunResult:
    plan: BatchPlan
    state: TrainState
    records: list[dict]  # every train and eval record, as written to metrics.jsonl
    summary: dict
    stopped: bool = False  # by SIGTERM/SIGINT (or stop_after_micro_steps), after saving


def evaluate(
    setup: Setup, params: Any, source: data_lib.Source, plan: BatchPlan, eval_examples: int
) -> dict[str, float]:
    """Weighted mean loss and accuracy over the targets of the first `eval_examples`
    held-out rows (0 = all), each row counted once whatever the split: see
    data.eval_batches."""
    sums = {"loss_sum": 0.0, "accuracy_sum": 0.0, "weight": 0.0}  # float64 on the host

    def take(result: Any) -> None:
        for key, value in jax.device_get(result).items():
            sums[key] += float(value)

    pending = None
    for batch in data_lib.eval_batches(source, plan, eval_examples, setup.batch_sharding):
        result = setup.eval_step(params, batch)
        if pending is not None:  # stay one call ahead, as the train loop does
            take(pending)
        pending = result
    take(pending)
    weight = sums["weight"]
    if weight <= 0:
        raise data_lib.DataError("the held-out rows have no scored target (every weight is 0)")
    return {
        "eval_loss": sums["loss_sum"] / weight,
        "eval_accuracy": sums["accuracy_sum"] / weight,
        "eval_examples": data_lib.eval_row_count(source, eval_examples),
    }


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
    """
    validate(config)  # every value, before any work (the CLI has checked them already)
    t, seed = config.train, config.train.seed
    profile = parse_profile_steps(t.profile_steps, t.steps)
    if profile and (workdir is None or not profiler_can_write(workdir)):
        raise ConfigError(
            "train.profile_steps writes to WORKDIR/profile/: give a workdir (a local path or gs://)"
        )
    if jax.process_index() != 0:  # one voice: only process 0 prints and writes
        echo, progress = (lambda *args: None), False
    mesh = mesh_lib.make_mesh(config.mesh.to_dict(), devices)
    shape = mesh_lib.mesh_shape(mesh)
    check_on_mesh(config, shape)
    schedule = schedule_from_config(config, shape)
    plan = schedule.first
    train_source, eval_source = data_lib.checked_sources(config, schedule.largest)
    # What a checkpoint must be resumed on: the same rows, and for token files the same
    # tokens (re-prepared data is other data).
    data_facts = data_lib.data_facts(train_source, eval_source)
    setup = build(config, plan, mesh, schedule)
    check_agreement({"config": config_to_json(config), "plan": plan.to_json()})
    fused = setup.accumulation == "fused"

    echo(f"batch plan ({len(mesh.devices.flat)} {mesh.devices.flat[0].platform} devices):")
    echo(plan.table())
    note = getattr(train_source, "note", None)  # how token files were read, where it matters
    if note:
        echo(note)

    checkpointer, restored = None, None
    if workdir is not None:
        checkpointer = Checkpointer(
            as_path(workdir) / "checkpoints", config.checkpoint.keep, warn=echo
        )
        restored = resume(
            checkpointer,
            setup,
            config,
            lambda meta: saved_schedule(config, shape, meta).plan_at(position_of(meta).examples),
            allow_batch_change=allow_batch_change,
            allow_longer=allow_longer,
            echo=echo,
            data=data_facts,
        )
    # Compiled once, ahead of time (once per K in fused mode), after the resume's checks so
    # that a refused resume costs no compile: the loop calls these executables, and their
    # cost analysis gives the FLOPs behind throughput and MFU.
    programs = StepPrograms(config, setup)
    cost = programs.get(plan)[1]
    peak = None
    if jax.process_index() == 0:  # only process 0 reports
        # A table peak in the matmuls' dtype (CPUs measure their own, in float32).
        peak = peak_lib.device_peak(
            mesh.local_devices, config.model.get("compute_dtype", "float32")
        )
    tracker = StepTracker(config, plan, setup, cost, peak)

    position = data_lib.Position()
    ramp = AutoRamp()
    if restored is not None:
        state, position = restored.state, restored.position
        schedule = saved_schedule(config, shape, restored.meta)
        setup = dataclasses.replace(setup, schedule=schedule)
        ramp = AutoRamp.load(restored.meta["loop"].get("batch_schedule"))
        tracker.load_loop_state(restored.meta["loop"], partial_step=position.micro > 0)
    else:
        state = setup.init(jax.random.key(seed))
    if schedule.plan_at(position.examples) != plan:
        # The plan in force where this run starts: a resume in a later stage.
        plan = schedule.plan_at(position.examples)
        echo(f"resuming in a later stage of the batch schedule; its plan:\n{plan.table()}")
    if schedule.kind != "fixed":  # as laid from where this run starts
        echo(f"batch schedule ({schedule.kind}):")
        echo(schedule.table())
    total = schedule.total_steps
    if position.step >= total and workdir is not None:
        if checkpointer:
            checkpointer.close()
        saved_events = restored.meta["loop"].get("events", []) if restored else []
        summary = finished_summary(
            config, schedule, workdir, position, saved_events, tracker, eval_source, echo
        )
        return RunResult(
            plan=schedule.plan_at(position.examples), state=state, records=[], summary=summary
        )

    # What changed at this resume: logged once, and kept in the checkpoints saved at this
    # step, so that a later resume from one of them keeps them in the log.
    events = resume_events(restored, config, schedule, shape) if restored else []
    run_dir = None
    if workdir is not None and jax.process_index() == 0:
        # Whatever an earlier attempt logged past the step this run starts from goes.
        saved_events = restored.meta["loop"].get("events", []) if restored else []
        run_dir = RunDir(workdir, resume_after_step=position.step, saved_events=saved_events)
        run_dir.write_json("config.json", config_to_json(config))
        ramped = schedule.kind != "fixed"
        plan_json = plan.to_json() | ({"batch_schedule": schedule.to_json()} if ramped else {})
        run_dir.write_json("plan.json", plan_json)
        table = plan.table() + ("\n\n" + schedule.table() if ramped else "")
        run_dir.write_text("plan", "\n".join("    " + line for line in table.splitlines()))
        run_dir.write_text("config", "```\n" + config.to_json_best_effort(indent=2) + "\n```")
        for event in events:
            run_dir.log_once(event)  # not twice: the checkpoint may hold it already
        # A summary belongs to a finished run; this one is not (again, or yet).
        (as_path(workdir) / "summary.json").unlink(missing_ok=True)
    records: list[dict] = []

    def emit(record: dict) -> None:
        records.append(record)
        if run_dir:
            run_dir.log(record)
        (bar.write if progress else echo)(format_record(record))

    kept_micro = 0  # micro-steps in a checkpoint of the same step that a save found on disk

    def save(at: data_lib.Position, at_plan: BatchPlan, *, wait: bool = False) -> bool:
        """Saves the state at `at`, whose next micro-step runs under `at_plan`."""
        nonlocal kept_micro
        if checkpointer is None:
            return False
        meta = {"config": config_to_json(config), "plan": at_plan.to_json(), "data": data_facts}
        loop_state = tracker.loop_state(at)
        loop_state["events"] = [e for e in events if e["step"] == at.step]
        loop_state["batch_schedule"] = schedule.state(at.step, at.examples) | ramp.state()
        saved = checkpointer.save(at, state, dict(meta, loop=loop_state), wait=wait)
        if not saved:
            kept_micro = int(checkpointer.read_meta(at.step)["loop"].get("micro", 0))
        return saved

    def load(key: tuple[int, int], at_plan: BatchPlan) -> dict[str, jax.Array]:
        """The batch of micro-step `micro` (fused: the whole step) of the optimizer step
        that starts reading at stream example `first`."""
        first, micro = key
        if fused:
            return data_lib.load_global_batch(
                train_source, first, at_plan, seed, setup.fused_batch_sharding, normalisation
            )
        return data_lib.load_micro_batch(
            train_source, first, micro, at_plan, seed, setup.batch_sharding, normalisation
        )

    def small_batch_grad_sq(at: Setup, now: TrainState, first: int) -> jax.Array | None:
        """The noise scale's small-batch |gradient|² at the params the step starting at
        `first` began from (unchanged until its last call), dispatched before that call."""
        rows = data_lib.load_small_batch(
            train_source, first, SMALL_BATCH_ROWS, seed, at.small_batch_sharding
        )
        return None if rows is None else at.small_batch_grad_sq(now.params, rows)

    def upcoming(
        step: int, first: int, micro: int, at_plan: BatchPlan
    ) -> Iterator[tuple[tuple[int, int], BatchPlan]]:
        """The batches after this one, under the batch schedule as it stands."""
        while True:
            micro += 1
            if fused or micro == at_plan.grad_accum_steps:
                step, first = step + 1, first + at_plan.global_batch_size
                if step >= total:
                    return
                at_plan = schedule.plan_at(first)
                micro = at_plan.grad_accum_steps - 1 if fused else 0
            yield (first, micro), at_plan

    normalisation = t.loss_normalisation
    prefetcher = Prefetcher(load, depth=t.prefetch)
    start = time.perf_counter()
    bar = tqdm.tqdm(
        total=total,
        initial=position.step,
        unit="step",
        disable=not progress,
        file=sys.stderr,
        dynamic_ncols=True,
    )
    pending = None  # (step, micro, metrics, step info) dispatched but not yet fetched

    def finish(fetched: tuple) -> None:
        step, micro, metrics, info = fetched
        record = tracker.micro_step_done(step, micro, metrics, info)
        if record is None:
            return
        bar.update(1)
        if record["loss"] is not None:  # None: the step scored no target
            bar.set_postfix(loss=f"{record['loss']:.4f}", refresh=False)
        if record["step"] % t.log_every == 0 or record["step"] == total:
            emit(record)
            tracker.close_window()

    def drain() -> None:
        """Waits for the last dispatched micro-step and takes its metrics."""
        nonlocal pending
        if pending is not None:
            finish(pending)
            pending = None

    profile_dir = as_path(workdir) / "profile" if workdir is not None else None
    tracing, stop_signal, stopped_at, saved = False, None, position, False
    examples = position.examples  # where the current optimizer step starts reading
    micro_steps = int(jax.device_get(state.micro_step))  # in all, across resumes
    # With several processes, JAX's preemption service takes SIGTERM and agrees on the
    # micro-step at which every process stops, so all save the same checkpoint.
    multi_process = jax.process_count() > 1
    tracker.restart_clock()  # the first step's time starts here, not at set-up
    step, step_plan = position.step, plan
    with _stop_requests(handle_sigterm=not multi_process) as stop:
        try:
            while step < total:
                step_plan = schedule.plan_at(examples)
                accum_steps = step_plan.grad_accum_steps
                if not programs.has(step_plan):  # fused: a new K is a new program
                    drain()
                    programs.get(step_plan)
                    tracker.restart_clock()  # the compile is no step's time
                step_fn, cost = programs.get(step_plan)
                hyper = setup.hyper(step_plan, examples)
                # What the step scores: a global batch of prompts only has no loss.
                scored = data_lib.step_weight(
                    train_source, examples, step_plan.global_batch_size, seed
                )
                info = StepInfo(step_plan, float(hyper.learning_rate), cost, scored)
                if profile and step == profile[0] and profile_dir is not None:
                    drain()  # the trace starts with the devices idle, at a step boundary
                    # JAX converts to Perfetto with pathlib, local paths only (jax#19263).
                    perfetto = is_local(profile_dir)
                    jax.profiler.start_trace(str(profile_dir), create_perfetto_trace=perfetto)
                    tracing = True
                with jax.profiler.StepTraceAnnotation("train", step_num=step):
                    first_micro = position.micro if step == position.step else 0
                    # Fused accumulation makes a whole optimizer step in one call.
                    micros = [accum_steps - 1] if fused else range(first_micro, accum_steps)
                    for micro in micros:
                        batch = prefetcher.get(
                            (examples, micro), step_plan, upcoming(step, examples, micro, step_plan)
                        )
                        small = None
                        if micro == accum_steps - 1 and has_two_batch_sizes(
                            step_plan.global_batch_size
                        ):
                            small = small_batch_grad_sq(setup, state, examples)
                        state, metrics = step_fn(state, batch, hyper)
                        if small is not None:  # the step's last call carries it
                            metrics = dict(metrics, small_grad_sq=small)
                        if pending is not None:
                            finish(pending)
                        pending = (step, micro, metrics, info)
                        micro_steps += accum_steps if fused else 1
                        if (
                            stop_after_micro_steps is not None
                            and micro_steps >= stop_after_micro_steps
                            and not stop
                        ):
                            stop.append("stop_after_micro_steps")
                        # A preemption notice reached every process: all stop here.
                        if (
                            multi_process
                            and not stop
                            and reached_preemption_sync_point(micro_steps)
                        ):
                            stop.append("SIGTERM")
                        if stop and micro < accum_steps - 1:  # mid-step: save right here
                            stop_signal = stop[0]
                            drain()
                            stopped_at = data_lib.Position(step, examples, micro + 1)
                            saved = save(stopped_at, step_plan, wait=True)
                            break
                    if stop_signal:
                        break
                examples += step_plan.global_batch_size
                done = step + 1
                if tracing and profile and done == profile[1]:
                    drain()
                    jax.profiler.stop_trace()
                    tracing = False
                    echo(f"profile of optimizer steps {profile[0]}:{profile[1]} in {profile_dir}")
                    tracker.restart_clock()
                if done == total or (t.eval_every and done % t.eval_every == 0):
                    drain()  # evaluate these params before the next step changes them
                    result = evaluate(setup, state.params, eval_source, step_plan, t.eval_examples)
                    emit(eval_record(done, step_plan, result, tracker))
                    tracker.restart_clock()
                if schedule.kind == AUTO and done < total and done % t.log_every == 0:
                    drain()  # the decision reads this window's noise scale
                    noise = tracker.noise_scale.estimate().get("noise_scale")
                    schedule = ramp.decide(schedule, noise, done, examples)
                    setup = dataclasses.replace(setup, schedule=schedule)
                    total = schedule.total_steps
                    bar.total = total
                next_plan = schedule.plan_at(examples)
                if done < total and next_plan.global_batch_size != step_plan.global_batch_size:
                    drain()  # the log reads in order: this step's record, then the change
                    event = batch_change_event(
                        done, examples, step_plan, next_plan, schedule, ramp.last_noise_scale
                    )
                    events.append(event)
                    if run_dir:
                        run_dir.log(event)
                    echo(format_batch_change(event))
                every = config.checkpoint.every
                if stop or done == total or (every and done % every == 0):
                    drain()  # the saved loop state must include this step's losses
                    stopped_at = data_lib.Position(done, examples, 0)
                    saved = save(stopped_at, next_plan, wait=bool(stop) or done == total)
                    if stop and done < total:  # a stop at the last step just finishes
                        stop_signal = stop[0]
                        break
                step = done
        finally:
            prefetcher.close()
            if tracing:
                jax.profiler.stop_trace()
            bar.close()
            if checkpointer:
                checkpointer.close()  # waits for a save still being written
            if run_dir:
                run_dir.close()
    if stop_signal:
        echo(
            _stop_message(
                stop_signal, stopped_at, saved, kept_micro, checkpointer, step_plan.grad_accum_steps
            )
        )
        return RunResult(plan=plan, state=state, records=records, summary={}, stopped=True)
    summary = summarize(
        config,
        step_plan,
        records,
        tracker,
        eval_source,
        time.perf_counter() - start,
        total,
        schedule.to_json() if schedule.changes_batch else None,
    )
    # The input pipeline's time on the critical path, and the part of it after the first
    # batch (which nothing loads ahead): 0 when loading keeps ahead of the devices.
    summary["input_wait_s"] = prefetcher.waited_s
    summary["input_wait_after_first_s"] = prefetcher.waited_s - prefetcher.first_wait_s
    if checkpointer:
        summary["checkpoint_blocking_s"] = checkpointer.blocking_s
        summary["checkpoints_saved"] = checkpointer.saves
    # `steps` counts the run's optimizer steps in all; the timings are this attempt's.
    summary["steps_this_attempt"] = total - position.step
    if run_dir:
        run_dir.write_json("summary.json", summary)
    echo(format_summary(summary))
    return RunResult(plan=plan, state=state, records=records, summary=summary)


def batch_change_event(
    done: int,
    examples: int,
    before: BatchPlan,
    after: BatchPlan,
    schedule: BatchSchedule,
    noise_scale: float | None,
) -> dict:
    """A stage of the batch schedule begins after optimizer step `done`."""
    event = {
        "event": "batch_change",
        "step": done,
        "examples_seen": examples,
        "reason": "auto" if schedule.kind == AUTO else "schedule",
        "from_global_batch_size": before.global_batch_size,
        "global_batch_size": after.global_batch_size,
        "from_grad_accum_steps": before.grad_accum_steps,
        "grad_accum_steps": after.grad_accum_steps,
        "peak_learning_rate": after.learning_rate,
    }
    if schedule.kind == AUTO:
        event["noise_scale"] = noise_scale  # the smoothed B_simple that decided it
    if after.seq_len is not None:
        event["tokens_seen"] = examples * after.seq_len
    return event


def format_batch_change(event: dict) -> str:
    why = (
        f"B_simple ≈ {event['noise_scale']:,.0f} above the batch"
        if event["reason"] == "auto"
        else "batch.schedule"
    )
    return (
        f"step {event['step']:>6}  global batch {event['from_global_batch_size']} -> "
        f"{event['global_batch_size']} (grad_accum_steps {event['from_grad_accum_steps']} -> "
        f"{event['grad_accum_steps']}) at example {event['examples_seen']:,}: {why}"
    )


def _stop_message(
    signal_name: str,
    at: data_lib.Position,
    saved: bool,
    kept_micro: int,
    checkpointer: Checkpointer | None,
    accum_steps: int,
) -> str:
    if checkpointer is None:
        return f"stopped by {signal_name}; no workdir, nothing saved"
    where = f"optimizer step {at.step}"
    if at.micro:
        where += f" + {at.micro} of {accum_steps} micro-steps"
    if saved:
        return (
            f"stopped by {signal_name}: saved checkpoint step_{at.step} at {where}; "
            "run the same command to resume"
        )
    return (
        f"stopped by {signal_name}: checkpoint step_{at.step} was already saved and is kept; "
        f"stopped at {where} (resuming redoes the {at.micro - kept_micro} micro-steps since, "
        "exactly); "
        "run the same command to resume"
    )


@contextlib.contextmanager
def _stop_requests(handle_sigterm: bool = True) -> Iterator[list[str]]:
    """A list that SIGTERM (what a Cloud TPU preemption sends) or SIGINT appends to.

    The loop checks it after every micro-step and then saves and returns; a second signal
    while saving is absorbed, so the checkpoint is finished rather than torn.
    """
    requests: list[str] = []
    if threading.current_thread() is not threading.main_thread():
        yield requests  # signals reach only the main thread
        return

    def handler(signum: int, frame: object) -> None:
        del frame
        requests.append(signal.Signals(signum).name)

    signals = (signal.SIGTERM, signal.SIGINT) if handle_sigterm else (signal.SIGINT,)
    previous = {sig: signal.signal(sig, handler) for sig in signals}
    try:
        yield requests
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)

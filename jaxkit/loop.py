"""The training loop: data in, micro-steps dispatched, metrics out.

The loop stays one micro-step ahead of the devices: it dispatches micro-step n, then
fetches micro-step n−1's metrics. Unbounded dispatch deadlocks simulated CPU devices, and
that fetch is where non-finite losses are caught.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
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

from jaxkit import costs
from jaxkit import data as data_lib
from jaxkit import mesh as mesh_lib
from jaxkit import peak as peak_lib
from jaxkit.batch_plan import BatchPlan, plan_from_config
from jaxkit.checkpoint import Checkpointer, Restored, resume
from jaxkit.config import ConfigError, config_to_json, parse_profile_steps, validate
from jaxkit.distributed import check_agreement
from jaxkit.metrics import RunDir, truncate_metrics
from jaxkit.records import (
    StepTracker,
    eval_record,
    format_record,
    format_summary,
    summarize,
)
from jaxkit.train_step import (
    Setup,
    TrainState,
    build,
    check_on_mesh,
    learning_rate_schedule,
)
from jaxkit.workdir import as_path, is_local, profiler_can_write, write_text_atomic


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
    """Mean loss and accuracy over the first `eval_examples` held-out rows (0 = all), each
    row counted once whatever the split: see data.eval_batches."""
    sums = {"loss_sum": 0.0, "accuracy_sum": 0.0, "rows": 0.0}  # float64 on the host

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
    return {
        "eval_loss": sums["loss_sum"] / sums["rows"],
        "eval_accuracy": sums["accuracy_sum"] / sums["rows"],
        "eval_examples": int(sums["rows"]),
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
    check_on_mesh(config, mesh_lib.mesh_shape(mesh))
    plan = plan_from_config(config, mesh_lib.mesh_shape(mesh))
    train_source, eval_source = data_lib.make_sources(config)
    data_lib.check_sources(train_source, plan)
    setup = build(config, plan, mesh)
    check_agreement({"config": config_to_json(config), "plan": plan.to_json()})
    accum_steps, fused = plan.grad_accum_steps, setup.accumulation == "fused"

    echo(f"batch plan ({len(mesh.devices.flat)} {mesh.devices.flat[0].platform} devices):")
    echo(plan.table())
    # Compiled once, ahead of time: the loop calls this executable, and its cost analysis
    # gives the FLOPs behind the throughput and MFU every record carries.
    step_fn, cost = costs.compile_setup_step(config, plan, setup)
    peak = None
    if jax.process_index() == 0:  # only process 0 reports
        peak = peak_lib.device_peak(mesh.local_devices)
    tracker = StepTracker(config, plan, setup, cost, peak)
    checkpointer, restored = None, None
    if workdir is not None:
        checkpointer = Checkpointer(
            as_path(workdir) / "checkpoints", config.checkpoint.keep, warn=echo
        )
        restored = resume(
            checkpointer,
            setup,
            config,
            plan,
            allow_batch_change=allow_batch_change,
            allow_longer=allow_longer,
            echo=echo,
        )
    position = data_lib.Position()
    if restored is not None:
        state, position = restored.state, restored.position
        tracker.load_loop_state(restored.meta["loop"], partial_step=position.micro > 0)
    else:
        state = setup.init(jax.random.key(seed))
    if position.step >= t.steps and workdir is not None:
        if checkpointer:
            checkpointer.close()
        saved_events = restored.meta["loop"].get("events", []) if restored else []
        return _finished_run(
            config, plan, state, workdir, position, saved_events, tracker, eval_source, echo
        )

    # What changed at this resume: logged once, and kept in the checkpoints saved at this
    # step, so that a later resume from one of them keeps them in the log.
    events = resume_events(restored, config, plan) if restored else []
    run_dir = None
    if workdir is not None and jax.process_index() == 0:
        # Whatever an earlier attempt logged past the step this run starts from goes.
        saved_events = restored.meta["loop"].get("events", []) if restored else []
        run_dir = RunDir(workdir, resume_after_step=position.step, saved_events=saved_events)
        run_dir.write_json("config.json", config_to_json(config))
        run_dir.write_json("plan.json", plan.to_json())
        run_dir.write_text("plan", "\n".join("    " + line for line in plan.table().splitlines()))
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

    def save(at: data_lib.Position, *, wait: bool = False) -> bool:
        nonlocal kept_micro
        if checkpointer is None:
            return False
        meta = {"config": config_to_json(config), "plan": plan.to_json()}
        loop_state = tracker.loop_state(at)
        loop_state["events"] = [e for e in events if e["step"] == at.step]
        saved = checkpointer.save(at, state, dict(meta, loop=loop_state), wait=wait)
        if not saved:
            kept_micro = int(checkpointer.read_meta(at.step)["loop"].get("micro", 0))
        return saved

    start = time.perf_counter()
    bar = tqdm.tqdm(
        total=t.steps,
        initial=position.step,
        unit="step",
        disable=not progress,
        file=sys.stderr,
        dynamic_ncols=True,
    )
    pending = None  # (step, micro, metrics) dispatched but not yet fetched

    def drain() -> None:
        """Waits for the last dispatched micro-step and takes its metrics."""
        nonlocal pending
        if pending is not None:
            _finish(tracker, bar, emit, *pending, t.log_every, t.steps)
            pending = None

    profile_dir = as_path(workdir) / "profile" if workdir is not None else None
    tracing, stop_signal, stopped_at, saved = False, None, position, False
    examples = position.examples  # where the current optimizer step starts reading
    micro_steps = int(jax.device_get(state.micro_step))  # in all, across resumes
    # With several processes, JAX's preemption service takes SIGTERM and agrees on the
    # micro-step at which every process stops, so all save the same checkpoint.
    multi_process = jax.process_count() > 1
    tracker.restart_clock()  # the first step's time starts here, not at set-up
    with _stop_requests(handle_sigterm=not multi_process) as stop:
        try:
            for step in range(position.step, t.steps):
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
                        if fused:
                            batch = data_lib.load_global_batch(
                                train_source, examples, plan, seed, setup.fused_batch_sharding
                            )
                        else:
                            batch = data_lib.load_micro_batch(
                                train_source, examples, micro, plan, seed, setup.batch_sharding
                            )
                        state, metrics = step_fn(state, batch)
                        if pending is not None:
                            _finish(tracker, bar, emit, *pending, t.log_every, t.steps)
                        pending = (step, micro, metrics)
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
                            saved = save(stopped_at, wait=True)
                            break
                    if stop_signal:
                        break
                examples += plan.global_batch_size
                done = step + 1
                if tracing and profile and done == profile[1]:
                    drain()
                    jax.profiler.stop_trace()
                    tracing = False
                    echo(f"profile of optimizer steps {profile[0]}:{profile[1]} in {profile_dir}")
                    tracker.restart_clock()
                if done == t.steps or (t.eval_every and done % t.eval_every == 0):
                    drain()  # evaluate these params before the next step changes them
                    result = evaluate(setup, state.params, eval_source, plan, t.eval_examples)
                    emit(eval_record(done, plan, result, tracker))
                    tracker.restart_clock()
                every = config.checkpoint.every
                if stop or done == t.steps or (every and done % every == 0):
                    drain()  # the saved loop state must include this step's losses
                    stopped_at = data_lib.Position(done, examples, 0)
                    saved = save(stopped_at, wait=bool(stop) or done == t.steps)
                    if stop and done < t.steps:  # a stop at the last step just finishes
                        stop_signal = stop[0]
                        break
        finally:
            if tracing:
                jax.profiler.stop_trace()
            bar.close()
            if checkpointer:
                checkpointer.close()  # waits for a save still being written
            if run_dir:
                run_dir.close()
    if stop_signal:
        echo(_stop_message(stop_signal, stopped_at, saved, kept_micro, checkpointer, accum_steps))
        return RunResult(plan=plan, state=state, records=records, summary={}, stopped=True)
    summary = summarize(config, plan, records, tracker, eval_source, time.perf_counter() - start)
    if checkpointer:
        summary["checkpoint_blocking_s"] = checkpointer.blocking_s
        summary["checkpoints_saved"] = checkpointer.saves
    if run_dir:
        run_dir.write_json("summary.json", summary)
    echo(format_summary(summary))
    return RunResult(plan=plan, state=state, records=records, summary=summary)


def resume_events(
    restored: Restored, config: ml_collections.ConfigDict, plan: BatchPlan
) -> list[dict]:
    """What changed at a resume, as records in the run's own history (metrics.jsonl)."""
    meta, at = restored.meta, restored.position
    events = []
    if meta["plan"] != plan.to_json():  # the move: plan and learning-rate policy
        events.append(
            {
                "event": "plan_change",
                "step": at.step,
                "micro_step": int(jax.device_get(restored.state.micro_step)),
                "examples_seen": at.examples,
                "from_plan": meta["plan"],
                "to_plan": plan.to_json(),
                "lr_scaling": plan.lr_scaling,
                "learning_rate": plan.learning_rate,
            }
        )
    if restored.redone_micro_steps:
        events.append(
            {
                "event": "partial_step_redone",
                "step": at.step,
                "micro_steps_redone": restored.redone_micro_steps,
                "examples_seen": at.examples,
            }
        )
    saved_steps = int(meta["config"]["train"]["steps"])
    if saved_steps != config.train.steps:  # --allow-longer: the schedule is re-laid
        old = ml_collections.ConfigDict(meta["config"])
        before = learning_rate_schedule(old, float(meta["plan"]["learning_rate"]))
        after = learning_rate_schedule(config, plan.learning_rate)
        events.append(
            {
                "event": "steps_change",
                "step": at.step,
                "from_steps": saved_steps,
                "to_steps": config.train.steps,
                # The rate of the next optimizer step under the old and the new schedule.
                "learning_rate_before": float(before(at.step)),
                "learning_rate_after": float(after(at.step)),
            }
        )
    return events


def _finished_run(
    config: ml_collections.ConfigDict,
    plan: BatchPlan,
    state: TrainState,
    workdir: str | os.PathLike,
    position: data_lib.Position,
    saved_events: Sequence[dict],
    tracker: StepTracker,
    eval_source: data_lib.Source,
    echo: Callable[[str], None],
) -> RunResult:
    """A rerun on a finished workdir: nothing to train. A run that finished without its
    summary (killed between the last checkpoint and the summary, or extended by
    --allow-longer and abandoned) gets one from its log, up to its checkpoint."""
    echo(f"{workdir} holds a finished run of {config.train.steps} steps; nothing to do")
    summary_file = as_path(workdir) / "summary.json"
    metrics_file = as_path(workdir) / "metrics.jsonl"
    records = []
    if metrics_file.exists() and jax.process_index() == 0:
        # What an abandoned attempt logged past the checkpoint is not part of this run.
        records = truncate_metrics(workdir, position.step, saved_events)
    if summary_file.exists():
        summary = json.loads(summary_file.read_text())
    else:
        records = [r for r in records if "event" not in r]
        summary = summarize(config, plan, records, tracker, eval_source, 0.0)
        summary["rebuilt_from"] = "metrics.jsonl"  # no timings: they were never logged whole
        if jax.process_index() == 0:
            write_text_atomic(summary_file, json.dumps(summary, indent=2) + "\n")
            echo(f"wrote the missing {summary_file} from metrics.jsonl")
    return RunResult(plan=plan, state=state, records=[], summary=summary)


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


def _finish(
    tracker: StepTracker,
    bar: tqdm.tqdm,
    emit: Callable[[dict], None],
    step: int,
    micro: int,
    metrics: dict[str, jax.Array],
    log_every: int,
    steps: int,
) -> None:
    record = tracker.micro_step_done(step, micro, metrics)
    if record is None:
        return
    bar.update(1)
    bar.set_postfix(loss=f"{record['loss']:.4f}", refresh=False)
    if record["step"] % log_every == 0 or record["step"] == steps:
        emit(record)
        tracker.close_window()

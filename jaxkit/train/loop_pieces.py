"""The loop's pieces: the state a training loop shares (`Run`) and one small object per
concern it hands work to at fixed points (`At`): log, a new program, profile, stop
requests, eval, the auto ramp, batch changes, checkpoints; and the input (`Batches`),
prefetched.

Each piece says when it is due and whether it needs a drain first (the last dispatched
micro-step's metrics taken: the devices idle, the log up to date). A new concern is one new
piece in `loop.train`'s list.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, Literal

import jax
import tqdm
from etils import epath
from jax.experimental.multihost_utils import reached_preemption_sync_point

from jaxkit.batch.noise_scale import SMALL_BATCH_ROWS, has_two_batch_sizes, samples_at
from jaxkit.batch.plan import Accumulation, BatchPlan
from jaxkit.batch.schedule import AUTO, BatchSchedule
from jaxkit.config import ConfigError, parse_profile_steps
from jaxkit.data import sources as data_lib
from jaxkit.data.prefetch import Prefetcher
from jaxkit.plan.costs import StepPrograms
from jaxkit.records.metrics import RunDir
from jaxkit.records.steps import StepTracker, eval_record, format_record
from jaxkit.sections import RunConfig
from jaxkit.step.train_step import Setup
from jaxkit.train.checkpoint import Checkpointer
from jaxkit.train.resume import Start
from jaxkit.workdir import as_path, is_local, profiler_can_write


def evaluate(
    setup: Setup, params: Any, source: data_lib.Source, plan: BatchPlan, eval_examples: int
) -> dict[str, float]:
    """Weighted mean loss and accuracy over the targets of the first `eval_examples`
    held-out rows (0 = all), each row counted once whatever the split (see
    data.eval_batches), the rows read and Σ weight, the targets scored. A mixture's
    held-out sources are each evaluated on their own first `eval_examples` rows:
    `eval_loss_by_source` holds each one's loss, `eval_loss` Σ weight × loss / Σ weight
    over all of their rows."""
    parts = getattr(source, "parts", None)
    if parts is not None:
        each = {
            name: _evaluate_sums(setup, params, part, plan, eval_examples)
            for name, part in zip(source.names, parts, strict=True)  # type: ignore[attr-defined]
        }
        total = {key: sum(sums[key] for sums in each.values()) for key in each[source.names[0]]}  # type: ignore[attr-defined]
        rows = sum(data_lib.eval_row_count(part, eval_examples) for part in parts)
        return _eval_result(total, rows) | {
            "eval_loss_by_source": {
                name: sums["loss_sum"] / sums["weight"] for name, sums in each.items()
            }
        }
    sums = _evaluate_sums(setup, params, source, plan, eval_examples)
    return _eval_result(sums, data_lib.eval_row_count(source, eval_examples))


def _evaluate_sums(
    setup: Setup, params: Any, source: data_lib.Source, plan: BatchPlan, eval_examples: int
) -> dict[str, float]:
    """Σ weight × loss, Σ weight × accuracy and Σ weight over one source's eval rows."""
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
    if sums["weight"] <= 0:
        raise data_lib.DataError("the held-out rows have no scored target (every weight is 0)")
    return sums


def _eval_result(sums: dict[str, float], rows: int) -> dict:
    weight = sums["weight"]
    return {
        "eval_loss": sums["loss_sum"] / weight,
        "eval_accuracy": sums["accuracy_sum"] / weight,
        "eval_examples": rows,
        # A count where each target weighs 1 (the sources' weights are 0 or 1).
        "eval_targets": int(weight) if weight.is_integer() else weight,
    }


# Where the loop hands work to its pieces: before an optimizer step ("start", its plan in
# `run.step_plan`), after each micro-step is dispatched ("micro", `run.micro`), when a step's
# record is fetched, a micro-step later ("record", `run.record`), and after an optimizer
# step ("end", `run.step` counting it).
At = Literal["start", "micro", "record", "end"]


class Piece:
    """One concern of the loop. At each point (`At`) the loop asks each piece in turn whether
    it is `due`; if so, it first drains where the piece `drains` (takes the last dispatched
    micro-step's metrics: the devices are then idle and the log is up to date), then calls
    it. A new concern is a new piece in `train`'s list."""

    drains = True  # False for pieces due at "record": a drain is what calls them

    def due(self, run: Run, at: At) -> bool:
        raise NotImplementedError

    def __call__(self, run: Run, at: At) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """On the way out of the loop, however it ends."""


@dataclasses.dataclass(eq=False)
class Run:
    """What the loop and its pieces share: the state in training, where it is, the outputs."""

    config: RunConfig
    start: Start  # where this attempt started
    programs: StepPrograms
    tracker: StepTracker
    batches: Batches
    echo: Callable[[str], None]
    progress: bool
    run_dir: RunDir | None
    events: list[dict]  # what changed at this resume, then each batch change
    pieces: list[Piece]

    def __post_init__(self) -> None:
        s = self.start
        self.state, self.setup, self.schedule, self.ramp = s.state, s.setup, s.schedule, s.ramp
        self.step, self.examples = s.position.step, s.position.examples  # done, consumed
        self.step_plan, self.micro, self.total = s.plan, 0, s.schedule.total_steps
        self.micro_steps = int(jax.device_get(self.state.micro_step))  # in all, across resumes
        self.records: list[dict] = []
        self.record: dict = {}
        self.pending: tuple | None = None  # (step, micro, metrics, step info) not yet fetched
        self.stop_requests: list[str] = []
        self.stop_signal: str | None = None  # what stopped the run, once it stops
        self.started = time.perf_counter()
        self.bar = tqdm.tqdm(
            total=self.total,
            initial=self.step,
            unit="step",
            disable=not self.progress,
            file=sys.stderr,
            dynamic_ncols=True,
        )

    def hand_over(self, at: At) -> None:
        """Calls each piece due at `at`, after a drain where it needs one."""
        for piece in self.pieces:
            if piece.due(self, at):
                if piece.drains:
                    self.drain()
                piece(self, at)

    def take(self, fetched: tuple) -> None:
        """Takes a dispatched micro-step's metrics (waiting for them); its step's record,
        once complete, goes to the pieces due at "record"."""
        step, micro, metrics, info = fetched
        record = self.tracker.micro_step_done(step, micro, metrics, info)
        if record is None:
            return
        self.bar.update(1)
        if record["loss"] is not None:  # None: the step scored no target
            self.bar.set_postfix(loss=f"{record['loss']:.4f}", refresh=False)
        self.record = record
        self.hand_over("record")

    def drain(self) -> None:
        """Waits for the last dispatched micro-step and takes its metrics."""
        if self.pending is not None:
            self.take(self.pending)
            self.pending = None

    def emit(self, record: dict) -> None:
        """A train or eval record: to the result, metrics.jsonl and the console."""
        self.records.append(record)
        if self.run_dir:
            self.run_dir.log(record)
        (self.bar.write if self.progress else self.echo)(format_record(record))

    def close(self) -> None:
        self.batches.close()
        for piece in self.pieces:
            piece.close()
        self.bar.close()
        if self.run_dir:
            self.run_dir.close()


class Batches:
    """The prefetch piece: each micro-step's batch (fused: each optimizer step's), loaded
    `train.prefetch` batches ahead by a background thread; and the noise scale's small batch.
    """

    def __init__(self, config: RunConfig, setup: Setup, source: data_lib.Source) -> None:
        self.source, self.seed, self.setup = source, config.train.seed, setup
        self.normalisation = config.train.loss_normalisation
        self.fused = setup.accumulation is Accumulation.FUSED
        self.noise_scale_every = config.train.noise_scale_every
        self.prefetcher = Prefetcher(self.load, depth=config.train.prefetch)

    def load(self, key: tuple[int, int], plan: BatchPlan) -> dict[str, jax.Array]:
        """The batch of micro-step `micro` (fused: the whole step) of the optimizer step
        that starts reading at stream example `first`."""
        first, micro = key
        if self.fused:
            sharding = self.setup.fused_batch_sharding
            return data_lib.load_global_batch(
                self.source, first, plan, self.seed, sharding, self.normalisation
            )
        sharding = self.setup.batch_sharding
        return data_lib.load_micro_batch(
            self.source, first, micro, plan, self.seed, sharding, self.normalisation
        )

    def get(self, run: Run) -> dict[str, jax.Array]:
        """Micro-step `run.micro`'s batch; the ones after it start loading."""
        ahead = self.upcoming(run, run.step, run.examples, run.micro, run.step_plan)
        return self.prefetcher.get((run.examples, run.micro), run.step_plan, ahead)

    def upcoming(
        self, run: Run, step: int, first: int, micro: int, plan: BatchPlan
    ) -> Iterator[tuple[tuple[int, int], BatchPlan]]:
        """The batches after this one, under the batch schedule as it stands."""
        while True:
            micro += 1
            if self.fused or micro == plan.grad_accum_steps:
                step, first = step + 1, first + plan.global_batch_size
                if step >= run.total:
                    return
                plan = run.schedule.plan_at(first)
                micro = plan.grad_accum_steps - 1 if self.fused else 0
            yield (first, micro), plan

    def scored(self, first: int, plan: BatchPlan) -> float:
        """What the step starting at `first` scores: a global batch of prompts only has no
        loss."""
        return data_lib.step_weight(self.source, first, plan.global_batch_size, self.seed)

    def small_batch_grad_sq(self, run: Run) -> jax.Array | None:
        """The noise scale's small-batch |gradient|² at the params the step in progress began
        from (unchanged until its last call), dispatched before that call; None, and nothing
        dispatched, where the step does not sample (noise_scale.samples_at)."""
        setup, plan = run.setup, run.step_plan
        if not has_two_batch_sizes(plan.global_batch_size):
            return None
        if not samples_at(run.step + 1, self.noise_scale_every):  # run.step: steps done
            return None
        rows = data_lib.load_small_batch(
            self.source, run.examples, SMALL_BATCH_ROWS, self.seed, setup.small_batch_sharding
        )
        return None if rows is None else setup.small_batch_grad_sq(run.state.params, rows)

    def summary(self) -> dict:
        # The input pipeline's time on the critical path, and the part of it after the first
        # batch (which nothing loads ahead): 0 when loading keeps ahead of the devices.
        waited = self.prefetcher.waited_s
        return {
            "input_wait_s": waited,
            "input_wait_after_first_s": waited - self.prefetcher.first_wait_s,
        }

    def close(self) -> None:
        self.prefetcher.close()


class Log(Piece):
    """A step's record to metrics.jsonl and the console every `train.log_every` steps and
    at the last; the step times its timings read start again after it."""

    drains = False  # a drain is what hands it the record

    def __init__(self, every: int) -> None:
        self.every = every

    def due(self, run: Run, at: At) -> bool:
        return at == "record" and (
            run.record["step"] % self.every == 0 or run.record["step"] == run.total
        )

    def __call__(self, run: Run, at: At) -> None:
        run.emit(run.record)
        run.tracker.close_window()


class NewProgram(Piece):
    """Fused accumulation compiles a program per K: a batch change to a new K compiles it
    before its first step, with the devices idle, and the compile is no step's time."""

    def due(self, run: Run, at: At) -> bool:
        return at == "start" and not run.programs.has(run.step_plan)

    def __call__(self, run: Run, at: At) -> None:
        run.programs.get(run.step_plan)
        run.tracker.restart_clock()


def profiling(config: RunConfig, workdir: str | os.PathLike | None) -> list[Piece]:
    """`train.profile_steps`' piece, if it asks for one: refused, before any work, without a
    workdir the profiler can write to."""
    steps = parse_profile_steps(config.train.profile_steps, config.train.steps)
    if not steps:
        return []
    if workdir is None or not profiler_can_write(workdir):
        raise ConfigError(
            "train.profile_steps writes to WORKDIR/profile/: give a workdir (a local path or gs://)"
        )
    return [Profile(*steps, as_path(workdir) / "profile")]


class Profile(Piece):
    """A trace of optimizer steps `first`..`last`-1 in WORKDIR/profile/; it starts and ends
    with the devices idle, at a step boundary."""

    def __init__(self, first: int, last: int, directory: epath.Path) -> None:
        self.first, self.last, self.directory, self.tracing = first, last, directory, False

    def due(self, run: Run, at: At) -> bool:
        if at == "start":
            return run.step == self.first
        return at == "end" and self.tracing and run.step == self.last

    def __call__(self, run: Run, at: At) -> None:
        if at == "start":
            # JAX converts to Perfetto with pathlib, local paths only (jax#19263).
            perfetto = is_local(self.directory)
            jax.profiler.start_trace(str(self.directory), create_perfetto_trace=perfetto)
            self.tracing = True
            return
        jax.profiler.stop_trace()
        self.tracing = False
        run.echo(f"profile of optimizer steps {self.first}:{self.last} in {self.directory}")
        run.tracker.restart_clock()

    def close(self) -> None:
        if self.tracing:
            jax.profiler.stop_trace()


class StopRequests(Piece):
    """SIGTERM or SIGINT (loop.stop_requests), a preemption notice every process reached,
    or `stop_after_micro_steps`: the run saves and returns (Checkpoints saves; in the middle
    of an optimizer step, right there)."""

    drains = False  # it only notes the request

    def __init__(self, stop_after_micro_steps: int | None) -> None:
        self.after = stop_after_micro_steps
        # With several processes, JAX's preemption service takes SIGTERM and agrees on the
        # micro-step at which every process stops, so all save the same checkpoint.
        self.multi_process = jax.process_count() > 1

    def due(self, run: Run, at: At) -> bool:
        return at == "micro" and not run.stop_requests

    def __call__(self, run: Run, at: At) -> None:
        if self.after is not None and run.micro_steps >= self.after:
            run.stop_requests.append("stop_after_micro_steps")
        # A preemption notice reached every process: all stop here.
        elif self.multi_process and reached_preemption_sync_point(run.micro_steps):
            run.stop_requests.append("SIGTERM")


class Evaluation(Piece):
    """Held-out loss and accuracy every `train.eval_every` optimizer steps and after the
    last, of the params before the next step changes them."""

    def __init__(self, every: int, examples: int, source: data_lib.Source) -> None:
        self.every, self.examples, self.source = every, examples, source

    def due(self, run: Run, at: At) -> bool:
        periodic = bool(self.every) and run.step % self.every == 0
        return at == "end" and (run.step == run.total or periodic)

    def __call__(self, run: Run, at: At) -> None:
        result = evaluate(run.setup, run.state.params, self.source, run.step_plan, self.examples)
        run.emit(eval_record(run.step, run.step_plan, result, run.tracker))
        run.tracker.restart_clock()


class AutoRampDecision(Piece):
    """`batch.schedule=auto`: at each step that samples the noise scale but the last, the
    ramp decides on the estimate with this sample in (hence the drain) whether the batch
    grows from here."""

    def __init__(self, noise_scale_every: int) -> None:
        self.every = noise_scale_every  # > 0: batch_schedule refuses auto without samples

    def due(self, run: Run, at: At) -> bool:
        auto = run.schedule.kind == AUTO
        return at == "end" and auto and run.step < run.total and samples_at(run.step, self.every)

    def __call__(self, run: Run, at: At) -> None:
        noise = run.tracker.noise_scale.estimate().get("noise_scale")
        run.schedule = run.ramp.decide(run.schedule, noise, run.step, run.examples)
        run.setup = dataclasses.replace(run.setup, schedule=run.schedule)
        run.total = run.schedule.total_steps
        run.bar.total = run.total


class BatchChange(Piece):
    """A new stage of the batch schedule starts after this step: an event in the log,
    after this step's record (hence the drain), and a line on the console."""

    def due(self, run: Run, at: At) -> bool:
        if at != "end" or run.step >= run.total:
            return False
        next_plan = run.schedule.plan_at(run.examples)
        return next_plan.global_batch_size != run.step_plan.global_batch_size

    def __call__(self, run: Run, at: At) -> None:
        next_plan, noise = run.schedule.plan_at(run.examples), run.ramp.last_noise_scale
        event = batch_change_event(
            run.step, run.examples, run.step_plan, next_plan, run.schedule, noise
        )
        run.events.append(event)
        if run.run_dir:
            run.run_dir.log(event)
        run.echo(format_batch_change(event))


class Checkpoints(Piece):
    """Saves every `checkpoint.every` optimizer steps, after the last, and on a stop request
    (then the run returns), also between two micro-steps of a step. The saved loop state
    includes the last micro-step's losses (hence the drain). Without a workdir, nothing is
    saved, but the loop still stops where a save would be."""

    def __init__(
        self,
        checkpointer: Checkpointer | None,
        config: RunConfig,
        saved_as: dict,
        data: dict,
        hf_source: dict | None = None,
    ) -> None:
        """`saved_as`: the config as each checkpoint's record keeps it (config.json's)."""
        self.checkpointer, self.every = checkpointer, config.checkpoint.every
        self.config, self.data = saved_as, data
        # A run from model.init_from: its source's config.json and dtypes, for an export.
        self.hf_source = {"hf_source": hf_source} if hf_source is not None else {}
        self.at, self.saved = data_lib.Position(), False  # the last save asked for, done?
        self.kept_micro = 0  # micro-steps in a checkpoint of the same step found on disk

    def due(self, run: Run, at: At) -> bool:
        if at == "micro":  # a stop in the middle of a step: save right here
            return bool(run.stop_requests) and run.micro < run.step_plan.grad_accum_steps - 1
        periodic = bool(self.every) and run.step % self.every == 0
        return at == "end" and (bool(run.stop_requests) or run.step == run.total or periodic)

    def __call__(self, run: Run, at: At) -> None:
        stop = run.stop_requests
        if at == "micro":
            here = data_lib.Position(run.step, run.examples, run.micro + 1)
            self.save(run, here, run.step_plan, wait=True)
            run.stop_signal = stop[0]
            return
        next_plan = run.schedule.plan_at(run.examples)
        at_end = data_lib.Position(run.step, run.examples, 0)
        self.save(run, at_end, next_plan, wait=bool(stop) or run.step == run.total)
        if stop and run.step < run.total:  # a stop at the last step just finishes
            run.stop_signal = stop[0]

    def save(self, run: Run, at: data_lib.Position, plan: BatchPlan, *, wait: bool) -> None:
        """Saves the state at `at`, whose next micro-step runs under `plan`."""
        self.at, self.saved = at, False
        if self.checkpointer is None:
            return
        loop_state = run.tracker.loop_state(at)
        loop_state["events"] = [e for e in run.events if e["step"] == at.step]
        loop_state["batch_schedule"] = run.schedule.state(at.step, at.examples) | run.ramp.state()
        meta = {"config": self.config, "plan": plan.to_json(), "data": self.data}
        meta |= self.hf_source
        self.saved = self.checkpointer.save(at, run.state, dict(meta, loop=loop_state), wait=wait)
        if not self.saved:
            self.kept_micro = int(self.checkpointer.read_meta(at.step)["loop"].get("micro", 0))

    def summary(self) -> dict:
        if self.checkpointer is None:
            return {}
        return {
            "checkpoint_blocking_s": self.checkpointer.blocking_s,
            "checkpoints_saved": self.checkpointer.saves,
        }

    def stop_message(self, signal_name: str, accum_steps: int) -> str:
        if self.checkpointer is None:
            return f"stopped by {signal_name}; no workdir, nothing saved"
        at = self.at
        where = f"optimizer step {at.step}"
        if at.micro:
            where += f" + {at.micro} of {accum_steps} micro-steps"
        if self.saved:
            return (
                f"stopped by {signal_name}: saved checkpoint step_{at.step} at {where}; "
                "run the same command to resume"
            )
        return (
            f"stopped by {signal_name}: checkpoint step_{at.step} was already saved and is "
            f"kept; stopped at {where} (resuming redoes the {at.micro - self.kept_micro} "
            "micro-steps since, exactly); run the same command to resume"
        )

    def close(self) -> None:
        if self.checkpointer:
            self.checkpointer.close()  # waits for a save still being written


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

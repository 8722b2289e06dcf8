"""What a resumed run reads from its checkpoint's record, beside the arrays checkpoint.py
restores: the batch schedule as the run lived it, what changed at this resume (the events
its log keeps), and a rerun on a run that has already finished.

A checkpoint's loop state records the stages the run trained in and the auto ramp's
decisions; checkpoints from before batch schedules recorded one fixed batch, read here as a
one-stage history.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from typing import Any

import jax

from jaxkit.batch.plan import BatchPlan, BatchPlanError
from jaxkit.batch.schedule import AutoRamp, BatchSchedule, schedule_from_config
from jaxkit.config import ADDED_DEFAULTS, saved_run_config
from jaxkit.data import sources as data_lib
from jaxkit.hf import load as hf_load
from jaxkit.models import contract
from jaxkit.models.llama import llama_model
from jaxkit.records.metrics import truncate_metrics
from jaxkit.records.steps import StepTracker, summarize
from jaxkit.sections import RunConfig
from jaxkit.step.train_step import Setup, TrainState
from jaxkit.train.checkpoint import Restored, position_of
from jaxkit.workdir import as_path, write_text_atomic


@dataclasses.dataclass
class Start:
    """Where an attempt starts training, fresh or from a checkpoint."""

    state: TrainState
    position: data_lib.Position
    schedule: BatchSchedule  # as laid from here on, after the history a checkpoint recorded
    setup: Setup  # with that schedule
    ramp: AutoRamp  # an auto ramp's windows and decisions so far
    plan: BatchPlan  # in force at `position`
    # A run from model.init_from: what an export needs of its source (hf/load.py's
    # source_record), recorded at the fresh start and carried by every checkpoint.
    hf_source: dict | None = None


def starting_point(
    config: RunConfig,
    shape: dict[str, int],
    setup: Setup,
    plan: BatchPlan,
    restored: Restored | None,
    tracker: StepTracker,
    echo: Callable[[str], None],
) -> Start:
    """A fresh state at the schedule's first `plan`, or the checkpoint's: its schedule, auto
    ramp and tracker's loop state as recorded (the tracker is loaded here)."""
    schedule, position, ramp = setup.schedule, data_lib.Position(), AutoRamp()
    hf_source = None
    if restored is not None:
        state, position = restored.state, restored.position
        schedule = saved_schedule(config, shape, restored.meta)
        setup = dataclasses.replace(setup, schedule=schedule)
        ramp = AutoRamp.load(restored.meta["loop"].get("batch_schedule"))
        tracker.load_loop_state(restored.meta["loop"], partial_step=position.micro > 0)
        hf_source = restored.meta.get("hf_source")
        if hf_load.source_dir(config) is not None:
            echo(
                f"model.init_from={llama_model(config).init_from} is not read: the checkpoint at "
                f"step {position.step} holds the params and the model's shape"
            )
    elif (directory := hf_load.source_dir(config)) is not None:
        state = initial_state(config, setup)
        hf_source = hf_load.source_record(directory, llama_model(config))
        echo(f"params from {llama_model(config).init_from}; the optimizer state starts fresh")
    else:
        state = setup.init(jax.random.key(config.train.seed))
    if schedule.plan_at(position.examples) != plan:
        # The plan in force where this run starts: a resume in a later stage.
        plan = schedule.plan_at(position.examples)
        echo(f"resuming in a later stage of the batch schedule; its plan:\n{plan.table()}")
    if schedule.kind != "fixed":  # as laid from where this run starts
        echo(f"batch schedule ({schedule.kind}):")
        echo(schedule.table())
    return Start(state, position, schedule, setup, ramp, plan, hf_source)


def saved_schedule(config: RunConfig, shape: dict[str, int], meta: dict) -> BatchSchedule:
    """This config's schedule from a checkpoint's position on, after the stages the run
    trained in before it (and an auto ramp's decisions) as the checkpoint recorded them."""
    at = position_of(meta)
    saved = meta["loop"].get("batch_schedule") or _legacy_history(meta, config)
    return schedule_from_config(config, shape, saved, (at.step, at.examples))


def saved_plan(config: RunConfig, shape: dict[str, int], meta: dict) -> BatchPlan:
    """This config's plan at a checkpoint's position (a batch schedule's stage there)."""
    return saved_schedule(config, shape, meta).plan_at(position_of(meta).examples)


def _legacy_history(meta: dict, config: RunConfig) -> dict:
    """The batch history of a checkpoint saved before batch schedules: one fixed batch."""
    plan, at = meta["plan"], position_of(meta)
    first = {
        "examples": 0,
        "asked_examples": 0,
        "global_batch_size": plan["global_batch_size"],
        "grad_accum_steps": plan["grad_accum_steps"],
        "learning_rate": plan["learning_rate"],
        "first_step": 0,
        "steps": at.step,
    }
    warmup = max(int(config.optimizer.warmup_steps), 0) * plan["global_batch_size"]
    return {"realized": [first] if at.step else [], "warmup_examples": warmup}


def resume_events(
    restored: Restored,
    config: RunConfig,
    schedule: BatchSchedule,
    shape: dict[str, int],
) -> list[dict]:
    """What changed at a resume, as records in the run's own history (metrics.jsonl)."""
    meta, at = restored.meta, restored.position
    plan = schedule.plan_at(at.examples)
    saved = meta["loop"].get("batch_schedule") or _legacy_history(meta, config)
    try:  # the saved config's schedule from here on: what the run would have done
        old = saved_run_config(meta["config"])
        before = schedule_from_config(
            old, meta["plan"]["mesh_shape"], saved, (at.step, at.examples)
        )
    except BatchPlanError:  # a mesh of the saved config no longer describable: no comparison
        before = None
    # The rate of the next optimizer step under the saved config and under this one.
    rates = {"learning_rate": schedule.learning_rate(at.examples, plan)}
    if before is not None:
        rates = {
            "learning_rate_before": before.learning_rate(at.examples, before.plan_at(at.examples)),
            "learning_rate_after": rates["learning_rate"],
        }
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
                "learning_rate": plan.learning_rate,  # the peak, scaled for this batch
                **rates,
            }
        )
    if restored.redone_micro_steps:
        events.append(
            {
                "event": "partial_step_redone",
                "step": at.step,
                # The counter goes back to the step's start: it counts the micro-steps
                # the run kept, so the redone ones are counted once.
                "micro_step": int(jax.device_get(restored.state.micro_step)),
                "micro_steps_redone": restored.redone_micro_steps,
                "examples_seen": at.examples,
            }
        )
    saved_t, t = meta["config"]["train"], config.train
    key = "steps" if t.steps is not None else "examples"
    wanted = t.steps if key == "steps" else t.examples
    if saved_t.get(key) != wanted:  # --allow-longer: the schedule is re-laid
        events.append(
            {
                "event": "steps_change",
                "step": at.step,
                "examples_seen": at.examples,
                f"from_{key}": saved_t.get(key),
                f"to_{key}": wanted,
                **rates,
            }
        )
    elif before is not None and _course(before) != _course(schedule):
        # batch.* changed what is still to come (the stages, the run's examples): the
        # learning-rate curve is re-laid over the examples the run will now train.
        events.append(
            {
                "event": "batch_schedule_change",
                "step": at.step,
                "examples_seen": at.examples,
                "from_schedule": before.to_json(),
                "to_schedule": schedule.to_json(),
                **rates,
            }
        )
    return events + _option_events(meta, config, at)


# LM options a resume may change whose change moves what is measured from there on:
# remat (the same model, other recomputation: hardware FLOPs, HFU and memory move) and the
# attention kernel (the same attention to round-off; memory, speed and the hardware FLOPs
# counted move: a Pallas kernel's are not counted).
_LOGGED_OPTIONS = ("remat", "attention")


def _option_events(meta: dict, config: RunConfig, at: data_lib.Position) -> list[dict]:
    """A `{option}_change` record for each logged LM option the resume changes; a run saved
    before an option's key ran as its declared `added` value."""
    if not contract(config).READS_LM_OPTIONS:
        return []
    saved_model = meta["config"].get("model", {})
    events = []
    for option in _LOGGED_OPTIONS:
        saved = saved_model.get(option, ADDED_DEFAULTS[f"model.{option}"])
        now = getattr(config.model, option)  # an LM option every model section holds
        if saved != now:
            events.append(
                {
                    "event": f"{option}_change",
                    "step": at.step,
                    "examples_seen": at.examples,
                    f"from_{option}": saved,
                    f"to_{option}": now,
                }
            )
    return events


def _course(schedule: BatchSchedule) -> tuple:
    """What a schedule trains from its origin on, whatever the mesh: each stage's start,
    batch, steps and peak rate, and the examples the learning rate's decay spans."""
    stages = tuple(
        (s.first_example, s.plan.global_batch_size, s.steps, s.plan.learning_rate)
        for s in schedule.stages  # from the resume on: both share the history before it
    )
    return stages, schedule.total_examples


def finished_summary(
    config: RunConfig,
    start: Start,
    workdir: str | os.PathLike,
    meta: dict,
    tracker: StepTracker,
    eval_source: data_lib.Source,
    echo: Callable[[str], None],
) -> dict:
    """The summary of a finished run, for a rerun on its workdir: nothing to train. A run
    that finished without its summary (killed between the last checkpoint and the summary,
    or extended by --allow-longer and abandoned) gets one from its log, up to its
    checkpoint (`meta`, as saved), on the plan it ended on: a rerun on other devices
    describes the run, not itself."""
    saved_events = meta["loop"].get("events", [])
    schedule, position = start.schedule, start.position
    echo(f"{workdir} holds a finished run of {position.step} steps; nothing to do")
    plan = schedule.plan_at(position.examples)
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
        ended = _ended_plan(plan, meta["plan"])
        summary = summarize(
            config,
            ended,
            records,
            tracker,
            eval_source,
            0.0,
            position.step,
            _trained_schedule(schedule, position.step),
        )
        if ended.mesh_shape != plan.mesh_shape:
            # This process's peak is another device count's.
            summary |= {"peak_flops_per_s": None, "peak_source": None}
        summary["rebuilt_from"] = "metrics.jsonl"  # no timings: they were never logged whole
        # Unknown, not 0: the run's first step and wall time were never logged, and a rerun
        # of a finished run compiles no step (the run's compile and memory are not known).
        summary |= {"first_step_s": None, "wall_time_s": None}
        for key in ("compile_s", "trace_s", "compile_cache_hit", "memory_bytes"):
            summary[key] = None
        if jax.process_index() == 0:
            write_text_atomic(summary_file, json.dumps(summary, indent=2) + "\n")
            echo(f"wrote the missing {summary_file} from metrics.jsonl")
    return summary


def _ended_plan(plan: BatchPlan, saved: dict) -> BatchPlan:
    """The plan a finished run ended on, as its checkpoint recorded it (`saved`, a
    BatchPlan's JSON), where `plan` is this rerun's for the same position."""
    fields = ("data_parallel_size", "per_device_batch_size", "grad_accum_steps")
    return dataclasses.replace(
        plan,
        mesh_shape=dict(saved.get("mesh_shape", plan.mesh_shape)),
        **{name: saved.get(name, getattr(plan, name)) for name in fields},
    )


def _trained_schedule(schedule: BatchSchedule, steps: int) -> dict | None:
    """The batch schedule's JSON over the steps a finished run trained: a schedule laid
    again at its end holds a stage of no steps there (this rerun's split), which is not the
    run's; a fixed batch that never changed has none (as the summary of a run on one plan)."""
    laid = schedule.to_json()
    stages = [s for s in laid["stages"] if s["steps"] > 0 or s["first_step"] < steps]
    if schedule.kind == "fixed" and len(stages) <= 1:
        return None
    return laid | {"stages": stages}


def initial_state(config: RunConfig, setup: Setup) -> TrainState:
    """The train state of a fresh run from model.init_from's weights: params cast to
    model.param_dtype (bfloat16 to float32 is exact), a fresh optimizer state, micro-step 0,
    each placed as setup.state_shardings says."""
    import jax
    import jax.numpy as jnp

    from jaxkit.step.optimizer import float32
    from jaxkit.step.train_step import TrainState, abstract_state

    directory = hf_load.source_dir(config)
    assert directory is not None
    hf_load.check_architecture(config, directory)
    target = abstract_state(setup)
    model = llama_model(config)  # model.init_from is a Llama's key
    params = hf_load.load_params(directory, model, target.params, setup.state_shardings.params)
    hf_load.check_finite(directory, model, params)
    init_opt: Callable[[Any], Any] = jax.jit(
        lambda p: setup.tx.init(float32(p)), out_shardings=setup.state_shardings.opt_state
    )
    micro_step: jax.Array = jax.device_put(
        jnp.zeros((), jnp.int32), setup.state_shardings.micro_step
    )
    return TrainState(params=params, opt_state=init_opt(params), micro_step=micro_step)

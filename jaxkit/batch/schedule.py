"""A global batch that may grow during training: stages of the batch plan, by examples.

    batch.schedule = ""                      one stage: the plan of batch.* for the whole run
    batch.schedule = "0:64,200000:128"       stage i starts at example E_i with global batch G_i
    batch.schedule = "0:64,25Mt:128"         ... or at token T_i (a `t` suffix; E = ⌈T / seq_len⌉)
    batch.schedule = "auto"                  K doubles when the sampled noise scale says so

Every stage keeps the micro-batch (data_parallel × per_device rows) and changes only K, so
memory stays flat and the MultiSteps step, which takes K as an argument, compiles once.
An optimizer step belongs to the stage in force at the example it starts reading from: a
stage starts at the first step boundary at or after its E_i (shown when they differ).

The learning rate follows the stages: its peak is scaled by optimizer.lr_scaling for each
stage's global batch, and warmup and cosine decay are laid over examples, not optimizer
steps (steps change size). For a fixed batch that is the same curve as one laid over steps.
"""

from __future__ import annotations

import dataclasses
import decimal
import math
import re

from jaxkit.batch.noise_scale import SMALL_BATCH_ROWS, has_two_batch_sizes
from jaxkit.batch.plan import BatchPlan, BatchPlanError, format_table, make_batch_plan
from jaxkit.sections import RunConfig

AUTO = "auto"
_STAGE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kMG]?)\s*(t?)\s*:\s*([0-9]+)\s*")
_SCALE = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9}


@dataclasses.dataclass(frozen=True)
class Position:
    """Where a run stands: what a checkpoint restores and the next step reads from."""

    step: int = 0  # optimizer steps done
    examples: int = 0  # examples those steps consumed: where the next step starts reading
    micro: int = 0  # micro-steps of the next optimizer step already done (mid-step saves)


def parse_stages(text: str, seq_len: int | None) -> list[tuple[int, int]]:
    """`"E:G,..."` → [(first example, global batch), ...]; `t` marks a token count."""
    stages: list[tuple[int, int]] = []
    for item in text.split(","):
        found = _STAGE.fullmatch(item)
        if not found:
            raise BatchPlanError(
                f"batch.schedule stage {item.strip()!r} is not EXAMPLES:GLOBAL_BATCH (e.g. "
                "0:64,200000:128; k, M or G scale the count, a t suffix makes it tokens: "
                "25Mt:128); or write batch.schedule=auto"
            )
        number, scale, tokens, batch = found.groups()
        count = decimal.Decimal(number) * _SCALE[scale]  # exact: 1.001k is 1001
        if count != int(count):
            raise BatchPlanError(f"batch.schedule stage {item.strip()!r}: not a whole count")
        start = int(count)
        if tokens:
            if seq_len is None:
                raise BatchPlanError(
                    f"batch.schedule stage {item.strip()!r} counts tokens, but this data has "
                    "no data.seq_len: count examples (no t suffix)"
                )
            start = -(-start // seq_len)  # the first example that starts at or past it
        if int(batch) <= 0:
            raise BatchPlanError(f"batch.schedule stage {item.strip()!r}: the batch must be > 0")
        if stages and start <= stages[-1][0]:
            raise BatchPlanError(
                f"batch.schedule: stage {item.strip()!r} starts at example {start:,}, not after "
                f"the stage before it ({stages[-1][0]:,}): list stages in increasing order"
            )
        stages.append((start, int(batch)))
    if stages[0][0] != 0:
        raise BatchPlanError(
            f"batch.schedule must start at example 0 (its first stage starts at "
            f"{stages[0][0]:,}): write 0:GLOBAL_BATCH first"
        )
    return stages


@dataclasses.dataclass(frozen=True)
class Stage:
    asked_examples: int  # where the schedule says the stage starts
    plan: BatchPlan
    first_step: int = 0  # optimizer steps before it, in this run (from the walk below)
    first_example: int = 0  # where its first optimizer step starts reading
    steps: int = 0  # optimizer steps in it; 0: not reached within the run's length

    def to_json(self) -> dict:
        return {
            "examples": self.first_example,
            "asked_examples": self.asked_examples,
            "global_batch_size": self.plan.global_batch_size,
            "grad_accum_steps": self.plan.grad_accum_steps,
            "learning_rate": self.plan.learning_rate,
            "first_step": self.first_step,
            "steps": self.steps,
        }


@dataclasses.dataclass(frozen=True)
class BatchSchedule:
    """The plan of every optimizer step, and its learning rate, as functions of examples.

    A resumed run lays the config's stages from where it resumes (the origin): what ran
    before is `history`, as its checkpoints recorded it, so a schedule changed at a resume
    changes only what is still to come, and the run's length and learning-rate curve count
    the examples actually trained.
    """

    kind: str  # fixed | scheduled | auto
    stages: tuple[Stage, ...]  # from the origin on; stages[0] is in force there
    history: tuple[dict, ...]  # stages run before the origin (Stage.to_json, as saved)
    decided: tuple[tuple[int, int, int], ...]  # auto: (first step, first example, global)
    length: tuple[int | None, int | None]  # (train.steps, train.examples): one is None
    total_steps: int  # auto: if the batch does not double again
    total_examples: int  # where the learning rate's decay ends
    warmup_examples: int
    initial_lr_fraction: float  # the first step's rate, as a fraction of the peak
    final_lr_fraction: float
    max_global_batch_size: int | None = None  # auto
    patience: int = 0  # auto: noise-scale samples in a row with B_simple above the batch
    origin: tuple[int, int] = (0, 0)  # (optimizer steps, examples) where it was laid

    @property
    def first(self) -> BatchPlan:
        """The plan in force at the origin (a fresh run's first stage)."""
        return self.stages[0].plan

    @property
    def largest(self) -> BatchPlan:
        if self.kind == AUTO and self.max_global_batch_size is not None:
            return _stage_plan(self.first, self.max_global_batch_size)
        return max((s.plan for s in self.stages), key=lambda p: p.global_batch_size)

    @property
    def changes_batch(self) -> bool:
        """Whether the run trains at more than one global batch (a schedule, or a batch
        changed at a resume)."""
        return self.kind != "fixed" or len(self.to_json()["stages"]) > 1

    def stage_at(self, examples: int) -> Stage:
        """The stage of the optimizer step that starts reading at stream example `examples`
        (at or after the origin)."""
        here = self.stages[0]
        for stage in self.stages[1:]:
            if stage.asked_examples <= examples:
                here = stage
        return here

    def plan_at(self, examples: int) -> BatchPlan:
        return self.stage_at(examples).plan

    def learning_rate(self, examples: int, plan: BatchPlan) -> float:
        """The rate of the optimizer step starting at `examples` under `plan`: the plan's
        scaled peak × linear warmup then cosine decay, both over examples (float64)."""
        w, d = self.warmup_examples, self.total_examples
        if examples < w:
            start = self.initial_lr_fraction
            return plan.learning_rate * (start + (1 - start) * examples / w)
        end = self.final_lr_fraction
        progress = min(examples - w, d - w) / (d - w)
        return plan.learning_rate * (end + (1 - end) * 0.5 * (1 + math.cos(math.pi * progress)))

    def with_stage(
        self, first_example: int, first_step: int, global_batch_size: int
    ) -> BatchSchedule:
        """An auto ramp's decision: a new stage from the step starting at `first_example`."""
        stage = Stage(first_example, _stage_plan(self.first, global_batch_size))
        decided = (*self.decided, (first_step, first_example, global_batch_size))
        return _laid(self, [*self.stages, stage], decided=decided)

    def realized(self, step: int, examples: int) -> list[dict]:
        """The stages a run stopped at (`step`, `examples`) has trained in, with their steps."""
        ran = [
            s.to_json() | {"steps": min(s.steps, step - s.first_step)}
            for s in self.stages
            if s.first_example < examples
        ]
        return _merged([*self.history, *ran])

    def state(self, step: int, examples: int) -> dict:
        """What a checkpoint at (`step`, `examples`) keeps, for schedule_from_config."""
        return {
            "realized": self.realized(step, examples),
            "decided": [list(d) for d in self.decided],
            "warmup_examples": self.warmup_examples,
        }

    def to_json(self) -> dict:
        return {
            "kind": self.kind,
            "total_steps": self.total_steps,
            "total_examples": self.total_examples,
            "warmup_examples": self.warmup_examples,
            "max_global_batch_size": self.max_global_batch_size,
            "stages": _merged([*self.history, *(s.to_json() for s in self.stages)]),
        }

    def table(self) -> str:
        """One row per stage: where it starts, its batch, K, peak rate and steps."""
        seq = self.first.seq_len
        header = ["stage", "examples"] + (["tokens"] if seq else [])
        header += ["global_batch_size", "grad_accum_steps", "peak learning_rate"]
        header.append("optimizer steps")
        stages = self.to_json()["stages"]
        rows = []
        for i, s in enumerate(stages):
            start = f"{s['examples']:,}"
            if s["examples"] != s["asked_examples"]:
                start += f" (asked {s['asked_examples']:,})"
            steps: object = s["steps"] if s["steps"] else "not reached"
            if self.kind == AUTO and i == len(stages) - 1:
                steps = f"{s['steps']} until a doubling"
            rows.append(
                [i, start]
                + ([f"{s['examples'] * seq:,}"] if seq else [])
                + [
                    s["global_batch_size"],
                    s["grad_accum_steps"],
                    f"{s['learning_rate']:.6g}",
                    steps,
                ]
            )
        return format_table(header, rows)


def _merged(stages: list[dict]) -> list[dict]:
    """Stage records with a stage cut in two by a resume joined again (when the resume kept
    its K: on another device count the two pieces stay apart)."""
    out: list[dict] = []
    for s in stages:
        last = out[-1] if out else None
        if (
            last is not None
            and last["global_batch_size"] == s["global_batch_size"]
            and last["grad_accum_steps"] == s["grad_accum_steps"]  # not another device count
            and last["first_step"] + last["steps"] == s["first_step"]
        ):
            out[-1] = last | {"steps": last["steps"] + s["steps"]}
        else:
            out.append(dict(s))
    return out


def _stage_plan(first: BatchPlan, global_batch_size: int) -> BatchPlan:
    """The first stage's plan with another global batch: same micro-batch, K re-derived."""
    return make_batch_plan(
        mesh_shape=first.mesh_shape,
        global_batch_size=global_batch_size,
        per_device_batch_size=first.per_device_batch_size,
        grad_accum_steps=None,
        seq_len=first.seq_len,
        learning_rate=first.base_learning_rate,
        lr_scaling=first.lr_scaling,
        reference_batch_size=first.reference_batch_size,
        dcn_shape=first.dcn_shape,
    )


def _walk(
    stages: list[Stage], steps: int | None, examples: int | None, step: int, seen: int
) -> list[Stage]:
    """Lays the run over the stages from optimizer step `step` at example `seen` (the
    origin): the stage in force there and those after it, each with its first step, first
    example and step count, until `steps` optimizer steps or `examples` examples are done."""
    out = []
    for i, stage in enumerate(stages):
        nxt = stages[i + 1].asked_examples if i + 1 < len(stages) else None
        if nxt is not None and nxt <= seen:
            continue  # over before the origin
        g = stage.plan.global_batch_size
        n = math.inf  # steps this stage may take: to the next stage, then to the run's end
        if nxt is not None:
            n = max(-(-(nxt - seen) // g), 0)
        if steps is not None:
            n = min(n, steps - step)
        if examples is not None:
            n = min(n, max(-(-(examples - seen) // g), 0))
        n = int(n)
        first = seen if n else max(seen, stage.asked_examples)  # not reached: where it would
        out.append(dataclasses.replace(stage, first_step=step, first_example=first, steps=n))
        step, seen = step + n, seen + n * g
    return out


def check_length(config: RunConfig) -> None:
    """A run is as long as train.steps optimizer steps or train.examples examples: one."""
    t = config.train
    if (t.steps is None) == (t.examples is None):
        raise BatchPlanError(
            "give one of train.steps (optimizer steps) and train.examples (examples to train "
            f"on), not {'both' if t.steps is not None else 'neither'}"
            + ("; set train.steps=null to run by examples" if t.steps is not None else "")
        )


def plan_from_config(config: RunConfig, mesh_shape: dict[str, int]) -> BatchPlan:
    """The batch plan a config asks for on a mesh of this shape: its first stage's."""
    return schedule_from_config(config, mesh_shape).first


def schedule_from_config(
    config: RunConfig,
    mesh_shape: dict[str, int],
    saved: dict | None = None,
    at: tuple[int, int] = (0, 0),
) -> BatchSchedule:
    """The run's schedule on a mesh of this shape, laid from optimizer step `at[0]` at
    example `at[1]`; `saved`: what the checkpoint there kept (BatchSchedule.state)."""
    b, o = config.batch, config.optimizer
    check_length(config)
    saved = saved or {}
    text = b.schedule.strip()
    if text.lower() == AUTO:
        text = AUTO
    max_global = b.max_global_batch_size
    if text != AUTO and max_global is not None:
        raise BatchPlanError(
            f"batch.max_global_batch_size={max_global} is read by batch.schedule=auto only "
            f"(batch.schedule={text!r}): set batch.schedule=auto, or leave it null"
        )
    first, stages = _asked_stages(config, mesh_shape, text)
    kind = AUTO if text == AUTO else "scheduled" if text else "fixed"
    if kind == AUTO:
        _check_auto(config, first, max_global)
    decided = [tuple(d) for d in saved.get("decided", [])] if kind == AUTO else []
    stages += _decided_stages(first, decided, max_global)
    warmup_steps = max(int(o.warmup_steps), 0)
    base = _unlaid(
        config,
        kind,
        # Warmup: optimizer.warmup_steps steps of the run's first batch, as it ran.
        int(saved.get("warmup_examples", warmup_steps * first.global_batch_size)),
        history=tuple(h for h in saved.get("realized", []) if h["examples"] < at[1]),
        decided=tuple(decided),
        max_global_batch_size=max_global if kind == AUTO else None,
        patience=b.auto_patience,
        origin=at,
    )
    return _laid(base, stages)


def _config_plan(
    config: RunConfig,
    mesh_shape: dict[str, int],
    global_batch_size: int | None,
    per_device: int | None,
    accum: int | None,
) -> BatchPlan:
    """The plan of one split on this mesh, with the config's sequence and learning rate."""
    o = config.optimizer
    dcn = {"data": config.mesh.dcn_data, "fsdp": config.mesh.dcn_fsdp}
    if any(mesh_shape.get(axis, 1) % slices for axis, slices in dcn.items()):
        dcn = {}  # a shape not of the config's mesh (one device, for the batch alone)
    return make_batch_plan(
        mesh_shape=mesh_shape,
        global_batch_size=global_batch_size,
        per_device_batch_size=per_device,
        grad_accum_steps=accum,
        seq_len=config.data.seq_len,
        learning_rate=o.learning_rate,
        lr_scaling=o.lr_scaling,
        reference_batch_size=o.reference_batch_size,
        dcn_shape=dcn,
    )


def _asked_stages(
    config: RunConfig, mesh_shape: dict[str, int], text: str
) -> tuple[BatchPlan, list[Stage]]:
    """The first plan and the stages batch.schedule's `text` asks for (one for a fixed batch
    or auto, whose later stages are decided as the run goes)."""
    b = config.batch
    if text in ("", AUTO):
        first = _config_plan(
            config, mesh_shape, b.global_batch_size, b.per_device_batch_size, b.grad_accum_steps
        )
        return first, [Stage(0, first)]
    asked = parse_stages(text, config.data.seq_len)
    g0 = asked[0][1]
    if b.global_batch_size is not None and b.global_batch_size != g0:
        raise BatchPlanError(
            f"batch.global_batch_size={b.global_batch_size} disagrees with batch.schedule's "
            f"first stage ({g0}): leave batch.global_batch_size null with a schedule"
        )
    if b.per_device_batch_size is None and b.grad_accum_steps is None:
        raise BatchPlanError(
            "a batch.schedule changes grad_accum_steps and keeps the per-device batch: give "
            "batch.per_device_batch_size (or batch.grad_accum_steps of the first stage)"
        )
    first = _config_plan(config, mesh_shape, g0, b.per_device_batch_size, b.grad_accum_steps)
    stages = []
    for start, g in asked:
        try:
            stages.append(Stage(start, _stage_plan(first, g)))
        except BatchPlanError as err:
            raise BatchPlanError(f"batch.schedule stage {start}:{g}: {err}") from None
    return first, stages


def _check_auto(config: RunConfig, first: BatchPlan, max_global: int | None) -> None:
    """What batch.schedule=auto needs before it can double the batch: a ceiling that is the
    first batch doubled, two batch sizes to measure the noise scale, a length in examples."""
    if max_global is None:
        raise BatchPlanError(
            "batch.schedule=auto doubles grad_accum_steps up to batch.max_global_batch_size: "
            "give it"
        )
    g0 = first.global_batch_size
    ratio = max_global // g0
    if max_global < g0 or max_global % g0 or ratio & (ratio - 1):
        doubles = [g0 * 2**i for i in range(6)]
        raise BatchPlanError(
            f"batch.max_global_batch_size={max_global} must be the first global batch "
            f"{g0} doubled zero or more times: one of {', '.join(map(str, doubles))}, ..."
        )
    if not has_two_batch_sizes(first.global_batch_size):
        raise BatchPlanError(
            "batch.schedule=auto reads the gradient noise scale, which needs the gradient "
            f"at two batch sizes: the first {SMALL_BATCH_ROWS} row(s) of each global batch "
            f"and the whole of it. Start with batch.global_batch_size > {SMALL_BATCH_ROWS} "
            f"(this plan has {first.global_batch_size})"
        )
    check_auto_samples(config, g0)
    if config.train.examples is None:
        raise BatchPlanError(
            "batch.schedule=auto decides the global batch as the run goes, so its length "
            "in optimizer steps is not known: give train.examples (and train.steps=null)"
        )


def check_auto_samples(config: RunConfig, first_global_batch: int) -> None:
    """That a batch.schedule=auto run samples the noise scale at some step before its last,
    where it has a step left to train at the batch that sample decides."""
    # A config saved before train.noise_scale_every sampled every step: it holds 1
    # (config.saved_config fills the keys added since, as the run ran).
    every = config.train.noise_scale_every
    if not every:
        raise BatchPlanError(
            "train.noise_scale_every=0 turns off the gradient noise scale that "
            "batch.schedule=auto decides on: sample it every N > 0 steps (default 10)"
        )
    if config.train.examples is None:
        return
    # The batch stays the first until a sampled step doubles it: at most this many steps.
    g0, examples = first_global_batch, config.train.examples
    longest = -(-examples // g0)
    if every >= longest:
        raise BatchPlanError(
            f"train.noise_scale_every={every} samples no step before the last of this "
            f"batch.schedule=auto run (train.examples={examples} is {longest} optimizer "
            f"steps at its first global batch {g0}), so it would train at a fixed batch: "
            f"sample every N < {longest} steps"
        )


def _decided_stages(
    first: BatchPlan, decided: list[tuple[int, ...]], max_global: int | None
) -> list[Stage]:
    """The stages an auto ramp decided before the checkpoint resumed from: a resume keeps
    them, so a ceiling lowered below one of them is refused."""
    stages = []
    for first_step, first_example, g in decided:
        if max_global is not None and g > max_global:
            raise BatchPlanError(
                f"this run's auto ramp reached a global batch of {g} at optimizer step "
                f"{first_step}, above batch.max_global_batch_size={max_global}: a resume "
                f"cannot take it back; use batch.max_global_batch_size >= {g}, or a new "
                "--workdir"
            )
        stages.append(Stage(first_example, _stage_plan(first, g)))
    return stages


def fixed_schedule(config: RunConfig, plan: BatchPlan) -> BatchSchedule:
    """One stage: `plan` for the whole run (what a split of a fixed batch trains)."""
    warmup_steps = max(int(config.optimizer.warmup_steps), 0)
    base = _unlaid(config, "fixed", warmup_steps * plan.global_batch_size)
    return _laid(base, [Stage(0, plan)])


def _unlaid(config: RunConfig, kind: str, warmup_examples: int, **fields: object) -> BatchSchedule:
    """A schedule with the config's length and learning-rate shape, before `_laid` lays
    its stages."""
    t, o = config.train, config.optimizer
    defaults: dict = {"history": (), "decided": ()}
    return BatchSchedule(
        kind=kind,
        stages=(),
        length=(t.steps, t.examples),
        total_steps=0,
        total_examples=0,
        warmup_examples=warmup_examples,
        initial_lr_fraction=1 / max(int(o.warmup_steps), 1),
        final_lr_fraction=o.final_lr_fraction,
        **(defaults | fields),
    )


def _laid(
    schedule: BatchSchedule,
    stages: list[Stage],
    decided: tuple[tuple[int, int, int], ...] | None = None,
) -> BatchSchedule:
    """`schedule` with `stages` laid over the run from its origin, and the learning rate's
    curve over the examples the run will have trained."""
    (steps, examples), (step0, seen0) = schedule.length, schedule.origin
    walked = _walk(stages, steps, examples, step0, seen0)
    total_steps = step0 + sum(s.steps for s in walked)
    # train.examples rounded up to a whole step, or as many as the steps take; an auto
    # ramp's total is known only as it goes: its decay ends at its target.
    total_examples = seen0 + sum(s.steps * s.plan.global_batch_size for s in walked)
    if schedule.kind == AUTO and examples is not None:
        total_examples = examples
    # As optax's warmup_cosine_decay_schedule over steps: the decay ends at least one
    # (first-batch) step past the warmup.
    first_batch = schedule.history[0]["global_batch_size"] if schedule.history else None
    first_batch = first_batch or walked[0].plan.global_batch_size
    return dataclasses.replace(
        schedule,
        stages=tuple(walked),
        decided=schedule.decided if decided is None else decided,
        total_steps=total_steps,
        total_examples=max(total_examples, schedule.warmup_examples + first_batch),
    )


def auto_decision(
    samples_above: int,
    noise_scale: float | None,
    global_batch_size: int,
    patience: int,
    max_global_batch_size: int,
) -> tuple[int, bool]:
    """The auto ramp's rule at a step that sampled the noise scale: (samples in a row with
    the smoothed B_simple above the global batch, whether to double K now). Never shrinks."""
    above = noise_scale is not None and noise_scale > global_batch_size
    samples_above = samples_above + 1 if above else 0
    if samples_above >= patience and 2 * global_batch_size <= max_global_batch_size:
        return 0, True
    return samples_above, False


@dataclasses.dataclass
class AutoRamp:
    """The auto ramp's memory between decisions: what a checkpoint keeps so that a resumed
    run decides as the uninterrupted one would (the noise scale's averages are kept too)."""

    samples_above: int = 0
    last_noise_scale: float | None = None  # what the last decision read

    def decide(
        self, schedule: BatchSchedule, noise_scale: float | None, done: int, examples: int
    ) -> BatchSchedule:
        """At sampled step `done`: `schedule`, with a doubled stage from here on
        when the rule says so."""
        assert schedule.max_global_batch_size is not None
        g = schedule.plan_at(examples).global_batch_size
        self.last_noise_scale = noise_scale
        self.samples_above, double = auto_decision(
            self.samples_above, noise_scale, g, schedule.patience, schedule.max_global_batch_size
        )
        return schedule.with_stage(examples, done, 2 * g) if double else schedule

    def state(self) -> dict:
        return {"samples_above": self.samples_above}

    @classmethod
    def load(cls, saved: dict | None) -> AutoRamp:
        saved = saved or {}
        # Runs saved before the ramp counted samples counted log windows, under this name.
        return cls(samples_above=int(saved.get("samples_above", saved.get("windows_above", 0))))

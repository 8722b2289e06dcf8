"""What a split costs before anything runs: the compiler's memory and FLOPs per device.

A split is one way to factor the global batch: (devices, per_device_batch_size,
grad_accum_steps). For each, the train step is lowered and compiled on abstract inputs
(shapes, dtypes and shardings; nothing is allocated or executed) and the compiled program
tells its per-device memory and FLOPs:

    memory = argument + output − alias + temp      (XLA's peak figure omits temps on CPU)
    flops  = K × cost_analysis()["flops"] per call − (K − 1) × the optimizer update's

`cost_analysis` describes the partitioned per-device program, so both figures are per
device. With MultiSteps the step is called K times per optimizer step. The fused step is one
call, but XLA's cost analysis counts a loop body once, not once per trip; so it too counts
as K calls. Either way every counted call includes one optimizer update, so
StepCost.flops_per_step takes K − 1 of them back out: it is the work an optimizer step
needs, K micro-batch gradients and one update, which is what the fused step executes.
MultiSteps (optax 0.2.8) computes the inner update on every call and masks its result, so
a MultiSteps device executes K − 1 updates more than this counts; they are wasted work, not
part of the step, and left out of FLOP/s and MFU alike.
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
import optax

from jaxkit import mesh as mesh_lib
from jaxkit.batch.plan import Accumulation, BatchPlan, divisors
from jaxkit.batch.schedule import plan_from_config
from jaxkit.config import is_lm
from jaxkit.plan import compile_cache, traffic
from jaxkit.plan.flops import hardware_flops, model_flops_per_example
from jaxkit.plan.targets import generation_of
from jaxkit.sections import RunConfig
from jaxkit.step.optimizer import Hyper
from jaxkit.step.train_step import Setup, abstract_state, build

_UNITS = {"": 1, "b": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_UNITS |= {"kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12}
_UNITS |= {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """'16GiB', '512MiB', '1.5GB', '2e9' → bytes."""
    match = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _UNITS:
        raise ValueError(
            f"{text!r} is not a memory size; write e.g. 16GiB, 512MiB, 2GB or a byte count"
        )
    value = float(match.group(1)) * _UNITS[unit]
    if value <= 0:
        raise ValueError(f"memory size {text!r} must be positive")
    return int(value)


def format_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def device_memory_bytes(device: jax.Device) -> int | None:
    """The memory JAX may use on `device`, where the backend reports it (not on CPU)."""
    try:
        stats = device.memory_stats()
    except Exception:  # backends without the call raise rather than return None
        return None
    limit = (stats or {}).get("bytes_limit")
    return int(limit) if limit else None


def format_seconds(seconds: float) -> str:
    """3.44 s, 12.3 ms, 37.2 µs; 0 for nothing."""
    for unit, size in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if seconds >= size:
            return f"{seconds / size:.3g} {unit}"
    return "0" if seconds == 0 else f"{seconds * 1e9:.3g} ns"


def format_flops(n: float) -> str:
    for unit, size in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f}"


@dataclasses.dataclass(frozen=True)
class StepCost:
    """The compiled train step of one split, per device."""

    argument_bytes: int
    output_bytes: int
    alias_bytes: int  # outputs written into donated inputs (the state)
    temp_bytes: int
    flops_per_call: float
    calls_per_step: int  # K: micro-steps per optimizer step (see the module docstring)
    update_flops: float  # the inner optimizer's update, which runs once per optimizer step
    compile_s: float  # the whole wait: tracing, lowering and compiling (or a cache read)
    # One micro-batch's share of the two counts of flops.py: the architecture's (model) and
    # the compiled matmuls, loop bodies times their trips and recomputation included.
    model_flops_per_call: float = 0.0
    hardware_flops_per_call: float = 0.0
    trace_s: float = 0.0  # tracing and lowering: the part of compile_s no cache skips
    compile_cache_hit: bool | None = None  # the program came from a cache (None: no cache)
    # The train state one device holds between steps (params, the optimizer's moments and
    # counters, MultiSteps' accumulator where the run keeps one): part of argument_bytes.
    state_bytes: int = 0
    # For a described TPU slice (step_time.py's inputs), per optimizer step per device:
    # the bytes moved to and from HBM, and the collectives, their runs counted per step.
    hbm_bytes_per_step: float = 0.0
    transfers: tuple[traffic.Transfer, ...] = ()

    @property
    def memory_bytes(self) -> int:
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes

    @property
    def flops_per_step(self) -> float:
        """FLOPs of one optimizer step per device: K micro-batch gradients, one update.

        Each of the K counted calls includes the optimizer update (MultiSteps computes it on
        every call and masks it; the fused scan is counted once around one update), which
        the step needs once: so K − 1 updates come off.
        """
        k = self.calls_per_step
        return k * self.flops_per_call - (k - 1) * self.update_flops

    @property
    def model_flops_per_step(self) -> float:
        """The architecture's FLOPs of one optimizer step per device: the basis of MFU."""
        return self.calls_per_step * self.model_flops_per_call

    @property
    def hardware_flops_per_step(self) -> float:
        """Matmul FLOPs the compiled step executes per optimizer step per device: HFU's."""
        return self.calls_per_step * self.hardware_flops_per_call

    def to_json(self) -> dict:
        return {
            "memory_bytes": self.memory_bytes,
            "state_bytes": self.state_bytes,
            "argument_bytes": self.argument_bytes,
            "output_bytes": self.output_bytes,
            "alias_bytes": self.alias_bytes,
            "temp_bytes": self.temp_bytes,
            "flops_per_step": self.flops_per_step,
            "model_flops_per_step": self.model_flops_per_step,
            "hardware_flops_per_step": self.hardware_flops_per_step,
            "compile_s": self.compile_s,
            "trace_s": self.trace_s,
            "compile_cache_hit": self.compile_cache_hit,
        }


def ramps(config: RunConfig) -> bool:
    """Whether `config`'s run grows its global batch (a batch schedule): its stages change
    only K, so its one MultiSteps program keeps an accumulator even where K is 1, and a
    split of it compiled alone (split_config drops the schedule) must keep one too."""
    return bool(config.batch.schedule)


def split_batch(per_device_batch_size: int, grad_accum_steps: int) -> dict[str, Any]:
    """The batch keys that name a split: its per-device batch and K, the global derived,
    one fixed global batch (no schedule)."""
    return {
        "global_batch_size": None,
        "per_device_batch_size": per_device_batch_size,
        "grad_accum_steps": grad_accum_steps,
        "schedule": "",
        "max_global_batch_size": None,
    }


def split_config(config: RunConfig, per_device_batch_size: int, grad_accum_steps: int) -> RunConfig:
    """A copy of `config` whose batch section names this split (global derived)."""
    batch = dataclasses.replace(
        config.batch, **split_batch(per_device_batch_size, grad_accum_steps)
    )
    return dataclasses.replace(config, batch=batch)


def batch_row_spec(config: RunConfig) -> dict[str, tuple[tuple[int, ...], str]]:
    """Each train batch entry's per-row shape and dtype, as the loader delivers them."""
    d = config.data
    if is_lm(config):
        assert d.seq_len is not None  # a language model's rows are seq_len tokens
        row = ((d.seq_len,), "int32")
        spec: dict[str, tuple[tuple[int, ...], str]] = {
            "inputs": row,
            "targets": row,
            "loss_weights": ((d.seq_len,), "float32"),
        }
        if d.document_mask:  # packed documents' segments
            spec |= {"segment_ids": row, "positions": row}
        return spec
    assert d.num_features is not None  # a classifier's rows are num_features features
    return {
        "inputs": ((d.num_features,), "float32"),
        "targets": ((), "int32"),
        "loss_weights": ((), "float32"),
    }


def abstract_batch(
    config: RunConfig, plan: BatchPlan, setup: Setup
) -> dict[str, jax.ShapeDtypeStruct]:
    """Shapes, dtypes and shardings of the batch one call of `setup.step` takes."""
    if setup.accumulation is Accumulation.FUSED:
        lead: tuple[int, ...] = (plan.grad_accum_steps, plan.micro_batch_size)
        sharding = setup.fused_batch_sharding
    else:
        lead, sharding = (plan.micro_batch_size,), setup.batch_sharding
    return {
        key: jax.ShapeDtypeStruct(lead + shape, jnp.dtype(dtype), sharding=sharding)
        for key, (shape, dtype) in batch_row_spec(config).items()
    }


def abstract_hyper(setup: Setup) -> Hyper:
    """Shapes of the step's per-call arguments K and learning rate: scalars, replicated."""
    replicated = setup.state_shardings.micro_step  # the state's replicated scalar
    return Hyper(
        jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated),
        jax.ShapeDtypeStruct((), jnp.float32, sharding=replicated),
    )


class OutOfMemory(Exception):  # noqa: N818 — what the compiler said, not a bug here
    """The compiler refused the step: it needs more memory than the device has.

    A TPU compiler knows its chip's HBM and will not compile past it (after trying to
    recompute activations to fit); `needed_bytes` is the requirement it names, where it
    names one (a lower bound: often the temporaries alone).
    """

    def __init__(self, message: str):
        super().__init__(message)
        found = re.search(r"(?:required for HLO temporaries \(|Used )([0-9.]+)([KMGT])", message)
        scale = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
        self.needed_bytes = int(float(found[1]) * scale[found[2]]) if found else None


def _lower(config: RunConfig, plan: BatchPlan, setup: Setup) -> tuple[jax.stages.Lowered, Any]:
    state = abstract_state(setup)
    batch = abstract_batch(config, plan, setup)
    return setup.step.lower(state, batch, abstract_hyper(setup)), state


def _compile(lowered: jax.stages.Lowered) -> tuple[jax.stages.Compiled, bool]:
    """The program, and whether it came from the persistent compilation cache."""
    try:
        with compile_cache.cache_events() as events:
            compiled = lowered.compile()
    except jax.errors.JaxRuntimeError as err:
        if "RESOURCE_EXHAUSTED" not in str(err):
            raise
        raise OutOfMemory(str(err).splitlines()[0]) from None
    return compiled, events.hit


def _with_counts(
    cost: StepCost, config: RunConfig, plan: BatchPlan, setup: Setup, hlo: str
) -> StepCost:
    """`cost` with the figures the setup gives: FLOP counts per call and the state's bytes."""
    # The fused program is a whole optimizer step; its trips were counted.
    calls = plan.grad_accum_steps if setup.accumulation is Accumulation.FUSED else 1
    devices = setup.batch_sharding.mesh.size
    return dataclasses.replace(
        cost,
        state_bytes=mesh_lib.bytes_per_device(abstract_state(setup)),
        model_flops_per_call=model_flops_per_example(config) * plan.micro_batch_size / devices,
        hardware_flops_per_call=hardware_flops(hlo) / calls,
    )


def compile_setup_step(
    config: RunConfig, plan: BatchPlan, setup: Setup
) -> tuple[jax.stages.Compiled, StepCost]:
    """`setup.step` compiled ahead of time from shapes alone, and what it costs.

    The loop calls the compiled step itself, so a run compiles once and knows its FLOPs.
    """
    start = time.perf_counter()
    lowered, state = _lower(config, plan, setup)
    update = update_flops(setup, state)  # lowered, not compiled: tracing time too
    trace_s = time.perf_counter() - start
    compiled, hit = _compile(lowered)
    seconds = time.perf_counter() - start
    cost = cost_of(compiled, plan.grad_accum_steps, update, seconds)
    hit = hit and compile_cache.in_use()
    cost = dataclasses.replace(cost, trace_s=trace_s, compile_cache_hit=hit)
    return compiled, _with_counts(cost, config, plan, setup, compiled.as_text() or "")


def _described(devices: Sequence[jax.Device]) -> bool:
    """Chips of a TPU topology compiled for from another machine: no client runs them."""
    return devices[0].platform not in {d.platform for d in jax.devices()}


# The rules by which a target plan's figures are read off its program (flops.py's,
# traffic.py's): a plan cache entry written under other rules is compiled again. Raise it
# when a change to those rules changes a figure.
FIGURES = 2

# What a target plan keeps of each compile: the compiler's figures, not the program.
_COMPILED_FIELDS = (
    *("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes"),
    *("flops_per_call", "hardware_flops_per_call"),
)


def _target_step_cost(
    config: RunConfig, plan: BatchPlan, setup: Setup, devices: Sequence[jax.Device]
) -> StepCost:
    """compile_setup_step's cost for a described TPU slice, from the plan cache when this
    program was compiled for these chips before (see compile_cache)."""
    start = time.perf_counter()
    lowered, state = _lower(config, plan, setup)
    trace_s = time.perf_counter() - start
    key = compile_cache.plan_key(lowered.as_text(), devices)
    entry = compile_cache.read_plan(key)
    if entry is not None and "out_of_memory" not in entry and entry.get("figures") != FIGURES:
        entry = None  # read off the program by other rules: compiled again for today's
    hit = entry is not None
    if entry is None:
        try:
            compiled = _compile(lowered)[0]
        except OutOfMemory as err:
            compile_cache.write_plan(key, {"out_of_memory": str(err)})
            raise
        cost = cost_of(compiled, plan.grad_accum_steps, 0.0, 0.0)
        text = compiled.as_text() or ""
        cost = _with_counts(cost, config, plan, setup, text)
        entry = {name: getattr(cost, name) for name in _COMPILED_FIELDS}
        entry |= _traffic_fields(text, setup, devices) | {"figures": FIGURES}
        compile_cache.write_plan(key, entry)
    if "out_of_memory" in entry:
        raise OutOfMemory(entry["out_of_memory"])
    cost = StepCost(
        argument_bytes=int(entry["argument_bytes"]),
        output_bytes=int(entry["output_bytes"]),
        alias_bytes=int(entry["alias_bytes"]),
        temp_bytes=int(entry["temp_bytes"]),
        flops_per_call=float(entry["flops_per_call"]),
        calls_per_step=plan.grad_accum_steps,
        update_flops=update_flops(setup, state),
        compile_s=time.perf_counter() - start,
        trace_s=trace_s,
        compile_cache_hit=hit,
        **_per_step(entry, plan, setup),
    )
    cost = _with_counts(cost, config, plan, setup, "")
    return dataclasses.replace(
        cost, hardware_flops_per_call=float(entry["hardware_flops_per_call"])
    )


def _traffic_fields(text: str, setup: Setup, devices: Sequence[jax.Device]) -> dict[str, Any]:
    """A target program's HBM bytes and collectives per call, as the plan cache keeps them:
    one MultiSteps program serves every K (K is its argument), so K stays out of the entry."""
    generation = generation_of(devices[0].device_kind)
    ordered = list(setup.batch_sharding.mesh.devices.flat)  # as the program numbers them
    found = traffic.transfers(text, ordered, generation.wraps if generation else None)
    return {
        "hbm_bytes_per_call": traffic.hbm_bytes(text),
        "transfers": [t.to_json() for t in found],
    }


def _per_step(entry: dict[str, Any], plan: BatchPlan, setup: Setup) -> dict[str, Any]:
    """StepCost's traffic fields from a plan cache entry's per-call figures: the MultiSteps
    program runs K times an optimizer step, the fused one once (its loop's trips counted)."""
    calls = 1 if setup.accumulation is Accumulation.FUSED else plan.grad_accum_steps
    return {
        "hbm_bytes_per_step": calls * float(entry["hbm_bytes_per_call"]),
        "transfers": tuple(
            dataclasses.replace(traffic.Transfer(**t), runs=t["runs"] * calls)
            for t in entry["transfers"]
        ),
    }


class StepPrograms:
    """The compiled step for each K a run uses: one program with MultiSteps (K is one of
    its arguments), one per K in fused mode (K is the leading dimension of its batch)."""

    def __init__(self, config: RunConfig, setup: Setup):
        self.config, self.setup = config, setup
        self.fused = setup.accumulation is Accumulation.FUSED
        self.compiled: dict[int | None, tuple[jax.stages.Compiled, StepCost]] = {}

    def _key(self, plan: BatchPlan) -> int | None:
        return plan.grad_accum_steps if self.fused else None

    def has(self, plan: BatchPlan) -> bool:
        return self._key(plan) in self.compiled

    def get(self, plan: BatchPlan) -> tuple[jax.stages.Compiled, StepCost]:
        """The program for `plan`'s steps (compiled on first use), and its cost under it."""
        key = self._key(plan)
        if key not in self.compiled:
            self.compiled[key] = compile_setup_step(self.config, plan, self.setup)
        program, cost = self.compiled[key]
        return program, dataclasses.replace(cost, calls_per_step=plan.grad_accum_steps)


def update_flops(setup: Setup, state: Any) -> float:
    """FLOPs per device of the inner optimizer's update and its application to the params.

    Counted on one device's shards of the state, from the lowered program: the update is
    elementwise per shard, and lowering costs a fraction of a compile at every run's start.
    (Before XLA's optimisations the count runs a little high: 10.0 M against 9.6 M compiled
    for the tiny LM, against 3.1 G per optimizer step.)
    """
    inner = setup.tx.inner_opt

    def update(grads: Any, inner_state: Any, params: Any) -> Any:
        updates, new_state = inner.update(grads, inner_state, params)
        return optax.apply_updates(params, updates), new_state

    def shard(x: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(x.sharding.shard_shape(x.shape), x.dtype)

    args = jax.tree.map(shard, (state.params, state.opt_state.inner_opt_state, state.params))
    return _flops(jax.jit(update).lower(*args))


def _flops(program: jax.stages.Compiled | jax.stages.Lowered) -> float:
    analysis = program.cost_analysis()
    if isinstance(analysis, list):  # older jax: one dict per program
        analysis = analysis[0]
    return float((analysis or {}).get("flops", 0.0))


def cost_of(
    compiled: jax.stages.Compiled, calls_per_step: int, update: float, compile_s: float
) -> StepCost:
    memory = compiled.memory_analysis()
    if memory is None:
        raise RuntimeError("this backend gives no memory analysis of compiled programs")
    held = memory.argument_size_in_bytes + memory.output_size_in_bytes
    held -= memory.alias_size_in_bytes
    temp = int(memory.temp_size_in_bytes)
    peak = int(getattr(memory, "peak_memory_in_bytes", 0) or 0)
    if temp == 0 and peak > held:
        # The TPU compiler reports no temporaries for some programs (a fused step with
        # remat=full) while its own peak is well above the state: the peak's excess is
        # what the step holds besides its arguments and outputs.
        temp = peak - held
    return StepCost(
        argument_bytes=int(memory.argument_size_in_bytes),
        output_bytes=int(memory.output_size_in_bytes),
        alias_bytes=int(memory.alias_size_in_bytes),
        temp_bytes=temp,
        flops_per_call=_flops(compiled),
        calls_per_step=calls_per_step,
        update_flops=update,
        compile_s=compile_s,
    )


def step_cost(
    config: RunConfig,
    plan: BatchPlan,
    devices: Sequence[jax.Device],
    ramps: bool = False,
) -> StepCost:
    """Compiled per-device memory and FLOPs of one optimizer step under `plan` on `devices`
    (`ramps`: in a run whose batch schedule grows past it, as train_step.build says)."""
    mesh = mesh_lib.make_mesh(dataclasses.asdict(config.mesh), devices)
    setup = build(config, plan, mesh, ramps=ramps)
    if _described(devices):
        return _target_step_cost(config, plan, setup, devices)
    return compile_setup_step(config, plan, setup)[1]


@dataclasses.dataclass(frozen=True)
class Split:
    devices: int  # devices the split runs on (the first `devices` of the live ones)
    plan: BatchPlan
    cost: StepCost | None = None
    out_of_memory: OutOfMemory | None = None  # the compiler refused it: too big to fit
    remat: str | None = None  # model.remat compiled; None: the config's (or a model without)

    @property
    def key(self) -> tuple[int, int, int, str | None]:
        p = self.plan
        return (p.data_parallel_size, p.per_device_batch_size, p.grad_accum_steps, self.remat)

    @property
    def hardware_per_model_flop(self) -> float | None:
        """Matmul FLOPs executed per model FLOP: 1 without recomputation, more with remat."""
        c = self.cost
        if c is None or not c.model_flops_per_step:
            return None
        return c.hardware_flops_per_step / c.model_flops_per_step


def with_remat(config: RunConfig, remat: str | None) -> RunConfig:
    """`config` with model.remat set (a copy), or `config` itself for None."""
    if remat is None:
        return config
    # one of model.remat's choices: planning's --remat policies are checked against them
    model = dataclasses.replace(config.model, remat=cast(Any, remat))
    return dataclasses.replace(config, model=model)


def enumerate_splits(config: RunConfig, device_counts: Sequence[int]) -> list[Split]:
    """Every exact (devices, per-device batch, accumulation) for the config's global batch.

    On each device count the mesh is the config's (one axis may be -1); counts the mesh
    cannot use are left out (`left_out` says why). Ordered by devices (most first), then
    per-device batch (largest first).
    """
    g = splits_global_batch(config, device_counts)
    splits = []
    for n in sorted(set(device_counts), reverse=True):
        try:
            shape = mesh_lib.resolve_mesh_shape(dataclasses.asdict(config.mesh), n)
        except mesh_lib.MeshError:
            continue
        dp = shape["data"] * shape["fsdp"]
        if g is None or g % dp:
            continue
        for b in reversed(divisors(g // dp)):
            plan = plan_from_config(split_config(config, b, g // (dp * b)), shape)
            splits.append(Split(devices=n, plan=plan))
    return splits


def splits_global_batch(config: RunConfig, device_counts: Sequence[int]) -> int | None:
    """The global batch every split makes: the config's, resolved on the most devices the
    mesh fits (with global_batch_size unset it depends on the data-parallel size); None
    where the mesh fits none of the counts."""
    for n in sorted(set(device_counts), reverse=True):
        try:
            shape = mesh_lib.resolve_mesh_shape(dataclasses.asdict(config.mesh), n)
        except mesh_lib.MeshError:
            continue
        return plan_from_config(config, shape).global_batch_size
    return None


def left_out(
    config: RunConfig, device_counts: Sequence[int], splits: Sequence[Split]
) -> dict[int, str]:
    """Each device count that has no split, and why."""
    g = splits_global_batch(config, device_counts)
    present = {s.devices for s in splits}
    reasons = {}
    for n in sorted(set(device_counts) - present, reverse=True):
        try:
            shape = mesh_lib.resolve_mesh_shape(dataclasses.asdict(config.mesh), n)
        except mesh_lib.MeshError as err:
            reasons[n] = str(err)
            continue
        dp = shape["data"] * shape["fsdp"]
        reasons[n] = f"its data × fsdp = {dp} ranks do not divide global_batch_size={g}"
    return reasons


def with_costs(
    config: RunConfig,
    splits: Sequence[Split],
    devices: Sequence[jax.Device],
    progress: Callable[[Split], None] = lambda split: None,
) -> list[Split]:
    """Each split with its compiled cost (one compile each; nothing runs)."""
    out = []
    for split in splits:
        b, k = split.plan.per_device_batch_size, split.plan.grad_accum_steps
        split_cfg = split_config(with_remat(config, split.remat), b, k)
        try:
            cost = step_cost(split_cfg, split.plan, devices[: split.devices], ramps(config))
            out.append(dataclasses.replace(split, cost=cost))
        except OutOfMemory as err:
            out.append(dataclasses.replace(split, out_of_memory=err))
        progress(out[-1])
    return out


def recommend(
    splits: Sequence[Split],
    budget: int,
    devices: int,
    predicted: Mapping[tuple[int, int, int, str | None], Any] | None = None,
) -> Split | None:
    """The split on `devices` devices that fits the budget with the most model FLOPs per
    second predicted: the fewest hardware FLOPs per model FLOP (recomputation is time
    spent on no model FLOP), then the seeds' rule: the largest per-device batch (wider
    matmuls run nearer the peak), then the fewest accumulation steps.

    With `predicted` step times (a target's, by Split.key: step_time.Prediction), the most
    predicted tokens per second per device comes first (to three significant figures, as
    the plan prints it), that order breaking ties."""
    fitting = [
        s for s in splits if s.devices == devices and s.cost and s.cost.memory_bytes <= budget
    ]
    if not fitting:
        return None

    def speed(s: Split) -> tuple[float, ...]:
        order = predicted_speed(
            s.hardware_per_model_flop or 1.0,
            s.plan.per_device_batch_size,
            s.plan.grad_accum_steps,
        )
        timed = (predicted or {}).get(s.key)
        rate = float(f"{timed.tokens_per_s_per_device:.3g}") if timed is not None else 0.0
        return (rate, *order)

    return max(fitting, key=speed)


def predicted_speed(
    hardware_per_model_flop: float, per_device_batch_size: int, grad_accum_steps: int
) -> tuple[float, int, int]:
    """A key that orders splits by predicted model FLOP/s (larger = faster): the fewest
    hardware FLOPs per model FLOP, then the widest per-device batch, then the fewest K.

    The ratio is taken to two decimals (a policy's hardly moves with the batch) and never
    below 1: fewer executed matmul FLOPs than the convention counts (no input gradient for
    the first layer; XLA turning a matmul with a dimension of 1 into a multiply and a sum)
    are not a faster step."""
    overhead = round(max(hardware_per_model_flop, 1.0), 2)
    return (-overhead, per_device_batch_size, -grad_accum_steps)


@dataclasses.dataclass(frozen=True)
class BatchSearch:
    per_device_batch_size: int  # largest that fits; 0 when even 1 does not
    cost: StepCost | None  # of that batch
    compiles: int
    seconds: float
    tried: dict[int, int | None]  # per-device batch → compiled memory bytes (None: the
    # compiler refused it, out of memory; `refused` holds what it said)
    refused: dict[int, OutOfMemory] = dataclasses.field(default_factory=dict)


def max_per_device_batch(
    config: RunConfig,
    devices: Sequence[jax.Device],
    budget: int,
    limit: int = 1 << 20,
    progress: Callable[[int, int | None], None] = lambda b, memory: None,
    starting: Callable[[int], None] = lambda b: None,
) -> BatchSearch:
    """The largest per-device batch whose compiled step fits `budget`, by compile-only search.

    Memory grows with the per-device micro-batch (not with accumulation), so the search
    compiles K = 1 steps: doubling until one does not fit, then bisecting between the last
    fit and the first miss. About 2·log2(answer) compiles. `starting(b)` is called as each
    compile begins (one for a TPU slice can take minutes), `progress(b, memory)` as it ends.
    """
    start = time.perf_counter()
    shape = mesh_lib.resolve_mesh_shape(dataclasses.asdict(config.mesh), len(devices))
    tried: dict[int, int | None] = {}
    refused: dict[int, OutOfMemory] = {}
    costs: dict[int, StepCost] = {}

    def fits(b: int) -> bool:
        split = split_config(config, b, 1)
        starting(b)
        try:
            cost = step_cost(split, plan_from_config(split, shape), devices, ramps(config))
        except OutOfMemory as err:
            tried[b], refused[b] = None, err
            progress(b, None)
            return False
        tried[b], costs[b] = cost.memory_bytes, cost
        progress(b, cost.memory_bytes)
        return cost.memory_bytes <= budget

    if not fits(1):
        return BatchSearch(0, None, len(tried), time.perf_counter() - start, tried, refused)
    low, high = 1, None  # low fits; high (when known) does not
    while high is None:
        candidate = min(low * 2, limit)
        if candidate == low:
            break
        if fits(candidate):
            low = candidate
        else:
            high = candidate
    while high is not None and high - low > 1:
        mid = (low + high) // 2
        if fits(mid):
            low = mid
        else:
            high = mid
    return BatchSearch(low, costs[low], len(tried), time.perf_counter() - start, tried, refused)


def splits_cost_table(
    splits: Sequence[Split],
    budget: int | None,
    chosen: Split | None,
    with_remat_column: bool = False,
) -> list[tuple[object, ...]]:
    """Rows for the --all-splits table: model FLOPs, and hardware FLOPs with their ratio to
    the model's (recomputation shows as more than 1×)."""
    rows: list[tuple[object, ...]] = []
    for s in splits:
        p, c = s.plan, s.cost
        memory = format_bytes(c.memory_bytes) if c else "?"
        flops = format_flops(c.model_flops_per_step) if c else "?"
        fits = "" if budget is None or c is None else ("yes" if c.memory_bytes <= budget else "no")
        if s.out_of_memory is not None:  # the compiler would not compile it
            needed = s.out_of_memory.needed_bytes
            memory = f"> {format_bytes(needed)}" if needed else "too much"
            fits = "no"
        hardware = format_flops(c.hardware_flops_per_step) if c else "?"
        ratio = s.hardware_per_model_flop
        if ratio is not None:
            hardware += f" ({ratio:.2f}×)"
        mark = "← recommended" if chosen is not None and s.key == chosen.key else ""
        row = (s.devices, p.per_device_batch_size, p.grad_accum_steps, p.global_batch_size)
        remat = () if not with_remat_column else (s.remat or "",)
        rows.append((*row, *remat, memory, flops, hardware, fits, mark))
    return rows


def split_header(with_remat_column: bool = False) -> tuple[str, ...]:
    """The --all-splits table's columns (a remat column when policies are compared)."""
    return (
        "devices",
        "per_device_batch_size",
        "grad_accum_steps",
        "global_batch_size",
        *(("remat",) if with_remat_column else ()),
        "memory/device",
        "model FLOPs/step/device",
        "hardware FLOPs/step/device",
        "fits",
        "",
    )


SPLIT_HEADER = split_header()

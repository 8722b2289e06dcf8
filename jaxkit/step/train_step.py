"""Train state, optimizer and the sharded train step.

The step is one pure function `(state, batch) -> (state, metrics)` run once per
micro-batch; `optax.MultiSteps` accumulates K micro-batch gradients (their mean) and
applies the inner optimizer on the K-th call. K and the learning rate are arguments of the
step (Hyper), so a batch schedule that changes K between optimizer steps compiles once.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Callable, Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxkit import mesh as mesh_lib
from jaxkit.batch.plan import Accumulation, BatchPlan
from jaxkit.batch.schedule import BatchSchedule, fixed_schedule
from jaxkit.models import (
    attention,
    build_model,
    check_mesh_divides,
    contract,
    eval_sums,
    model_loss,
)
from jaxkit.sections import RunConfig
from jaxkit.step.fused_step import fused_train_step
from jaxkit.step.optimizer import (
    Hyper,
    OneCallSteps,
    applied_grad_norm,
    float32,
    holds_accumulator,
    hyper_for,
    make_optimizer,
)


@struct.dataclass
class TrainState:
    params: Any  # nested dict of arrays, laid out as mesh.RULES say
    # Counters, the inner optimizer state and the accumulator (acc_grads: None where every
    # call is a whole optimizer step, optimizer.holds_accumulator).
    opt_state: optax.MultiStepsState
    micro_step: Any  # int32 scalar: micro-batches consumed (a spec in layout trees)

    @property
    def step(self) -> jax.Array:
        """Optimizer steps done."""
        return self.opt_state.gradient_step


def _stderr(line: str) -> None:
    print(line, file=sys.stderr)


def with_kernel(
    config: RunConfig,
    devices: Sequence[jax.Device],
    warn: Callable[[str], None] = _stderr,
) -> RunConfig:
    """`config` with model.attention the kernel that runs on `devices` (a copy where that
    differs from what it says), for a model that reads the LM options; `config` otherwise."""
    if not contract(config).READS_LM_OPTIONS:
        return config
    m, data = config.model, config.data
    assert data.seq_len is not None  # a model that reads the LM options reads rows of tokens
    kernel, note = attention.choose(
        m.attention,
        backend=attention.backend_of(devices[0]),
        compute_dtype=m.compute_dtype,
        seq_len=data.seq_len,
        document_mask=data.source == "tokens" and data.document_mask,
        fused=Accumulation(config.train.accumulation) is Accumulation.FUSED,
    )
    if note:
        warn(note)
    if m.attention == kernel:
        return config
    # one of model.attention's choices: attention.choose picks among them
    model = dataclasses.replace(m, attention=cast(Any, kernel))
    return dataclasses.replace(config, model=model)


@dataclasses.dataclass(frozen=True)
class Setup:
    """What the loop, the benchmarks and the tests need to run steps on a mesh."""

    graphdef: nnx.GraphDef
    # Laid out as the step's; K and the rate are the step's arguments. OneCallSteps where
    # the state holds no accumulator.
    tx: optax.MultiSteps | OneCallSteps
    schedule: BatchSchedule  # the plan and learning rate of every optimizer step
    state_shardings: TrainState
    batch_sharding: jax.sharding.NamedSharding  # a micro-batch: rows over the batch axes
    init: jax.stages.Wrapped  # jitted key -> state, born sharded
    # MULTISTEPS: step takes one micro-batch per call. FUSED: one (K, rows, ...) batch per
    # call, sharded as fused_batch_sharding, and makes a whole optimizer step.
    accumulation: Accumulation
    fused_batch_sharding: jax.sharding.NamedSharding
    step: jax.stages.Wrapped  # jitted (state, batch, hyper) -> (state, metrics), donated state
    eval_step: Callable  # jitted (params, batch) -> metrics
    # (params, rows) -> |gradient|² of the noise scale's small batch (noise_scale.py), its
    # rows replicated: a row or two, the same on every device.
    small_batch_grad_sq: Callable[[Any, dict[str, jax.Array]], jax.Array]
    small_batch_sharding: jax.sharding.NamedSharding

    @property
    def holds_accumulator(self) -> bool:
        """Whether the state carries MultiSteps' accumulator between calls."""
        return isinstance(self.tx, optax.MultiSteps)

    def hyper(self, plan: BatchPlan, examples: int = 0) -> Hyper:
        """K and the rate of the optimizer step under `plan` that starts at `examples`."""
        if plan.grad_accum_steps > 1 and not (
            self.holds_accumulator or self.accumulation is Accumulation.FUSED
        ):
            # Each call would apply a step of its own: a setup built for another schedule.
            raise ValueError(
                f"this step was built for one call per optimizer step; the plan has "
                f"grad_accum_steps={plan.grad_accum_steps}: build it with that plan's schedule"
            )
        return hyper_for(self.schedule, plan, examples)


def _abstract_model(config: RunConfig) -> tuple[nnx.GraphDef, nnx.State]:
    with nnx.use_eager_sharding(False):
        return nnx.split(nnx.eval_shape(lambda: build_model(config, nnx.Rngs(0))))


def abstract_params(config: RunConfig) -> dict:
    """The model's params as shapes and dtypes (nested dicts), nothing allocated."""
    return nnx.to_pure_dict(_abstract_model(config)[1])


def build(
    config: RunConfig,
    plan: BatchPlan,
    mesh: Mesh,
    schedule: BatchSchedule | None = None,
    ramps: bool = False,
) -> Setup:
    """The state layout and the jitted init, train and eval steps for one mesh and plan
    (the first stage of `schedule`, which defaults to `plan` for the whole run). `ramps`:
    the plan is one stage of a run whose batch grows past it (a split the planner compiles
    alone), so MultiSteps keeps the accumulator that run's one program holds at every K."""
    config = with_kernel(config, list(mesh.devices.flat))  # auto: the mesh's kernel
    schedule = schedule or fixed_schedule(config, plan)
    accumulation = Accumulation(config.train.accumulation)  # config.check_values checked it
    largest_k = schedule.largest.grad_accum_steps
    accumulator = holds_accumulator(accumulation is Accumulation.FUSED, largest_k, ramps)
    tx = make_optimizer(config, hyper_for(schedule, plan, 0), accumulator)
    graphdef, abstract_params = _abstract_model(config)
    # A param without a partitioning annotation gets P(): replicated (custom_model.py).
    param_specs = nnx.to_pure_dict(nnx.get_partition_spec(abstract_params))
    opt_specs = optax.tree_map_params(
        tx,
        lambda _, spec: spec,
        jax.eval_shape(lambda p: tx.init(float32(p)), nnx.to_pure_dict(abstract_params)),
        param_specs,
        transform_non_params=lambda _: P(),
        is_leaf=lambda x: isinstance(x, P),
    )
    specs = TrainState(params=param_specs, opt_state=opt_specs, micro_step=P())
    state_shardings = mesh_lib.named_shardings(mesh, specs)
    batch_sharding = mesh_lib.batch_sharding(mesh)
    replicated = mesh_lib.replicated(mesh)

    def init(key: jax.Array) -> TrainState:
        with nnx.use_eager_sharding(False):
            params = nnx.to_pure_dict(nnx.state(build_model(config, nnx.Rngs(key))))
        return TrainState(
            params=params, opt_state=tx.init(float32(params)), micro_step=jnp.zeros((), jnp.int32)
        )

    # Shardings are fixed here, at the jit boundary: state as RULES say, rows over the
    # batch axes, metrics replicated. The state is donated: its buffers are reused in place.
    fused_batch_sharding = NamedSharding(mesh, P(None, mesh_lib.BATCH_AXES))
    if accumulation is Accumulation.FUSED:
        step_fn = functools.partial(fused_train_step, graphdef=graphdef, config=config, mesh=mesh)
        step_batch_sharding = fused_batch_sharding
    else:
        step_fn = functools.partial(train_step, graphdef=graphdef, config=config)
        step_batch_sharding = batch_sharding
    step = jax.jit(
        on_mesh(step_fn, mesh),
        in_shardings=(state_shardings, step_batch_sharding, replicated),
        out_shardings=(state_shardings, replicated),
        donate_argnames="state",
    )
    evaluate = jax.jit(
        on_mesh(functools.partial(eval_step, graphdef=graphdef), mesh),
        in_shardings=(state_shardings.params, batch_sharding),
        out_shardings=replicated,
    )
    small_sq: Callable[[Any, dict[str, jax.Array]], jax.Array]
    if all(s.is_fully_replicated for s in jax.tree.leaves(state_shardings.params)):
        # Every device holds the whole params and the row: one of them takes the gradient
        # from its own copies, and the others do not repeat it (simulated CPU devices share
        # the host's cores: lm_tiny's row took 25 ms on one against 124 ms on 8).
        small_sq = functools.partial(
            _on_one_device, jax.jit(functools.partial(small_batch_grad_sq, graphdef=graphdef))
        )
    else:  # params sharded over fsdp or tensor: the devices take it together
        small_sq = jax.jit(
            on_mesh(functools.partial(small_batch_grad_sq, graphdef=graphdef), mesh),
            in_shardings=(state_shardings.params, replicated),
            out_shardings=replicated,
        )
    return Setup(
        graphdef=graphdef,
        tx=tx,
        schedule=schedule,
        state_shardings=state_shardings,
        batch_sharding=batch_sharding,
        init=jax.jit(on_mesh(init, mesh), out_shardings=state_shardings),
        accumulation=accumulation,
        fused_batch_sharding=fused_batch_sharding,
        step=step,
        eval_step=evaluate,
        small_batch_grad_sq=small_sq,
        small_batch_sharding=replicated,
    )


def abstract_state(setup: Setup) -> TrainState:
    """Shapes, dtypes and target shardings of a fresh train state, nothing allocated."""
    shapes = jax.eval_shape(setup.init, jax.random.key(0))
    return jax.tree.map(
        lambda a, sharding: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding),
        shapes,
        setup.state_shardings,
    )


def accumulator_layout(abstract: Any, held: bool) -> Any:
    """`abstract` (a state's shapes and target shardings) with MultiSteps' accumulator, laid
    out as the params and in float32 as MultiSteps keeps it, or without one (None)."""
    ms = abstract.opt_state
    if held == (ms.acc_grads is not None):
        return abstract
    acc = None
    if held:
        acc = jax.tree.map(
            lambda p: jax.ShapeDtypeStruct(p.shape, jnp.float32, sharding=p.sharding),
            abstract.params,
        )
    return abstract.replace(opt_state=ms._replace(acc_grads=acc))


def _on_one_device(fn: Callable, *trees: Any) -> Any:
    """`fn` of fully replicated arrays, run on the first device this process holds, on
    that device's copies (no transfer)."""
    return fn(*(jax.tree.map(lambda x: x.addressable_shards[0].data, t) for t in trees))


def check_on_mesh(config: RunConfig, shape: dict[str, int]) -> None:
    """What the config asks of a mesh of this shape: shards that divide evenly."""
    check_mesh_divides(config, shape)


def on_mesh(fn: Callable, mesh: Mesh) -> Callable:
    """`fn`, traced with `mesh` as the abstract mesh: the model's activation constraints
    (mesh.constrain) then apply; the shardings at the jit boundary are unchanged."""

    @functools.wraps(fn)
    def traced(*args: Any, **kwargs: Any) -> Any:
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return fn(*args, **kwargs)

    return traced


def _all_finite(tree: Any) -> jax.Array:
    return jnp.all(jnp.array([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def train_step(
    state: TrainState,
    batch: dict[str, jax.Array],
    hyper: Hyper,
    *,
    graphdef: nnx.GraphDef,
    config: RunConfig,
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One micro-step: gradient of the micro-batch's share of its step's loss (its weighted
    loss × K / the global batch's weight), fed to MultiSteps, whose mean over the K
    micro-steps is then the gradient of Σ weight × loss / Σ weight over the global batch
    (a state without an accumulator takes a whole step per call: K = 1).

    A non-finite micro-batch contributes a zero gradient (so the accumulation keeps its
    cadence of K micro-batches per optimizer step) and is counted in `nonfinite`.
    """

    def loss_fn(params: Any) -> jax.Array:
        return model_loss(nnx.merge(graphdef, params), batch)

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    grads = float32(grads)
    finite = jnp.isfinite(loss) & _all_finite(grads)
    grads = jax.tree.map(lambda g: jnp.where(finite, g, jnp.zeros_like(g)), grads)
    tx = make_optimizer(config, hyper, accumulator=state.opt_state.acc_grads is not None)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    new_state = TrainState(
        params=optax.apply_updates(state.params, updates),
        opt_state=opt_state,
        micro_step=state.micro_step + 1,
    )
    metrics = {
        "loss": loss,
        "grad_norm": applied_grad_norm(opt_state),
        "nonfinite": (~finite).astype(jnp.int32),  # micro-batches skipped by this call
    }
    return new_state, metrics


def small_batch_grad_sq(
    params: Any, rows: dict[str, jax.Array], *, graphdef: nnx.GraphDef
) -> jax.Array:
    """|∇ Σ loss_weights × loss|² over `rows`, whose loss_weights sum to 1: the squared norm
    of the noise scale's small-batch gradient (noise_scale.py, data.load_small_batch)."""

    def loss_fn(p: Any) -> jax.Array:
        return model_loss(nnx.merge(graphdef, p), rows)

    return optax.tree.norm(float32(jax.grad(loss_fn)(params))) ** 2


def eval_step(
    params: Any, batch: dict[str, jax.Array], *, graphdef: nnx.GraphDef
) -> dict[str, jax.Array]:
    """Σ weight × loss and Σ weight × hit over the batch's targets (padding rows weigh 0),
    and Σ weight: the caller divides once at the end, as a training step's loss does."""
    return eval_sums(nnx.merge(graphdef, params), batch)

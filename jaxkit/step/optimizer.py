"""The optimizer: optax.MultiSteps around (gradient norm, clip, adamw | sgd).

K (micro-steps per optimizer step) and the learning rate are not baked into the optimizer:
they arrive with each call as a `Hyper`, so a batch schedule that changes K between optimizer
steps runs one compiled step, and the rate follows a curve laid over examples on the host.

The accumulator is held only where a step's micro-batches arrive in several calls (MultiSteps
mode at K > 1 somewhere in the run): at K = 1, and in fused mode (which sums inside its one
call), every call is a whole optimizer step and the state keeps MultiSteps' layout with
`acc_grads` None (`OneCallSteps`), one params-sized float32 buffer less between steps.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxkit.batch.plan import BatchPlan
from jaxkit.batch.schedule import BatchSchedule
from jaxkit.config import ConfigError
from jaxkit.sections import RunConfig


class Hyper(NamedTuple):
    """What may change between optimizer steps without a recompile: traced, not static."""

    grad_accum_steps: Any  # int32 scalar: K of the current stage of the batch schedule
    learning_rate: Any  # float32 scalar: the rate of the optimizer step being accumulated


def hyper_for(schedule: BatchSchedule, plan: BatchPlan, examples: int) -> Hyper:
    """The Hyper of the optimizer step that starts reading at stream example `examples`."""
    return Hyper(
        np.int32(plan.grad_accum_steps), np.float32(schedule.learning_rate(examples, plan))
    )


def decays(scan_layers: bool) -> Any:
    """The weight-decay mask: matrices only, not norm scales or biases. Scanned blocks
    carry a leading layer axis (params under "blocks"), which does not make a vector a
    matrix."""

    def is_matrix(path: tuple, p: Any) -> bool:
        stacked = scan_layers and any(getattr(k, "key", None) == "blocks" for k in path)
        return p.ndim - stacked >= 2

    return lambda params: jax.tree_util.tree_map_with_path(is_matrix, params)


def float32(tree: Any) -> Any:
    """`tree` in float32: gradients are accumulated, and optimizer moments kept, in float32
    whatever the params' dtype (bfloat16 sums lose the small micro-batch contributions)."""
    return jax.tree.map(lambda x: x.astype(jnp.float32), tree)


def make_optimizer(
    config: RunConfig, hyper: Hyper, accumulator: bool = True
) -> optax.MultiSteps | OneCallSteps:
    """MultiSteps(K) around (record norm, clip, adamw | sgd), K and the rate from `hyper`;
    without `accumulator`, OneCallSteps around the same chain (every call one step).

    Built inside the traced step, so K and the rate are arguments of one compiled program
    (the batch schedule changes them without a recompile). The rate is a schedule that
    ignores its count: the host lays the schedule over examples (batch_schedule), and the
    state keeps the layout of a scheduled optimizer. The inner chain always has these three
    parts (clip may be the identity), so its state is laid out the same whatever the config:
    (GradNormState, clip state, optimizer state).
    """
    o = config.optimizer
    mask = decays(config.model.scan_layers)

    def rate(count: Any) -> Any:
        del count
        return hyper.learning_rate

    if o.name == "adamw":
        inner = optax.adamw(rate, b1=o.b1, b2=o.b2, weight_decay=o.weight_decay, mask=mask)
    elif o.name == "sgd":
        decay = optax.add_decayed_weights(o.weight_decay, mask=mask)
        inner = optax.chain(decay, optax.sgd(rate, momentum=o.momentum or None))
    else:
        raise ConfigError(f"optimizer.name={o.name!r} is not one of adamw, sgd")
    clip = optax.clip_by_global_norm(o.grad_clip_norm) if o.grad_clip_norm > 0 else optax.identity()
    inner = optax.chain(record_grad_norm(), clip, inner)
    if not accumulator:
        return OneCallSteps(inner)
    return optax.MultiSteps(inner, every_k_schedule=lambda _: hyper.grad_accum_steps)


def holds_accumulator(fused: bool, largest_grad_accum_steps: int, ramps: bool = False) -> bool:
    """Whether the train state carries an accumulator between calls: only MultiSteps mode
    does, and only where some step of the run takes more than one call. A run whose K
    changes (`ramps`: a batch schedule, whose stages change only K) keeps it at every K,
    K = 1 included: one compiled program."""
    return not fused and (ramps or largest_grad_accum_steps > 1)


class OneCallSteps:
    """MultiSteps at K = 1 without its accumulator: every call applies the inner optimizer.

    The state is MultiSteps' (`gradient_step` the optimizer steps, `mini_step` 0) with
    `acc_grads` None, so the step count, the inner state and the checkpoints' layout are
    those of the MultiSteps state, less the buffer that holds zeros at every boundary.
    The update is what MultiSteps applies at K = 1 (the mean of one gradient is itself).
    """

    def __init__(self, inner: optax.GradientTransformation):
        self.inner_opt = inner

    def init(self, params: Any) -> optax.MultiStepsState:
        return optax.MultiStepsState(
            mini_step=jnp.zeros([], jnp.int32),
            gradient_step=jnp.zeros([], jnp.int32),
            inner_opt_state=self.inner_opt.init(params),
            acc_grads=None,
            skip_state=(),
        )

    def update(
        self, updates: Any, state: optax.MultiStepsState, params: Any = None
    ) -> tuple[Any, optax.MultiStepsState]:
        updates, inner = self.inner_opt.update(updates, state.inner_opt_state, params)
        return updates, state._replace(gradient_step=state.gradient_step + 1, inner_opt_state=inner)


class GradNormState(NamedTuple):
    grad_norm: jax.Array  # float32: global norm of the gradient the optimizer last applied


def record_grad_norm() -> optax.GradientTransformation:
    """Passes updates through and keeps their global norm in its state.

    Inside MultiSteps it sees the accumulated mean gradient, and its state is kept only on
    the K-th micro-step: so it holds the norm of each optimizer step's gradient.
    """

    def init(params: Any) -> GradNormState:
        del params
        return GradNormState(jnp.zeros((), jnp.float32))

    def update(updates: Any, state: GradNormState, params: Any = None) -> tuple:
        del state, params
        return updates, GradNormState(optax.tree.norm(updates))

    return optax.GradientTransformation(init, update)


def applied_grad_norm(opt_state: optax.MultiStepsState) -> jax.Array:
    """The norm of the gradient of the last optimizer step (before clipping)."""
    return opt_state.inner_opt_state[0].grad_norm

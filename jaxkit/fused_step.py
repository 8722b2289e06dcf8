"""Fused accumulation: one jit call and one gradient reduction across "data" per step.

`optax.MultiSteps` called once per micro-batch all-reduces the gradient K times per
optimizer step, and so does a `lax.scan` under plain jit (XLA keeps the all-reduce inside
the loop). Here `jax.shard_map`, manual over the "data" axis only, makes each data group
sum its own micro-batch gradients over a local scan, and a single `pmean` crosses "data"
once per optimizer step. Inside a group the "fsdp" and "tensor" axes stay with the
compiler: params, gradients and the accumulator keep the params' sharding (the gradient is
reduce-scattered over "fsdp" at each micro-step, so the accumulator is sharded, as
MaxText's default), and the tensor axis splits the work as it does in MultiSteps mode. The
loss, the model and the inner optimizer are the ones the MultiSteps step uses, and the
state keeps MultiSteps' layout, so checkpoints move between the modes at optimizer-step
boundaries.

A step in which any micro-batch is non-finite is skipped as a whole: the devices only learn
of it after the local sums, when a micro-batch can no longer be taken out. Params and the
optimizer's moments stay as they were; its step counts advance with `gradient_step`, so
the learning-rate schedule and the optimizer step stay one count, as in MultiSteps mode
(where a bad micro-batch adds a zero gradient and the step is applied).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxkit.models import cross_entropy
from jaxkit.optimizer import Hyper, float32, make_optimizer


def fused_train_step(
    state: Any,
    batch: dict[str, jax.Array],
    hyper: Hyper,
    *,
    graphdef: nnx.GraphDef,
    config: Any,
    mesh: Mesh,
) -> tuple[Any, dict[str, jax.Array]]:
    """One optimizer step on a (K, micro_batch, ...) batch: local scan, one pmean."""
    accum_steps = jax.tree.leaves(batch)[0].shape[0]  # K is in the batch's shape here
    tx = make_optimizer(config, hyper)

    def accumulate(params: Any, batch_KxB: dict[str, jax.Array]) -> tuple[Any, ...]:
        """Mean gradient, mean loss, non-finite micro-batches and mean |micro-batch
        gradient|² over this group's rows of the K micro-batches, summed in a local scan."""

        def micro(grad_sum: Any, mb: dict[str, jax.Array]) -> tuple[Any, tuple]:
            def loss_fn(p: Any) -> jax.Array:
                return cross_entropy(nnx.merge(graphdef, p)(mb["inputs"]), mb["targets"])

            loss, grads = jax.value_and_grad(loss_fn)(params)
            grads = float32(grads)
            norm = optax.tree.norm(grads)
            finite = jnp.isfinite(loss) & jnp.isfinite(norm)
            return jax.tree.map(jnp.add, grad_sum, grads), (loss, ~finite, norm**2)

        zeros = jax.tree.map(jnp.zeros_like, float32(params))
        grad_sum, (losses, nonfinite, small_sq) = jax.lax.scan(micro, zeros, batch_KxB)
        return (
            jax.tree.map(lambda g: g / accum_steps, grad_sum),
            jnp.mean(losses),
            jnp.sum(nonfinite).astype(jnp.float32),
            jnp.mean(small_sq),
        )

    def per_data_group(params: Any, batch_KxB: dict[str, jax.Array]) -> tuple[Any, ...]:
        # Params are invariant across "data"; grad would then insert its own psum. Marking
        # them varying keeps the gradient local until the one pmean below.
        params = jax.tree.map(lambda p: jax.lax.pcast(p, "data", to="varying"), params)
        # The one reduction across "data" of the step: the mean over K micro-batches and
        # the data groups is the global batch's mean gradient (equal-sized micro-batches).
        return jax.lax.pmean(accumulate(params, batch_KxB), "data")

    if mesh.shape["data"] == 1:  # no data groups to reduce over (XLA rejects a 1-way one)
        grads, loss, bad, small_sq = accumulate(state.params, batch)
    else:
        # Manual over "data" only: fsdp and tensor stay with the compiler, which keeps
        # params, gradients and the accumulator sharded as the params are.
        grads, loss, bad, small_sq = jax.shard_map(
            per_data_group,
            mesh=mesh,
            in_specs=(P(), P(None, "data")),
            out_specs=(P(), P(), P(), P()),
            axis_names={"data"},
        )(state.params, batch)

    ms = state.opt_state
    updates, inner = tx.inner_opt.update(grads, ms.inner_opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    ok = bad == 0

    def keep(new: Any, old: Any) -> Any:
        """`new` for a good step; for a skipped one `old`, but for the step counts (the
        only integer leaves of the optimizer state), which advance as gradient_step does."""

        def pick(n: jax.Array, o: jax.Array) -> jax.Array:
            return n if jnp.issubdtype(n.dtype, jnp.integer) else jnp.where(ok, n, o)

        return jax.tree.map(pick, new, old)

    opt_state = optax.MultiStepsState(
        mini_step=ms.mini_step,
        gradient_step=ms.gradient_step + 1,  # a skipped step still counts, as the data moved on
        inner_opt_state=keep(inner, ms.inner_opt_state),
        acc_grads=ms.acc_grads,
        skip_state=ms.skip_state,
    )
    new_state = state.replace(
        params=keep(params, state.params),
        opt_state=opt_state,
        micro_step=state.micro_step + accum_steps,
    )
    metrics = {
        # Micro-batches that did not reach the params: all K of a skipped step.
        "nonfinite": jnp.where(ok, 0, accum_steps).astype(jnp.int32),
        "loss": loss,
        "grad_norm": inner[0].grad_norm,  # not finite for a skipped step; not logged then
        # Mean |gradient|² of one device's share of a micro-batch (per_device rows).
        "small_grad_sq": small_sq,
    }
    return new_state, metrics

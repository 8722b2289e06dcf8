"""Fused accumulation: one jit call and one gradient reduction across "data" per step.

`optax.MultiSteps` called once per micro-batch all-reduces the gradient K times per
optimizer step, and so does a `lax.scan` under plain jit (XLA keeps the all-reduce inside
the loop). Here `jax.shard_map`, manual over the "data" axis only, makes each data group
sum its own micro-batch gradients over a local scan, and a single `psum` crosses "data"
once per optimizer step. Inside a group the "fsdp" and "tensor" axes stay with the
compiler: params, gradients and the accumulator keep the params' sharding (the gradient is
reduce-scattered over "fsdp" at each micro-step, so the accumulator is sharded, as
MaxText's default), and the tensor axis splits the work as it does in MultiSteps mode. The
loss, the model and the inner optimizer are the ones the MultiSteps step uses, and the
state keeps MultiSteps' layout without its accumulator (optimizer.OneCallSteps: every call
is a whole step), so checkpoints move between the modes at optimizer-step boundaries. The
micro-batch gradients are summed in a buffer of the step's own, which lives only while the
step runs: between steps the state holds params and the optimizer's moments alone.

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

from jaxkit.models import model_loss
from jaxkit.step.optimizer import Hyper, OneCallSteps, float32, make_optimizer


def fused_train_step(
    state: Any,
    batch: dict[str, jax.Array],
    hyper: Hyper,
    *,
    graphdef: nnx.GraphDef,
    config: Any,
    mesh: Mesh,
) -> tuple[Any, dict[str, jax.Array]]:
    """One optimizer step on a (K, micro_batch, ...) batch: local scan, one psum."""
    accum_steps = jax.tree.leaves(batch)[0].shape[0]  # K is in the batch's shape here
    tx = make_optimizer(config, hyper, accumulator=False)

    groups = mesh.shape["data"]

    def micro(params: Any, mb: dict[str, jax.Array]) -> tuple[Any, jax.Array, jax.Array]:
        """One micro-batch's float32 gradient, its loss and whether either is not finite."""

        def loss_fn(p: Any) -> jax.Array:
            return model_loss(nnx.merge(graphdef, p), mb)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        grads = float32(grads)
        return grads, loss, ~(jnp.isfinite(loss) & jnp.isfinite(optax.tree.norm(grads)))

    def accumulate(params: Any, acc_grads: Any, batch_KxB: dict[str, jax.Array]) -> tuple[Any, ...]:
        """Gradient and loss summed over this group's rows of the K micro-batches (the
        loader's weights make the sum over every group the global batch's Σ w·loss / Σ w),
        and the non-finite micro-batches. K > 1 sums into `acc_grads` (zeros)."""
        if accum_steps == 1:  # no scan: the TPU compiler ran a one-trip scan's layers twice
            grads, loss, bad = micro(params, jax.tree.map(lambda x: x[0], batch_KxB))
            return grads, loss, bad.astype(jnp.float32)

        def add_micro(grad_sum: Any, mb: dict[str, jax.Array]) -> tuple[Any, tuple]:
            # The barrier makes the params a value of this trip: otherwise XLA hoists their
            # fsdp all-gathers and layout copies out of the loop and holds every layer's
            # gathered weights through the whole scan, where MultiSteps gathers them within
            # each micro-step (CPU, 2x2x2: 3.3 MiB more per device at K = 8).
            p, mb = jax.lax.optimization_barrier((params, mb))
            grads, loss, bad = micro(p, mb)
            return jax.tree.map(jnp.add, grad_sum, grads), (loss, bad)

        grad_sum, (losses, nonfinite) = jax.lax.scan(add_micro, acc_grads, batch_KxB)
        return grad_sum, jnp.sum(losses), jnp.sum(nonfinite).astype(jnp.float32)

    def per_data_group(
        params: Any, acc_grads: Any, batch_KxB: dict[str, jax.Array]
    ) -> tuple[Any, ...]:
        # Params are invariant across "data"; grad would then insert its own psum. Marking
        # them varying keeps the gradient local until the one reduction below (the
        # accumulator too: each group sums into its copy, and zeros add nothing).
        params, acc_grads = jax.tree.map(
            lambda x: jax.lax.pcast(x, "data", to="varying"), (params, acc_grads)
        )
        # The one reduction across "data" of the step: the groups' sums add up to the
        # global batch's gradient and loss.
        return jax.lax.psum(accumulate(params, acc_grads, batch_KxB), "data")

    # The sums' buffer, the step's own: it lives while the step runs (K = 1 needs none),
    # where MultiSteps mode keeps one in the state between calls.
    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), state.params)
    if groups == 1:  # no data groups to reduce over (XLA rejects a 1-way one)
        grads, loss, bad = accumulate(state.params, zeros, batch)
    else:
        # Manual over "data" only: fsdp and tensor stay with the compiler, which keeps
        # params, gradients and the accumulator sharded as the params are.
        grads, loss, bad = jax.shard_map(
            per_data_group,
            mesh=mesh,
            in_specs=(P(), P(), P(None, "data")),
            out_specs=(P(), P(), P()),
            axis_names={"data"},
        )(state.params, zeros, batch)

    return _applied(state, tx, grads, loss, bad, accum_steps)


def _applied(
    state: Any,
    tx: OneCallSteps,
    grads: Any,
    loss: jax.Array,
    bad: jax.Array,
    accum_steps: int,
) -> tuple[Any, dict[str, jax.Array]]:
    """The optimizer step from the step's summed gradient, in MultiSteps' state layout; a
    step with a non-finite micro-batch (`bad` > 0) is skipped whole."""
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
        acc_grads=None,  # the sums lived in the step alone
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
    }
    return new_state, metrics

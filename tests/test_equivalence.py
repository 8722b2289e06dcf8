"""The four seed splits of a global batch of 32 train the same model as one big batch.

The reference is written here with jax + optax alone: one device, the whole global batch
per step, no MultiSteps and no jaxkit train step; only the model's forward pass and the
data order come from jaxkit (they are what the splits must agree on).
"""

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from small_configs import SMALL_LM

from jaxkit.batch_plan import plan_from_config
from jaxkit.config import apply_overrides, load_config
from jaxkit.data import global_batch_rows, make_sources
from jaxkit.loop import train
from jaxkit.mesh import make_mesh, mesh_shape
from jaxkit.models import build_model
from jaxkit.train_step import build

STEPS = 5
# (devices, per-device batch, accumulation steps): all give a global batch of 32.
SEED_SPLITS = [(1, 32, 1), (4, 8, 1), (2, 8, 2), (1, 8, 4)]
SMALL = {
    "mlp_digits": [],
    "lm_tiny": SMALL_LM,
}
# float32 round-off: the splits sum the same per-example gradients in a different order
# (per device, across devices, across micro-steps), so each gradient differs from the
# reference by a few ulps (~1e-7 relative). Measured over five adamw steps: losses within
# 4.7e-7 relative, params within 1.7e-7 absolute (weights are O(0.1), so a few ulps).
# 2e-6 and 1e-6 bound that with a 4-6x margin, while a real mistake (a dropped
# micro-batch, a sum instead of a mean, a schedule that advances per micro-step) moves
# the losses by more than 1e-3. (A parameter whose true gradient is zero would break
# this: Adam turns round-off-sized gradients into lr-sized steps of random sign. That is
# why the attention key projection has no bias.)
LOSS_RTOL = 2e-6
PARAM_ATOL = 1e-6


def small_config(name, devices, per_device):
    config = load_config(name)
    apply_overrides(
        config,
        SMALL[name]
        + [
            "batch.global_batch_size=32",
            f"batch.per_device_batch_size={per_device}",
            "batch.grad_accum_steps=null",
            f"train.steps={STEPS}",
            "train.log_every=1",
            "train.eval_every=0",
            "train.eval_batches=1",
            "optimizer.warmup_steps=2",
            "mesh.data=-1",
        ],
    )
    return config


def reference_run(config, init_params):
    """Plain full-batch training on one device with optax.adamw."""
    o = config.optimizer
    with nnx.use_eager_sharding(False):
        graphdef, _ = nnx.split(nnx.eval_shape(lambda: build_model(config, nnx.Rngs(0))))
    schedule = optax.warmup_cosine_decay_schedule(
        o.learning_rate / o.warmup_steps,
        o.learning_rate,
        o.warmup_steps,
        max(STEPS, o.warmup_steps + 1),
        o.learning_rate * o.final_lr_fraction,
    )
    matrices = lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)  # noqa: E731
    tx = optax.adamw(schedule, b1=o.b1, b2=o.b2, weight_decay=o.weight_decay, mask=matrices)
    if o.grad_clip_norm > 0:
        tx = optax.chain(optax.clip_by_global_norm(o.grad_clip_norm), tx)

    @jax.jit
    def step(params, opt_state, inputs, targets):
        def loss_fn(p):
            logits = nnx.merge(graphdef, p)(inputs)
            return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    source, _ = make_sources(config)
    params = jax.device_put(init_params, jax.devices()[0])
    opt_state, losses = tx.init(params), []
    for i in range(STEPS):
        batch = source[global_batch_rows(i, 32, len(source), config.train.seed)]
        params, opt_state, loss = step(params, opt_state, batch["inputs"], batch["targets"])
        losses.append(float(loss))
    return np.array(losses), jax.device_get(params)


@pytest.mark.parametrize("name", ["mlp_digits", "lm_tiny"])
def test_seed_splits_match_a_full_batch_reference(name):
    runs = {}
    for devices, per_device, accum in SEED_SPLITS:
        config = small_config(name, devices, per_device)
        result = train(
            config, devices=jax.devices()[:devices], progress=False, echo=lambda *a: None
        )
        plan = result.plan
        assert (plan.data_parallel_size, plan.per_device_batch_size, plan.grad_accum_steps) == (
            devices,
            per_device,
            accum,
        )
        losses = np.array([r["loss"] for r in result.records if "loss" in r])
        assert len(losses) == STEPS
        assert int(result.state.step) == STEPS and int(result.state.micro_step) == STEPS * accum
        runs[(devices, per_device, accum)] = (losses, jax.device_get(result.state.params))

    # Same seed, same init: the reference starts from the params jaxkit initialises.
    config = small_config(name, 1, 32)
    mesh = make_mesh(config.mesh.to_dict(), jax.devices()[:1])
    setup = build(config, plan_from_config(config, mesh_shape(mesh)), mesh)
    init = jax.device_get(setup.init(jax.random.key(config.train.seed)).params)
    ref_losses, ref_params = reference_run(config, init)
    assert ref_losses[-1] < ref_losses[0]  # the reference itself trains

    for split, (losses, params) in runs.items():
        np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL, err_msg=str(split))
        worst = max(
            float(np.max(np.abs(a - b)))
            for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params), strict=True)
        )
        assert worst < PARAM_ATOL, (split, worst)

"""The four seed splits of a global batch of 32 train the same model as one big batch:
the same losses, gradient norms and params, under adamw and under sgd.

The reference is written here with jax + optax alone: one device, the whole global batch
per step, loss Σ weight × loss / Σ weight (the plain mean where rows carry no weights), no
MultiSteps and no jaxkit train step; only the model's forward pass and the data order come
from jaxkit (they are what the splits must agree on).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from small_configs import SMALL_LM

from jaxkit.batch.schedule import plan_from_config
from jaxkit.config import apply_overrides, load_config, run_config
from jaxkit.data.sources import global_batch_rows, make_sources
from jaxkit.mesh import make_mesh, mesh_shape
from jaxkit.models import build_model
from jaxkit.step.train_step import build
from jaxkit.train.loop import train

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
# The logged grad_norm is the norm of the accumulated gradient before clipping; the
# reference's is the norm of the full-batch gradient. Both sum the same per-example
# gradients in another order, so they differ by round-off of the squared-norm sum
# (~1e-7 relative in float32). Measured: within 1.8e-7 relative on every split, both
# models, adamw and sgd, five steps. 1e-6 keeps a 5x margin; a sum of the K micro-batch
# gradients instead of their mean is off by K - 1 = 100% or 300%. (On lm_tiny the
# gradient norm is ~3-11 against grad_clip_norm=1, and Adam ignores a gradient's scale:
# so under adamw the losses cannot see such a scale error, only this norm can.)
GRAD_NORM_RTOL = 1e-6

# SGD is linear in the gradient, so a wrong gradient scale moves every parameter. Clipping
# is off here (the clip would rescale a too-large gradient back to the same update) and the
# learning rate is high enough for five steps to train. Only the splits that accumulate:
# K = 2 and K = 4 micro-batches per step.
SGD_SPLITS = [(2, 8, 2), (1, 8, 4)]
SGD_OVERRIDES = ["optimizer.name=sgd", "optimizer.learning_rate=0.1", "optimizer.grad_clip_norm=0"]
# Measured over five steps: losses within 2.2e-7 relative (LOSS_RTOL applies), params
# within 1.8e-7 absolute: round-off of gradients summed in another order, times the
# learning rate, summed over steps with momentum. 1e-6 keeps a 5x margin; a summed
# gradient moves the params by (K - 1) x lr x |g| per step, orders of magnitude more.
SGD_PARAM_ATOL = 1e-6


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
            "train.eval_examples=32",
            "optimizer.warmup_steps=2",
            "mesh.data=-1",
        ],
    )
    return config


def reference_schedule(config):
    """The learning rate of each step, as jaxkit's config gives it."""
    o = config.optimizer
    return optax.warmup_cosine_decay_schedule(
        o.learning_rate / o.warmup_steps,
        o.learning_rate,
        o.warmup_steps,
        max(STEPS, o.warmup_steps + 1),
        o.learning_rate * o.final_lr_fraction,
    )


# Adam divides each gradient by its own running size, so an element whose gradient is
# round-off-sized against the sum that forms it moves by up to the learning rate a step, of
# either sign (why the attention key projection has no bias, above). The llama-family models
# have a few such elements: 1 or 2 of 24,000-32,000 land 1.1e-6 to 1.9e-6 from the reference
# while 99.9% stay within 3e-8, and which ones depends on the CPU compiler's arithmetic
# (Python 3.12's bytes, jax 0.12, YNNPACK's fusions on or off: docs/contributing.md#jax-012).
# For them: every element within Adam's bound, the sum of the steps' rates, and at most
# ROUNDOFF_ELEMENTS beyond PARAM_ATOL. A real mistake moves thousands of elements.
ROUNDOFF_ELEMENTS = 4


def assert_adam_params_match(params, ref_params, config, what=""):
    diffs = np.concatenate(
        [
            np.abs(np.asarray(a) - np.asarray(b)).ravel()
            for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params), strict=True)
        ]
    )
    schedule = reference_schedule(config)
    adam_bound = sum(float(schedule(i)) for i in range(STEPS))
    assert diffs.max() < adam_bound, (what, diffs.max(), adam_bound)
    assert np.sum(diffs >= PARAM_ATOL) <= ROUNDOFF_ELEMENTS, (what, np.sort(diffs)[-8:])


def reference_run(config, init_params):
    """Plain full-batch training on one device with optax (adamw, or sgd with momentum).

    Returns the loss and the gradient's global norm (before clipping) of every step, and the
    params before every step and after the last (STEPS + 1 entries).
    """
    o = config.optimizer
    with nnx.use_eager_sharding(False):
        graphdef, _ = nnx.split(nnx.eval_shape(lambda: build_model(config, nnx.Rngs(0))))
    schedule = reference_schedule(config)
    matrices = lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)  # noqa: E731
    if o.name == "adamw":
        tx = optax.adamw(schedule, b1=o.b1, b2=o.b2, weight_decay=o.weight_decay, mask=matrices)
    else:  # sgd: L2 weight decay on matrices added to the gradient, then heavy-ball momentum
        assert o.name == "sgd"
        tx = optax.chain(
            optax.add_decayed_weights(o.weight_decay, mask=matrices),
            optax.sgd(schedule, momentum=o.momentum or None),
        )
    if o.grad_clip_norm > 0:
        tx = optax.chain(optax.clip_by_global_norm(o.grad_clip_norm), tx)

    @jax.jit
    def step(params, opt_state, inputs, targets, weights):
        def loss_fn(p):  # Σ weight × loss / Σ weight: the mean where every weight is 1
            logits = nnx.merge(graphdef, p)(inputs)
            losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
            return jnp.sum(weights * losses) / jnp.sum(weights)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, optax.tree.norm(grads)

    source, _ = make_sources(config)
    params = jax.device_put(init_params, jax.devices()[0])
    # Committed to the device as the step's outputs are: an optimizer state fresh from
    # tx.init would make the second call compile the step again.
    opt_state = jax.device_put(tx.init(params), jax.devices()[0])
    losses, grad_norms = [], []
    trajectory = [jax.device_get(params)]
    for i in range(STEPS):
        batch = source[global_batch_rows(i, 32, len(source), config.train.seed)]
        weights = batch.get("weights", np.ones(batch["targets"].shape, np.float32))
        params, opt_state, loss, grad_norm = step(
            params, opt_state, batch["inputs"], batch["targets"], weights
        )
        losses.append(float(loss))
        grad_norms.append(float(grad_norm))
        trajectory.append(jax.device_get(params))
    return np.array(losses), np.array(grad_norms), trajectory


def run_splits(name, splits, overrides=()):
    """{split: (losses, grad_norms, final params)} of jaxkit training each split."""
    runs = {}
    for devices, per_device, accum in splits:
        config = small_config(name, devices, per_device)
        apply_overrides(config, list(overrides))
        result = train(
            config, devices=jax.devices()[:devices], progress=False, echo=lambda *a: None
        )
        plan = result.plan
        assert (plan.data_parallel_size, plan.per_device_batch_size, plan.grad_accum_steps) == (
            devices,
            per_device,
            accum,
        )
        logged = [r for r in result.records if "loss" in r]
        assert [r["step"] for r in logged] == list(range(1, STEPS + 1))
        assert int(result.state.step) == STEPS and int(result.state.micro_step) == STEPS * accum
        runs[(devices, per_device, accum)] = (
            np.array([r["loss"] for r in logged]),
            np.array([r["grad_norm"] for r in logged]),
            jax.device_get(result.state.params),
        )
    return runs


def reference_for(name, overrides=()):
    """The full-batch reference, from the params jaxkit initialises (same seed, same init)."""
    config = small_config(name, 1, 32)
    apply_overrides(config, list(overrides))
    mesh = make_mesh(config.mesh.to_dict(), jax.devices()[:1])
    typed = run_config(config)
    setup = build(typed, plan_from_config(typed, mesh_shape(mesh)), mesh)
    init = jax.device_get(setup.init(jax.random.key(config.train.seed)).params)
    return reference_run(typed, init)


def max_param_diff(params, ref_params):
    return max(
        float(np.max(np.abs(a - b)))
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params), strict=True)
    )


@pytest.mark.parametrize("name", ["mlp_digits", "lm_tiny"])
def test_seed_splits_match_a_full_batch_reference(name):
    runs = run_splits(name, SEED_SPLITS)
    ref_losses, ref_grad_norms, trajectory = reference_for(name)
    ref_params = trajectory[-1]
    assert ref_losses[-1] < ref_losses[0]  # the reference itself trains

    for split, (losses, grad_norms, params) in runs.items():
        np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL, err_msg=str(split))
        np.testing.assert_allclose(
            grad_norms, ref_grad_norms, rtol=GRAD_NORM_RTOL, err_msg=f"grad_norm {split}"
        )
        worst = max_param_diff(params, ref_params)
        assert worst < PARAM_ATOL, (split, worst)


@pytest.mark.parametrize("name", ["mlp_digits", "lm_tiny"])
def test_accumulated_sgd_matches_a_full_batch_reference(name):
    """With an optimizer that feels the gradient's scale: MultiSteps must average."""
    runs = run_splits(name, SGD_SPLITS, SGD_OVERRIDES)
    ref_losses, ref_grad_norms, trajectory = reference_for(name, SGD_OVERRIDES)
    ref_params = trajectory[-1]
    assert ref_losses[-1] < ref_losses[0]  # the reference itself trains

    for split, (losses, grad_norms, params) in runs.items():
        np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL, err_msg=str(split))
        np.testing.assert_allclose(
            grad_norms, ref_grad_norms, rtol=GRAD_NORM_RTOL, err_msg=f"grad_norm {split}"
        )
        worst = max_param_diff(params, ref_params)
        assert worst < SGD_PARAM_ATOL, (split, worst)

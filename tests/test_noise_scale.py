"""The gradient noise scale: the estimator against a closed form, and the step's inputs to it."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from test_equivalence import STEPS, reference_for, small_config

from jaxkit import data as data_lib
from jaxkit import mesh as mesh_lib
from jaxkit.batch_schedule import plan_from_config
from jaxkit.config import apply_overrides, load_config
from jaxkit.loop import train
from jaxkit.models import build_model, cross_entropy
from jaxkit.noise_scale import NoiseScale, unbiased_estimates
from jaxkit.train_step import build

# The logged estimates against ones recomputed from float32 gradients taken here: the
# squared norms agree to ~2e-7 relative (summation order), and the |G|² estimate, a
# difference B_big·|G_big|² − B_small·|G_small|², amplifies that by its condition number,
# (B_big·big + B_small·small) / |B_big·big − B_small·small|, about 6 on these smoothed
# values. Measured: within 5.8e-7 relative (fused |G|², step 1), 1e-7 elsewhere. 5e-6 keeps
# an 8x margin; a wrong B_small (per-device rows for a micro-batch: 1 for 8) is off by
# tens of percent to 27x, a missing bias correction by 1/(1 − dⁿ).
NOISE_RTOL = 5e-6


def test_estimates_match_linear_regression_in_closed_form():
    """Least squares y = x·w* + ε with x ~ N(0, I_d), ε ~ N(0, σ²), at w = w* + δ.

    A row's gradient of ½(x·w − y)² is g = x(x·δ − ε), so G = E[g] = δ and, by Isserlis,
    Σ = δδᵀ + (|δ|² + σ²) I: tr Σ = (d + 1)|δ|² + dσ², B_simple = d + 1 + dσ²/|δ|².
    """
    d, sigma, b_small, b_big, draws = 8, 2.0, 4, 64, 4000
    rng = np.random.default_rng(0)
    delta = rng.normal(size=d)
    delta /= np.linalg.norm(delta)  # |δ| = 1
    true_grad_sq, true_trace = 1.0, (d + 1) + d * sigma**2
    true_b = true_trace / true_grad_sq  # 41

    def mean_sq_norm(b: int) -> np.ndarray:
        x = rng.normal(size=(draws, b, d))
        eps = rng.normal(scale=sigma, size=(draws, b))
        g = np.mean(x * (x @ delta - eps)[..., None], axis=1)  # one batch mean per draw
        return np.sum(g**2, axis=1)

    small, big = mean_sq_norm(b_small), mean_sq_norm(b_big)
    grad_sq, trace = unbiased_estimates(small.mean(), big.mean(), b_small, b_big)
    # Tolerance from the draws themselves: 4 standard errors of each estimate (the two
    # batch sizes are independent). The test is only meaningful if those are small.
    se_small, se_big = small.std() / np.sqrt(draws), big.std() / np.sqrt(draws)
    se_grad_sq = np.hypot(b_big * se_big, b_small * se_small) / (b_big - b_small)
    se_trace = np.hypot(se_small, se_big) / (1 / b_small - 1 / b_big)
    assert se_grad_sq < 0.1 * true_grad_sq and se_trace < 0.05 * true_trace
    assert abs(grad_sq - true_grad_sq) < 4 * se_grad_sq
    assert abs(trace - true_trace) < 4 * se_trace
    assert trace / grad_sq == pytest.approx(true_b, rel=0.25)

    # The online estimator, fed one (small, big) pair per step, settles near the same value.
    online = NoiseScale(b_small, b_big, decay=0.999)
    for s, g in zip(small, big, strict=True):
        estimate = online.update(s, g)
    assert estimate["noise_scale"] == pytest.approx(true_b, rel=0.25)


def test_smoothing_is_bias_corrected_and_survives_a_save():
    ns = NoiseScale(b_small=8, b_big=32, decay=0.9)
    assert ns.estimate() == {}
    grad_sq, trace = unbiased_estimates(2.0, 1.0, 8, 32)
    for _ in range(3):  # constant inputs: the corrected averages are those inputs exactly
        out = ns.update(2.0, 1.0)
    assert out["grad_sq_estimate"] == pytest.approx(grad_sq, rel=1e-12)
    assert out["grad_var_estimate"] == pytest.approx(trace, rel=1e-12)
    assert out["noise_scale"] == pytest.approx(trace / grad_sq, rel=1e-12)
    restored = NoiseScale(b_small=8, b_big=32, decay=0.9)
    restored.load(ns.state())
    assert restored.estimate() == out
    with pytest.raises(ValueError, match="b_small < b_big"):
        unbiased_estimates(1.0, 1.0, 32, 32)


@pytest.mark.parametrize("accumulation", ["multisteps", "fused"])
def test_the_step_reports_the_small_batch_gradient_norm(accumulation):
    """multisteps: |gradient of the micro-batch|²; fused: the mean over devices and
    micro-batches of |gradient of one device's rows|². Computed here without the kit."""
    config = load_config("mlp_digits")
    apply_overrides(
        config,
        [
            "batch.global_batch_size=32",
            "batch.per_device_batch_size=2",  # 8 devices × 2 rows × K = 2
            f"train.accumulation={accumulation}",
        ],
    )
    mesh = mesh_lib.make_mesh(config.mesh.to_dict())
    plan = plan_from_config(config, mesh_lib.mesh_shape(mesh))
    setup = build(config, plan, mesh)
    source, _ = data_lib.make_sources(config)
    state = setup.init(jax.random.key(0))
    params = jax.device_get(state.params)

    def sq_norm(rows: dict) -> float:
        def loss(p):
            return cross_entropy(nnx.merge(setup.graphdef, p)(rows["inputs"]), rows["targets"])

        return float(optax.tree.norm(jax.grad(loss)(params)) ** 2)

    rows = [data_lib.micro_batch_rows(0, m, plan, len(source), 0) for m in range(2)]
    if accumulation == "multisteps":
        batch = data_lib.load_micro_batch(source, 0, 0, plan, 0, setup.batch_sharding)
        _, metrics = setup.step(state, batch, setup.hyper(plan))
        expected = sq_norm(source[rows[0]])
    else:
        batch = data_lib.load_global_batch(source, 0, plan, 0, setup.fused_batch_sharding)
        _, metrics = setup.step(state, batch, setup.hyper(plan))
        b = plan.per_device_batch_size
        shares = [r[i * b : (i + 1) * b] for r in rows for i in range(8)]
        expected = float(np.mean([sq_norm(source[s]) for s in shares]))
    # float32 gradients summed in different orders: agreement to a few ulps of the norm.
    assert float(metrics["small_grad_sq"]) == pytest.approx(expected, rel=1e-5)


def test_a_run_logs_the_noise_scale_and_the_summary_names_it(tmp_path):
    config = load_config("mlp_digits")
    apply_overrides(
        config,
        ["batch.per_device_batch_size=1", "train.steps=6", "train.log_every=2"],
    )  # 8 × 1 × 4: micro-batches of 8 rows against a global batch of 32
    result = train(config, progress=False, echo=lambda *a: None)
    logged = [r for r in result.records if "loss" in r]
    assert all("grad_var_estimate" in r and "grad_sq_estimate" in r for r in logged)
    s = result.summary
    assert s["grad_var_estimate"] > 0 and s["grad_sq_estimate"] > 0
    assert s["noise_scale"] == pytest.approx(s["grad_var_estimate"] / s["grad_sq_estimate"])


@pytest.mark.parametrize("accumulation", ["multisteps", "fused"])
def test_logged_noise_scale_matches_one_computed_from_micro_batch_gradients(accumulation):
    """8 devices × 1 row × K = 4 for five adamw steps; every logged estimate recomputed here.

    The params of each step come from the plain optax full-batch reference of
    test_equivalence (the same trajectory up to round-off); each step's gradients at those
    params are taken here with jax.grad, per micro-batch (8 rows) and per row. The small
    batch is a micro-batch under MultiSteps (B_small = 8) and one device's row when fused
    (B_small = 1); the big batch is the step's 32 rows. Then appendix A.1 of McCandlish et
    al.: unbiased |G|² and tr Σ per step, an exponential moving average of each (decay d,
    from zero), divided by 1 − dⁿ after n steps.
    """
    decay, k, global_batch = 0.8, 4, 32
    overrides = [f"train.accumulation={accumulation}", f"train.noise_scale_decay={decay}"]
    config = small_config("mlp_digits", 8, 1)
    apply_overrides(config, overrides)
    result = train(config, devices=jax.devices(), progress=False, echo=lambda *a: None)
    assert result.plan.grad_accum_steps == k and result.plan.micro_batch_size == 8
    logged = [r for r in result.records if "loss" in r]
    assert [r["step"] for r in logged] == list(range(1, STEPS + 1))
    assert all(r["skipped_micro_batches"] == 0 for r in logged)

    _, _, trajectory = reference_for("mlp_digits", overrides)
    with nnx.use_eager_sharding(False):
        graphdef, _ = nnx.split(nnx.eval_shape(lambda: build_model(config, nnx.Rngs(0))))
    source, _ = data_lib.make_sources(config)

    @jax.jit
    def grad_sq(params, inputs, targets):  # |∇ mean loss over these rows|²
        def loss(p):
            logits = nnx.merge(graphdef, p)(inputs)
            return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

        return optax.tree.norm(jax.grad(loss)(params)) ** 2

    b_small = 8 if accumulation == "multisteps" else 1
    grad_sq_avg = trace_avg = 0.0
    for step, record in enumerate(logged):
        params = trajectory[step]  # before this step's update
        rows = source[data_lib.global_batch_rows(step, global_batch, len(source), 0)]
        x, y = rows["inputs"], rows["targets"]
        # Small batches: the step's rows in consecutive groups of B_small (micro-batch m is
        # rows [8m, 8m + 8); fused, one row per device, where order does not matter).
        groups = [slice(i, i + b_small) for i in range(0, global_batch, b_small)]
        small_sq = np.mean([float(grad_sq(params, x[g], y[g])) for g in groups])
        big_sq = float(grad_sq(params, x, y))
        g2 = (global_batch * big_sq - b_small * small_sq) / (global_batch - b_small)
        trace = (small_sq - big_sq) / (1 / b_small - 1 / global_batch)
        grad_sq_avg = decay * grad_sq_avg + (1 - decay) * g2
        trace_avg = decay * trace_avg + (1 - decay) * trace
        correction = 1 - decay ** (step + 1)
        expected_g2, expected_trace = grad_sq_avg / correction, trace_avg / correction
        assert record["grad_sq_estimate"] == pytest.approx(expected_g2, rel=NOISE_RTOL)
        assert record["grad_var_estimate"] == pytest.approx(expected_trace, rel=NOISE_RTOL)
        assert expected_g2 > 0  # so B_simple is defined and logged
        assert record["noise_scale"] == pytest.approx(expected_trace / expected_g2, rel=NOISE_RTOL)

"""The gradient noise scale: the estimator against a closed form, and the step's inputs to it."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from jaxkit import data as data_lib
from jaxkit import mesh as mesh_lib
from jaxkit.batch_plan import plan_from_config
from jaxkit.config import apply_overrides, load_config
from jaxkit.models import cross_entropy
from jaxkit.noise_scale import NoiseScale, unbiased_estimates
from jaxkit.train_step import build


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
        _, metrics = setup.step(state, batch)
        expected = sq_norm(source[rows[0]])
    else:
        batch = data_lib.load_global_batch(source, 0, plan, 0, setup.fused_batch_sharding)
        _, metrics = setup.step(state, batch)
        b = plan.per_device_batch_size
        shares = [r[i * b : (i + 1) * b] for r in rows for i in range(8)]
        expected = float(np.mean([sq_norm(source[s]) for s in shares]))
    # float32 gradients summed in different orders: agreement to a few ulps of the norm.
    assert float(metrics["small_grad_sq"]) == pytest.approx(expected, rel=1e-5)


def test_a_run_logs_the_noise_scale_and_the_summary_names_it(tmp_path):
    from jaxkit.loop import train

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

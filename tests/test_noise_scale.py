"""The gradient noise scale: the estimator against a closed form, and the step's inputs to it."""

import itertools

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_equivalence import STEPS, reference_for, small_config

from jaxkit import mesh as mesh_lib
from jaxkit.batch.noise_scale import SMALL_BATCH_ROWS, NoiseScale, unbiased_estimates
from jaxkit.batch.schedule import plan_from_config
from jaxkit.config import apply_overrides, load_config, run_config
from jaxkit.data import sources as data_lib
from jaxkit.models import build_model, cross_entropy
from jaxkit.records.metrics import read_metrics
from jaxkit.step.train_step import build
from jaxkit.train import loop_pieces
from jaxkit.train.loop import train

# The logged estimates against ones recomputed from float32 gradients taken here: the
# squared norms agree to ~2e-7 relative (summation order), and the |G|² estimate, a
# difference B_big·|G_big|² − B_small·|G_small|², amplifies that by its condition number,
# (B_big·big + B_small·small) / |B_big·big − B_small·small|, about 6 on these smoothed
# values. Measured: within 7.4e-7 relative (fused B_simple, step 1), 1.5e-7 with MultiSteps.
# 5e-6 keeps a 7x margin; the second row's gradient in place of the first's moves the
# estimates by 1.7% to 2.6x, B_small = 2 for 1 turns the |G|² estimate negative, a missing
# bias correction is off by 1/(1 − dⁿ).
NOISE_RTOL = 5e-6
# Two splits of the same global batch against each other: the same rows summed in another
# order, so losses, gradient norms and the estimates built on them differ by round-off.
# Measured between 8, 4 and 2 devices (mlp_digits, batch 32 → 128): losses within 7.7e-8
# relative, B_simple within 8.3e-7 (its |G|² estimate amplifies round-off, see above).
# 1e-5, the bound on losses, keeps a 12x margin; the micro-batch as small batch
# gave B_simple 43 against 3 on two splits of one scheduled ramp.
SPLIT_RTOL = 1e-5


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


@pytest.mark.parametrize(
    "mesh", [["mesh.data=-1"], ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]]
)
def test_the_small_batch_is_the_first_row_of_the_global_batch(mesh):
    """The noise scale's small batch for the step starting at example 32: the first row of
    that global batch, its |gradient of the mean loss|² taken here without the kit. On one
    device's copies where params are whole everywhere, by the mesh where they are sharded."""
    config = load_config("mlp_digits")
    apply_overrides(config, ["batch.global_batch_size=32", "batch.per_device_batch_size=2", *mesh])
    mesh = mesh_lib.make_mesh(config.mesh.to_dict())
    plan = plan_from_config(run_config(config), mesh_lib.mesh_shape(mesh))
    setup = build(run_config(config), plan, mesh)
    source, _ = data_lib.make_sources(run_config(config))
    state = setup.init(jax.random.key(0))
    params = jax.device_get(state.params)

    def loss(p, rows):
        return cross_entropy(nnx.merge(setup.graphdef, p)(rows["inputs"]), rows["targets"])

    first = data_lib.global_batch_rows(1, 32, len(source), 0)[:SMALL_BATCH_ROWS]
    expected = float(optax.tree.norm(jax.grad(loss)(params, source[first])) ** 2)
    rows = data_lib.load_small_batch(source, 32, SMALL_BATCH_ROWS, 0, setup.small_batch_sharding)
    got = float(setup.small_batch_grad_sq(state.params, rows))
    # The same float32 gradient in another summation order: agreement to a few ulps.
    assert got == pytest.approx(expected, rel=1e-5)
    # And not the next row's (the estimate would be another sample of the same noise).
    other = source[data_lib.global_batch_rows(1, 32, len(source), 0)[1:2]]
    assert got != pytest.approx(float(optax.tree.norm(jax.grad(loss)(params, other)) ** 2))


ESTIMATES = ("grad_sq_estimate", "grad_var_estimate", "noise_scale")


def test_only_sampled_steps_take_the_small_gradient_and_log_the_noise_scale(tmp_path, monkeypatch):
    """train.noise_scale_every=3 over 7 steps logged every step: the small batch is loaded
    and its gradient dispatched for steps 3 and 6 alone, and only their records, in
    metrics.jsonl and TensorBoard, carry the estimates; the summary names the last."""
    loads = []
    real = loop_pieces.data_lib.load_small_batch

    def counted(source, first, *args):
        loads.append(first)  # the stream example the sampled step starts at
        return real(source, first, *args)

    monkeypatch.setattr(loop_pieces.data_lib, "load_small_batch", counted)
    config = load_config("mlp_digits")
    apply_overrides(
        config,
        [
            "batch.per_device_batch_size=1",  # 8 × 1 × 4: micro-batches of 8 rows of 32
            "train.steps=7",
            "train.log_every=1",
            "train.eval_every=0",
            "train.noise_scale_every=3",
        ],
    )
    result = train(config, tmp_path, progress=False, echo=lambda *a: None)
    assert loads == [2 * 32, 5 * 32]  # steps 3 and 6 start after 2 and 5 global batches
    logged = [r for r in read_metrics(tmp_path) if "loss" in r]
    assert [r["step"] for r in logged] == list(range(1, 8))
    assert [r["step"] for r in logged if "grad_sq_estimate" in r] == [3, 6]
    assert all(any(k in r for k in ESTIMATES) == (r["step"] % 3 == 0) for r in logged)
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    for tag in ("noise_scale/grad_sq", "noise_scale/grad_var"):
        assert [e.step for e in events.Scalars(tag)] == [3, 6]
    assert [e.step for e in events.Scalars("train/loss")] == list(range(1, 8))
    s = result.summary
    assert (s["grad_sq_estimate"], s["grad_var_estimate"]) == (
        logged[5]["grad_sq_estimate"],
        logged[5]["grad_var_estimate"],
    )
    assert s["grad_var_estimate"] > 0 and s["grad_sq_estimate"] > 0
    assert s["noise_scale"] == pytest.approx(s["grad_var_estimate"] / s["grad_sq_estimate"])


@pytest.mark.parametrize("accumulation", ["multisteps", "fused"])
def test_logged_noise_scale_matches_one_computed_from_micro_batch_gradients(accumulation):
    """8 devices × 1 row × K = 4 for five adamw steps, sampling steps 2 and 4; every logged
    estimate recomputed here.

    The params of each step come from the plain optax full-batch reference of
    test_equivalence (the same trajectory up to round-off); each step's gradients at those
    params are taken here with jax.grad, of its first row (the small batch, B_small = 1, in
    both modes) and of its 32 rows (the big batch). Then appendix A.1 of McCandlish et
    al.: unbiased |G|² and tr Σ per step, an exponential moving average of each (decay d,
    from zero) over the sampled steps alone, divided by 1 − dⁿ after n samples.
    """
    decay, k, global_batch, every = 0.8, 4, 32, 2
    overrides = [f"train.accumulation={accumulation}", f"train.noise_scale_decay={decay}"]
    overrides.append(f"train.noise_scale_every={every}")
    config = small_config("mlp_digits", 8, 1)
    apply_overrides(config, overrides)
    result = train(config, devices=jax.devices(), progress=False, echo=lambda *a: None)
    assert result.plan.grad_accum_steps == k and result.plan.micro_batch_size == 8
    logged = [r for r in result.records if "loss" in r]
    assert [r["step"] for r in logged] == list(range(1, STEPS + 1))
    assert all(r["skipped_micro_batches"] == 0 for r in logged)

    _, _, trajectory = reference_for("mlp_digits", overrides)
    typed = run_config(config)
    with nnx.use_eager_sharding(False):
        graphdef, _ = nnx.split(nnx.eval_shape(lambda: build_model(typed, nnx.Rngs(0))))
    source, _ = data_lib.make_sources(typed)

    @jax.jit
    def grad_sq(params, inputs, targets):  # |∇ mean loss over these rows|²
        def loss(p):
            logits = nnx.merge(graphdef, p)(inputs)
            return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

        return optax.tree.norm(jax.grad(loss)(params)) ** 2

    b_small = SMALL_BATCH_ROWS
    grad_sq_avg = trace_avg = 0.0
    samples = 0
    for step, record in enumerate(logged):
        if record["step"] % every:  # not sampled: no estimate logged, none moved
            assert not any(key in record for key in ESTIMATES), record
            continue
        params = trajectory[step]  # before this step's update
        rows = source[data_lib.global_batch_rows(step, global_batch, len(source), 0)]
        x, y = rows["inputs"], rows["targets"]
        small_sq = float(grad_sq(params, x[:b_small], y[:b_small]))  # the step's first rows
        big_sq = float(grad_sq(params, x, y))
        g2 = (global_batch * big_sq - b_small * small_sq) / (global_batch - b_small)
        trace = (small_sq - big_sq) / (1 / b_small - 1 / global_batch)
        grad_sq_avg = decay * grad_sq_avg + (1 - decay) * g2
        trace_avg = decay * trace_avg + (1 - decay) * trace
        samples += 1
        correction = 1 - decay**samples
        expected_g2, expected_trace = grad_sq_avg / correction, trace_avg / correction
        assert record["grad_sq_estimate"] == pytest.approx(expected_g2, rel=NOISE_RTOL)
        assert record["grad_var_estimate"] == pytest.approx(expected_trace, rel=NOISE_RTOL)
        assert expected_g2 > 0  # so B_simple is defined and logged
        assert record["noise_scale"] == pytest.approx(expected_trace / expected_g2, rel=NOISE_RTOL)
    assert samples == STEPS // every


def _train_records(overrides, devices):
    config = load_config("mlp_digits")
    apply_overrides(config, overrides)
    result = train(config, devices=jax.devices()[:devices], progress=False, echo=lambda *a: None)
    return [r for r in result.records if "loss" in r]


# Splits of a global batch of 32 (devices × 4 rows × K): K = 1, 2, 4 in the first stage.
SPLIT_DEVICES = (8, 4, 2)
SPLIT = ["batch.per_device_batch_size=4", "train.steps=null", "train.log_every=1"]
SPLIT += ["train.eval_every=0", "train.eval_examples=32"]


def test_the_auto_ramp_decides_the_same_on_every_split():
    """batch.schedule=auto from 32 rows up to 128 on 8 × 4 × 1, 4 × 4 × 2 and 2 × 4 × 4: the
    same global batch at every optimizer step, the same losses and the same B_simple.

    With the small batch a micro-batch, as it was, the 8-device split had none (K = 1) and
    the others measured B_simple from 16 and 8 rows: other numbers, other decisions.
    """
    auto = ["batch.global_batch_size=32", "batch.schedule=auto", "train.noise_scale_every=2"]
    auto += ["batch.max_global_batch_size=128", "batch.auto_patience=1", "train.examples=512"]
    # 4 × 32 + 2 × 64 + 2 × 128 rows: eight steps, the last of them the one sample taken at
    # 128 rows (K = 16 on 2 devices); a ninth step would sample nothing.
    runs = {n: _train_records(SPLIT + auto, n) for n in SPLIT_DEVICES}
    first = runs[SPLIT_DEVICES[0]]
    batches = [r["global_batch_size"] for r in first]
    # The rule, applied here to the logged B_simple at each sampled (even) step, gives every
    # step's batch; and this run both doubles and holds, so a flipped decision would show.
    for record, nxt in zip(first, batches[1:], strict=False):
        g = record["global_batch_size"]
        # None while the |G|² estimate is ≤ 0, and at the odd steps, which do not sample.
        above = record["step"] % 2 == 0 and record.get("noise_scale", 0) > g
        assert nxt == (2 * g if above and 2 * g <= 128 else g)
    held = [a == b < 128 for a, b in itertools.pairwise(batches)]
    assert len(set(batches)) == 3 and any(held), batches
    for n, records in runs.items():
        assert [r["global_batch_size"] for r in records] == batches, n
        assert [r["grad_accum_steps"] for r in records] == [g // (4 * n) for g in batches], n
        # Round-off only: see SPLIT_RTOL.
        np.testing.assert_allclose(
            [r["loss"] for r in records], [r["loss"] for r in first], rtol=SPLIT_RTOL
        )
        np.testing.assert_allclose(
            [r.get("noise_scale", np.nan) for r in records],
            [r.get("noise_scale", np.nan) for r in first],
            rtol=SPLIT_RTOL,
            err_msg=str(n),
        )


def test_a_scheduled_ramp_reports_the_same_noise_scale_on_every_split():
    """32 rows, then 64 from example 96: K 1 → 2 on 8 devices, 4 → 8 on 2, sampling every
    second step: the same steps sample on both splits, and give the same estimates. A stage
    with K = 1 used to add nothing to the estimate (B_simple 43 against 3 in the report)."""
    ramp = ["batch.schedule=0:32,96:64", "train.examples=352", "train.noise_scale_every=2"]
    runs = {n: _train_records(SPLIT + ramp, n) for n in (8, 2)}
    assert [r["global_batch_size"] for r in runs[8]] == [32, 32, 32, 64, 64, 64, 64]
    for records in runs.values():
        assert [r["step"] for r in records if "grad_sq_estimate" in r] == [2, 4, 6]
    for key in ("loss", "grad_sq_estimate", "grad_var_estimate", "noise_scale"):
        np.testing.assert_allclose(
            [r.get(key, np.nan) for r in runs[2]],
            [r.get(key, np.nan) for r in runs[8]],
            rtol=SPLIT_RTOL,
            err_msg=key,
        )

"""Fused accumulation: same trajectory as MultiSteps, one gradient all-reduce per step."""

import jax
import numpy as np
import pytest
from small_configs import SMALL_LM

from jaxkit.batch_plan import plan_from_config
from jaxkit.config import apply_overrides, load_config
from jaxkit.data import load_global_batch, load_micro_batch, make_sources
from jaxkit.hlo import count_all_reduces
from jaxkit.loop import train
from jaxkit.mesh import make_mesh, mesh_shape
from jaxkit.train_step import build

# Same reasoning as test_equivalence: the same per-example gradients summed in another
# order (local scans, then one pmean) differ by float32 round-off only.
LOSS_RTOL = 2e-6
PARAM_ATOL = 1e-6


def config_for(name, mode, per_device, *extra):
    config = load_config(name)
    apply_overrides(
        config,
        [
            *(SMALL_LM if name == "lm_tiny" else []),
            "batch.global_batch_size=32",
            f"batch.per_device_batch_size={per_device}",
            "batch.grad_accum_steps=null",
            "train.steps=5",
            "train.log_every=1",
            "train.eval_batches=1",
            f"train.accumulation={mode}",
            *extra,
        ],
    )
    return config


@pytest.mark.parametrize("name", ["mlp_digits", "lm_tiny"])
@pytest.mark.parametrize("devices,per_device", [(2, 8), (8, 1)])  # K = 2 and K = 4
def test_fused_follows_the_multisteps_trajectory(name, devices, per_device):
    results = {}
    for mode in ("multisteps", "fused"):
        config = config_for(name, mode, per_device)
        results[mode] = train(
            config, devices=jax.devices()[:devices], progress=False, echo=lambda *a: None
        )
    a, b = results["multisteps"], results["fused"]
    assert b.plan.grad_accum_steps == 32 // (devices * per_device) > 1
    losses = lambda r: np.array([x["loss"] for x in r.records if "loss" in x])  # noqa: E731
    np.testing.assert_allclose(losses(b), losses(a), rtol=LOSS_RTOL)
    for x, y in zip(jax.tree.leaves(a.state), jax.tree.leaves(b.state), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=PARAM_ATOL, rtol=0)
    assert int(b.state.micro_step) == int(a.state.micro_step)


@pytest.mark.parametrize("accum", [4, 8])
def test_fused_all_reduces_once_per_optimizer_step_multisteps_k_times(accum):
    per_step = {}
    for mode in ("multisteps", "fused"):
        config = config_for("mlp_digits", mode, 32 // (8 * accum) or 1)
        apply_overrides(config, ["batch.global_batch_size=null", f"batch.grad_accum_steps={accum}"])
        mesh = make_mesh(config.mesh.to_dict())
        plan = plan_from_config(config, mesh_shape(mesh))
        setup = build(config, plan, mesh)
        source, _ = make_sources(config)
        state = setup.init(jax.random.key(0))
        if mode == "fused":
            batch = load_global_batch(source, 0, plan, 0, setup.fused_batch_sharding)
            calls = 1
        else:
            batch = load_micro_batch(source, 0, 0, plan, 0, setup.batch_sharding)
            calls = accum
        counts = count_all_reduces(setup.step.lower(state, batch).compile().as_text())
        per_step[mode] = calls * counts.per_call(loop_trips=accum)
        if mode == "fused":
            assert counts.inside_loops == 0  # nothing crosses devices inside the scan
    assert per_step == {"multisteps": accum, "fused": 1}


def test_a_fused_step_with_a_non_finite_micro_batch_is_skipped_whole():
    config = config_for("mlp_digits", "fused", 2)
    mesh = make_mesh(config.mesh.to_dict())
    plan = plan_from_config(config, mesh_shape(mesh))
    setup = build(config, plan, mesh)
    source, _ = make_sources(config)
    state = setup.init(jax.random.key(0))
    before = [np.asarray(x) for x in jax.tree.leaves(jax.device_get(state.params))]
    batch = load_global_batch(source, 0, plan, 0, setup.fused_batch_sharding)
    poisoned = dict(batch, inputs=batch["inputs"].at[1, 3].set(np.nan))
    state, metrics = setup.step(state, poisoned)
    assert int(metrics["nonfinite"]) == plan.grad_accum_steps
    after = [np.asarray(x) for x in jax.tree.leaves(jax.device_get(state.params))]
    for x, y in zip(before, after, strict=True):
        np.testing.assert_array_equal(x, y)
    assert int(state.step) == 1 and int(state.micro_step) == plan.grad_accum_steps
    state, metrics = setup.step(state, batch)
    assert int(metrics["nonfinite"]) == 0 and np.isfinite(float(metrics["loss"]))

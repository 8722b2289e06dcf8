import dataclasses

import jax
import numpy as np
import pytest

from jaxkit.batch.schedule import plan_from_config
from jaxkit.config import ConfigError, apply_overrides, load_config, run_config
from jaxkit.data.sources import load_micro_batch, make_sources
from jaxkit.mesh import make_mesh, mesh_shape
from jaxkit.records.steps import NonFiniteLossError
from jaxkit.step.train_step import build
from jaxkit.train.loop import train


def digits(*overrides):
    config = load_config("mlp_digits")
    apply_overrides(config, list(overrides))
    return config


def test_learning_rate_schedule_advances_once_per_optimizer_step():
    # K = 4 micro-steps per optimizer step: the logged rate is the schedule at the
    # optimizer step, and params change only on every 4th micro-step.
    config = digits(
        "batch.per_device_batch_size=1",
        "train.steps=6",
        "train.log_every=1",
        "optimizer.warmup_steps=4",
        "mesh.data=-1",
    )
    result = train(config, progress=False, echo=lambda *a: None)
    assert result.plan.grad_accum_steps == 4
    lrs = [r["learning_rate"] for r in result.records if "loss" in r]
    peak = result.plan.learning_rate
    # Warmup from peak/4 to the peak over 4 optimizer steps: 1/4, 7/16, 5/8, 13/16 of it.
    np.testing.assert_allclose(lrs[:4], np.array([1 / 4, 7 / 16, 5 / 8, 13 / 16]) * peak, rtol=1e-6)
    assert int(result.state.opt_state.inner_opt_state[2][0].count) == 6  # adamw's own count
    assert int(result.state.micro_step) == 24

    config = run_config(config)
    mesh = make_mesh(dataclasses.asdict(config.mesh))
    plan = plan_from_config(config, mesh_shape(mesh))
    setup = build(config, plan, mesh)
    source, _ = make_sources(config)
    state = setup.init(jax.random.key(0))
    before = jax.device_get(state.params)
    for micro in range(4):
        batch = load_micro_batch(source, 0, micro, plan, 0, setup.batch_sharding)
        state, _ = setup.step(state, batch, setup.hyper(plan))
        after = jax.device_get(state.params)
        changed = any(
            np.any(a != b)
            for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True)
        )
        assert changed == (micro == 3), micro
        assert int(state.step) == (micro == 3)


def test_non_finite_micro_batch_is_skipped_and_counted():
    config = run_config(digits("train.steps=1", "batch.per_device_batch_size=2", "mesh.data=-1"))
    mesh = make_mesh(dataclasses.asdict(config.mesh))
    plan = plan_from_config(config, mesh_shape(mesh))
    assert plan.grad_accum_steps == 2
    setup = build(config, plan, mesh)
    source, _ = make_sources(config)
    state = setup.init(jax.random.key(0))
    good = load_micro_batch(source, 0, 0, plan, 0, setup.batch_sharding)
    bad = dict(good, inputs=good["inputs"] * np.nan)
    state, m_bad = setup.step(state, bad, setup.hyper(plan))
    assert int(m_bad["nonfinite"]) == 1
    assert np.all(np.isfinite(np.asarray(state.opt_state.acc_grads["head"]["kernel"])))
    state, m_good = setup.step(state, good, setup.hyper(plan))
    assert int(m_good["nonfinite"]) == 0 and int(state.step) == 1
    for leaf in jax.tree.leaves(jax.device_get(state.params)):
        assert np.all(np.isfinite(leaf))
    # The state is born with its final dtypes and shardings, so the step compiled once.
    assert setup.step._cache_size() == 1


def test_run_stops_with_a_clear_error_after_non_finite_losses_in_a_row():
    config = digits(
        "train.steps=20",
        "optimizer.learning_rate=1e30",
        "optimizer.warmup_steps=0",
        "train.max_nonfinite_in_row=3",
    )
    with pytest.raises(NonFiniteLossError, match="3 non-finite micro-batches in a row"):
        train(config, progress=False, echo=lambda *a: None)


def test_sgd_with_momentum_trains_through_multisteps():
    config = digits(
        "optimizer.name=sgd",
        "optimizer.learning_rate=0.1",
        "train.steps=30",
        "train.log_every=30",
        "batch.per_device_batch_size=2",
    )
    result = train(config, progress=False, echo=lambda *a: None)
    assert result.plan.grad_accum_steps == 2
    losses = [r["loss"] for r in result.records if "loss" in r]
    assert losses[-1] < 1.0  # from log(10) = 2.30 at init
    assert result.summary["eval_accuracy"] > 0.8
    with pytest.raises(ConfigError, match=r"optimizer\.name='lion': must be one of adamw, sgd"):
        train(digits("optimizer.name=lion"), progress=False, echo=lambda *a: None)

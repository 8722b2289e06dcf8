"""The loop's evaluation: every held-out row, once, whatever the split; the last step's
record and eval whatever the periods; and the peak its MFU divides by."""

import dataclasses
import json
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from cli_run import jaxkit
from flax import nnx
from small_configs import SMALL_LM

from jaxkit.batch.schedule import plan_from_config
from jaxkit.config import apply_overrides, load_config, run_config
from jaxkit.data.sources import make_sources
from jaxkit.mesh import make_mesh, mesh_shape
from jaxkit.models import build_model
from jaxkit.plan import peak as peak_lib
from jaxkit.records.metrics import read_metrics
from jaxkit.step.train_step import build
from jaxkit.train.loop import evaluate, train

# (devices, per-device batch): micro-batches of 32, 8, 8 and 1 rows; 270 held-out rows
# divide none of them but 1 (the old eval read 256 of them on 8×4 and 264 on 2×4).
SPLITS = [(8, 4), (2, 4), (8, 1), (1, 1)]
# One float32 sum of per-row losses in another order per split: a few ulps of ~2.3.
RTOL = 1e-6


def digits_on(devices, per_device):
    config = load_config("mlp_digits")
    apply_overrides(
        config,
        [
            f"batch.per_device_batch_size={per_device}",
            "batch.global_batch_size=null",
            "batch.grad_accum_steps=1",
        ],
    )
    config = run_config(config)
    mesh = make_mesh(dataclasses.asdict(config.mesh), jax.devices()[:devices])
    plan = plan_from_config(config, mesh_shape(mesh))
    return config, plan, build(config, plan, mesh)


def reference(config, params, rows):
    """Mean loss and accuracy of `rows` held-out rows, one device, plain optax."""
    _, eval_source = make_sources(config)
    with nnx.use_eager_sharding(False):
        graphdef, _ = nnx.split(nnx.eval_shape(lambda: build_model(config, nnx.Rngs(0))))
    logits = nnx.merge(graphdef, jax.device_put(params, jax.devices()[0]))(
        jnp.asarray(eval_source.inputs[:rows])
    )
    labels = jnp.asarray(eval_source.targets[:rows])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    hits = int(jnp.sum(jnp.argmax(logits, -1) == labels))
    return float(loss), hits / rows  # a count of rows: exact


@pytest.mark.parametrize("eval_examples", [0, 100])
def test_eval_reads_the_same_rows_for_every_split(eval_examples):
    params = None
    results = {}
    for devices, per_device in SPLITS:
        config, plan, setup = digits_on(devices, per_device)
        state = setup.init(jax.random.key(0))
        if params is None:
            params = jax.device_get(state.params)
        _, eval_source = make_sources(config)
        placed = jax.device_put(params, setup.state_shardings.params)
        results[(devices, per_device)] = evaluate(setup, placed, eval_source, plan, eval_examples)
    rows = 270 if eval_examples == 0 else eval_examples
    loss, accuracy = reference(config, params, rows)
    for split, result in results.items():
        assert result["eval_examples"] == rows, split
        assert result["eval_loss"] == pytest.approx(loss, rel=RTOL), split
        assert result["eval_accuracy"] == pytest.approx(accuracy, abs=1e-9), split


def test_eval_examples_beyond_the_held_out_split_reads_it_all_and_says_so():
    config, plan, setup = digits_on(8, 4)
    _, eval_source = make_sources(config)
    state = setup.init(jax.random.key(0))
    result = evaluate(setup, state.params, eval_source, plan, 10_000)
    assert result["eval_examples"] == len(eval_source) == 270
    np.testing.assert_allclose(
        result["eval_loss"], evaluate(setup, state.params, eval_source, plan, 0)["eval_loss"]
    )


def test_the_last_step_is_logged_and_evaluated_when_the_periods_do_not_divide_the_run(tmp_path):
    """7 steps, a record and an eval every 3: steps 3 and 6, and 7, the last, whose loss
    and eval the summary reports (not step 6's)."""
    periods = ["train.steps=7", "train.log_every=3", "train.eval_every=3", "checkpoint.every=0"]
    out = jaxkit("train", "mlp_digits", *periods, "--workdir", str(tmp_path), "--no-progress")
    assert out.returncode == 0, out.stderr
    records = read_metrics(tmp_path)
    trained = {r["step"]: r for r in records if "loss" in r}
    evals = {r["step"]: r for r in records if "eval_loss" in r}
    assert list(trained) == list(evals) == [3, 6, 7]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 7
    assert summary["final_loss"] == trained[7]["loss"]
    assert (summary["eval_loss"], summary["eval_accuracy"]) == (
        evals[7]["eval_loss"],
        evals[7]["eval_accuracy"],
    )
    assert f"eval loss {evals[7]['eval_loss']:.4f}" in out.stdout


def test_mfu_divides_by_the_peak_of_the_compute_dtype_off_cpu(monkeypatch):
    """Float32 params with bfloat16 matmuls on an H100: the table's bfloat16 peak (989
    TFLOP/s dense, NVIDIA's figure), not the float32 (TF32) one of the params' dtype (494)."""
    real, asked = peak_lib.device_peak, []

    def on_h100(devices, *args, **kwargs):  # the loop's devices, seen as H100s
        asked.append(len(devices))
        gpu = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H100 80GB HBM3")
        return real([gpu] * len(devices), *args, **kwargs)

    monkeypatch.setattr(peak_lib, "device_peak", on_h100)
    config = load_config("lm_tiny")
    precision = ["model.param_dtype=float32", "model.compute_dtype=bfloat16"]
    steps = ["train.steps=3", "train.log_every=1", "train.eval_every=0"]
    apply_overrides(config, [*SMALL_LM, *precision, *steps, "optimizer.warmup_steps=1"])
    result = train(config, progress=False, echo=lambda *a: None)
    assert asked == [8]
    s = result.summary
    assert (s["peak_flops_per_s"], s["peak_source"]) == (
        989e12,
        "H100 bfloat16 peak from the kit's table",
    )
    timed = [r for r in result.records if "mfu" in r]
    assert timed
    for r in timed:  # the same division, in float64 both sides
        assert r["mfu"] == pytest.approx(r["model_flops_per_step"] / r["step_time_s"] / 989e12)

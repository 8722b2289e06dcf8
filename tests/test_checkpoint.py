"""Checkpoints: exact resume, resume elsewhere, refusals, corruption (in-process)."""

import os
import signal

import jax
import numpy as np
import pytest

from jaxkit.batch_plan import plan_from_config
from jaxkit.checkpoint import Checkpointer, CheckpointError, abstract_state
from jaxkit.config import apply_overrides, load_config
from jaxkit.loop import train
from jaxkit.mesh import make_mesh, mesh_shape
from jaxkit.metrics import read_metrics
from jaxkit.train_step import build

# Same tolerance and reasoning as test_equivalence: a different device count sums the same
# per-example gradients in another order, a few ulps per step.
LOSS_RTOL = 2e-6
PARAM_ATOL = 1e-6
COMPARED = ("step", "micro_step", "loss", "learning_rate", "grad_norm", "examples_seen")


def digits(*overrides):
    config = load_config("mlp_digits")
    apply_overrides(
        config,
        [
            "train.steps=6",
            "train.log_every=1",
            "train.eval_every=3",
            "checkpoint.every=0",
            *overrides,
        ],
    )
    return config


def run(config, workdir, devices=8, **kw):
    return train(
        config, workdir, devices=jax.devices()[:devices], progress=False, echo=lambda *a: None, **kw
    )


def leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]


def same_records(a_dir, b_dir):
    a, b = read_metrics(a_dir), read_metrics(b_dir)
    strip = lambda r: {k: r[k] for k in (*COMPARED, "eval_loss") if k in r}  # noqa: E731
    return [strip(r) for r in a] == [strip(r) for r in b]


def test_resume_mid_accumulation_is_bitwise_identical(tmp_path):
    config = digits("batch.per_device_batch_size=1")  # 8 devices × 1 × K=4
    full = run(config, tmp_path / "full")
    stopped = run(config, tmp_path / "cut", stop_after_micro_steps=10)  # step 2, micro 2 of 4
    assert stopped.stopped and int(stopped.state.opt_state.mini_step) == 2
    ckpt = Checkpointer(tmp_path / "cut" / "checkpoints", keep=3, warn=print)
    assert ckpt.steps() == [10]
    assert ckpt.read_meta(10)["loop"]["partial_step_losses"]  # two fetched micro-losses
    resumed = run(config, tmp_path / "cut")
    assert not resumed.stopped
    for a, b in zip(leaves(full.state), leaves(resumed.state), strict=True):
        np.testing.assert_array_equal(a, b)
    assert same_records(tmp_path / "full", tmp_path / "cut")


def test_resume_at_a_boundary_on_fewer_devices_re_derives_accumulation(tmp_path):
    config = digits()  # global 32, per-device 4: K = 1 on 8 devices, 2 on 4, 4 on 2
    full = run(config, tmp_path / "full")
    full_losses = np.array([r["loss"] for r in full.records if "loss" in r])
    for devices, k in ((4, 2), (2, 4)):
        workdir = tmp_path / f"to{devices}"
        run(config, workdir, stop_after_micro_steps=3)  # after 3 optimizer steps on 8
        resumed = run(config, workdir, devices=devices)
        assert resumed.plan.grad_accum_steps == k
        assert int(resumed.state.micro_step) == 6 * k  # the counter is re-based at the move
        records = [r for r in read_metrics(workdir) if "loss" in r]
        assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
        np.testing.assert_allclose([r["loss"] for r in records], full_losses, rtol=LOSS_RTOL)
        worst = max(
            float(np.max(np.abs(a - b)))
            for a, b in zip(leaves(full.state.params), leaves(resumed.state.params), strict=True)
        )
        assert worst < PARAM_ATOL, (devices, worst)


def test_resume_from_a_2x2x2_mesh_onto_4_devices(tmp_path):
    config = digits("mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2")  # dp 4: K = 2
    reference = run(digits(), tmp_path / "dp8")
    run(config, tmp_path / "moved", stop_after_micro_steps=4)
    resumed = run(digits(), tmp_path / "moved", devices=4)  # 4 × 1 × 1 mesh, K = 2
    assert resumed.plan.mesh_shape == {"data": 4, "fsdp": 1, "tensor": 1}
    losses = [r["loss"] for r in read_metrics(tmp_path / "moved") if "loss" in r]
    np.testing.assert_allclose(
        losses, [r["loss"] for r in reference.records if "loss" in r], rtol=LOSS_RTOL
    )


def test_a_changed_global_batch_is_refused_unless_allowed(tmp_path):
    run(digits("optimizer.lr_scaling=linear"), tmp_path, stop_after_micro_steps=2)
    bigger = digits("optimizer.lr_scaling=linear", "batch.global_batch_size=64")
    before = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    with pytest.raises(CheckpointError, match="--allow-batch-change") as err:
        run(bigger, tmp_path)
    assert "saved plan" in str(err.value) and "32" in str(err.value)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == before
    resumed = run(bigger, tmp_path, allow_batch_change=True)
    assert resumed.plan.learning_rate == pytest.approx(2 * 3e-3)  # linear: 64 / 32
    records = [r for r in read_metrics(tmp_path) if "loss" in r]
    assert [r["examples_seen"] for r in records] == [32, 64, 128, 192, 256, 320]
    (change,) = [r for r in read_metrics(tmp_path) if r.get("event") == "plan_change"]
    assert change["step"] == 2 and change["lr_scaling"] == "linear"
    assert change["from_plan"]["global_batch_size"] == 32
    assert change["to_plan"]["global_batch_size"] == 64
    assert change["learning_rate"] == pytest.approx(6e-3)


def test_a_conflicting_config_is_refused_with_a_diff(tmp_path):
    run(digits(), tmp_path, stop_after_micro_steps=2)
    with pytest.raises(CheckpointError) as err:
        run(digits("optimizer.learning_rate=0.01", "train.seed=3"), tmp_path)
    message = str(err.value)
    assert "optimizer.learning_rate: 0.003 (saved) -> 0.01" in message
    assert "train.seed: 0 (saved) -> 3" in message


def test_a_corrupted_checkpoint_falls_back_to_the_previous_one(tmp_path):
    config = digits("checkpoint.every=2", "checkpoint.keep=5")
    full = run(config, tmp_path / "full")
    run(config, tmp_path / "cut", stop_after_micro_steps=4)
    ckpt_dir = tmp_path / "cut" / "checkpoints"
    assert sorted(int(p.name) for p in ckpt_dir.iterdir() if p.name.isdigit()) == [2, 4]
    for file in (ckpt_dir / "4" / "state").rglob("*"):
        if file.is_file() and file.stat().st_size > 0 and "zarr" not in file.name:
            file.write_bytes(b"\0" * file.stat().st_size)  # bit rot in the arrays
    warnings = []
    resumed = train(config, tmp_path / "cut", progress=False, echo=warnings.append)
    assert any("checkpoint at micro-step 4 is unreadable" in w for w in warnings)
    assert (ckpt_dir / "4.unreadable").is_dir()
    for a, b in zip(leaves(full.state), leaves(resumed.state), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_checkpoint_of_another_model_shape_is_refused_and_left_alone(tmp_path):
    run(digits(), tmp_path, stop_after_micro_steps=2)
    other = digits("model.hidden_size=64")
    mesh = make_mesh(other.mesh.to_dict())
    setup = build(other, plan_from_config(other, mesh_shape(mesh)), mesh)
    ckpt = Checkpointer(tmp_path / "checkpoints", keep=3, warn=print)
    with pytest.raises(
        CheckpointError,
        match=r"(?s)different model:\n.*params.hidden.0.kernel: saved \(64, 128\), model wants",
    ):
        ckpt.restore_latest(abstract_state(setup), check=lambda step, meta: None)
    assert ckpt.steps() == [2] and not list((tmp_path / "checkpoints").glob("*.unreadable"))


def test_rerunning_a_finished_run_changes_nothing(tmp_path):
    first = run(digits(), tmp_path)
    before = (tmp_path / "metrics.jsonl").read_text()
    again = run(digits(), tmp_path)
    assert again.records == [] and again.summary == first.summary
    assert (tmp_path / "metrics.jsonl").read_text() == before
    for a, b in zip(leaves(first.state), leaves(again.state), strict=True):
        np.testing.assert_array_equal(a, b)


def test_checkpoints_move_between_multisteps_and_fused_at_step_boundaries(tmp_path):
    config = digits("batch.per_device_batch_size=2")  # 8 × 2 × K=2
    full = run(config, tmp_path / "full")
    run(config, tmp_path / "moved", stop_after_micro_steps=6)  # a boundary: 3 steps of 2
    fused = run(
        digits("batch.per_device_batch_size=2", "train.accumulation=fused"), tmp_path / "moved"
    )
    losses = [r["loss"] for r in read_metrics(tmp_path / "moved") if "loss" in r]
    np.testing.assert_allclose(
        losses, [r["loss"] for r in full.records if "loss" in r], rtol=LOSS_RTOL
    )
    for a, b in zip(leaves(full.state.params), leaves(fused.state.params), strict=True):
        np.testing.assert_allclose(a, b, atol=PARAM_ATOL, rtol=0)
    run(config, tmp_path / "mid", stop_after_micro_steps=5)  # half-way through step 3
    with pytest.raises(CheckpointError, match=r"train\.accumulation=multisteps"):
        run(digits("batch.per_device_batch_size=2", "train.accumulation=fused"), tmp_path / "mid")


def test_ctrl_c_saves_and_stops_like_a_preemption(tmp_path):
    config = digits("train.steps=30")
    sent = []

    def press_ctrl_c(line):  # the console line of step 4: the user presses Ctrl-C
        if line.startswith("step      4  loss") and not sent:
            sent.append(True)
            os.kill(os.getpid(), signal.SIGINT)

    result = train(config, tmp_path, progress=False, echo=press_ctrl_c)
    assert result.stopped and sent
    ckpt = Checkpointer(tmp_path / "checkpoints", keep=3, warn=print)
    stopped_at = ckpt.steps()[-1]
    assert 4 <= stopped_at < 30  # the next micro-step boundary after the signal
    resumed = run(config, tmp_path)
    full = run(config, tmp_path / "full")
    for a, b in zip(leaves(full.state), leaves(resumed.state), strict=True):
        np.testing.assert_array_equal(a, b)

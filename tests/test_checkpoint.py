"""Checkpoints: exact resume, resume elsewhere, refusals, corruption (in-process)."""

import dataclasses
import json
import os
import shutil
import signal
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

from jaxkit.batch import noise_scale
from jaxkit.batch.schedule import plan_from_config, schedule_from_config
from jaxkit.config import apply_overrides, load_config, run_config
from jaxkit.data.sources import make_sources, stream_rows
from jaxkit.mesh import make_mesh, mesh_shape
from jaxkit.plan import costs
from jaxkit.records.metrics import read_metrics
from jaxkit.step.train_step import build
from jaxkit.train import loop as loop_lib
from jaxkit.train import loop_pieces
from jaxkit.train.checkpoint import Checkpointer, CheckpointError, abstract_state, empty_accumulator
from jaxkit.train.loop import train

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


# The uninterrupted runs several tests compare against, trained once for the module (each
# test only reads them): a run's cached programs still cost it a trace and 6 steps.
@pytest.fixture(scope="module")
def full_k1(tmp_path_factory):
    """digits() on 8 devices, K = 1; its workdir with it."""
    workdir = tmp_path_factory.mktemp("full_k1")
    return run(digits(), workdir), workdir


def finished_in(workdir, full_k1):
    """The finished 6-step digits() run, copied into `workdir` as if it had run there."""
    return copied(full_k1, workdir)


@pytest.fixture(scope="module")
def full_k4(tmp_path_factory):
    """digits(per-device batch 1) on 8 devices, K = 4; its workdir with it."""
    workdir = tmp_path_factory.mktemp("full_k4")
    return run(digits("batch.per_device_batch_size=1"), workdir), workdir


@pytest.fixture(scope="module")
def full_8_steps(tmp_path_factory):
    """digits(8 steps, no eval before the end) on 8 devices, K = 1: the trajectory that the
    runs moved between device counts over 8 steps follow."""
    workdir = tmp_path_factory.mktemp("full_8_steps")
    return run(digits("train.steps=8", "train.eval_every=0"), workdir)


# Runs stopped part-way that several tests resume, each from a copy (a stopped run is its
# workdir's files), trained once for the module.
@pytest.fixture(scope="module")
def cut_k1(tmp_path_factory):
    """digits() on 8 devices stopped after 2 optimizer steps; its workdir."""
    workdir = tmp_path_factory.mktemp("cut_k1")
    return run(digits(), workdir, stop_after_micro_steps=2), workdir


@pytest.fixture(scope="module")
def cut_k4(tmp_path_factory):
    """digits(per-device batch 1) on 8 devices (K = 4) stopped 2 micro-steps into step 3:
    step_2 holds the half-step; its workdir."""
    workdir = tmp_path_factory.mktemp("cut_k4")
    config = digits("batch.per_device_batch_size=1")
    return run(config, workdir, stop_after_micro_steps=10), workdir


@pytest.fixture(scope="module")
def cut_every_2(tmp_path_factory):
    """digits(a checkpoint every 2 steps, 5 kept) stopped after 4 steps; its workdir."""
    workdir = tmp_path_factory.mktemp("cut_every_2")
    config = digits("checkpoint.every=2", "checkpoint.keep=5")
    return run(config, workdir, stop_after_micro_steps=4), workdir


def copied(fixture_run, workdir):
    """A module run's workdir copied into `workdir`, as if it had run there; its result."""
    result, source = fixture_run
    shutil.copytree(source, workdir, dirs_exist_ok=True)
    return result


def same_records(a_dir, b_dir):
    a, b = read_metrics(a_dir), read_metrics(b_dir)
    strip = lambda r: {k: r[k] for k in (*COMPARED, "eval_loss") if k in r}  # noqa: E731
    return [strip(r) for r in a] == [strip(r) for r in b]


def test_resume_mid_accumulation_is_bitwise_identical(tmp_path, full_k4, cut_k4):
    config = digits("batch.per_device_batch_size=1")  # 8 devices × 1 × K=4
    full, full_dir = full_k4
    stopped = copied(cut_k4, tmp_path / "cut")  # stopped at step 2, micro 2 of 4
    assert stopped.stopped and int(stopped.state.opt_state.mini_step) == 2
    ckpt = Checkpointer(tmp_path / "cut" / "checkpoints", keep=3, warn=print)
    assert ckpt.steps() == [2]  # keyed by optimizer steps done; the half-step is in the record
    loop = ckpt.read_meta(2)["loop"]
    assert (loop["step"], loop["micro"], loop["examples_seen"]) == (2, 2, 64)
    assert len(loop["partial_step_losses"]) == 2  # the two fetched micro-losses
    resumed = run(config, tmp_path / "cut")
    assert not resumed.stopped
    for a, b in zip(leaves(full.state), leaves(resumed.state), strict=True):
        np.testing.assert_array_equal(a, b)
    assert same_records(full_dir, tmp_path / "cut")


def test_resume_at_a_boundary_on_fewer_devices_re_derives_accumulation(tmp_path, full_k1):
    config = digits()  # global 32, per-device 4: K = 1 on 8 devices, 2 on 4, 4 on 2
    full, _ = full_k1
    full_losses = np.array([r["loss"] for r in full.records if "loss" in r])
    run(config, tmp_path / "cut", stop_after_micro_steps=3)  # after 3 optimizer steps on 8
    for devices, k in ((4, 2), (2, 4)):
        workdir = tmp_path / f"to{devices}"
        shutil.copytree(tmp_path / "cut", workdir)  # each resumes the same stopped run
        resumed = run(config, workdir, devices=devices)
        assert resumed.plan.grad_accum_steps == k
        assert int(resumed.state.micro_step) == 3 + 3 * k  # micro-steps in all, both splits
        records = [r for r in read_metrics(workdir) if "loss" in r]
        assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
        np.testing.assert_allclose([r["loss"] for r in records], full_losses, rtol=LOSS_RTOL)
        worst = max(
            float(np.max(np.abs(a - b)))
            for a, b in zip(leaves(full.state.params), leaves(resumed.state.params), strict=True)
        )
        assert worst < PARAM_ATOL, (devices, worst)


def test_resume_from_a_2x2x2_mesh_onto_4_devices(tmp_path, full_k1):
    config = digits("mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2")  # dp 4: K = 2
    reference, _ = full_k1  # on 8 devices
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


def test_a_conflicting_config_is_refused_with_a_diff(tmp_path, cut_k1):
    copied(cut_k1, tmp_path)
    with pytest.raises(CheckpointError) as err:
        run(digits("optimizer.learning_rate=0.01", "train.seed=3"), tmp_path)
    message = str(err.value)
    assert "optimizer.learning_rate: 0.003 (saved) -> 0.01" in message
    assert "train.seed: 0 (saved) -> 3" in message


def test_a_corrupted_checkpoint_falls_back_to_the_previous_one(tmp_path, full_k1, cut_every_2):
    config = digits("checkpoint.every=2", "checkpoint.keep=5")
    full, _ = full_k1  # uninterrupted, and saved only at its end
    copied(cut_every_2, tmp_path / "cut")  # stopped after 4 steps
    ckpt_dir = tmp_path / "cut" / "checkpoints"
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["step_2", "step_4"]
    for file in (ckpt_dir / "step_4" / "state").rglob("*"):
        if file.is_file() and file.stat().st_size > 0 and "zarr" not in file.name:
            file.write_bytes(b"\0" * file.stat().st_size)  # bit rot in the arrays
    warnings = []
    resumed = train(config, tmp_path / "cut", progress=False, echo=warnings.append)
    assert any("checkpoint step_4 is unreadable" in w for w in warnings)
    assert (ckpt_dir / "step_4.unreadable").is_dir()
    for a, b in zip(leaves(full.state), leaves(resumed.state), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_checkpoint_of_another_model_shape_is_refused_and_left_alone(tmp_path, cut_k1):
    copied(cut_k1, tmp_path)
    other = run_config(digits("model.hidden_size=64"))
    mesh = make_mesh(dataclasses.asdict(other.mesh))
    setup = build(other, plan_from_config(other, mesh_shape(mesh)), mesh)
    ckpt = Checkpointer(tmp_path / "checkpoints", keep=3, warn=print)
    with pytest.raises(
        CheckpointError,
        match=r"(?s)step_2 .* different model:\n.*params.hidden.0.kernel: saved \(64, 128\), "
        "model wants",
    ):
        ckpt.restore_latest(abstract_state(setup), check=lambda meta: None)
    assert ckpt.steps() == [2] and not list((tmp_path / "checkpoints").glob("*.unreadable"))


def test_rerunning_a_finished_run_changes_nothing(tmp_path, full_k1):
    first = finished_in(tmp_path, full_k1)
    before = (tmp_path / "metrics.jsonl").read_text()
    again = run(digits(), tmp_path)
    assert again.records == [] and again.summary == first.summary
    assert (tmp_path / "metrics.jsonl").read_text() == before
    for a, b in zip(leaves(first.state), leaves(again.state), strict=True):
        np.testing.assert_array_equal(a, b)


def test_rerunning_a_finished_run_compiles_no_step(tmp_path, monkeypatch, full_k1):
    """Nothing is left to train, so no step program is compiled; its summary rebuilt from
    metrics.jsonl gives the compile and the compiled memory as unknown."""
    finished_in(tmp_path, full_k1)
    compiles = []
    real = costs.compile_setup_step
    monkeypatch.setattr(
        costs, "compile_setup_step", lambda *a, **kw: compiles.append(a[1]) or real(*a, **kw)
    )
    run(digits(), tmp_path)
    (tmp_path / "summary.json").unlink()
    rebuilt = run(digits(), tmp_path).summary
    assert compiles == []
    assert rebuilt["memory_bytes"] is None and rebuilt["compile_s"] is None


def test_checkpoints_move_between_multisteps_and_fused_at_step_boundaries(tmp_path, full_k1):
    config = digits("batch.per_device_batch_size=2")  # 8 × 2 × K=2
    # The uninterrupted run at K = 1: K = 2, multisteps or fused, sums the same gradients in
    # another order (LOSS_RTOL and PARAM_ATOL's round-off).
    full, _ = full_k1
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
    # Half-way through step 3: fused mode cannot continue an accumulation, so it redoes
    # step 3 from its first micro-batch and still follows the same trajectory.
    run(config, tmp_path / "mid", stop_after_micro_steps=5)
    fused = run(
        digits("batch.per_device_batch_size=2", "train.accumulation=fused"), tmp_path / "mid"
    )
    records = read_metrics(tmp_path / "mid")
    (redone,) = [r for r in records if r.get("event") == "partial_step_redone"]
    assert (redone["step"], redone["micro_steps_redone"]) == (2, 1)
    # The counter goes back from 5 to the 4 micro-steps of the 2 steps kept.
    assert redone["micro_step"] == 4
    # K=2 throughout: each step kept adds 2, the redone one included once.
    assert [r["micro_step"] for r in records if "loss" in r] == [2 * s for s in range(1, 7)]
    losses = [r["loss"] for r in records if "loss" in r]
    np.testing.assert_allclose(
        losses, [r["loss"] for r in full.records if "loss" in r], rtol=LOSS_RTOL
    )
    for a, b in zip(leaves(full.state.params), leaves(fused.state.params), strict=True):
        np.testing.assert_allclose(a, b, atol=PARAM_ATOL, rtol=0)


def test_ctrl_c_saves_and_stops_like_a_preemption(tmp_path):
    config = digits("train.steps=30", "train.eval_every=0")  # no eval every 3 of the 30 steps
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


def test_a_run_moved_2_8_8_devices_with_stops_finishes_every_step_once(tmp_path, full_8_steps):
    # The case: global 32, per-device 4, a checkpoint every 2 steps. On 2 devices
    # (K=4) the run saved under the old numbering at micro-steps 8 and 16; resumed on 8
    # (K=1) it saved 6 and 7 below them, resumed at step 4 again and then failed for good.
    config = digits("train.steps=8", "checkpoint.every=2", "train.eval_every=0")
    full = full_8_steps  # uninterrupted on 8 devices, saved only at its end
    workdir = tmp_path / "moved"
    first = run(config, workdir, devices=2, stop_after_micro_steps=14)  # 2 into step 4
    assert first.plan.grad_accum_steps == 4 and first.stopped
    ckpt = Checkpointer(workdir / "checkpoints", keep=3, warn=print)
    assert ckpt.steps() == [2, 3]  # 3: three steps done and two micro-batches of the 4th
    assert ckpt.read_meta(3)["loop"]["micro"] == 2
    # Micro-steps count across resumes: 12 before step 4 (the half-step is redone), then
    # one per step at K=1, so 15 is the end of step 6.
    second = run(config, workdir, devices=8, stop_after_micro_steps=15)
    assert second.stopped and second.plan.grad_accum_steps == 1
    ckpt.manager.reload()
    assert ckpt.steps() == [3, 4, 6]  # only ever growing
    third = run(config, workdir, devices=8)
    assert not third.stopped
    ckpt.manager.reload()
    assert ckpt.steps()[-1] == 8
    records = read_metrics(workdir)
    train_records = [r for r in records if "loss" in r]
    assert [r["step"] for r in train_records] == list(range(1, 9))  # each step exactly once
    np.testing.assert_allclose(
        [r["loss"] for r in train_records],
        [r["loss"] for r in full.records if "loss" in r],
        rtol=LOSS_RTOL,
    )
    assert [r["examples_seen"] for r in train_records] == [32 * i for i in range(1, 9)]
    worst = max(
        float(np.max(np.abs(a - b)))
        for a, b in zip(leaves(full.state.params), leaves(third.state.params), strict=True)
    )
    assert worst < PARAM_ATOL, worst
    (redone,) = [r for r in records if r.get("event") == "partial_step_redone"]
    assert (redone["step"], redone["micro_steps_redone"]) == (3, 2)
    assert json.loads((workdir / "summary.json").read_text())["steps"] == 8


def test_a_half_step_is_continued_on_the_same_split_and_redone_on_another(
    tmp_path, full_k4, cut_k4
):
    config = digits("batch.per_device_batch_size=1")  # 8 × 1 × K=4
    typed = run_config(config)
    copied(cut_k4, tmp_path / "cut")  # stopped at step 2, 2 of 4 micro-steps
    mesh = make_mesh(dataclasses.asdict(typed.mesh))
    setup = build(typed, plan_from_config(typed, mesh_shape(mesh)), mesh)
    ckpt = Checkpointer(tmp_path / "cut" / "checkpoints", keep=3, warn=print)
    mid = ckpt.restore(2, abstract_state(setup))
    assert int(mid.opt_state.mini_step) == 2
    assert any(np.any(np.asarray(x) != 0) for x in jax.tree.leaves(mid.opt_state.acc_grads))
    # The boundary state before it: the same run stopped after two whole steps.
    run(config, tmp_path / "boundary", stop_after_micro_steps=8)
    boundary = Checkpointer(tmp_path / "boundary" / "checkpoints", keep=3, warn=print).restore(
        2, abstract_state(setup)
    )
    emptied = empty_accumulator(mid)
    for name in ("params", "opt_state"):
        for a, b in zip(
            leaves(getattr(emptied, name)), leaves(getattr(boundary, name)), strict=True
        ):
            np.testing.assert_array_equal(a, b)  # bitwise: nothing else moved mid-step
    for a, b in zip(
        jax.tree.leaves(emptied.opt_state.acc_grads),
        jax.tree.leaves(mid.opt_state.acc_grads),
        strict=True,
    ):
        assert a.sharding == b.sharding  # placed as the step expects it
    # Resumed on 4 devices (K=8, another micro-batch size), the half-step is redone.
    messages = []
    resumed = train(
        config, tmp_path / "cut", devices=jax.devices()[:4], progress=False, echo=messages.append
    )
    assert resumed.plan.grad_accum_steps == 8
    assert any("cannot continue: that step starts again" in m for m in messages), messages
    full, _ = full_k4
    worst = max(
        float(np.max(np.abs(a - b)))
        for a, b in zip(leaves(full.state.params), leaves(resumed.state.params), strict=True)
    )
    assert worst < PARAM_ATOL, worst


def test_a_stop_right_after_a_checkpoint_keeps_it_and_loses_nothing(tmp_path, full_k4):
    config = digits("batch.per_device_batch_size=1", "checkpoint.every=1")  # K=4
    messages = []
    stopped = train(
        config,
        tmp_path / "cut",
        progress=False,
        echo=messages.append,
        stop_after_micro_steps=10,
    )
    assert stopped.stopped
    # Step 2 was saved at its boundary; the stop 2 micro-steps later keeps that checkpoint.
    assert any("checkpoint step_2 was already saved and is kept" in m for m in messages)
    ckpt = Checkpointer(tmp_path / "cut" / "checkpoints", keep=3, warn=print)
    assert ckpt.steps() == [1, 2] and ckpt.read_meta(2)["loop"]["micro"] == 0
    resumed = run(config, tmp_path / "cut")
    full, full_dir = full_k4  # uninterrupted, and saved only at its end
    for a, b in zip(leaves(full.state), leaves(resumed.state), strict=True):
        np.testing.assert_array_equal(a, b)
    assert same_records(full_dir, tmp_path / "cut")


def test_a_workdir_numbered_by_micro_step_is_resumed_from_its_most_advanced_checkpoint(
    tmp_path, full_8_steps
):
    """Earlier jaxkit keyed checkpoints by micro-step (checkpoints/N, no prefix, no
    "format" in the record). Such a workdir is made here from today's checkpoints."""
    config = digits("train.steps=8", "checkpoint.every=2", "checkpoint.keep=5")
    full = full_8_steps  # uninterrupted on 8 devices: the same trajectory (evals change none)
    workdir = tmp_path / "old"
    run(config, workdir, devices=2, stop_after_micro_steps=16)  # K=4: steps 2 and 4 saved
    run(config, workdir, devices=8, stop_after_micro_steps=18)  # 16 + 2 at K=1: step 6
    ckpt_dir = workdir / "checkpoints"
    # As the old numbering had them: [6 (K=1), 8 (K=4, step 2), 16 (K=4, step 4)].
    for step, micro_step in ((2, 8), (4, 16), (6, 6)):
        (ckpt_dir / f"step_{step}").rename(ckpt_dir / str(micro_step))
        meta_file = ckpt_dir / str(micro_step) / "meta" / "metadata"
        meta = json.loads(meta_file.read_text())
        del meta["format"]
        meta_file.write_text(json.dumps(meta))
    messages = []
    resumed = train(
        config, workdir, devices=jax.devices()[:8], progress=False, echo=messages.append
    )
    # Micro-step 16 is the highest number but step 4; the checkpoint named 6 is step 6.
    assert any("at optimizer step 6 (checkpoint 6, numbered by micro-step" in m for m in messages)
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["16", "6", "8", "step_8"]
    losses = [r["loss"] for r in read_metrics(workdir) if "loss" in r]
    np.testing.assert_allclose(
        losses, [r["loss"] for r in full.records if "loss" in r], rtol=LOSS_RTOL
    )
    worst = max(
        float(np.max(np.abs(a - b)))
        for a, b in zip(leaves(full.state.params), leaves(resumed.state.params), strict=True)
    )
    assert worst < PARAM_ATOL, worst


def test_a_batch_change_continues_the_data_stream_without_skipping_or_repeating(
    tmp_path, monkeypatch
):
    served = []

    class Recorded:
        """The training rows as jaxkit loads them, recording every row index it serves."""

        def __init__(self, inner):
            self.inner = inner

        def __len__(self):
            return len(self.inner)

        def __getitem__(self, rows):
            rows = np.asarray(rows).tolist()
            # The noise scale's small batch reads a step's first row again, on its own.
            (small if len(rows) == noise_scale.SMALL_BATCH_ROWS else served).extend(rows)
            return self.inner[rows]

        def row_weight_sums(self, rows):  # the step's normaliser, known without reading rows
            return loop_lib.data_lib.row_weight_sums(self.inner, rows)

    small = []
    real = loop_lib.data_lib.make_sources
    monkeypatch.setattr(
        loop_lib.data_lib, "make_sources", lambda c: (Recorded(real(c)[0]), real(c)[1])
    )
    # Rows read in the step's path only: prefetch reads ahead rows a stopped run never
    # trains on (test_prefetch checks that it hands out exactly these batches).
    config = digits("train.steps=30", "train.eval_every=0", "train.prefetch=0")  # 30 × 32 > 1527
    run(config, tmp_path, stop_after_micro_steps=20)  # 20 steps of 32 rows: 640 examples
    bigger = digits(
        "train.steps=30", "train.eval_every=0", "batch.global_batch_size=64", "train.prefetch=0"
    )
    run(bigger, tmp_path, allow_batch_change=True)  # 10 steps of 64 rows
    # Independently of jaxkit: epoch permutations of the 1527 training rows, end to end.
    n = len(make_sources(run_config(config))[0])
    stream = np.concatenate([np.random.default_rng([0, e]).permutation(n) for e in range(2)])
    assert served == stream[: 20 * 32 + 10 * 64].tolist()
    starts = [32 * i for i in range(20)] + [640 + 64 * i for i in range(10)]
    # The first row of each step that samples the noise scale (10, 20, 30: every 10th by
    # default), and only that.
    assert small == stream[[starts[9], starts[19], starts[29]]].tolist()
    records = [r for r in read_metrics(tmp_path) if "loss" in r]
    assert records[-1]["examples_seen"] == 20 * 32 + 10 * 64


def test_a_summary_rebuilt_on_other_devices_describes_the_run_not_the_rerun(tmp_path):
    # Begun on 4 devices (K=2), finished on 2 (K=4), its summary lost, rerun on 4: the
    # rebuilt summary is the one the run wrote, but for what this process measured.
    config = digits("train.steps=4", "train.eval_every=0")  # global 32, per-device 4
    run(config, tmp_path, devices=4, stop_after_micro_steps=4)  # 2 steps at K=2
    run(config, tmp_path, devices=2)  # 2 more at K=4: the run ends on 2 devices
    written = json.loads((tmp_path / "summary.json").read_text())
    (tmp_path / "summary.json").unlink()
    run(config, tmp_path, devices=4)
    rebuilt = json.loads((tmp_path / "summary.json").read_text())
    assert written["grad_accum_steps"] == rebuilt["grad_accum_steps"] == 4
    assert rebuilt["batch_schedule"] == written["batch_schedule"]  # no stage of 0 steps
    assert [s["steps"] for s in rebuilt["batch_schedule"]["stages"]] == [2, 2]
    # The rerun's peak and compiled memory are 4 devices', not the run's: unknown.
    assert rebuilt["peak_flops_per_s"] is None and rebuilt["memory_bytes"] is None
    for key in ("final_loss", "steps", "global_batch_size", "examples_seen"):
        assert rebuilt[key] == written[key], key


def test_stopping_on_the_last_micro_step_still_finishes_the_run(tmp_path):
    config = digits("batch.per_device_batch_size=1")  # K=4, 6 steps: 24 micro-steps
    result = run(config, tmp_path, stop_after_micro_steps=24)
    assert not result.stopped and (tmp_path / "summary.json").exists()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["eval_loss"] == result.summary["eval_loss"]
    # A finished run that lost its summary (killed right after the last checkpoint) gets
    # one back from metrics.jsonl when rerun.
    (tmp_path / "summary.json").unlink()
    again = run(config, tmp_path)
    rebuilt = json.loads((tmp_path / "summary.json").read_text())
    assert rebuilt["rebuilt_from"] == "metrics.jsonl" and again.summary == rebuilt
    for key in ("final_loss", "eval_loss", "eval_accuracy", "steps", "global_batch_size"):
        assert rebuilt[key] == summary[key], key


def test_train_steps_grows_only_when_asked_and_the_schedule_change_is_logged(tmp_path, full_k1):
    finished_in(tmp_path, full_k1)  # 6 steps, finished
    longer = digits("train.steps=10")
    with pytest.raises(CheckpointError, match=r"holds a finished run of 6 steps.*--allow-longer"):
        run(longer, tmp_path)
    with pytest.raises(CheckpointError, match="cannot be shortened"):
        run(digits("train.steps=4"), tmp_path)
    stopped = run(longer, tmp_path, allow_longer=True, stop_after_micro_steps=8)
    assert stopped.stopped and not (tmp_path / "summary.json").exists()  # unfinished again
    result = run(longer, tmp_path, allow_longer=True)
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records if "loss" in r] == list(range(1, 11))
    (change,) = [r for r in records if r.get("event") == "steps_change"]
    assert (change["step"], change["from_steps"], change["to_steps"]) == (6, 6, 10)
    # The rate step 7 used is the new schedule's, counted in optimizer steps (6 done).
    step7 = next(r for r in records if r.get("step") == 7 and "loss" in r)
    assert step7["learning_rate"] == pytest.approx(float(result_schedule(longer)(6)))
    assert change["learning_rate_after"] == pytest.approx(step7["learning_rate"])
    assert change["learning_rate_before"] == pytest.approx(float(result_schedule(digits())(6)))
    assert result.summary["steps"] == 10


def result_schedule(config):
    """The config's learning-rate schedule, written out with optax alone."""
    o, steps = config.optimizer, config.train.steps
    return optax.warmup_cosine_decay_schedule(
        o.learning_rate / o.warmup_steps,
        o.learning_rate,
        o.warmup_steps,
        max(steps, o.warmup_steps + 1),
        o.learning_rate * o.final_lr_fraction,
    )


class CrashError(RuntimeError):
    """A crash in the middle of a run: nothing is saved on the way out."""


def crash_at_step(monkeypatch, step):
    """Makes the run die (as kill -9 would, for what is on disk) when it logs `step`."""
    real = loop_pieces.format_record

    def format_record(record):
        if record.get("step") == step and "loss" in record:
            raise CrashError(f"crashed at step {step}")
        return real(record)

    monkeypatch.setattr(loop_pieces, "format_record", format_record)


def test_an_abandoned_extension_leaves_the_finished_run_as_it_was(tmp_path, monkeypatch, full_k1):
    finished = finished_in(tmp_path, full_k1)  # 6 steps
    before = json.loads((tmp_path / "summary.json").read_text())
    crash_at_step(monkeypatch, 9)
    with pytest.raises(CrashError):  # --allow-longer to 12 steps, dead at step 9, never saved
        run(digits("train.steps=12"), tmp_path, allow_longer=True)
    monkeypatch.undo()
    again = run(digits(), tmp_path)  # back to the finished 6-step run
    after = json.loads((tmp_path / "summary.json").read_text())
    for key in ("steps", "final_loss", "eval_loss", "eval_accuracy"):
        assert after[key] == before[key] == finished.summary[key], key
    assert again.summary == after
    assert max(r["step"] for r in read_metrics(tmp_path)) == 6
    assert not [r for r in read_metrics(tmp_path) if r.get("event") == "steps_change"]


def test_a_redone_half_step_counts_its_non_finite_micro_batches_once(tmp_path, monkeypatch):
    # Poison the rows of micro-batches 0 and 1 of step 2 on 2 devices × 4 rows (K=4): a
    # streak of 2 there. Redone on 8 devices (one micro-batch of 32), step 2 is one bad
    # micro-batch: a streak of 1 and 1 skipped in all, as an uninterrupted 8-device run.
    config = digits("train.max_nonfinite_in_row=3")
    n = len(make_sources(run_config(config))[0])
    bad = stream_rows(2 * 32, 16, n, seed=0)
    real = loop_lib.data_lib.make_sources

    def poisoned(c):
        train_source, eval_source = real(c)
        inputs = train_source.inputs.copy()
        inputs[bad] = np.nan
        return dataclasses.replace(train_source, inputs=inputs), eval_source

    monkeypatch.setattr(loop_lib.data_lib, "make_sources", poisoned)
    first = run(config, tmp_path / "cut", devices=2, stop_after_micro_steps=10)
    assert first.stopped  # 2 micro-batches into step 2, both non-finite
    resumed = run(config, tmp_path / "cut", devices=8)
    full = run(config, tmp_path / "full", devices=8)
    assert resumed.summary["skipped_micro_batches"] == full.summary["skipped_micro_batches"] == 1
    assert [r["skipped_micro_batches"] for r in read_metrics(tmp_path / "cut") if "loss" in r] == [
        r["skipped_micro_batches"] for r in full.records if "loss" in r
    ]


def test_a_restart_from_scratch_drops_the_old_summary(tmp_path, full_k1):
    finished_in(tmp_path, full_k1)  # 6 steps, finished: its one checkpoint is step_6
    (tmp_path / "checkpoints" / "step_6" / "meta" / "metadata").write_text("not json")
    messages = []
    stopped = train(
        digits("checkpoint.keep=1"),
        tmp_path,
        devices=jax.devices(),
        progress=False,
        echo=messages.append,
        stop_after_micro_steps=3,
    )
    assert stopped.stopped and any("starting from scratch" in m for m in messages)
    assert not (tmp_path / "summary.json").exists()  # the run is not finished
    assert max(r["step"] for r in read_metrics(tmp_path)) == 3


def test_a_checkpoint_set_aside_twice_keeps_both_copies(tmp_path, cut_every_2):
    config = digits("checkpoint.every=2", "checkpoint.keep=5")
    copied(cut_every_2, tmp_path)  # stopped after 4 steps: step_2 and step_4
    ckpt_dir = tmp_path / "checkpoints"
    (ckpt_dir / "step_4.unreadable").mkdir()  # an earlier fallback at the same step
    (ckpt_dir / "step_4" / "meta" / "metadata").write_text("not json")
    warnings = []
    train(config, tmp_path, progress=False, echo=warnings.append)
    assert any("moved to step_4.unreadable-2" in w for w in warnings), warnings
    assert (ckpt_dir / "step_4.unreadable").is_dir()


def test_a_new_workdir_starts_without_a_warning(tmp_path):
    messages = []
    train(digits("train.steps=2"), tmp_path, progress=False, echo=messages.append)
    assert not [m for m in messages if "warning" in m], messages


def test_a_kept_checkpoint_names_the_micro_steps_resuming_redoes(tmp_path, cut_k4):
    config = digits("batch.per_device_batch_size=1")  # 8 × 1 × K=4
    copied(cut_k4, tmp_path)  # stopped after 10 micro-steps: step_2 holds 2 of step 3's 4
    messages = []
    train(config, tmp_path, progress=False, echo=messages.append, stop_after_micro_steps=11)
    (line,) = [m for m in messages if m.startswith("stopped by")]
    assert "checkpoint step_2 was already saved and is kept" in line
    assert "+ 3 of 4 micro-steps" in line and "redoes the 1 micro-steps since" in line


def test_an_attempt_that_dies_before_saving_does_not_log_its_events_twice(
    tmp_path, monkeypatch, cut_k1
):
    copied(cut_k1, tmp_path)
    bigger = digits("batch.global_batch_size=64")
    crash_at_step(monkeypatch, 3)
    with pytest.raises(CrashError):
        run(bigger, tmp_path, allow_batch_change=True)
    monkeypatch.undo()
    run(bigger, tmp_path, allow_batch_change=True)
    changes = [r for r in read_metrics(tmp_path) if r.get("event") == "plan_change"]
    assert len(changes) == 1 and changes[0]["step"] == 2


def test_a_changed_noise_scale_decay_resumes(tmp_path, cut_k1):
    copied(cut_k1, tmp_path)
    resumed = run(digits("train.noise_scale_decay=0.5"), tmp_path)  # only smooths a metric
    assert not resumed.stopped and int(resumed.state.step) == 6


def test_a_resumed_run_says_its_steps_apart_and_a_rebuilt_summary_knows_no_timings(
    tmp_path, capsys
):
    """`done:` names this attempt's steps with this attempt's time and the run's in all;
    a summary rebuilt from metrics.jsonl has no timings to give: null, not 0."""
    import re

    from jaxkit import cli

    args = ["train", "mlp_digits", "train.eval_every=0", "checkpoint.every=0", "--no-progress",
            "--workdir", str(tmp_path)]  # fmt: skip
    assert cli.main([*args, "train.steps=4"]) == 0
    assert re.search(r"^done: 4 optimizer steps in [\d.]+ s$", capsys.readouterr().out, re.M)
    assert cli.main([*args, "train.steps=7", "--allow-longer"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^done: 3 optimizer steps this attempt in [\d.]+ s; 7 in all$", out, re.M)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["steps"], summary["steps_this_attempt"]) == (7, 3)
    (tmp_path / "summary.json").unlink()
    assert cli.main([*args, "train.steps=7"]) == 0
    assert "wrote the missing" in capsys.readouterr().out
    rebuilt = json.loads((tmp_path / "summary.json").read_text())
    assert rebuilt["rebuilt_from"] == "metrics.jsonl" and rebuilt["steps"] == 7
    unknown = ("first_step_s", "wall_time_s", "compile_s", "trace_s", "compile_cache_hit")
    for key in (*unknown, "median_step_time_s"):
        assert rebuilt[key] is None, key
    assert rebuilt["final_loss"] == summary["final_loss"]


def test_small_replicated_arrays_are_saved_whole_without_compiling_a_slice_each(tmp_path):
    """Orbax would share a replicated array's save over its 8 replicas with one compiled
    slicing program per array and device; arrays of under a MiB per slice are written
    whole by one replica (nothing is lowered during the save), and read back the same."""
    import orbax.checkpoint as ocp

    from jaxkit.train.checkpoint import REPLICA_PARALLEL_MIN_BYTES, _manager

    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    # Shapes of their own, so that no earlier test compiled their slices in this process.
    tree = {
        "w": jax.device_put(np.arange(8 * 24, dtype=np.float32).reshape(8, 24), replicated),
        "b": jax.device_put(np.arange(40, dtype=np.float32), replicated),
    }
    assert REPLICA_PARALLEL_MIN_BYTES > 8 * 24 * 4  # the premise: these slices are small
    manager = _manager(tmp_path, create=True)
    lowered = []

    def listen(event, duration, **kwargs):
        if event == "/jax/core/compile/jaxpr_to_mlir_module_duration":
            lowered.append(duration)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        manager.save(1, args=ocp.args.Composite(state=ocp.args.StandardSave(tree)))
        manager.wait_until_finished()
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert lowered == []  # orbax's own handler lowers a slicing program per array and device
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree
    )
    restored = manager.restore(
        1, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract))
    ).state
    manager.close()
    for name, array in tree.items():
        np.testing.assert_array_equal(np.asarray(restored[name]), np.asarray(array))


@pytest.mark.parametrize(
    "overrides,held",
    [
        (("batch.per_device_batch_size=4",), False),  # 8 × 4 × K=1
        (("batch.per_device_batch_size=2",), True),  # 8 × 2 × K=2
        (("batch.per_device_batch_size=2", "train.accumulation=fused"), False),
        (
            (
                "batch.per_device_batch_size=4",
                "batch.global_batch_size=null",
                "batch.schedule=0:32,64:64",
            ),
            True,
        ),
    ],
)
def test_a_state_holds_an_accumulator_only_where_a_step_takes_several_calls(overrides, held):
    """MultiSteps' accumulator holds zeros at every step boundary: kept between calls only
    where a step's micro-batches arrive in several (MultiSteps mode at K > 1, or a batch
    schedule that reaches K > 1, which runs one program at every K)."""
    config = run_config(digits(*overrides))
    mesh = make_mesh(dataclasses.asdict(config.mesh))
    schedule = schedule_from_config(config, mesh_shape(mesh))
    setup = build(config, schedule.first, mesh, schedule)
    state = abstract_state(setup)
    assert (state.opt_state.acc_grads is not None) == held
    assert setup.holds_accumulator == held


# A workdir written by jaxkit before states dropped the accumulator where it is always zeros
# between calls (tests/data/multisteps_mid_step/make.py): mlp_digits with 8 hidden units on
# 1 device at K = 2, stopped 1 micro-step into optimizer step 2.
WRITTEN_WITH_AN_ACCUMULATOR = Path(__file__).parent / "data" / "multisteps_mid_step"


def tiny_digits(*overrides):
    return digits(
        "model.hidden_size=8",
        "model.num_layers=1",
        "batch.global_batch_size=8",
        "batch.per_device_batch_size=4",
        "train.steps=3",
        "train.eval_every=0",
        "train.noise_scale_every=0",
        *overrides,
    )


@pytest.fixture(scope="module")
def tiny_full(tmp_path_factory):
    """The three steps uninterrupted, K = 2 (the old workdir's split), as jaxkit runs today."""
    return run(tiny_digits(), tmp_path_factory.mktemp("tiny_full"), devices=1)


@pytest.mark.parametrize(
    "overrides,continued",
    [
        ((), True),  # the same split: the half-step continues, the accumulator is kept
        (("batch.per_device_batch_size=8",), False),  # K = 1: redone, the accumulator dropped
        (("train.accumulation=fused",), False),  # fused: redone, the accumulator dropped
    ],
)
def test_a_checkpoint_written_with_an_accumulator_resumes(
    tmp_path, tiny_full, overrides, continued
):
    workdir = tmp_path / "old"
    shutil.copytree(WRITTEN_WITH_AN_ACCUMULATOR, workdir)
    messages = []
    resumed = train(
        tiny_digits(*overrides),
        workdir,
        devices=jax.devices()[:1],
        progress=False,
        echo=messages.append,
    )
    assert any("at optimizer step 1, 1 of 2 micro-steps" in m for m in messages), messages
    redone = any("cannot continue: that step starts again" in m for m in messages)
    assert redone == (not continued), messages
    assert (resumed.state.opt_state.acc_grads is not None) == continued
    assert int(resumed.state.step) == 3 and int(resumed.state.opt_state.mini_step) == 0
    # The same trajectory as the uninterrupted run: every split follows it to round-off
    # (the checkpoint's first step and a half ran under the jax that wrote it).
    worst = max(
        float(np.max(np.abs(a - b)))
        for a, b in zip(leaves(tiny_full.state.params), leaves(resumed.state.params), strict=True)
    )
    assert worst < PARAM_ATOL, worst
    records = [r for r in read_metrics(workdir) if "loss" in r]
    assert [r["step"] for r in records] == [1, 2, 3]  # step 1 logged once, by the old run


def test_another_model_s_refusal_names_the_params_not_an_accumulator(tmp_path):
    """The old workdir's accumulator mirrors its params: a refusal of another model names
    what differs in the params, not the accumulator a K = 1 run does not even keep."""
    shutil.copytree(WRITTEN_WITH_AN_ACCUMULATOR, tmp_path / "old")
    other = run_config(tiny_digits("model.hidden_size=16", "batch.per_device_batch_size=8"))
    mesh = make_mesh(dataclasses.asdict(other.mesh), jax.devices()[:1])  # K = 1
    setup = build(other, plan_from_config(other, mesh_shape(mesh)), mesh)
    ckpt = Checkpointer(tmp_path / "old" / "checkpoints", keep=3, warn=print)
    with pytest.raises(CheckpointError) as refused:
        ckpt.restore_latest(abstract_state(setup), check=lambda meta: None)
    message = str(refused.value)
    assert "params.hidden.0.kernel: saved (64, 8), model wants (64, 16)" in message, message
    assert "acc_grads" not in message, message


# A workdir written by jaxkit before the typed config sections (tests/data/lm_before_sections/
# make.py): a transformer LM on synthetic tokens, 1 device, K = 2, stopped after step 2 of 4.
LM_BEFORE_SECTIONS = Path(__file__).parent / "data" / "lm_before_sections"
LM_BEFORE_SECTIONS_OVERRIDES = [
    "model.vocab_size=32",
    "model.d_model=16",
    "model.num_heads=2",
    "model.mlp_dim=32",
    "model.num_layers=1",
    "data.seq_len=16",
    "data.source=synthetic",
    "data.num_examples=256",
    "batch.global_batch_size=8",
    "batch.per_device_batch_size=4",
    "train.steps=4",
    "train.log_every=1",
    "train.eval_every=2",
    "checkpoint.every=0",
    "train.noise_scale_every=0",
]


def test_a_run_saved_before_the_typed_sections_resumes_unchanged(tmp_path):
    """Its saved config resumes as it ran (no key refused, none read differently), and the
    resumed run ends where an uninterrupted one of today's code does."""
    config = load_config("lm_tiny")
    apply_overrides(config, LM_BEFORE_SECTIONS_OVERRIDES)
    full = run(config, tmp_path / "full", devices=1)
    workdir = tmp_path / "old"
    shutil.copytree(LM_BEFORE_SECTIONS, workdir)
    messages = []
    resumed = train(
        config, workdir, devices=jax.devices()[:1], progress=False, echo=messages.append
    )
    assert any("resum" in m and "step 2" in m for m in messages), messages
    assert int(resumed.state.step) == 4
    worst = max(
        float(np.max(np.abs(a - b)))
        for a, b in zip(leaves(full.state.params), leaves(resumed.state.params), strict=True)
    )
    assert worst < PARAM_ATOL, worst
    records = [r for r in read_metrics(workdir) if "loss" in r]
    assert [r["step"] for r in records] == [1, 2, 3, 4]  # steps 1 and 2 by the old run
    saved = json.loads((LM_BEFORE_SECTIONS / "config.json").read_text())
    written = json.loads((workdir / "config.json").read_text())
    for key in ("dcn_data", "dcn_fsdp"):  # declared since, and saved at their `added` value
        assert written["mesh"].pop(key) == 1
    assert written == saved  # read, not rewritten

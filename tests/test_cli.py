"""The CLI end to end, through subprocesses as a user runs it."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def jaxkit(*args, timeout=300):
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run(
        [sys.executable, "-m", "jaxkit", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=env,
    )


def test_plan_json_on_a_good_config():
    out = jaxkit("plan", "lm_tiny", "--host-devices", "4", "--json")
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert plan["mesh_shape"] == {"data": 4, "fsdp": 1, "tensor": 1}
    assert (
        plan["data_parallel_size"],
        plan["per_device_batch_size"],
        plan["grad_accum_steps"],
    ) == (4, 4, 4)
    assert (plan["global_batch_size"], plan["micro_batch_size"]) == (64, 16)
    assert (plan["seq_len"], plan["tokens_per_step"], plan["learning_rate"]) == (128, 8192, 3e-3)


def test_plan_table_and_overrides():
    out = jaxkit(
        "plan",
        "mlp_digits",
        "batch.per_device_batch_size=null",
        "batch.grad_accum_steps=2",
        "optimizer.lr_scaling=linear",
        "optimizer.reference_batch_size=16",
        "--host-devices",
        "2",
    )
    assert out.returncode == 0, out.stderr
    assert "per_device_batch_size | 8" in out.stdout and "= 2 × 8 × 2" in out.stdout
    assert "0.006" in out.stdout  # 3e-3 × 32/16


def test_plan_errors_exit_nonzero_with_the_reason():
    bad = jaxkit(
        "plan", "mlp_digits", "batch.global_batch_size=30", "--host-devices", "8", "--json"
    )
    assert bad.returncode == 2 and bad.stdout == ""
    assert "data_parallel_size × per_device_batch_size × grad_accum_steps" in bad.stderr
    assert "32, 64" in bad.stderr
    typo = jaxkit("plan", "mlp_digits", "batch.per_device=4")
    assert typo.returncode == 2 and "batch.per_device_batch_size" in typo.stderr
    mesh = jaxkit("plan", "mlp_digits", "mesh.data=3", "--host-devices", "8")
    assert mesh.returncode == 2 and "8 are available" in mesh.stderr


def test_train_refuses_data_too_small_before_training(tmp_path):
    out = jaxkit("train", "lm_tiny", "data.max_bytes=20000", "--workdir", str(tmp_path / "r"))
    assert out.returncode == 2 and "fewer than one micro-batch" in out.stderr
    assert "Traceback" not in out.stderr and not (tmp_path / "r" / "metrics.jsonl").exists()


def test_train_writes_config_plan_and_metrics(tmp_path):
    workdir = tmp_path / "run"
    out = jaxkit(
        "train",
        "lm_tiny",
        "train.steps=4",
        "train.log_every=2",
        "train.eval_every=2",
        "train.eval_batches=1",
        "data.max_bytes=100000",
        "model.num_layers=1",
        "--host-devices",
        "8",
        "--workdir",
        str(workdir),
        "--no-progress",
    )
    assert out.returncode == 0, out.stderr
    assert "tokens_per_step" in out.stdout and "nats/byte" in out.stdout
    assert json.loads((workdir / "config.json").read_text())["train"]["steps"] == 4
    assert json.loads((workdir / "plan.json").read_text())["grad_accum_steps"] == 2
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    train_records = [r for r in records if "loss" in r]
    eval_records = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in train_records] == [2, 4]
    assert [r["step"] for r in eval_records] == [2, 4]
    for key in (
        "step",
        "micro_step",
        "loss",
        "learning_rate",
        "grad_norm",
        "examples_seen",
        "tokens_seen",
        "step_time_s",
        "examples_per_s",
    ):
        assert key in train_records[0], key
    assert train_records[1]["micro_step"] == 8 and train_records[1]["examples_seen"] == 256
    assert train_records[1]["tokens_seen"] == 256 * 128
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["eval_loss"] == eval_records[-1]["eval_loss"] and summary["unigram_entropy"] > 2


def test_train_reports_bad_choices_without_a_traceback(tmp_path):
    out = jaxkit("train", "mlp_digits", "model.kind=cnn", "--workdir", str(tmp_path / "r"))
    assert out.returncode == 2 and "model.kind='cnn' is not one of transformer, mlp" in out.stderr
    assert "Traceback" not in out.stderr

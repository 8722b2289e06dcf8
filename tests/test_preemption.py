"""Crashes and preemptions, through real subprocesses and real signals."""

import json
import os
import random
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from jaxkit.batch_plan import plan_from_config
from jaxkit.checkpoint import Checkpointer, abstract_state
from jaxkit.config import apply_overrides, load_config
from jaxkit.mesh import make_mesh, mesh_shape
from jaxkit.metrics import read_metrics
from jaxkit.train_step import build

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 30
OVERRIDES = [
    "model.num_layers=1",
    "model.d_model=32",
    "model.num_heads=2",
    "model.mlp_dim=64",
    "data.seq_len=32",
    "data.max_bytes=200000",
    "batch.global_batch_size=32",
    "batch.per_device_batch_size=2",
    f"train.steps={STEPS}",
    "train.log_every=1",
    "train.eval_every=0",
    "train.eval_batches=1",
    "checkpoint.every=2",
    "checkpoint.keep=2",
]  # 8 devices × 2 rows × K = 2


def start(workdir):
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jaxkit",
            "train",
            "lm_tiny",
            *OVERRIDES,
            "--host-devices",
            "8",
            "--workdir",
            str(workdir),
            "--no-progress",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=ROOT),
    )


def finish(workdir):
    proc = start(workdir)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    return out


def wait_for(predicate, timeout=120):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def logged_steps(workdir):
    path = workdir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def final_state(workdir):
    config = load_config("lm_tiny")
    apply_overrides(config, OVERRIDES)
    mesh = make_mesh(config.mesh.to_dict())
    setup = build(config, plan_from_config(config, mesh_shape(mesh)), mesh)
    ckpt = Checkpointer(workdir / "checkpoints", keep=2, warn=print)
    last = ckpt.steps()[-1]
    assert last == STEPS * 2  # the final checkpoint, at the last micro-step
    state = ckpt.restore(last, abstract_state(setup))
    ckpt.close()
    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(state))]


def losses(workdir):
    return [(r["step"], r["loss"], r["grad_norm"]) for r in read_metrics(workdir) if "loss" in r]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One uninterrupted run that both tests compare against."""
    workdir = tmp_path_factory.mktemp("reference")
    finish(workdir)
    return workdir


def test_kill_9_anywhere_loses_nothing(tmp_path, reference):
    workdir = tmp_path / "killed"
    rng = random.Random(20261121)
    in_save = False
    for attempt in range(3):
        proc = start(workdir)
        before = logged_steps(workdir)
        wait_for(lambda p=proc, n=before: logged_steps(workdir) > n + 2 or p.poll() is not None)
        if attempt == 0:  # once in the middle of an asynchronous save
            wait_for(
                lambda p=proc: (
                    any("tmp" in d.name for d in (workdir / "checkpoints").iterdir())
                    or p.poll() is not None
                )
            )
            in_save = proc.poll() is None
        else:  # and at random points in between
            time.sleep(rng.uniform(0.0, 0.8))
        if proc.poll() is not None:
            break
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
    assert in_save, "the first kill was meant to land during a save"
    out = finish(workdir)
    assert "resuming from" in out
    assert not [p for p in (workdir / "checkpoints").iterdir() if "tmp" in p.name]
    assert losses(workdir) == losses(reference)  # bitwise: same floats in the JSON
    for a, b in zip(final_state(reference), final_state(workdir), strict=True):
        np.testing.assert_array_equal(a, b)


def test_sigterm_saves_exits_zero_and_resumes_exactly(tmp_path, reference):
    workdir = tmp_path / "preempted"
    proc = start(workdir)
    wait_for(lambda: logged_steps(workdir) >= 3)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    line = next(x for x in out.splitlines() if x.startswith("stopped by SIGTERM"))
    saved = int(line.split("micro-step ")[1].split()[0])
    ckpt = Checkpointer(workdir / "checkpoints", keep=2, warn=print)
    assert ckpt.steps()[-1] == saved and saved < STEPS * 2
    meta = ckpt.read_meta(saved)
    ckpt.close()
    assert meta["loop"]["step"] == saved // 2
    assert json.loads((workdir / "plan.json").read_text())["grad_accum_steps"] == 2
    out = finish(workdir)
    assert f"resuming from {workdir / 'checkpoints'}" in out
    assert losses(workdir) == losses(reference)
    for a, b in zip(final_state(reference), final_state(workdir), strict=True):
        np.testing.assert_array_equal(a, b)

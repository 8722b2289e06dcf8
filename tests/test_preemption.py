"""Crashes and preemptions, through real subprocesses and real signals. The runs that
nothing interrupts (the references, and the last attempt that finishes a run) train in the
test's process."""

import functools
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from cli_run import jaxkit, python_c

from jaxkit.batch.schedule import plan_from_config
from jaxkit.config import apply_overrides, load_config, run_config
from jaxkit.mesh import make_mesh, mesh_shape
from jaxkit.records.metrics import read_metrics
from jaxkit.step.train_step import build
from jaxkit.train.checkpoint import Checkpointer, abstract_state

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
    "train.eval_examples=32",
    "checkpoint.every=2",
    "checkpoint.keep=2",
    "train.noise_scale_every=0",  # not under test: a program less for each process to compile
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
    """The run to its end, and its output. In this process (8 devices, as `--host-devices 8`
    gives a new one): nothing interrupts it. It saves only at its end, the checkpoint its
    final state is read from: nothing kills it in a save, and each save costs about 0.3 s
    of CPU (checkpoint.every may change on a resume)."""
    args = ["lm_tiny", *OVERRIDES, "checkpoint.every=0", "--workdir", str(workdir)]
    done = jaxkit("train", *args, "--no-progress")
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


def wait_for(predicate, timeout=120):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def logged_steps(workdir):
    """Train records in the log (not the events a resume writes before it trains)."""
    path = workdir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return sum('"loss"' in line for line in lines)


@functools.cache
def abstract_train_state():
    """The train state's shapes and shardings, that a checkpoint restores into: one build."""
    config = load_config("lm_tiny")
    apply_overrides(config, OVERRIDES)
    mesh = make_mesh(config.mesh.to_dict())
    return abstract_state(
        build(run_config(config), plan_from_config(run_config(config), mesh_shape(mesh)), mesh)
    )


def final_state(workdir):
    ckpt = Checkpointer(workdir / "checkpoints", keep=2, warn=print)
    last = ckpt.steps()[-1]
    assert last == STEPS  # the final checkpoint, keyed by optimizer steps
    state = ckpt.restore(last, abstract_train_state())
    ckpt.close()
    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(state))]


def losses(workdir):
    return [(r["step"], r["loss"], r["grad_norm"]) for r in read_metrics(workdir) if "loss" in r]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One uninterrupted run that both tests compare against: its workdir and final state."""
    workdir = tmp_path_factory.mktemp("reference")
    finish(workdir)
    return workdir, final_state(workdir)


def torn_save(workdir):
    """What a save killed half-way leaves: orbax's temporary directory for the next step,
    with part of the arrays and no commit marker. Made here from the newest checkpoint, so
    the test does not depend on a kill landing inside a save."""
    ckpt_dir = workdir / "checkpoints"
    newest = max(
        (p for p in ckpt_dir.iterdir() if p.name.startswith("step_") and "." not in p.name),
        key=lambda p: int(p.name.split("_")[1]),
    )
    torn = ckpt_dir / f"step_{int(newest.name.split('_')[1]) + 1}.orbax-checkpoint-tmp-1700000000"
    shutil.copytree(newest, torn)
    for marker in torn.rglob("commit_success.txt"):
        marker.unlink()
    for file in sorted(p for p in (torn / "state").rglob("*") if p.is_file())[::2]:
        file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    return torn


def test_kill_9_anywhere_loses_nothing(tmp_path, reference):
    workdir = tmp_path / "killed"
    rng = random.Random(20261121)
    for _ in range(3):  # kills at random points, wherever they land (in a save or not)
        proc = start(workdir)
        before = logged_steps(workdir)
        wait_for(lambda p=proc, n=before: logged_steps(workdir) > n + 2 or p.poll() is not None)
        time.sleep(rng.uniform(0.0, 0.8))
        if proc.poll() is not None:
            break
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
    torn = torn_save(workdir)
    out = finish(workdir)
    assert "resuming from" in out
    assert not torn.exists()
    assert not [p for p in (workdir / "checkpoints").iterdir() if "tmp" in p.name]
    reference, reference_state = reference
    assert losses(workdir) == losses(reference)  # bitwise: same floats in the JSON
    for a, b in zip(reference_state, final_state(workdir), strict=True):
        np.testing.assert_array_equal(a, b)


def test_sigterm_saves_exits_zero_and_resumes_exactly(tmp_path, reference):
    workdir = tmp_path / "preempted"
    proc = start(workdir)
    wait_for(lambda: logged_steps(workdir) >= 3)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    line = next(x for x in out.splitlines() if x.startswith("stopped by SIGTERM"))
    saved = int(re.search(r"checkpoint step_(\d+)", line).group(1))
    ckpt = Checkpointer(workdir / "checkpoints", keep=2, warn=print)
    assert ckpt.steps()[-1] == saved and saved < STEPS
    meta = ckpt.read_meta(saved)
    ckpt.close()
    assert meta["loop"]["step"] == saved and meta["loop"]["examples_seen"] == saved * 32
    assert json.loads((workdir / "plan.json").read_text())["grad_accum_steps"] == 2
    out = finish(workdir)
    assert f"resuming from {workdir / 'checkpoints'}" in out
    reference, reference_state = reference
    assert losses(workdir) == losses(reference)
    for a, b in zip(reference_state, final_state(workdir), strict=True):
        np.testing.assert_array_equal(a, b)


def test_sigterm_on_2_then_8_then_8_devices_finishes_every_step_once(tmp_path):
    """A run preempted and moved between device counts, through the CLI, as on a pod."""
    steps = 40  # each stop lands a few steps after the 3rd record it waits for
    run = [
        "mlp_digits",
        "batch.global_batch_size=32",
        "batch.per_device_batch_size=4",  # K = 4 on 2 devices, 1 on 8
        f"train.steps={steps}",
        "train.log_every=1",
        "train.eval_every=0",
        "checkpoint.every=2",
        "train.noise_scale_every=0",  # not under test: a program less for each process
    ]

    def launch(workdir, devices):
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "jaxkit",
                "train",
                *run,
                "--host-devices",
                str(devices),
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

    # The uninterrupted run, and the last attempt (no signal), in this process: 8 devices,
    # as `--host-devices 8` gives a new one. The uninterrupted run saves only at its end.
    done = jaxkit(
        "train", *run, "checkpoint.every=0", "--workdir", str(tmp_path / "reference"),
        "--no-progress",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    workdir = tmp_path / "moved"
    for devices in (2, 8):
        proc = launch(workdir, devices)
        before = logged_steps(workdir)
        wait_for(lambda p=proc, n=before: logged_steps(workdir) >= n + 3 or p.poll() is not None)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0 and "stopped by SIGTERM" in out, out
    done = jaxkit("train", *run, "--workdir", str(workdir), "--no-progress")
    assert done.returncode == 0, done.stdout + done.stderr
    records = [r for r in read_metrics(workdir) if "loss" in r]
    assert [r["step"] for r in records] == list(range(1, steps + 1))  # each once, in order
    expected = [r["loss"] for r in read_metrics(tmp_path / "reference") if "loss" in r]
    # Another device count sums the same per-example gradients in another order (see
    # test_equivalence): round-off only.
    np.testing.assert_allclose([r["loss"] for r in records], expected, rtol=2e-6)
    assert json.loads((workdir / "summary.json").read_text())["steps"] == steps


# `jaxkit train` as the console script runs it, with stdout a file that stays block-buffered
# (the wrapper is no TextIOWrapper the CLI could make line-buffered), and a Ctrl-C that lands
# where one did before training: inside a garbage-collection callback, as jax registers one.
# Python runs a signal's handler at its next check, here right after raise_signal, inside
# the callback; a KeyboardInterrupt raised there is printed as "Exception ignored" and dropped.
CTRL_C_INSIDE_GC = r"""
import gc, signal, sys

from jaxkit import cli

armed = False


class Unbuffered:
    def __init__(self, stream):
        self.stream = stream

    def write(self, text):
        global armed
        armed = armed or text.startswith("batch plan")  # set up, not yet training
        return self.stream.write(text)

    def __getattr__(self, name):
        return getattr(self.stream, name)


def ctrl_c(phase, info):
    global armed
    if armed:
        armed = False
        signal.raise_signal(signal.SIGINT)


gc.callbacks.append(ctrl_c)
sys.stdout = Unbuffered(sys.stdout)
sys.exit(cli.main(sys.argv[1:]))
"""


def test_ctrl_c_before_training_exits_130_even_inside_a_gc_callback(tmp_path):
    workdir = tmp_path / "run"
    argv = ["train", "mlp_digits", "train.steps=3", "--workdir", str(workdir), "--no-progress"]
    with open(tmp_path / "stdout", "w") as stdout:
        done = subprocess.run(
            [sys.executable, "-c", CTRL_C_INSIDE_GC, *argv],
            stdout=stdout,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env=dict(os.environ, PYTHONPATH=ROOT),
            timeout=300,
        )
    assert done.returncode == 130, done.stderr[-2000:]
    assert done.stderr.endswith("jaxkit: interrupted\n") and "Exception ignored" not in done.stderr
    assert "batch plan" in (tmp_path / "stdout").read_text()  # flushed on the way out
    assert not (workdir / "metrics.jsonl").exists() and not list(workdir.glob("checkpoints/*"))


# `jaxkit train` as the console script runs it (`main()` reads sys.argv); SIGTERM (a
# requeue, a preemption) after the last step, as the run's summary is made, and again once
# the command is done, as the interpreter tears down (a second or so on a CPU).
SIGTERM_AT_THE_SUMMARY = r"""
import signal, sys

from jaxkit import cli
from jaxkit.train import loop

real = loop.summarize


def summarize(*args, **kwargs):
    signal.raise_signal(signal.SIGTERM)
    return real(*args, **kwargs)


loop.summarize = summarize
code = cli.main()
signal.raise_signal(signal.SIGTERM)
sys.exit(code)
"""


def test_sigterm_after_the_last_step_finishes_the_run_and_exits_zero(tmp_path):
    workdir = tmp_path / "run"
    argv = ["train", "mlp_digits", "train.steps=3", "train.eval_examples=32"]
    argv += ["train.noise_scale_every=0", "--host-devices", "1"]  # a compile or two less
    argv += ["--workdir", str(workdir), "--no-progress"]
    done = python_c(SIGTERM_AT_THE_SUMMARY, *argv)
    # It said "terminated (SIGTERM) before training started: nothing to save" and exited
    # 143, with step 3 saved and the summary never written; the SIGTERM during the teardown
    # killed the finished run (status -15) without a word.
    assert done.returncode == 0, done.stderr[-2000:]
    assert "before training started" not in done.stderr
    assert "done: 3 optimizer steps" in done.stdout
    assert json.loads((workdir / "summary.json").read_text())["steps"] == 3
    assert [p.name for p in (workdir / "checkpoints").iterdir()] == ["step_3"]

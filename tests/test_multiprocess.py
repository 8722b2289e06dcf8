"""Two processes × 4 simulated devices form one 8-device mesh (loopback only, bounded)."""

import errno
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from cli_run import jaxkit  # in-process: one process's run, as a new one would do it

from jaxkit import distributed
from jaxkit.train.lock import LOCK_NAME, run_lock

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = [
    "mlp_digits",
    "train.steps=6",
    "train.log_every=1",
    "train.eval_every=3",
    "checkpoint.every=3",
    "checkpoint.keep=2",
]


def reserve_port() -> socket.socket:
    """A loopback port held for the coordinator until the run is over.

    Finding a free port and letting it go leaves it to anyone until the coordinator binds
    it. Instead this socket keeps it bound (never listening, so it takes no connections)
    with SO_REUSEPORT. The coordinator's gRPC server sets SO_REUSEPORT as well (gRPC's
    default on Linux), so it can bind the same port meanwhile; anything else that binds it
    gets EADDRINUSE, and the kernel skips it when it picks a port for bind(0) or connect().
    (Checked with jax.distributed here: held this way, two processes join; held without
    the option, the coordinator fails with "Failed to start RPC server".)
    """
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    s.bind(("127.0.0.1", 0))
    return s


class Run(list):
    """The processes of one run, and the socket that holds their coordinator's port."""

    def __init__(self, procs, port_holder):
        super().__init__(procs)
        self.port_holder = port_holder


# The kit's own bounds on joining and on a silent peer (jaxkit/distributed.py) for every run
# whose test is not about them, and XLA's bound on a CPU collective raised (a flag both jax
# 0.10's and 0.12's XLA know): with 30 s and 20 s and XLA's default, a process of a
# two-process run aborted (SIGABRT) once on a machine loaded three times over, as its peer
# had just connected its CPU collectives (gloo). The tests about them shorten them themselves.
TIMEOUTS = {
    "JAXKIT_JOIN_TIMEOUT_S": "120",
    "JAXKIT_HEARTBEAT_TIMEOUT_S": "60",
    "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_cpu_collective_timeout_seconds=600",
}


def assert_all_exit_0(results):
    """Each process's status, and the end of the output of each that failed, whole (a
    list's repr in an assertion is cut in the middle, where the reason is)."""
    failed = [
        f"process {i} exited {rc}:\n{out[-4000:]}" for i, (rc, out) in enumerate(results) if rc
    ]
    assert not failed, "\n\n".join(failed)


def start(workdir, run=RUN, processes=1, per_process_extra=None, ids=None, **env_vars):
    """Starts `jaxkit train` as processes `ids` (default all) of a `processes`-process run."""
    env = {**os.environ, "PYTHONPATH": ROOT, **TIMEOUTS, **env_vars}
    port_holder = reserve_port() if processes > 1 else None
    port = port_holder.getsockname()[1] if port_holder else None
    procs = []
    for i in range(processes) if ids is None else ids:
        cmd = [
            sys.executable,
            "-m",
            "jaxkit",
            "train",
            *run,
            *(per_process_extra or {}).get(i, []),
            "--host-devices",
            str(8 // processes),
            "--workdir",
            str(workdir),
            "--no-progress",
        ]
        if processes > 1:
            cmd += [
                "--coordinator",
                f"127.0.0.1:{port}",
                "--num-processes",
                str(processes),
                "--process-id",
                str(i),
            ]
        procs.append(
            subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env
            )
        )
    return Run(procs, port_holder)


def finish(procs, timeout=240):
    """[(returncode, output)] of every process; all are killed if one overruns."""
    results = []
    deadline = time.monotonic() + timeout
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=max(1, deadline - time.monotonic()))
            results.append((proc.returncode, out))
    finally:
        for proc in procs:
            proc.kill()
        if procs.port_holder is not None:
            procs.port_holder.close()
    return results


def launch(workdir, run=RUN, processes=1, per_process_extra=None):
    return finish(start(workdir, run, processes, per_process_extra))


def wait_for_records(workdir, count, proc, timeout=120):
    metrics = workdir / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    while not (metrics.exists() and metrics.read_text().count("\n") >= count):
        assert time.monotonic() < deadline and proc.poll() is None, "never started"
        time.sleep(0.1)


def records(workdir):
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def assert_same_run(a, b):
    """The same steps and losses, to round-off; what a resume logs of itself set aside."""
    ra, rb = ([r for r in records(w) if "event" not in r] for w in (a, b))
    assert [r["step"] for r in ra] == [r["step"] for r in rb]
    for x, y in zip(ra, rb, strict=True):
        key = "loss" if "loss" in x else "eval_loss"
        # Gloo sums across processes in another order than one process does: round-off only.
        np.testing.assert_allclose(x[key], y[key], rtol=2e-6)


def test_the_held_port_refuses_other_binders_but_not_a_reuseport_server():
    holder = reserve_port()
    port = holder.getsockname()[1]
    try:
        for family, host in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET, "0.0.0.0")):
            with socket.socket(family) as other, pytest.raises(OSError) as refused:
                other.bind((host, port))
            assert refused.value.errno == errno.EADDRINUSE
        with socket.socket() as server:  # a server that sets SO_REUSEPORT, as gRPC does
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            server.bind(("127.0.0.1", port))
            server.listen()
    finally:
        holder.close()


def launch_here(workdir, run=RUN):
    """[(returncode, output)] of the one-process run, in this process: the 8 devices that
    `--host-devices 8` gives a new one (conftest), without its start-up."""
    done = jaxkit("train", *run, "--workdir", str(workdir), "--no-progress")
    return [(done.returncode, done.stdout + done.stderr)]


# The pieces Gloo's C++ stream writes one after another for each rank it connects:
# "[Gloo] Rank 6 is connected to 7 peer ranks. Expected number of connected peer ranks is : 7".
# Its threads write at once, so a line may break between any two pieces (seen: "[Gloo] Rank
# 6[Gloo] Rank 5 is connected to ..."); each piece is taken out on its own, leaving the counts.
GLOO_PIECES = (
    r"\[Gloo\] Rank ",
    r" is connected to ",
    r" peer ranks\. Expected number of connected peer ranks is : ",
)


def gloo_removed(output):
    """The output with each of Gloo's pieces taken out: of its lines, the counts remain."""
    for piece in GLOO_PIECES:
        output = re.sub(piece, "", output)
    return output


# Two micro-steps of 2 rows per device (K = 2 on 8 devices), so that the two accumulation
# modes reduce the gradient across the slices differently: MultiSteps at every micro-step,
# the fused step once per optimizer step.
ACCUMULATING = [*RUN, "batch.per_device_batch_size=2"]
TWO_SLICES = [*ACCUMULATING, "mesh.dcn_data=2"]  # each process a slice of 4 devices


def test_two_slices_train_like_one_process_and_resume_across_process_counts(tmp_path):
    """Two processes of 4 devices as two slices (the mesh over them laid out as over two
    TPU slices, each process a slice on CPU) train as one process of 8 does, in both
    accumulation modes; each run resumes on the other's processes."""
    one, two = tmp_path / "one", tmp_path / "two"
    ((rc, out),) = launch_here(one, ACCUMULATING)
    assert rc == 0, out
    results = launch(two, TWO_SLICES, processes=2)
    assert_all_exit_0(results)
    assert "step      6" in results[0][1] and "step      6" not in results[1][1]  # one voice
    # Process 1 prints nothing of its own (not its join, nor the workdir): only the lines of
    # the Gloo library under JAX's CPU collectives, which every process prints, interleaved.
    # With Gloo's pieces taken out, only their counts may be left.
    own = gloo_removed(results[1][1])
    assert re.fullmatch(r"[\d\s]*", own), results[1][1]
    assert results[0][1].startswith("joining 2 processes at 127.0.0.1:")
    assert "data-parallel ranks = 2 × 1 × 4 × 1 over 2 slices" in results[0][1]
    assert_same_run(one, two)  # MultiSteps: measured within 6e-8
    # Its checkpoint evaluates here, on one slice: the data axis takes this slice's devices.
    evaluated = jaxkit("eval", str(two), "--json")
    assert evaluated.returncode == 0, evaluated.stderr
    np.testing.assert_allclose(
        json.loads(evaluated.stdout)["eval_loss"], records(two)[-1]["eval_loss"], rtol=2e-6
    )

    def stopped_at_step_3(source, name):
        moved = tmp_path / name
        shutil.copytree(source, moved)
        shutil.rmtree(moved / "checkpoints" / "step_6")  # as if it had stopped after step 3
        return moved

    # The two-slice run resumed as one process of 8 devices (one slice).
    moved = stopped_at_step_3(two, "two_as_1")
    results = launch_here(moved, ACCUMULATING)
    assert_all_exit_0(results)
    assert "resuming from" in results[0][1] and "optimizer step 3" in results[0][1]
    assert_same_run(one, moved)
    (moved_by,) = [r for r in records(moved) if "event" in r]  # the run's log says so
    assert moved_by["event"] == "plan_change" and moved_by["step"] == 3
    assert moved_by["from_plan"]["dcn_shape"] == {"data": 2, "fsdp": 1}
    assert "dcn_shape" not in moved_by["to_plan"]

    # The one-process run resumed as two slices, switching to the fused step, against the
    # same resume in one process (a resume may change both).
    fused = [*ACCUMULATING, "train.accumulation=fused"]
    here = stopped_at_step_3(one, "one_fused")
    assert_all_exit_0(launch_here(here, fused))
    moved = stopped_at_step_3(one, "one_as_2_fused")
    results = launch(moved, [*fused, "mesh.dcn_data=2"], processes=2)
    assert_all_exit_0(results)
    assert "resuming from" in results[0][1] and "optimizer step 3" in results[0][1]
    assert_same_run(here, moved)  # the fused step: measured within 1.1e-7


def test_processes_that_resolved_different_configs_stop(tmp_path):
    results = launch(tmp_path, processes=2, per_process_extra={1: ["optimizer.learning_rate=0.01"]})
    assert all(rc != 0 for rc, _ in results), results
    assert (
        "process 1 resolved config.optimizer.learning_rate=0.01, process 0 0.003" in results[1][1]
    )
    assert "every process must run the same command" in results[0][1]


def test_a_workdir_in_use_stops_every_process_of_a_second_run(tmp_path):
    """Only process 0 takes the workdir's lock; the others hear its refusal from it, so
    none is left waiting for a peer that has gone."""
    with run_lock(tmp_path):  # this process is the first run
        results = launch(tmp_path, processes=2)
    in_use = f"jaxkit: error: {tmp_path} is in use by pid {os.getpid()} on "
    for returncode, out in results:
        assert returncode == 2 and in_use in out, out
        assert "batch plan" not in out
    assert os.listdir(tmp_path) == [LOCK_NAME]


def test_a_peer_that_never_joins_stops_the_run_in_bounded_time(tmp_path):
    began = time.monotonic()
    procs = start(tmp_path, processes=2, ids=[0], JAXKIT_JOIN_TIMEOUT_S="5")  # 1 never comes
    ((returncode, out),) = finish(procs, timeout=120)
    assert returncode != 0
    assert time.monotonic() - began < 90
    assert "joining 2 processes" in out


def test_a_peer_that_dies_stops_the_others_in_bounded_time(tmp_path):
    run = ["mlp_digits", "train.steps=100000", "train.log_every=10", "train.noise_scale_every=0"]
    procs = start(tmp_path, run, processes=2, JAXKIT_HEARTBEAT_TIMEOUT_S="10")
    wait_for_records(tmp_path, 2, procs[0])
    procs[1].kill()  # kill -9 in the middle of training
    killed = time.monotonic()
    (returncode, _), _ = finish(procs, timeout=90)
    assert returncode != 0
    assert time.monotonic() - killed < 90


def test_sigterm_to_one_process_saves_the_same_step_everywhere(tmp_path):
    steps = 100  # the stop lands a few steps after the 2nd record (step 27 of a loaded run)
    args = [
        "mlp_digits",
        f"train.steps={steps}",
        "train.log_every=10",
        "checkpoint.every=0",
        "train.noise_scale_every=0",  # not under test: a program less to compile
        "train.eval_every=0",  # at the end only
    ]
    procs = start(tmp_path, args, processes=2)
    wait_for_records(tmp_path, 2, procs[0])
    procs[0].send_signal(signal.SIGTERM)  # a preemption notice reaches one host
    results = finish(procs, timeout=120)
    assert len(results) == 2
    assert_all_exit_0(results)
    outs = [out for _, out in results]
    saved = sorted(int(p.name.removeprefix("step_")) for p in (tmp_path / "checkpoints").iterdir())
    assert len(saved) == 1 and 0 < saved[0] < steps  # one checkpoint, the same for both
    assert f"saved checkpoint step_{saved[0]} at optimizer step {saved[0]}" in outs[0]
    results = launch(tmp_path, args, processes=2)  # and the pair resumes it
    assert_all_exit_0(results)
    assert records(tmp_path)[-1]["step"] == steps


def _pci(root, name, vendor, device):
    (root / name).mkdir(parents=True)
    (root / name / "vendor").write_text(vendor + "\n")
    (root / name / "device").write_text(device + "\n")


def test_a_tpu_vm_is_known_by_its_pci_chips_not_by_google_nics(tmp_path, monkeypatch):
    monkeypatch.delenv("TPU_WORKER_HOSTNAMES", raising=False)
    monkeypatch.delenv("TPU_ACCELERATOR_TYPE", raising=False)
    _pci(tmp_path, "0000:00:04.0", "0x1ae0", "0x0042")  # gVNIC: on every GCE VM
    _pci(tmp_path, "0000:00:05.0", "0x8086", "0x005e")  # another vendor, a TPU-like id
    assert not distributed.on_cloud_tpu_vm(str(tmp_path))
    _pci(tmp_path, "0000:00:06.0", "0x1ae0", "0x005e")  # a TPU v4 chip
    assert distributed.on_cloud_tpu_vm(str(tmp_path))
    assert not distributed.on_cloud_tpu_vm(str(tmp_path / "missing"))
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "t1,t2")  # GKE
    assert distributed.on_cloud_tpu_vm(str(tmp_path / "missing"))

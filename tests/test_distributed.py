"""Joining a cluster that jax finds by itself: jax's call is recorded, and one real process
shows what a user sees when a peer never joins."""

import importlib.machinery
import os
import random
import socket
import subprocess
import sys
import types
import warnings

import jax
import pytest
from jax._src.clusters import K8sCluster, cloud_tpu_cluster

from jaxkit import distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLUSTER_PREFIXES = ("SLURM_", "OMPI_", "TPU_", "MEGASCALE_", "JAXKIT_")
CLUSTER_VARIABLES = ("KUBERNETES_SERVICE_HOST", "JOB_COMPLETION_INDEX")
TIMEOUTS = {
    "initialization_timeout": distributed.JAX_JOIN_TIMEOUT_S,
    "heartbeat_timeout_seconds": distributed.HEARTBEAT_TIMEOUT_S,
}
SLURM = {  # one task of `srun --nodes=2 --ntasks-per-node=8`
    "SLURM_JOB_ID": "4242",
    "SLURM_STEP_NODELIST": "gpu[001-002]",
    "SLURM_NTASKS": "16",
    "SLURM_PROCID": "11",
    "SLURM_LOCALID": "3",
}
OPEN_MPI = {  # one process of `mpirun -np 4` (Open MPI 4)
    "OMPI_MCA_orte_hnp_uri": "1531576320.0;tcp://10.96.0.1,10.148.0.1:34911",
    "OMPI_COMM_WORLD_SIZE": "4",
    "OMPI_COMM_WORLD_RANK": "2",
    "OMPI_COMM_WORLD_LOCAL_RANK": "2",
}
KUBERNETES = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "JOB_COMPLETION_INDEX": "1"}
# Where each says the process's rank: 11, 2 and 1 above, so none of them is process 0.
RANKS = {
    "SLURM": "SLURM_PROCID",
    "Open MPI": "OMPI_COMM_WORLD_RANK",
    "Kubernetes": "JOB_COMPLETION_INDEX",
}


@pytest.fixture
def joins(monkeypatch):
    """No cluster around (whatever this machine is); returns the kwargs of each join."""
    for name in list(os.environ):
        if name.startswith(CLUSTER_PREFIXES) or name in CLUSTER_VARIABLES:
            monkeypatch.delenv(name)
    monkeypatch.setattr(distributed, "on_cloud_tpu_vm", lambda: False)
    monkeypatch.setattr(cloud_tpu_cluster, "running_in_cloud_tpu_vm", False)
    for package in ("kubernetes", "mpi4py"):  # not importable, even if installed
        monkeypatch.setitem(sys.modules, package, None)
    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kwargs: calls.append(kwargs))
    return calls


def _kubernetes_package(monkeypatch):
    """Just enough of the `kubernetes` package for jax to take this pod for a cluster."""
    k8s = types.ModuleType("kubernetes")
    k8s.config = types.SimpleNamespace(load_incluster_config=lambda: None)
    k8s.client = types.SimpleNamespace(
        CoreV1Api=object, BatchV1Api=object, exceptions=types.SimpleNamespace(ApiException=OSError)
    )
    monkeypatch.setitem(sys.modules, "kubernetes", k8s)
    for name in ("_core_api", "_batch_api", "_ApiException"):  # jax sets them on the class
        monkeypatch.setattr(K8sCluster, name, None, raising=False)


@pytest.mark.parametrize(
    "variables, name", [(SLURM, "SLURM"), (OPEN_MPI, "Open MPI"), (KUBERNETES, "Kubernetes")]
)
def test_a_detected_cluster_is_joined_without_flags(joins, monkeypatch, capsys, variables, name):
    if name == "Kubernetes":
        _kubernetes_package(monkeypatch)
    for key, value in variables.items():
        monkeypatch.setenv(key, value)
    assert distributed.detected_cluster() == name
    distributed.initialize(None, None, None)
    assert joins == [TIMEOUTS]  # jax finds the coordinator, the count and the id
    assert capsys.readouterr().out == ""  # not process 0: quiet, as in training
    monkeypatch.setenv(RANKS[name], "0")
    distributed.initialize(None, None, None)
    out = capsys.readouterr().out
    assert out.startswith(f"{name} cluster detected: joining")
    assert f"within {distributed.JOIN_TIMEOUT_S} s" in out


def test_without_a_cluster_nothing_is_joined(joins, capsys):
    assert distributed.detected_cluster() is None
    distributed.initialize(None, None, None)
    assert joins == [] and capsys.readouterr().out == ""


@pytest.mark.parametrize(
    "variables, count, rank",
    [
        (SLURM, "SLURM_NTASKS", "SLURM_PROCID"),
        (OPEN_MPI, "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"),
    ],
)
def test_a_job_of_one_process_runs_alone(joins, monkeypatch, variables, count, rank):
    # `srun -n1`, an `salloc -n1` shell, `mpirun -np 1`: as without a cluster (on SLURM jax
    # would bind the process to GPU SLURM_LOCALID only)
    for key, value in {**variables, count: "1", rank: "0"}.items():
        monkeypatch.setenv(key, value)
    assert distributed.detected_cluster() is None
    distributed.initialize(None, None, None)
    assert joins == []


def test_mpi4py_installed_is_no_cluster(joins, monkeypatch):
    # jax tries mpi4py only when asked (cluster_detection_method="mpi4py")
    mpi4py = types.ModuleType("mpi4py")
    mpi4py.__spec__ = importlib.machinery.ModuleSpec("mpi4py", None)
    monkeypatch.setitem(sys.modules, "mpi4py", mpi4py)
    assert distributed.detected_cluster() is None
    distributed.initialize(None, None, None)
    assert joins == []


def test_a_pod_outside_an_indexed_job_runs_alone_and_quietly(joins, monkeypatch):
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")  # in every pod
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        K8sCluster.is_env_present()  # without the `kubernetes` package jax warns ...
        assert [w for w in warned if "kubernetes" in str(w.message)]
        warned.clear()
        assert distributed.detected_cluster() is None  # ... jaxkit does not
        assert warned == []
    _kubernetes_package(monkeypatch)  # with it, a pod that no Indexed Job started
    assert distributed.detected_cluster() is None
    distributed.initialize(None, None, None)
    assert joins == []


@pytest.mark.parametrize("how", ["flags", "environment"])
def test_flags_override_a_detected_cluster(joins, monkeypatch, capsys, how):
    for key, value in SLURM.items():
        monkeypatch.setenv(key, value)
    if how == "flags":
        distributed.initialize("10.1.2.3:5555", 2, 1)
    else:
        monkeypatch.setenv("JAXKIT_COORDINATOR", "10.1.2.3:5555")
        monkeypatch.setenv("JAXKIT_NUM_PROCESSES", "2")
        monkeypatch.setenv("JAXKIT_PROCESS_ID", "1")
        distributed.initialize(None, None, None)
    given = {"coordinator_address": "10.1.2.3:5555", "num_processes": 2, "process_id": 1}
    assert joins == [{**given, **TIMEOUTS}]
    assert capsys.readouterr().out == ""  # process 1: process 0 says where they join
    distributed.initialize("10.1.2.3:5555", 2, 0)
    assert capsys.readouterr().out.startswith("joining 2 processes at 10.1.2.3:5555")


SLURM_FIRST_PORT = 65536 - 2**12


def _held_slurm_port() -> socket.socket:
    """A loopback port in SLURM's coordinator range, held as tests/test_multiprocess.py does.

    jax derives the coordinator's port from the job id (61440 + id mod 4096); SO_REUSEPORT lets
    the coordinator bind it too while anything else is kept off.
    """
    for port in random.sample(range(SLURM_FIRST_PORT, 65536), 64):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            s.close()
            continue
        return s
    raise AssertionError("no free port in SLURM's coordinator range")


def test_a_slurm_peer_that_never_joins_is_one_line_not_an_abort(tmp_path):
    # Task 0 of a 2-task job step whose task 1 never starts: without the watchdog jax aborts
    # from C++ (status 134, a stack trace) once its own join timeout passes.
    holder = _held_slurm_port()
    port = holder.getsockname()[1]
    slurm = {
        "SLURM_JOB_ID": str(port - SLURM_FIRST_PORT),
        "SLURM_STEP_NODELIST": "localhost",
        "SLURM_NTASKS": "2",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
    }
    env = {k: v for k, v in os.environ.items() if not k.startswith(CLUSTER_PREFIXES)}
    env.update(slurm, JAXKIT_JOIN_TIMEOUT_S="2", PYTHONPATH=ROOT)
    cmd = [sys.executable, "-m", "jaxkit", "train", "mlp_digits", "--workdir", str(tmp_path)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    finally:
        holder.close()
    assert "SLURM cluster detected" in done.stdout
    assert done.returncode == distributed.JOIN_FAILED, done.stderr[-2000:]
    assert done.stderr.splitlines()[-1] == (
        f"jaxkit: error: not every process joined the run at localhost:{port} within 2 s: start "
        "the same command as every process of the job, each able to reach "
        f"localhost:{port}, or raise JAXKIT_JOIN_TIMEOUT_S"
    )
    assert "Check failure" not in done.stderr and "Terminating process" not in done.stderr

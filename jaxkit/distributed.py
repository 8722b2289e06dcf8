"""Several processes, one mesh: joining them, and checking they agree.

Every process runs the same command. On Cloud TPU VMs, and in the clusters that
`jax.distributed.initialize()` recognizes by itself (a SLURM job step, Open MPI's mpirun, an
indexed Kubernetes Job), the processes find their peers with nothing more said. Elsewhere the
coordinator, the process count and this process's id are given (flags or JAXKIT_COORDINATOR /
JAXKIT_NUM_PROCESSES / JAXKIT_PROCESS_ID); given, they override a detected cluster. Joining
and liveness are bounded in time, so a peer that never comes or dies stops the others with an
error instead of a hang.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import sys
import threading
import warnings

import jax
import numpy as np

from jaxkit.config import flatten

# A peer that has not joined by then is an error; one silent this long is taken as dead and
# the others stop. The environment may shorten them (the tests do).
JOIN_TIMEOUT_S = int(os.environ.get("JAXKIT_JOIN_TIMEOUT_S", "120"))
HEARTBEAT_TIMEOUT_S = int(os.environ.get("JAXKIT_HEARTBEAT_TIMEOUT_S", "60"))
# jax's own bound on the join comes later: when it is reached, jax aborts the process from
# C++ (SIGABRT, exit 134, a stack trace), so jaxkit's watchdog must speak first.
JAX_JOIN_TIMEOUT_S = JOIN_TIMEOUT_S + 30
JOIN_FAILED = 1  # exit status of a process whose peers did not all join


class DistributedError(RuntimeError):
    """Processes that cannot form one run."""


# TPU chips are PCI devices of Google's vendor id with these device ids (v3, v4, v5p, v5e,
# v6e, 7x, and one unnamed); Google's virtual NIC shares the vendor id on every GCE VM.
GOOGLE_PCI_VENDOR = "0x1ae0"
TPU_PCI_DEVICES = ("0x0027", "0x0056", "0x005e", "0x0062", "0x0063", "0x006f", "0x0076")


def on_cloud_tpu_vm(pci_devices: str = "/sys/bus/pci/devices") -> bool:
    """A TPU host: GKE sets TPU_* variables; a plain TPU VM shows its chips on the PCI bus."""
    if os.environ.get("TPU_WORKER_HOSTNAMES") or os.environ.get("TPU_ACCELERATOR_TYPE"):
        return True
    for device in pathlib.Path(pci_devices).glob("*"):
        try:
            vendor = (device / "vendor").read_text().strip()
            model = (device / "device").read_text().strip()
        except OSError:
            continue
        if vendor == GOOGLE_PCI_VENDOR and model in TPU_PCI_DEVICES:
            return True
    return False


# jax's cluster types (jax._src.clusters), as people call them.
CLUSTER_NAMES = {
    "SlurmCluster": "SLURM",
    "OmpiCluster": "Open MPI",
    "K8sCluster": "Kubernetes",
    "GkeTpuCluster": "GKE TPU",
    "GceTpuCluster": "Cloud TPU",
}
# Where the environment holds the process count: a job of one process is left alone, as
# before. Joining would gain it nothing, take a port, and on SLURM or Open MPI jax would
# restrict it to one GPU of its allocation (the one of its local rank).
_PROCESS_COUNT_VARS = {"SlurmCluster": "SLURM_NTASKS", "OmpiCluster": "OMPI_COMM_WORLD_SIZE"}


def detected_cluster() -> str | None:
    """Names the cluster of several processes `jax.distributed.initialize()` would join, if any."""
    try:
        from jax._src.clusters import ClusterEnv
    except ImportError:  # moved in another jax: flags and TPU VMs still join
        return None
    # jax takes the first type present, in this order, skipping the opt-in ones: mpi4py
    # would take any machine with mpi4py installed for a cluster.
    found = None
    for cluster in ClusterEnv._cluster_types:
        if cluster.opt_in_only_method:
            continue
        try:
            # A pod without the `kubernetes` package makes jax warn; for jaxkit it runs
            # alone, as before, and should not warn at every start.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                present = cluster.is_env_present()
        except Exception:  # a pod whose service account is not mounted: not a job to join
            return None
        if present:
            found = cluster.__name__
            break
    if found is None:
        return None
    count_var = _PROCESS_COUNT_VARS.get(found)
    if count_var is not None and os.environ.get(count_var) == "1":
        return None
    # Every pod sees KUBERNETES_SERVICE_HOST; jax can place only an Indexed Job's pods (by
    # this index), and any other pod runs alone, as before.
    if found == "K8sCluster" and "JOB_COMPLETION_INDEX" not in os.environ:
        return None
    return CLUSTER_NAMES.get(found, found)


def _env_int(name: str) -> int | None:
    text = os.environ.get(name)
    if not text:
        return None
    try:
        return int(text)
    except ValueError:
        raise DistributedError(f"{name}={text!r} is not an integer") from None


def initialize(coordinator: str | None, num_processes: int | None, process_id: int | None) -> None:
    """Joins this process to its peers; does nothing for a single process."""
    coordinator = coordinator or os.environ.get("JAXKIT_COORDINATOR")
    if num_processes is None:
        num_processes = _env_int("JAXKIT_NUM_PROCESSES")
    if process_id is None:
        process_id = _env_int("JAXKIT_PROCESS_ID")
    given = [v is not None for v in (coordinator, num_processes, process_id)]
    if any(given) and not all(given):
        raise DistributedError(
            "--coordinator HOST:PORT, --num-processes P and --process-id I go together "
            f"(got coordinator={coordinator}, num_processes={num_processes}, "
            f"process_id={process_id})"
        )
    if all(given):
        assert coordinator is not None and num_processes is not None and process_id is not None
        if not 0 <= process_id < num_processes:
            raise DistributedError(f"--process-id {process_id} is not in [0, {num_processes})")
        if process_id == 0:  # one voice, as in training; a join that fails is said by all
            print(
                f"joining {num_processes} processes at {coordinator} as process 0; a peer "
                f"that has not joined within {JOIN_TIMEOUT_S} s or falls silent for "
                f"{HEARTBEAT_TIMEOUT_S} s stops the run",
                flush=True,
            )
        _join(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id)
    elif on_cloud_tpu_vm():
        _join()
    elif (cluster := detected_cluster()) is not None:
        if _rank_before_joining(cluster) in (None, 0):  # one voice, where the rank is known
            print(
                f"{cluster} cluster detected: joining its processes as jax.distributed finds "
                f"them (--coordinator, --num-processes and --process-id override); a peer that "
                f"has not joined within {JOIN_TIMEOUT_S} s or falls silent for "
                f"{HEARTBEAT_TIMEOUT_S} s stops the run",
                flush=True,
            )
        _join()


# Where a cluster's environment says a process's rank before jax.distributed does.
_RANK_VARS = {
    "SLURM": "SLURM_PROCID",
    "Open MPI": "OMPI_COMM_WORLD_RANK",
    "Kubernetes": "JOB_COMPLETION_INDEX",
}


def _rank_before_joining(cluster: str) -> int | None:
    """This process's rank in a detected cluster, from its environment, or None."""
    text = os.environ.get(_RANK_VARS.get(cluster, ""), "")
    return int(text) if text.isdigit() else None


def _derived_coordinator() -> str | None:
    """The address jax derived for a detected cluster; it sets it before it connects."""
    try:
        from jax._src.distributed import global_state
    except ImportError:  # moved in another jax: the message says "the coordinator"
        return None
    address = getattr(global_state, "coordinator_address", None)
    return address if isinstance(address, str) else None


def _join(**given: str | int) -> None:
    """`jax.distributed.initialize`, where peers that have not all joined in time are one line.

    jax would abort from C++ instead (exit 134 and a stack trace that blames "another task").
    Its connect releases the GIL, so a watchdog thread can give the error and exit first;
    jax's own bound stays, later, for a join the watchdog somehow misses.
    """
    joined = threading.Event()

    def watchdog() -> None:
        if joined.wait(JOIN_TIMEOUT_S):
            return
        address = given.get("coordinator_address") or _derived_coordinator() or "the coordinator"
        print(
            f"jaxkit: error: not every process joined the run at {address} within "
            f"{JOIN_TIMEOUT_S} s: start the same command as every process of the job, each "
            f"able to reach {address}, or raise JAXKIT_JOIN_TIMEOUT_S",
            file=sys.stderr,
            flush=True,
        )
        os._exit(JOIN_FAILED)  # the main thread is inside jax's connect, in C++

    threading.Thread(target=watchdog, name="jaxkit-join-watchdog", daemon=True).start()
    try:
        jax.distributed.initialize(
            initialization_timeout=JAX_JOIN_TIMEOUT_S,
            heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S,
            **given,  # type: ignore[arg-type]
        )
    finally:
        joined.set()


def check_agreement(resolved: dict) -> None:
    """Stops every process unless all resolved the same config and plan (`resolved`)."""
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    text = json.dumps(resolved, sort_keys=True).encode()
    digest = np.frombuffer(hashlib.sha256(text).digest()[:8], dtype=np.int64)
    digests = np.asarray(multihost_utils.process_allgather(digest)).reshape(-1)
    if np.all(digests == digests[0]):
        return
    # Name the first difference: every process compares itself with process 0.
    size = multihost_utils.broadcast_one_to_all(np.array([len(text)], np.int64))
    buffer = np.zeros(int(np.asarray(size)[0]), np.uint8)
    if jax.process_index() == 0:
        buffer = np.frombuffer(text, np.uint8).copy()
    first = bytes(np.asarray(multihost_utils.broadcast_one_to_all(buffer)))
    mine, theirs = flatten(resolved), flatten(json.loads(first))
    diffs = [k for k in sorted(mine.keys() | theirs.keys()) if mine.get(k) != theirs.get(k)]
    odd = [i for i, d in enumerate(digests) if d != digests[0]]
    if diffs:
        key = diffs[0]
        raise DistributedError(
            f"process {jax.process_index()} resolved {key}={mine.get(key)!r}, process 0 "
            f"{theirs.get(key)!r}: every process must run the same command"
        )
    raise DistributedError(
        f"processes {odd} resolved a different config or plan than process 0 "
        "(their own errors name the first difference): every process must run the same command"
    )


# The longest refusal process 0 hands the others (bytes of UTF-8; longer ones are cut).
_REFUSAL_BYTES = 1024


def process_0_refusal(refusal: str | None) -> str | None:
    """Process 0's `refusal` (None: none) on every process, for what only process 0 checks
    (the workdir's lock): every process then stops with it, none waits for a peer that left."""
    if jax.process_count() == 1:
        return refusal
    from jax.experimental import multihost_utils

    buffer = np.zeros(_REFUSAL_BYTES, np.uint8)
    if jax.process_index() == 0 and refusal:
        text = refusal.encode()[:_REFUSAL_BYTES]
        buffer[: len(text)] = np.frombuffer(text, np.uint8)
    got = bytes(np.asarray(multihost_utils.broadcast_one_to_all(buffer))).rstrip(b"\0")
    return got.decode(errors="replace") or None

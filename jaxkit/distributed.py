"""Several processes, one mesh: joining them, and checking they agree.

On Cloud TPU VMs every host runs the same command and `jax.distributed.initialize()` finds
its peers by itself. Elsewhere the coordinator, the process count and this process's id are
given (flags or JAXKIT_COORDINATOR / JAXKIT_NUM_PROCESSES / JAXKIT_PROCESS_ID). Joining and
liveness are bounded in time, so a peer that never comes or dies stops the others with an
error instead of a hang.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib

import jax
import numpy as np

from jaxkit.config import flatten

# A peer that has not joined by then is an error; one silent this long is taken as dead and
# the others stop. The environment may shorten them (the tests do).
JOIN_TIMEOUT_S = int(os.environ.get("JAXKIT_JOIN_TIMEOUT_S", "120"))
HEARTBEAT_TIMEOUT_S = int(os.environ.get("JAXKIT_HEARTBEAT_TIMEOUT_S", "60"))


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
        assert num_processes is not None and process_id is not None
        if not 0 <= process_id < num_processes:
            raise DistributedError(f"--process-id {process_id} is not in [0, {num_processes})")
        print(
            f"joining {num_processes} processes at {coordinator} as process {process_id}; a "
            f"peer that has not joined within {JOIN_TIMEOUT_S} s or falls silent for "
            f"{HEARTBEAT_TIMEOUT_S} s stops the run",
            flush=True,
        )
        jax.distributed.initialize(
            coordinator_address=coordinator,
            num_processes=num_processes,
            process_id=process_id,
            initialization_timeout=JOIN_TIMEOUT_S,
            heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S,
        )
    elif on_cloud_tpu_vm():
        jax.distributed.initialize(
            initialization_timeout=JOIN_TIMEOUT_S, heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S
        )


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

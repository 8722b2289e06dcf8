"""The workdir lock: one run at a time on a workdir, and who holds it when another is refused."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
from collections.abc import Iterator

from jaxkit.workdir import is_local

# The file a run's process 0 holds locked while it runs (see run_lock).
LOCK_NAME = ".lock"


class WorkdirInUseError(RuntimeError):
    """Another run holds the workdir (exit status 2)."""


@contextlib.contextmanager
def run_lock(workdir: str | os.PathLike) -> Iterator[str | None]:
    """Holds `WORKDIR/.lock` while the body runs: a second run on the workdir meanwhile is
    refused (WorkdirInUseError, naming the pid, host and start time the file records)
    instead of training beside this one and tearing its checkpoints.

    The lock is the operating system's (flock, through filelock), so it goes with its
    process: a run killed with SIGKILL leaves a `.lock` that holds nobody. A URL's workdir
    gets none (an object store has no locks), nor does one on a network file system (NFS,
    SMB, Lustre, gcsfuse, ...), whose locks are the server's to keep or lose; there, and
    where the lock cannot be taken, the body runs unlocked and gets a line saying so
    (None when locked, or for a URL). A workdir this call created is removed again if the
    run wrote nothing into it: a run refused before its first file leaves nothing on disk.
    """
    if not is_local(workdir):
        yield None
        return
    import filelock

    directory = os.path.abspath(os.fspath(workdir))
    network = network_file_system(directory)
    if network is not None:
        yield f"{directory} is on {network}, where jaxkit takes no lock: {_UNLOCKED}"
        return
    created = _missing_directories(directory)
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, LOCK_NAME)
    # Read before trying: some filelock versions empty the file as they try.
    holder = _holder(path)
    lock = filelock.FileLock(path, timeout=0)
    try:
        lock.acquire()
    except filelock.Timeout:
        raise WorkdirInUseError(_in_use(directory, holder or _holder(path))) from None
    except OSError as err:  # ENOLCK, ...: the run goes on as it did before there were locks
        yield f"{path} cannot be locked ({err}): {_UNLOCKED}"
        return
    try:
        started = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
        record = {"pid": os.getpid(), "host": socket.gethostname(), "since": started}
        with open(path, "w", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        yield None
    finally:
        try:
            if created and os.listdir(directory) == [LOCK_NAME]:
                os.unlink(path)  # still held: a run starting now takes a new file
                with contextlib.suppress(OSError):  # a parent something else wrote into
                    for made in created:  # the workdir first, then the parents made for it
                        os.rmdir(made)
            else:
                open(path, "w").close()  # the file stays, naming nobody
        finally:
            lock.release()


_UNLOCKED = "a second run on this workdir meanwhile would not be refused"


# File system types (Linux's names) whose locks a server keeps, across machines.
NETWORK_FILE_SYSTEMS = frozenset(
    {"nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "ceph", "fuse.gcsfuse", "fuse.sshfs"}
)


def network_file_system(directory: str, mountinfo: str = "/proc/self/mountinfo") -> str | None:
    """The type of the network file system `directory` is on (Linux; elsewhere None)."""
    try:
        with open(mountinfo, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    real = os.path.realpath(directory)
    best, kind = "", None
    for line in lines:
        # ID PARENT MAJOR:MINOR ROOT MOUNT_POINT OPTIONS [OPTIONAL ...] - TYPE SOURCE ...
        fields = line.split()
        if "-" not in fields[5:]:
            continue
        point = fields[4].replace("\\040", " ")
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, fields[fields.index("-", 5) + 1]
    return kind if kind in NETWORK_FILE_SYSTEMS else None


def _missing_directories(directory: str) -> list[str]:
    """`directory` and those of its parents that do not exist, innermost first."""
    missing = []
    while not os.path.exists(directory):
        missing.append(directory)
        directory = os.path.dirname(directory)
    return missing


def _holder(path: str) -> dict | None:
    """The pid, host and start time a `.lock` records, or None (no file, or none yet)."""
    try:
        with open(path, encoding="utf-8") as f:
            record = json.loads(f.read())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _in_use(directory: str, holder: dict | None) -> str:
    if holder is None:
        return f"{directory} is in use by another run (its {LOCK_NAME} is held)"
    return (
        f"{directory} is in use by pid {holder.get('pid')} on {holder.get('host')} since "
        f"{holder.get('since')}: one run per workdir"
    )

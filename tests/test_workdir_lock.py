"""One run per workdir: process 0 holds `WORKDIR/.lock`, an operating-system lock that goes
with its process, and a second run on the workdir is refused in one line before any work.

The holder is a real second process (a few lines of Python that take the lock, no JAX), so
that what the kernel does when it dies by SIGKILL is what the test sees.
"""

import os
import re
import signal
import socket
import subprocess
import sys

import pytest
from cli_run import jaxkit

from jaxkit.config import apply_overrides, load_config
from jaxkit.mesh import MeshError
from jaxkit.train import lock as lock_lib
from jaxkit.train import loop
from jaxkit.train.lock import LOCK_NAME, WorkdirInUseError, network_file_system, run_lock

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOLD = """
import sys, time
from jaxkit.train.lock import run_lock
with run_lock(sys.argv[1]):
    print("held", flush=True)
    time.sleep(600)
"""
TRAIN = ["train", "mlp_digits", "--no-progress", "train.log_every=1", "checkpoint.every=0"]


def hold(workdir):
    """A process holding `workdir`'s lock, once it says so."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(workdir)], stdout=subprocess.PIPE, text=True, env=env
    )
    assert holder.stdout.readline() == "held\n"
    return holder


def assert_free(workdir):
    with run_lock(workdir):  # raises WorkdirInUseError while anyone holds it
        pass


def test_a_second_run_is_refused_until_the_first_is_killed(tmp_path):
    workdir = tmp_path / "run"
    holder = hold(workdir)
    try:
        out = jaxkit(*TRAIN, "--workdir", str(workdir), "train.steps=2")
        assert out.returncode == 2, out.stderr
        (line,) = out.stderr.splitlines()
        when = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC"
        said = f"jaxkit: error: {workdir} is in use by pid {holder.pid} on {socket.gethostname()}"
        assert re.fullmatch(re.escape(said) + f" since {when}: one run per workdir", line), line
        assert "batch plan" not in out.stdout  # before any work
        assert os.listdir(workdir) == [LOCK_NAME]  # nothing of its own written
    finally:
        holder.send_signal(signal.SIGKILL)  # no handler, no cleanup: the kernel drops the lock
        holder.wait()
    out = jaxkit(*TRAIN, "--workdir", str(workdir), "train.steps=2")
    assert out.returncode == 0, out.stderr
    assert_free(workdir)  # released at the end
    assert (workdir / LOCK_NAME).read_text() == ""  # and naming nobody
    # The .lock left in the workdir stands in the way of nothing that reads it: a refused
    # resume (released again), a longer resume, a report.
    out = jaxkit(*TRAIN, "--workdir", str(workdir), "train.steps=1")
    assert out.returncode == 2 and "train.steps" in out.stderr, out.stderr
    assert_free(workdir)
    out = jaxkit(*TRAIN, "--workdir", str(workdir), "train.steps=3", "--allow-longer")
    assert out.returncode == 0 and "resuming from" in out.stdout, out.stderr
    assert sorted(os.listdir(workdir / "checkpoints")) == ["step_2", "step_3"]
    out = jaxkit("report", str(workdir), "--out", str(tmp_path / "report"))
    assert out.returncode == 0, out.stderr


def digits(*overrides):
    config = load_config("mlp_digits")
    apply_overrides(config, ["train.steps=2", *overrides])
    return config


def test_the_lock_is_released_on_every_way_out(tmp_path, monkeypatch):
    quiet = {"progress": False, "echo": lambda line: None}
    # Refused inside the run, before it wrote anything: the workdir it made goes too.
    workdir = tmp_path / "made" / "run"
    with pytest.raises(MeshError):
        loop.train(digits("mesh.data=3"), workdir, **quiet)
    assert not (tmp_path / "made").exists()
    # Failing in the middle of training: its files stay, the lock goes.
    workdir = tmp_path / "run"

    def fail(run):
        raise RuntimeError("a failure mid-run")

    monkeypatch.setattr(loop, "_train_steps", fail)
    with pytest.raises(RuntimeError, match="mid-run"):
        loop.train(digits(), workdir, **quiet)
    assert (workdir / "config.json").exists()
    assert_free(workdir)
    # And while it is held, the run inside is refused the same way as a second process's.
    with run_lock(workdir), pytest.raises(WorkdirInUseError, match=f"pid {os.getpid()} "):
        loop.train(digits(), workdir, **quiet)


# A machine's mounts as Linux lists them: the root on a disk, an NFS share, a disk mounted at
# a path with a space (written \040).
MOUNTINFO = """\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
40 22 0:50 / /mnt/shared rw,relatime shared:20 - nfs4 server:/export rw,vers=4.2
41 22 8:17 / /mnt/my\\040disk rw,relatime - ext4 /dev/sdb1 rw
"""


def test_a_url_or_network_workdir_gets_no_lock(tmp_path, monkeypatch):
    info = tmp_path / "mountinfo"
    info.write_text(MOUNTINFO)
    assert network_file_system("/mnt/shared", str(info)) == "nfs4"
    assert network_file_system("/mnt/shared/runs/a", str(info)) == "nfs4"
    assert network_file_system("/mnt/shared2/runs/a", str(info)) is None
    assert network_file_system("/mnt/my disk/run", str(info)) is None
    assert network_file_system("/home/me/run", str(info)) is None
    monkeypatch.setattr(lock_lib, "network_file_system", lambda directory: "nfs4")
    workdir = tmp_path / "run"
    with run_lock(workdir) as note, run_lock(workdir) as again:  # no lock to refuse the second
        assert (
            note
            == again
            == (
                f"{workdir} is on nfs4, where jaxkit takes no lock: a second run on this workdir "
                "meanwhile would not be refused"
            )
        )
    assert not workdir.exists()
    monkeypatch.chdir(tmp_path)
    with run_lock("gs://bucket/run") as note, run_lock("gs://bucket/run"):
        assert note is None
    assert os.listdir(tmp_path) == ["mountinfo"]  # no local "gs:" directory

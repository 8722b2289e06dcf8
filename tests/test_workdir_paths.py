"""Workdirs that are URLs: `gs://bucket/run` end to end, offline.

fsspec's "gcs" protocol (what epath asks for a gs:// path) is served by an in-memory bucket
that, like GCS, cannot append to an object; renames there fail the test, since on GCS they
are a copy and a delete. Everything else (epath's gs:// path class and backend, orbax's
directory handling, the run directory, the report) is the real code.
"""

import io
import json
import os
import sys
import tempfile
import types
from typing import ClassVar

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from jaxkit import cli
from jaxkit.config import ConfigError, apply_overrides, load_config
from jaxkit.records.metrics import RunDir, read_metrics
from jaxkit.records.report import PLOTS
from jaxkit.train import loop
from jaxkit.train.checkpoint import Checkpointer, CheckpointError
from jaxkit.workdir import absolute, as_path, missing_gcs_support

URL = "gs://bucket/run"


class FakeGCS(MemoryFileSystem):
    """gs://BUCKET/KEY as the in-memory key BUCKET/KEY."""

    protocol = ("gs", "gcs")
    root_marker = ""
    store: ClassVar[dict] = {}  # its own, not memory://'s
    pseudo_dirs: ClassVar[list] = [""]

    @classmethod
    def _strip_protocol(cls, path):
        path = fsspec.utils.stringify_path(path)
        for prefix in ("gs://", "gcs://"):
            path = path.removeprefix(prefix)
        return path.strip("/")

    def _open(self, path, mode="rb", **kwargs):
        if "a" in mode:
            raise OSError(f"{path}: a GCS object cannot be appended to")
        return super()._open(path, mode, **kwargs)

    def mv(self, *args, **kwargs):
        raise AssertionError(f"rename {args} on GCS: a copy and a delete, not atomic")


@pytest.fixture
def gcs(monkeypatch, tmp_path):
    # Registered for the rest of the session (epath caches the filesystem); no other test
    # reaches gs://.
    for name in FakeGCS.protocol:
        fsspec.register_implementation(name, FakeGCS, clobber=True)
    FakeGCS.store.clear()
    FakeGCS.pseudo_dirs[:] = [""]
    # orbax asks google-cloud-storage whether a bucket has a hierarchical namespace before
    # it lists checkpoints; this bucket has none.
    bucket = types.SimpleNamespace(hierarchical_namespace_enabled=False)
    client = types.SimpleNamespace(get_bucket=lambda name: bucket)
    storage = types.ModuleType("google.cloud.storage")
    storage.Client = lambda: client
    cloud = types.ModuleType("google.cloud")
    cloud.storage = storage
    monkeypatch.setitem(sys.modules, "google.cloud", cloud)
    monkeypatch.setitem(sys.modules, "google.cloud.storage", storage)
    # Staging directories of URL run directories go here, to check they are removed.
    (tmp_path / "staging").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "staging"))
    monkeypatch.chdir(tmp_path)  # a mangled "gs:/bucket" would appear here as gs:/
    return FakeGCS


def read(url):
    return as_path(url).read_bytes()


def tensorboard_scalars(logdir, tag):
    """Steps of `tag` as TensorBoard reads them from `logdir` (through fsspec for gs://)."""
    events = EventAccumulator(logdir)
    events.Reload()
    return [e.step for e in events.Scalars(tag)]


def test_a_gs_url_survives_every_join(gcs, tmp_path):
    assert str(as_path(URL) / "checkpoints" / "4") == f"{URL}/checkpoints/4"
    assert str(absolute(URL)) == URL
    assert str(absolute("runs/x")) == str(tmp_path / "runs" / "x")

    checkpointer = Checkpointer(as_path(URL) / "checkpoints", keep=2, warn=print)
    try:
        assert str(checkpointer.directory) == f"{URL}/checkpoints"
        assert str(checkpointer.manager.directory) == f"{URL}/checkpoints"
        assert str(checkpointer.directory.parent) == URL  # named in refusals
        assert checkpointer.steps() == []  # listed in the bucket
    finally:
        checkpointer.close()
    assert "bucket/run/checkpoints" in gcs.pseudo_dirs  # orbax created it in the bucket

    run_dir = RunDir(URL)
    assert str(run_dir.path / "metrics.jsonl") == f"{URL}/metrics.jsonl"
    run_dir.close()
    assert sorted(os.listdir(tmp_path)) == ["staging"]  # no local "gs:" directory anywhere


def test_a_run_dir_on_gs_uploads_whole_objects_as_it_goes(gcs, tmp_path):
    run_dir = RunDir(URL, upload_every_s=3600)
    run_dir.write_json("plan.json", {"global_batch_size": 32})
    assert json.loads(read(f"{URL}/plan.json")) == {"global_batch_size": 32}
    run_dir.log({"step": 1, "loss": 2.0})  # the first record goes up at once
    assert [r["step"] for r in read_metrics(URL)] == [1]
    run_dir.log({"step": 2, "loss": 1.5})  # within the upload interval: local so far
    assert [r["step"] for r in read_metrics(URL)] == [1]
    run_dir.close()
    assert [r["step"] for r in read_metrics(URL)] == [1, 2]
    assert tensorboard_scalars(f"{URL}/tensorboard", "train/loss") == [1, 2]
    assert os.listdir(tmp_path / "staging") == []

    # A resumed run drops what was logged after its checkpoint, in the bucket at once.
    resumed = RunDir(URL, resume_after_step=1, upload_every_s=0)
    assert [r["step"] for r in read_metrics(URL)] == [1]
    resumed.log({"step": 2, "loss": 1.25})
    assert [(r["step"], r["loss"]) for r in read_metrics(URL)] == [(1, 2.0), (2, 1.25)]
    resumed.close()
    # Its own event file went up too (the earlier attempt's stays; the two are named by
    # the second they started in, the same one here).
    assert tensorboard_scalars(f"{URL}/tensorboard", "train/loss")[-1] == 2


def test_local_json_files_are_still_replaced_whole(tmp_path, monkeypatch):
    run_dir = RunDir(tmp_path / "run")
    run_dir.write_json("summary.json", {"version": 1})
    seen = []
    real_replace = os.replace

    def replace(src, dst):
        with open(src) as new, open(dst) as old:
            seen.append((json.load(old), json.load(new)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    run_dir.write_json("summary.json", {"version": 2})
    run_dir.close()
    # The new text was whole in a temporary file while the old one was still in place.
    assert seen == [({"version": 1}, {"version": 2})]
    assert sorted(os.listdir(tmp_path / "run")) == ["metrics.jsonl", "summary.json", "tensorboard"]


def digits_run(workdir, *overrides):
    config = load_config("mlp_digits")
    apply_overrides(
        config, ["train.steps=6", "train.log_every=2", "train.eval_every=3", *overrides]
    )
    return loop.train(config, workdir, progress=False, echo=lambda *a: None)


def test_training_on_a_gs_workdir_then_reporting_from_it(gcs, tmp_path, monkeypatch, capsys):
    given = []

    class LocalCheckpointer(Checkpointer):
        """Orbax writes arrays to gs:// with tensorstore's own GCS client, which needs the
        network: the checkpoints go to a local directory once the URL is recorded."""

        def __init__(self, directory, keep, warn):
            given.append(str(directory))
            super().__init__(tmp_path / "checkpoints", keep, warn)

    monkeypatch.setattr(loop, "Checkpointer", LocalCheckpointer)
    result = digits_run(URL)
    assert given == [f"{URL}/checkpoints"]
    assert read_metrics(URL) == json.loads(json.dumps(result.records))
    assert [r["step"] for r in read_metrics(URL) if "loss" in r] == [2, 4, 6]
    assert json.loads(read(f"{URL}/config.json"))["train"]["steps"] == 6
    assert json.loads(read(f"{URL}/plan.json"))["global_batch_size"] == 32
    summary = json.loads(read(f"{URL}/summary.json"))
    assert summary == json.loads(json.dumps(result.summary))
    assert tensorboard_scalars(f"{URL}/tensorboard", "train/loss") == [2, 4, 6]
    assert sorted(os.listdir(tmp_path)) == ["checkpoints", "staging"]
    assert os.listdir(tmp_path / "staging") == []

    # The same command again finds the finished run and reads its summary from the bucket.
    again = digits_run(URL)
    assert again.records == [] and again.summary == summary

    assert cli.main(["report", URL]) == 0
    assert capsys.readouterr().out.strip() == f"report: {URL}/report/report.md"
    report = read(f"{URL}/report/report.md").decode()
    _header, row = (line for line in report.splitlines() if line.startswith("| run "))
    assert [c.strip() for c in row.strip("|").split("|")][:7] == [
        *("run", "finished", "8", "4", "1", "32", "6")
    ]
    for name in PLOTS:
        with Image.open(io.BytesIO(read(f"{URL}/report/{name}"))) as image:
            assert image.format == "PNG" and image.size[0] > 300


def test_gs_without_the_gcs_extra_and_profiles_off_gcs_are_clean_errors(monkeypatch, capsys):
    def no_gcsfs(protocol):
        raise ImportError(f"Install gcsfs to access {protocol}")

    monkeypatch.setattr(fsspec, "get_filesystem_class", no_gcsfs)
    monkeypatch.setitem(sys.modules, "google.cloud.storage", None)  # import fails
    message = missing_gcs_support(URL)
    assert "gcsfs and google-cloud-storage" in message and "jaxkit[gcs]" in message
    assert missing_gcs_support("runs/x") is None and missing_gcs_support("s3://b/x") is None
    with pytest.raises(CheckpointError, match=r"jaxkit\[gcs\]"):
        Checkpointer(f"{URL}/checkpoints", keep=2, warn=print)
    assert cli.main(["report", URL]) == 2
    assert "jaxkit[gcs]" in capsys.readouterr().err

    # JAX's profiler writes local paths and gs:// only: refused before any work.
    with pytest.raises(ConfigError, match="a local path or gs://"):
        digits_run("s3://bucket/run", "train.profile_steps=1:2")

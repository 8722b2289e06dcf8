"""Weights & Biases logging (jaxkit/records/wandb_log.py), read back from the files W&B itself
writes.

The runs log with WANDB_MODE=offline under tmp_path: no network, no login. An offline run is
a .wandb file of W&B's protobuf records, and `wandb.sdk.internal.datastore` is the only
reader of that file there is (`wandb sync` uploads offline runs through it). It is imported
at the top of this file, so a wandb that moves or drops it fails every test here instead of
skipping them: wandb 0.30 dropped it, which is why pyproject.toml keeps wandb below 0.30
until these tests have another reader that is not our own.
"""

import json
import shutil
import sys

import jax
import pytest
import wandb
from cli_run import jaxkit
from wandb.proto import wandb_internal_pb2
from wandb.sdk.internal import datastore

from jaxkit.config import ConfigError, apply_overrides, load_config, run_config
from jaxkit.records import wandb_log
from jaxkit.records.metrics import EVAL_TAGS, TRAIN_TAGS, read_metrics
from jaxkit.train.loop import train

# Four optimizer steps of the digits MLP, a record every 2 and an eval every 3 (steps 3 and
# 4): train and eval records at steps of their own and at the same step.
RUN = ["train.steps=4", "train.log_every=2", "train.eval_every=3", "checkpoint.every=2"]


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """W&B offline, with everything it writes (runs, settings, caches) under tmp_path. W&B
    reads these variables once a process, at its set-up: it is torn down after each test,
    so that the next reads its own."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_ERROR_REPORTING", "false")  # nothing leaves the machine
    for name in ("DIR", "CONFIG_DIR", "CACHE_DIR", "DATA_DIR", "ARTIFACT_DIR"):
        monkeypatch.setenv(f"WANDB_{name}", str(tmp_path / "wandb_home"))
    yield
    wandb.teardown()


def offline_runs(tmp_path) -> list[dict]:
    """Each offline attempt under tmp_path, in the order they started: the run's id, project,
    name, branch point (a rewind's), config, history by step (W&B's own keys left out) and
    summary."""
    # A finished run's file may still be being written by W&B's service process: its
    # teardown waits for it (the next run starts another).
    wandb.teardown()
    attempts = []
    for path in (tmp_path / "wandb_home").glob("wandb/offline-run-*/run-*.wandb"):
        store = datastore.DataStore()
        store.open_for_scan(str(path))
        attempt = {"branch": None, "history": {}, "summary": {}}
        while (data := store.scan_data()) is not None:
            record = wandb_internal_pb2.Record()
            record.ParseFromString(data)
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run = record.run
                attempt |= {"id": run.run_id, "project": run.project, "name": run.display_name}
                attempt["started"] = (run.start_time.seconds, run.start_time.nanos)
                attempt["config"] = {i.key: json.loads(i.value_json) for i in run.config.update}
                # Where a rewind or a fork starts, as every wandb since 0.17 records it.
                attempt["branch"] = attempt["config"].pop("_wandb", {}).get("branch_point")
            elif kind == "history":
                row = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                       for i in record.history.item}  # fmt: skip
                step = row.pop("_step")
                attempt["history"][step] = {k: v for k, v in row.items() if k[0] != "_"}
            elif kind == "summary":
                for item in record.summary.update:
                    attempt["summary"][item.key or "/".join(item.nested_key)] = json.loads(
                        item.value_json
                    )
        attempts.append(attempt)
    return sorted(attempts, key=lambda a: a["started"])


def rows(records: list[dict], low: int = 0, high: int = 2**31) -> dict[int, dict]:
    """metrics.jsonl's train and eval records with step in (low, high], as history rows: the
    values by TensorBoard's tags (metrics.TRAIN_TAGS, EVAL_TAGS), one row a step."""
    out: dict[int, dict] = {}
    for record in records:
        if "event" in record or not low < record["step"] <= high:
            continue
        tags = EVAL_TAGS if "eval_loss" in record else TRAIN_TAGS
        row = out.setdefault(record["step"], {})
        row |= {tag: record[key] for key, tag in tags.items() if record.get(key) is not None}
    return out


@pytest.mark.usefixtures("offline")
def test_a_run_logs_its_config_plan_scalars_and_summary_to_wandb(tmp_path):
    workdir = tmp_path / "run"
    out = jaxkit("train", "mlp_digits", *RUN, "wandb.project=kit", "wandb.run_name=first",
                 "--workdir", str(workdir), "--no-progress")  # fmt: skip
    assert out.returncode == 0, out.stderr
    (attempt,) = offline_runs(tmp_path)
    assert (attempt["project"], attempt["name"], attempt["branch"]) == ("kit", "first", None)
    saved = json.loads((workdir / "wandb.json").read_text())
    assert saved == {"id": attempt["id"], "project": "kit", "entity": None}
    for name in ("config", "plan"):
        assert attempt["config"][name] == json.loads((workdir / f"{name}.json").read_text())
    # Every scalar of metrics.jsonl, at its optimizer step under its TensorBoard tag, and no
    # other: W&B keeps the same float64 that metrics.jsonl prints, so they compare exactly.
    assert attempt["history"] == rows(read_metrics(workdir))
    assert sorted(attempt["history"]) == [2, 3, 4]
    assert {"eval/loss", "train/loss", "throughput/mfu"} <= attempt["history"][4].keys()
    summary = json.loads((workdir / "summary.json").read_text())
    assert {key: attempt["summary"].get(key) for key in summary} == summary


@pytest.mark.usefixtures("offline")
def test_a_resume_on_another_device_count_continues_the_wandb_run(tmp_path):
    workdir = tmp_path / "run"
    out = jaxkit("train", "mlp_digits", *RUN, "wandb.project=kit", "--workdir", str(workdir),
                 "--no-progress")  # fmt: skip
    assert out.returncode == 0, out.stderr
    # As if the first attempt (8 devices) had died after logging step 4 but saving step 2.
    shutil.rmtree(workdir / "checkpoints" / "step_4")
    config = load_config("mlp_digits")
    apply_overrides(config, [*RUN, "wandb.project=kit"])
    said: list[str] = []
    train(config, workdir, devices=jax.devices()[:4], progress=False, echo=said.append)
    assert not [line for line in said if "W&B" in line]  # the same run: nothing to say
    metrics = read_metrics(workdir)
    first, resumed = offline_runs(tmp_path)
    assert first["id"] == resumed["id"] == json.loads((workdir / "wandb.json").read_text())["id"]
    # Rewound to its checkpoint's step: what the first attempt logged after it is superseded.
    assert resumed["branch"] == {"run_id": first["id"], "step": 2}
    assert {s: r for s, r in first["history"].items() if s <= 2} == rows(metrics, high=2)
    assert sorted(first["history"]) == [2, 3, 4]  # logged, then superseded
    assert resumed["history"] == rows(metrics, low=2)
    assert resumed["config"]["plan"]["mesh_shape"]["data"] == 4

    # Another project at a further resume: a new W&B run, given the history up to its
    # checkpoint from metrics.jsonl, and one line that says so.
    shutil.rmtree(workdir / "checkpoints" / "step_4")
    apply_overrides(config, ["wandb.project=other"])
    train(config, workdir, devices=jax.devices()[:4], progress=False, echo=said.append)
    *_, new = offline_runs(tmp_path)
    assert new["id"] != first["id"] and (new["project"], new["branch"]) == ("other", None)
    assert json.loads((workdir / "wandb.json").read_text())["id"] == new["id"]
    assert new["history"] == rows(read_metrics(workdir))
    (line,) = [line for line in said if "W&B" in line]
    assert line == (
        f"W&B: run {new['id']} is new, with metrics.jsonl's scalars up to step 2: run "
        f"{first['id']} is in project 'kit', this one logs to project 'other'"
    )


def test_a_project_without_wandb_installed_is_refused_naming_the_extra(tmp_path, monkeypatch):
    # `import wandb` then fails as it does where the package is missing.
    monkeypatch.setitem(sys.modules, "wandb", None)
    workdir = tmp_path / "run"
    out = jaxkit("train", "mlp_digits", "train.steps=1", "wandb.project=kit",
                 "--workdir", str(workdir), "--no-progress")  # fmt: skip
    assert out.returncode == 2
    assert out.stderr == (
        "jaxkit: error: wandb.project='kit' logs to Weights & Biases, which needs "
        "pip install 'jaxkit[wandb]'\n"
    )
    assert not workdir.exists()  # refused before any work
    # With no project the run never imports wandb, so it trains where the package is missing.
    out = jaxkit("train", "mlp_digits", "train.steps=1", "--workdir", str(workdir), "--no-progress")
    assert out.returncode == 0, out.stderr


@pytest.mark.usefixtures("offline")
def test_a_refused_rewind_starts_a_new_run_and_a_refused_start_stops_the_run(tmp_path, monkeypatch):
    # W&B's answers where it is online: a server without rewinds, then no login.
    real_init, refusals = wandb.init, []

    def init(**kwargs):
        if refusals:
            raise refusals[0]
        if "resume_from" in kwargs:
            raise wandb.errors.CommError("failed to rewind run: run not found")
        return real_init(**kwargs)

    monkeypatch.setattr(wandb, "init", init)
    workdir = tmp_path / "run"
    workdir.mkdir()
    records = [
        {"step": 2, "loss": 2.5, "learning_rate": 0.001, "grad_norm": None},
        {"step": 2, "eval_loss": 2.25, "eval_accuracy": 0.5},
        {"event": "batch_change", "step": 2},
        {"step": 4, "loss": 2.0, "learning_rate": 0.002},  # past the checkpoint at step 2
    ]
    (workdir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (workdir / "wandb.json").write_text('{"id": "gone1234", "project": "kit", "entity": null}')
    config = load_config("mlp_digits")
    apply_overrides(config, ["wandb.project=kit"])
    said: list[str] = []
    run = wandb_log.open_run(run_config(config), workdir, 2, {"plan": {}}, said.append)
    assert run is not None
    run.finish()
    (new,) = offline_runs(tmp_path)
    assert new["id"] != "gone1234" and new["branch"] is None
    assert new["history"] == {2: {"train/loss": 2.5, "train/learning_rate": 0.001,
                                  "eval/loss": 2.25, "eval/accuracy": 0.5}}  # fmt: skip
    assert said == [
        f"W&B: run {new['id']} is new, with metrics.jsonl's scalars up to step 2: W&B did "
        "not rewind run gone1234 to step 2: failed to rewind run: run not found"
    ]

    refusals.append(wandb.errors.UsageError("No API key configured.\nUse `wandb login`."))
    (workdir / "wandb.json").unlink()
    with pytest.raises(ConfigError) as refused:
        wandb_log.open_run(run_config(config), workdir, 0, {}, said.append)
    assert str(refused.value) == (
        "wandb.project='kit': W&B did not start a run: No API key configured."
    )
    assert not (workdir / "wandb.json").exists()

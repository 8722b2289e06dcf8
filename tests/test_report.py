import json
import statistics
import subprocess
import sys

import pytest
from PIL import Image

from jaxkit.config import apply_overrides, load_config
from jaxkit.records.report import PLOTS, load_run, summary_row, summary_rows
from jaxkit.train.loop import train


def tiny_run(workdir, per_device):
    config = load_config("mlp_digits")
    apply_overrides(
        config,
        [
            f"batch.per_device_batch_size={per_device}",
            "train.steps=6",
            "train.log_every=2",
            "train.eval_every=3",
        ],
    )
    train(config, workdir, progress=False, echo=lambda *a: None)


def test_report_on_two_runs_draws_both_and_tabulates_both(tmp_path):
    tiny_run(tmp_path / "k1", per_device=4)  # 8 × 4 × 1
    tiny_run(tmp_path / "k2", per_device=2)  # 8 × 2 × 2
    (tmp_path / "k2" / "summary.json").unlink()  # as if k2 were still running
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxkit",
            "report",
            str(tmp_path / "k1"),
            str(tmp_path / "k2"),
            "--out",
            str(tmp_path / "report"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    report = (tmp_path / "report" / "report.md").read_text()
    rows = [line for line in report.splitlines() if line.startswith("| k")]
    assert len(rows) == 2
    k1, k2 = ([c.strip() for c in row.strip("|").split("|")] for row in rows)
    assert k1[:7] == ["k1", "finished", "8", "4", "1", "32", "6"]
    assert k2[:7] == ["k2", "running or interrupted", "8", "2", "2", "32", "6"]
    for name in PLOTS:
        assert f"({name})" in report
        with Image.open(tmp_path / "report" / name) as image:
            assert image.size[0] > 300 and image.size[1] > 200


def test_report_refuses_a_directory_that_is_not_a_run(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "jaxkit", "report", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "not a jaxkit run directory" in out.stderr


def test_throughput_of_a_run_whose_global_batch_changed_is_its_steps_own(tmp_path):
    # Four log windows at a global batch of 16 (160 examples/s), then two at 64 (320/s):
    # the run never went faster than 320 examples/s.
    records = [
        {
            "step": s,
            "loss": 1.0,
            "examples_seen": 16 * s,
            "global_batch_size": 16,
            "step_time_s": 0.1,
            "examples_per_s": 160.0,
        }
        for s in range(1, 5)
    ] + [
        {
            "step": s,
            "loss": 1.0,
            "examples_seen": 64 + 64 * (s - 4),
            "global_batch_size": 64,
            "step_time_s": 0.2,
            "examples_per_s": 320.0,
        }
        for s in range(5, 7)
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "plan.json").write_text(json.dumps({"global_batch_size": 64}))
    run, stage_1, stage_2 = summary_rows(load_run(tmp_path))
    # The run's row is its last stage's, as summary.json is; each stage's its own (the
    # run's first window, compile included, counted in none).
    assert (run["examples_per_s"], run["median_step_time_s"], run["global_batch"]) == (
        320.0,
        0.2,
        64,
    )
    assert stage_1["run"] == f"{tmp_path.name} stage 1"
    assert (stage_1["steps"], stage_1["examples_per_s"]) == (4, 160.0)
    assert stage_2["run"] == f"{tmp_path.name} stage 2"
    assert (stage_2["steps"], stage_2["examples_per_s"]) == (6, 320.0)
    assert summary_row(load_run(tmp_path)) == run


def test_report_of_a_ramped_run_gives_its_last_stage_and_a_row_per_stage(tmp_path, capsys):
    """mlp_digits at 32 rows (K = 1) for 4 steps, then 64 (K = 2) for 4."""
    from jaxkit import cli

    argv = ["train", "mlp_digits", "batch.global_batch_size=null", "batch.schedule=0:32,128:64",
            "train.steps=8", "train.log_every=1", "train.eval_every=2", "checkpoint.every=0",
            "--no-progress", "--workdir", str(tmp_path / "ramp")]  # fmt: skip
    assert cli.main(argv) == 0
    records = [json.loads(line) for line in (tmp_path / "ramp" / "metrics.jsonl").open()]
    train = [r for r in records if "loss" in r]
    assert [r["global_batch_size"] for r in train] == [32] * 4 + [64] * 4
    summary = json.loads((tmp_path / "ramp" / "summary.json").read_text())
    assert cli.main(["report", str(tmp_path / "ramp"), "--out", str(tmp_path / "report")]) == 0
    table = [
        [c.strip() for c in line.strip("|").split("|")]
        for line in (tmp_path / "report" / "report.md").read_text().splitlines()
        if line.startswith("| ramp")
    ]
    assert [row[:7] for row in table] == [
        ["ramp", "finished", "8", "4", "2", "64", "8"],
        ["ramp stage 1", "of 2", "8", "4", "1", "32", "4"],
        ["ramp stage 2", "of 2", "8", "4", "2", "64", "8"],
    ]
    # One record a step: the run's median step is summary.json's, over the last stage only.
    last_stage = [r["step_time_s"] for r in train[4:]]
    assert summary["median_step_time_s"] == pytest.approx(statistics.median(last_stage), rel=1e-12)
    assert float(table[0][9]) == pytest.approx(summary["median_step_time_s"], abs=5e-5)
    first_stage = [r["step_time_s"] for r in train[1:4]]  # step 1's window holds the compile
    assert float(table[1][9]) == pytest.approx(statistics.median(first_stage), abs=5e-5)
    # Each stage's last eval: step 4 (stage 1's params), step 8 (stage 2's).
    evals = {r["step"]: r["eval_loss"] for r in records if "eval_loss" in r}
    assert float(table[1][8]) == pytest.approx(evals[4], abs=5e-5)
    assert float(table[2][8]) == pytest.approx(evals[8], abs=5e-5)


def test_a_stage_ended_by_a_resume_on_other_devices_shows_the_plan_it_ran_on(tmp_path):
    """4 devices × 4 rows × K=2 for three steps, stopped, then 2 × 4 × 4 to the end: the first
    stage's row is 4 × 4 × 2 and ends at step 3 (where it stopped, not step 2, its last log),
    while the run's plan.json is the last stage's."""
    import jax

    config = load_config("mlp_digits")
    apply_overrides(config, ["train.steps=6", "train.log_every=2", "train.eval_every=0"])
    quiet = {"progress": False, "echo": lambda *a: None}
    train(config, tmp_path / "r", devices=jax.devices()[:4], stop_after_micro_steps=6, **quiet)
    train(config, tmp_path / "r", devices=jax.devices()[:2], **quiet)
    rows = summary_rows(load_run(tmp_path / "r"))
    first, second = (
        {k: r[k] for k in ("devices", "per_device", "accum", "steps")} for r in rows[1:]
    )
    assert first == {"devices": 4, "per_device": 4, "accum": 2, "steps": 3}
    assert second == {"devices": 2, "per_device": 4, "accum": 4, "steps": 6}


def test_report_shows_each_mixture_sources_rows_epochs_and_eval(tmp_path):
    """summary.json's examples_by_source, epochs_by_source and eval_loss_by_source: a row
    per source, in NAME order, below the runs' table; a run of one source adds none."""
    from jaxkit import cli

    record = {"step": 4, "loss": 3.9, "examples_seen": 128, "step_time_s": 0.1}
    mixed = {
        "examples_by_source": {"web": 90, "code": 38},
        "epochs_by_source": {"web": 90 / 84, "code": 38 / 14},
        "eval_loss_by_source": {"web": 4.14421, "code": 4.13389},
    }
    for name, summary in (("mix", mixed), ("one", {"final_loss": 3.9})):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text(json.dumps(record) + "\n")
        (tmp_path / name / "plan.json").write_text(json.dumps({"global_batch_size": 32}))
        (tmp_path / name / "summary.json").write_text(json.dumps(summary))
    out = tmp_path / "report"
    runs = [str(tmp_path / "mix"), str(tmp_path / "one")]
    assert cli.main(["report", *runs, "--out", str(out)]) == 0
    lines = (out / "report.md").read_text().splitlines()
    at = lines.index("Rows read from each source of a mixture, and each source's held-out loss:")
    end = lines.index("", at + 2)
    table = [[c.strip() for c in line.strip("|").split("|")] for line in lines[at + 2 : end]]
    assert table == [
        ["run", "source", "examples", "epochs", "eval_loss"],
        ["---", "---", "---", "---", "---"],
        ["mix", "code", "38", "2.714", "4.1339"],
        ["mix", "web", "90", "1.071", "4.1442"],
    ]

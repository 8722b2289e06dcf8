import json
import subprocess
import sys

from PIL import Image

from jaxkit.config import apply_overrides, load_config
from jaxkit.loop import train
from jaxkit.report import PLOTS, load_run, summary_row


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
            "step_time_s": 0.1,
            "examples_per_s": 160.0,
        }
        for s in range(1, 5)
    ] + [
        {
            "step": s,
            "loss": 1.0,
            "examples_seen": 64 + 64 * (s - 4),
            "step_time_s": 0.2,
            "examples_per_s": 320.0,
        }
        for s in range(5, 7)
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "plan.json").write_text(json.dumps({"global_batch_size": 64}))
    row = summary_row(load_run(tmp_path))
    assert row["examples_per_s"] == 160.0  # the median window: 3 of the 5 counted ran at 160

"""jaxkit.plan.planning called in-process, as a notebook calls it: it answers what `jaxkit plan
--json` prints for the same request."""

import json

from small_configs import SMALL_LM

from jaxkit import cli
from jaxkit.config import load_config, run_config
from jaxkit.plan import planning

# Seconds a compile took and whether the cache served it: measured per call, not answers.
TIMINGS = ("compile_s", "trace_s", "compile_cache_hit")


def without_timings(result):
    result["splits"] = [{k: v for k, v in s.items() if k not in TIMINGS} for s in result["splits"]]
    return result


def test_all_splits_returns_what_plan_all_splits_json_prints(capsys):
    line = ["plan", "mlp_digits", "--all-splits", "--device-counts", "8", "--memory-budget", "1MiB"]
    assert cli.main([*line, "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)

    request = planning.request(run_config(load_config("mlp_digits")), memory_budget="1MiB")
    result = planning.all_splits(request, device_counts=[8])
    assert without_timings(result.to_json()) == without_timings(printed)
    # mlp_digits' global batch of 32 on 8 devices: 4 rows a device, as 4×1, 2×2 or 1×4.
    assert [(s.plan.per_device_batch_size, s.plan.grad_accum_steps) for s in result.splits] == [
        (4, 1),
        (2, 2),
        (1, 4),
    ]
    assert result.to_json()["memory_budget_bytes"] == 2**20


def test_summary_returns_what_plan_json_prints(capsys):
    assert cli.main(["plan", "mlp_digits", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert (
        planning.summary(planning.request(run_config(load_config("mlp_digits")))).to_json()
        == printed
    )


def test_a_runs_plan_json_is_what_plan_json_prints(tmp_path, capsys):
    """docs/training.md: plan.json holds the plan "as `plan --json` prints it", the model block
    (its kernel, loss chunks, params and FLOPs) included."""
    line = ["lm_tiny", *SMALL_LM, "train.steps=1", "train.eval_every=0"]
    assert cli.main(["train", *line, "--workdir", str(tmp_path), "--no-progress"]) == 0
    capsys.readouterr()
    assert cli.main(["plan", *line, "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    saved = json.loads((tmp_path / "plan.json").read_text())
    assert saved["model"]["attention"] == "xla"  # the kernel that ran, never "auto"
    assert saved == printed

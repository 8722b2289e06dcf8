"""A global batch that grows: the stages, their learning rates, one compile, the same
trajectory on any device count, resume across a stage boundary, and the auto ramp."""

import json
import math
import shutil

import jax
import numpy as np
import optax
import pytest
from test_equivalence import LOSS_RTOL, PARAM_ATOL

from jaxkit import cli
from jaxkit.batch.plan import BatchPlanError
from jaxkit.batch.schedule import auto_decision, parse_stages, schedule_from_config
from jaxkit.config import ConfigError, apply_overrides, load_config, run_config, validate
from jaxkit.plan import costs
from jaxkit.records import report
from jaxkit.train.checkpoint import CheckpointError
from jaxkit.train.loop import train

SHAPE_8 = {"data": 8, "fsdp": 1, "tensor": 1}
# mlp_digits on 8 devices × 4 rows: micro-batch 32, so K = 1, 2, 4 over the stages.
RAMP = "0:32,256:64,640:128"


def digits(*overrides):
    config = load_config("mlp_digits")
    apply_overrides(config, list(overrides))
    return config


def ramped(*overrides):
    return digits(
        "batch.global_batch_size=null",
        f"batch.schedule={RAMP}",
        "train.steps=16",
        "train.log_every=1",
        "train.eval_every=0",
        "train.eval_examples=64",
        "optimizer.warmup_steps=2",
        *overrides,
    )


def quiet(config, **kwargs):
    return train(config, progress=False, echo=lambda *a: None, **kwargs)


def train_records(result):
    return [r for r in result.records if "loss" in r]


def test_stages_parse_examples_scales_and_tokens():
    assert parse_stages("0:64, 200000:128,600k:256", None) == [
        (0, 64),
        (200000, 128),
        (600000, 256),
    ]
    assert parse_stages("0:64,1.5M:128", None) == [(0, 64), (1_500_000, 128)]
    assert parse_stages("0:64,1.001k:128,0.067G:256", None)[1:] == [(1001, 128), (67 * 10**6, 256)]
    # 25M tokens of 128-token rows: the first example that starts at or past token 25M.
    assert parse_stages("0:64,25Mt:128", 128) == [(0, 64), (math.ceil(25e6 / 128), 128)]
    for bad, why in [
        ("64:32,128:64", "must start at example 0"),
        ("0:32,100:64,100:128", "increasing order"),
        ("0:32,1000t:64", "no data.seq_len"),
        ("0:32,x:64", "is not EXAMPLES:GLOBAL_BATCH"),
        ("0:32,100:0", "must be > 0"),
        ("0:32,1.5:64", "not a whole count"),
    ]:
        with pytest.raises(BatchPlanError, match=why):
            parse_stages(bad, None)


def test_each_stage_keeps_the_micro_batch_and_a_stage_that_does_not_divide_names_valid_ones():
    schedule = schedule_from_config(run_config(ramped()), SHAPE_8)
    plans = [s.plan for s in schedule.stages]
    assert [p.global_batch_size for p in plans] == [32, 64, 128]
    assert [p.grad_accum_steps for p in plans] == [1, 2, 4]
    assert {(p.per_device_batch_size, p.micro_batch_size) for p in plans} == {(4, 32)}
    with pytest.raises(BatchPlanError, match=r"stage 256:80: .*Valid global_batch_size near 80"):
        schedule_from_config(run_config(ramped("batch.schedule=0:32,256:80")), SHAPE_8)
    with pytest.raises(BatchPlanError, match=r"disagrees with batch\.schedule's first stage"):
        schedule_from_config(run_config(ramped("batch.global_batch_size=64")), SHAPE_8)


def walk_by_hand(stages, steps=None, examples=None):
    """Optimizer steps per stage, one step at a time: a step belongs to the stage in force
    at the example it starts from."""
    counts, step, seen = [0] * len(stages), 0, 0
    while (steps is not None and step < steps) or (examples is not None and seen < examples):
        i = max(j for j, (start, _) in enumerate(stages) if start <= seen)
        counts[i] += 1
        seen += stages[i][1]
        step += 1
    return counts, seen


@pytest.mark.parametrize(
    ("text", "length"),
    [
        ("0:32,256:64,640:128", "train.steps=16"),
        ("0:32,250:64,650:128", "train.steps=16"),  # boundaries inside a step: next step
        ("0:32,250:64,650:128", "train.steps=5"),  # later stages not reached
        ("0:32,250:64,650:128", "train.examples=1000"),
        ("0:32,250:64,650:128", "train.examples=1001"),  # the last step passes the target
    ],
)
def test_the_plan_table_counts_the_steps_a_run_makes_in_each_stage(text, length):
    config = ramped(f"batch.schedule={text}", "train.steps=null", length)
    schedule = schedule_from_config(run_config(config), SHAPE_8)
    steps = config.train.steps
    counts, seen = walk_by_hand(parse_stages(text, None), steps, config.train.examples)
    assert [s.steps for s in schedule.stages] == counts
    assert schedule.total_steps == sum(counts)
    assert schedule.total_examples == seen
    table = schedule.table()
    if "250" in text and counts[1]:
        assert "(asked 250)" in table  # the stage starts at the first step boundary past it
    if counts[-1] == 0:
        assert "not reached" in table


def test_one_of_train_steps_and_train_examples():
    with pytest.raises(ConfigError, match=r"not both; set train\.steps=null"):
        validate(digits("train.examples=1000"))
    with pytest.raises(ConfigError, match="not neither"):
        validate(digits("train.steps=null"))


def test_a_fixed_batch_keeps_the_learning_rate_of_a_schedule_laid_over_steps():
    config = digits("optimizer.warmup_steps=10", "train.steps=200")
    schedule = schedule_from_config(run_config(config), SHAPE_8)
    plan = schedule.first
    by_step = optax.warmup_cosine_decay_schedule(
        init_value=plan.learning_rate / 10,
        peak_value=plan.learning_rate,
        warmup_steps=10,
        decay_steps=200,
        end_value=plan.learning_rate * config.optimizer.final_lr_fraction,
    )
    for step in [0, 1, 5, 9, 10, 11, 100, 199, 250]:
        ours = schedule.learning_rate(step * plan.global_batch_size, plan)
        # optax computes in float32: agreement to float32 round-off of the rate.
        np.testing.assert_allclose(ours, float(by_step(step)), rtol=1e-6)


def test_a_ramp_scales_each_stage_peak_and_lays_warmup_and_decay_over_examples():
    config = ramped(
        "optimizer.lr_scaling=sqrt",
        "optimizer.reference_batch_size=32",
        "optimizer.warmup_steps=4",
        "train.steps=null",
        "train.examples=3200",
    )
    schedule = schedule_from_config(run_config(config), SHAPE_8)
    base = config.optimizer.learning_rate
    assert [s.plan.learning_rate for s in schedule.stages] == pytest.approx(
        [base, base * math.sqrt(2), base * 2]
    )
    end = config.optimizer.final_lr_fraction
    warmup, total = 4 * 32, schedule.total_examples  # warmup: 4 steps of the first stage
    for e in [0, 64, 127, 128, 640, 1600, total - 128, total]:
        plan = schedule.plan_at(e)
        if e < warmup:
            shape = 1 / 4 + (1 - 1 / 4) * e / warmup
        else:
            shape = end + (1 - end) * 0.5 * (
                1 + math.cos(math.pi * (e - warmup) / (total - warmup))
            )
        assert schedule.learning_rate(e, plan) == pytest.approx(plan.learning_rate * shape)


def test_a_ramp_scales_each_stage_from_the_base_rate_when_the_reference_is_another_batch(
    capsys,
):
    """Reference 256, stages 32, 64, 128: each stage's peak is base × G / 256, in the plan
    table and in the rate every step of the loop applies (scaling a stage from the first
    stage's already-scaled rate would give 8× too low rates from stage 1 on)."""
    scaling = ["optimizer.lr_scaling=linear", "optimizer.reference_batch_size=256"]
    config = ramped(*scaling)
    base, end = config.optimizer.learning_rate, config.optimizer.final_lr_fraction
    peaks = {g: base * g / 256 for g in (32, 64, 128)}  # 3.75e-4, 7.5e-4, 1.5e-3
    records = train_records(quiet(config))
    assert [r["global_batch_size"] for r in records] == [32] * 8 + [64] * 6 + [128] * 2
    warmup, total = 2 * 32, 8 * 32 + 6 * 64 + 2 * 128  # over examples: 2 first-stage steps
    for r in records:
        g = r["global_batch_size"]
        e = r["examples_seen"] - g  # where the step starts reading
        if e < warmup:
            shape = 1 / 2 + (1 - 1 / 2) * e / warmup
        else:
            progress = (e - warmup) / (total - warmup)
            shape = end + (1 - end) * 0.5 * (1 + math.cos(math.pi * progress))
        # Logged as float32: agreement to its round-off.
        assert r["learning_rate"] == pytest.approx(peaks[g] * shape, rel=1e-6), r["step"]

    args = ["plan", "mlp_digits", "batch.global_batch_size=null", f"batch.schedule={RAMP}"]
    assert cli.main([*args, "train.steps=16", *scaling]) == 0
    out = capsys.readouterr().out
    assert "learning_rate         | 0.000375 | = 0.003 × 32/256 (linear)" in out
    stage_rows = [line for line in out.splitlines() if line[:2] in ("0 ", "1 ", "2 ")]
    rates = [float(row.split("|")[4]) for row in stage_rows]
    assert rates == pytest.approx([peaks[32], peaks[64], peaks[128]], rel=1e-6)


@pytest.fixture(scope="module")
def ramped_runs():
    """The ramp trained once for the module on the 8 devices, MultiSteps and fused: each
    run's result and the K of each step it compiled (the tests only read them)."""
    original = costs.compile_setup_step

    def counted(accumulation):
        compiles = []

        def counting(*args, **kwargs):
            compiles.append(args[1].grad_accum_steps)
            return original(*args, **kwargs)

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(costs, "compile_setup_step", counting)
            return quiet(ramped(f"train.accumulation={accumulation}")), compiles

    return {accumulation: counted(accumulation) for accumulation in ("multisteps", "fused")}


def test_a_ramped_run_compiles_its_step_once_and_logs_each_steps_batch(ramped_runs):
    result, compiles = ramped_runs["multisteps"]
    assert len(compiles) == 1  # K is an argument of the one MultiSteps program
    records = train_records(result)
    assert [r["global_batch_size"] for r in records] == [32] * 8 + [64] * 6 + [128] * 2
    assert [r["grad_accum_steps"] for r in records] == [1] * 8 + [2] * 6 + [4] * 2
    assert records[-1]["examples_seen"] == 8 * 32 + 6 * 64 + 2 * 128
    assert records[-1]["micro_step"] == 8 * 1 + 6 * 2 + 2 * 4
    assert result.summary["batch_schedule"]["stages"][2]["steps"] == 2
    # The one program holds MultiSteps' accumulator at every K, K = 1 included.
    assert result.state.opt_state.acc_grads is not None

    fused, compiles = ramped_runs["fused"]  # K is the batch's leading dimension, one program per K
    assert compiles == [1, 2, 4]
    assert fused.state.opt_state.acc_grads is None  # the sums live inside each step


def final_params(result):
    return jax.tree.leaves(jax.device_get(result.state.params))


def assert_same_trajectory(a, b):
    """Equal global batches, other splits: round-off apart (see test_equivalence)."""
    ra, rb = train_records(a), train_records(b)
    assert [r["step"] for r in ra] == [r["step"] for r in rb]
    assert [r["global_batch_size"] for r in ra] == [r["global_batch_size"] for r in rb]
    np.testing.assert_allclose([r["loss"] for r in ra], [r["loss"] for r in rb], rtol=LOSS_RTOL)
    for x, y in zip(final_params(a), final_params(b), strict=True):
        np.testing.assert_allclose(x, y, atol=PARAM_ATOL)


def test_a_ramped_run_follows_one_trajectory_on_8_and_4_devices_and_fused(ramped_runs):
    eight = ramped_runs["multisteps"][0]
    four = quiet(ramped(), devices=jax.devices()[:4])  # micro-batch 16: K = 2, 4, 8
    assert [r["grad_accum_steps"] for r in train_records(four)] == [2] * 8 + [4] * 6 + [8] * 2
    assert_same_trajectory(eight, four)
    assert_same_trajectory(eight, ramped_runs["fused"][0])


def test_a_ramped_run_resumes_across_stage_boundaries_on_other_device_counts(tmp_path, ramped_runs):
    reference = ramped_runs["multisteps"][0]  # uninterrupted, on the 8 devices
    work = tmp_path / "moved"
    # Stage 1 (K = 2 on 8 devices) starts at micro-step 8: stop in the middle of step 10.
    first = quiet(ramped(), workdir=work, stop_after_micro_steps=8 + 2 * 2 + 1)
    assert first.stopped
    # On 4 devices the half step cannot go on (K = 4 there): it is redone (12 micro-steps
    # done). Steps 11-14 take 16 more; stop 3 micro-steps into step 15, in stage 2 (K = 8).
    second = quiet(ramped(), workdir=work, devices=jax.devices()[:4], stop_after_micro_steps=31)
    assert second.stopped
    last = quiet(ramped(), workdir=work)
    assert not last.stopped
    lines = [json.loads(x) for x in (work / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in lines if "loss" in r]
    assert steps == list(range(1, 17))  # every step once, in order
    changes = [r for r in lines if r.get("event") == "batch_change"]
    assert [(c["step"], c["global_batch_size"]) for c in changes] == [(8, 64), (14, 128)]
    # Other device counts, the same schedule: nothing to come changed, so no such event.
    assert not [r for r in lines if r.get("event") == "batch_schedule_change"]
    for x, y in zip(final_params(reference), final_params(last), strict=True):
        np.testing.assert_allclose(x, y, atol=PARAM_ATOL)
    # What ran, piece by piece: stage 1 ran with K = 2 on 8 devices, then K = 4 on 4.
    pieces = [
        (s["examples"], s["global_batch_size"], s["grad_accum_steps"], s["steps"])
        for s in last.summary["batch_schedule"]["stages"]
    ]
    assert pieces == [(0, 32, 1, 8), (256, 64, 2, 2), (384, 64, 4, 4), (640, 128, 4, 2)]
    # plan.json and the report show the plan the last attempt ran, and the last step's batch.
    plan = json.loads((work / "plan.json").read_text())
    assert (plan["global_batch_size"], plan["grad_accum_steps"]) == (128, 4)
    row = report.summary_row(report.load_run(work))
    assert (row["devices"], row["global_batch"], row["accum"]) == (8, 128, 4)


def test_the_auto_rule_doubles_after_patience_samples_above_the_batch_and_never_shrinks():
    windows, g, sizes = 0, 32, []
    # B_simple estimates at successive sampled steps (None: not yet measured).
    for noise in [None, 50, 20, 40, 41, 45, 60, 70, 100, 130, 140, 150, 10, 10, 300, 300, 300]:
        windows, double = auto_decision(windows, noise, g, patience=3, max_global_batch_size=128)
        if double:
            g *= 2
        sizes.append(g)
    assert sizes == [32] * 5 + [64] * 4 + [128] * 8
    assert auto_decision(2, 999.0, 128, patience=3, max_global_batch_size=128) == (3, False)


def auto(*overrides):
    # 8 devices × 2 rows × K = 2 (any K would do: the noise scale's small batch is the
    # global batch's first row).
    return digits(
        "batch.global_batch_size=32",
        "batch.per_device_batch_size=2",
        "batch.schedule=auto",
        "batch.max_global_batch_size=128",
        "batch.auto_patience=2",
        "train.steps=null",
        "train.examples=900",  # 14 steps: two at 128, the maximum, reached at step 10
        "train.log_every=2",
        "train.noise_scale_every=2",  # decides every 2nd step, on that step's sample
        "train.eval_every=0",
        "train.eval_examples=64",
        *overrides,
    )


@pytest.fixture(scope="module")
def auto_run(tmp_path_factory):
    """The auto ramp trained once for the module, uninterrupted, with a workdir: its result
    and workdir (the tests only read them)."""
    workdir = tmp_path_factory.mktemp("auto") / "whole"
    return quiet(auto(), workdir=workdir), workdir


def test_auto_ramp_decisions_are_the_rule_applied_to_the_logged_noise_scale(auto_run):
    result, workdir = auto_run
    lines = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    changes = [r for r in lines if r.get("event") == "batch_change"]
    assert changes, "mlp_digits' B_simple (~60-150 rows) should exceed a batch of 32"
    records = [r for r in lines if "loss" in r]
    total = records[-1]["step"]
    windows, g, expected = 0, 32, []
    for r in records:
        assert r["global_batch_size"] == g
        if r["step"] % 2 == 0 and r["step"] < total:
            windows, double = auto_decision(windows, r.get("noise_scale"), g, 2, 128)
            if double:
                g *= 2
                expected.append((r["step"], g))
    assert [(c["step"], c["global_batch_size"]) for c in changes] == expected
    assert records[-1]["examples_seen"] >= 900 > records[-1]["examples_seen"] - g
    assert result.summary["examples_seen"] == records[-1]["examples_seen"]


@pytest.fixture(scope="module")
def auto_stopped(tmp_path_factory):
    """The auto ramp stopped mid-step three times, resumed after each but the last: the
    workdir, which each test copies before resuming it."""
    work = tmp_path_factory.mktemp("auto") / "stopped"
    # Mid-step stops in steps 5, 9 and 12: the first two resume from checkpoints taken one
    # sample above the batch into the patience of 2 (mlp_digits' B_simple is ~90 early, above
    # 32 and 64), so a resume that forgot that sample would double a sample late.
    for stop_at in (9, 22, 41):
        assert quiet(auto(), workdir=work, stop_after_micro_steps=stop_at).stopped
    return work


def test_a_resumed_auto_run_makes_the_same_decisions(tmp_path, auto_run, auto_stopped):
    whole, whole_dir = auto_run
    work = shutil.copytree(auto_stopped, tmp_path / "stopped")
    last = quiet(auto(), workdir=work)

    def history(path):
        lines = [json.loads(x) for x in (path / "metrics.jsonl").read_text().splitlines()]
        changes = [(r["step"], r["global_batch_size"]) for r in lines if "event" in r]
        return changes, [(r["step"], r["global_batch_size"]) for r in lines if "loss" in r]

    assert history(work) == history(whole_dir)
    # The same device count and split: the resumed run repeats the same arithmetic.
    for x, y in zip(final_params(whole), final_params(last), strict=True):
        np.testing.assert_array_equal(x, y)


def test_auto_needs_two_batch_sizes_a_maximum_it_can_reach_and_a_length_in_examples():
    # K = 1 has two batch sizes too: the global batch's first row and the global batch.
    k1 = schedule_from_config(run_config(auto("batch.per_device_batch_size=4")), SHAPE_8)
    assert k1.first.grad_accum_steps == 1
    one_row = auto("batch.global_batch_size=1", "batch.per_device_batch_size=1")
    with pytest.raises(BatchPlanError, match="two batch sizes: the first 1 row"):
        schedule_from_config(run_config(one_row), {"data": 1, "fsdp": 1, "tensor": 1})
    assert schedule_from_config(run_config(auto("batch.schedule=AUTO")), SHAPE_8).kind == "auto"
    with pytest.raises(BatchPlanError, match="one of 32, 64, 128"):
        schedule_from_config(run_config(auto("batch.max_global_batch_size=100")), SHAPE_8)
    with pytest.raises(BatchPlanError, match=r"give train\.examples"):
        schedule_from_config(run_config(auto("train.examples=null", "train.steps=10")), SHAPE_8)
    with pytest.raises(BatchPlanError, match=r"read by batch\.schedule=auto only"):
        schedule_from_config(run_config(auto("batch.schedule=")), SHAPE_8)
    with pytest.raises(BatchPlanError, match="give it"):
        schedule_from_config(run_config(auto("batch.max_global_batch_size=null")), SHAPE_8)


def test_auto_without_noise_scale_samples_is_refused_in_one_line_before_any_work(tmp_path):
    from cli_run import jaxkit  # in-process: what the command prints and writes

    work = tmp_path / "run"
    line = ["train", "mlp_digits", "batch.global_batch_size=32", "batch.schedule=auto"]
    line += ["batch.max_global_batch_size=64", "train.steps=null", "train.examples=320"]
    out = jaxkit(*line, "train.noise_scale_every=0", "--workdir", str(work))
    # Refused where the batch plan is made: after the workdir is named, before it is made.
    assert out.returncode == 2 and out.stdout == f"workdir: {work}\n" and not work.exists(), out
    assert out.stderr.startswith("jaxkit: error: train.noise_scale_every=0 turns off")
    assert out.stderr.count("\n") == 1, out.stderr


def test_plan_prints_the_stage_table_and_json():
    from cli_run import jaxkit  # in-process, on its 8 devices (as `--host-devices 8` gives)

    args = ["plan", "mlp_digits", "batch.global_batch_size=null", f"batch.schedule={RAMP}"]
    table = jaxkit(*args, "train.steps=10")
    assert table.returncode == 0, table.stderr
    assert "batch schedule (scheduled" in table.stdout
    row = next(line for line in table.stdout.splitlines() if line.startswith("2 "))
    assert [c.strip() for c in row.split("|")] == ["2", "640", "128", "4", "0.003", "not reached"]
    out = jaxkit(*args, "--json", "train.steps=30")
    assert out.returncode == 0, out.stderr
    stages = json.loads(out.stdout)["batch_schedule"]["stages"]
    assert [(s["examples"], s["grad_accum_steps"], s["steps"]) for s in stages] == [
        (0, 1, 8),
        (256, 2, 6),
        (640, 4, 16),
    ]


def read_log(path):
    return [json.loads(x) for x in (path / "metrics.jsonl").read_text().splitlines()]


def assert_every_step_once_and_examples_add_up(lines):
    records = [r for r in lines if "loss" in r]
    assert [r["step"] for r in records] == list(range(1, len(records) + 1))
    seen = 0
    for r in records:
        seen += r["global_batch_size"]
        assert r["examples_seen"] == seen
    return records


def test_a_schedule_changed_at_a_resume_changes_only_what_is_still_to_come(tmp_path):
    run_by_examples = ["train.steps=null", "train.examples=1600"]
    # 8 steps of 32 and 6 of 64 reach example 640; stage 2 (K = 4) starts at micro-step 20:
    # stop 2 micro-steps into its second step (position: step 15, example 768).
    first = quiet(ramped(*run_by_examples), workdir=tmp_path, stop_after_micro_steps=26)
    assert first.stopped
    later = "batch.schedule=0:32,256:64,640:128,1024:256"  # a stage added ahead
    result = quiet(ramped(*run_by_examples, later), workdir=tmp_path)
    lines = read_log(tmp_path)
    records = assert_every_step_once_and_examples_add_up(lines)
    # 768 + 2 × 128 = 1024, then 256s until at or past 1600: 1792, at step 15 + 2 + 3.
    assert (records[-1]["step"], records[-1]["examples_seen"]) == (20, 1792)
    summary = result.summary
    assert (summary["steps"], summary["examples_seen"]) == (20, 1792)
    stages = [
        (s["examples"], s["global_batch_size"], s["steps"])
        for s in summary["batch_schedule"]["stages"]
    ]
    assert stages == [(0, 32, 8), (256, 64, 6), (640, 128, 3), (1024, 256, 3)]
    # The learning rate's decay spans the examples the run trains, and the change is logged.
    assert summary["batch_schedule"]["total_examples"] == 1792
    (change,) = [r for r in lines if r.get("event") == "batch_schedule_change"]
    assert change["step"] == 15 and change["to_schedule"]["total_examples"] == 1792
    assert change["from_schedule"]["total_examples"] == 1664  # 640 + 8 × 128
    assert change["learning_rate_after"] == pytest.approx(records[15]["learning_rate"], rel=1e-6)


def test_a_batch_changed_at_a_resume_keeps_the_runs_length_in_examples(tmp_path):
    by_examples = digits("train.steps=null", "train.examples=1600", "train.log_every=1")
    assert quiet(by_examples, workdir=tmp_path, stop_after_micro_steps=20).stopped  # 640 seen
    apply_overrides(by_examples, ["batch.global_batch_size=64"])
    result = quiet(by_examples, workdir=tmp_path, allow_batch_change=True)
    lines = read_log(tmp_path)
    records = assert_every_step_once_and_examples_add_up(lines)
    assert (records[-1]["step"], records[-1]["examples_seen"]) == (20 + 960 // 64, 1600)
    assert result.summary["examples_seen"] == 1600
    (change,) = [r for r in lines if r.get("event") == "plan_change"]
    assert change["learning_rate_after"] == pytest.approx(records[20]["learning_rate"], rel=1e-6)
    # The run still ends at 1,600 examples and lr_scaling is none: the same curve goes on.
    assert change["learning_rate_before"] == change["learning_rate_after"]


def test_a_batch_changed_at_a_resume_ends_the_decay_where_the_run_ends(tmp_path):
    config = digits("train.steps=10", "train.log_every=1", "optimizer.warmup_steps=2")
    assert quiet(config, workdir=tmp_path, stop_after_micro_steps=5).stopped
    apply_overrides(config, ["batch.global_batch_size=64"])
    result = quiet(config, workdir=tmp_path, allow_batch_change=True)
    schedule = result.summary["batch_schedule"]
    # 5 steps of 32 then 5 of 64: the decay spans 480 examples, not 10 × 64.
    assert schedule["total_examples"] == result.summary["examples_seen"] == 5 * 32 + 5 * 64
    last = train_records(result)[-1]
    end = config.optimizer.final_lr_fraction
    progress = (480 - 64 - 2 * 32) / (480 - 2 * 32)  # the last step starts 64 before
    expected = end + (1 - end) * 0.5 * (1 + math.cos(math.pi * progress))
    assert last["learning_rate"] == pytest.approx(3e-3 * expected, rel=1e-6)


def test_an_auto_resume_cannot_lower_the_maximum_below_what_it_reached(tmp_path, auto_stopped):
    work = shutil.copytree(auto_stopped, tmp_path / "stopped")  # stopped at 128, since step 10
    with pytest.raises(BatchPlanError, match="reached a global batch of 128"):
        quiet(auto("batch.max_global_batch_size=64"), workdir=work)


def test_a_run_by_examples_grows_only_with_allow_longer(tmp_path):
    config = ramped("train.steps=null", "train.examples=640")
    quiet(config, workdir=tmp_path)
    longer = ramped("train.steps=null", "train.examples=1000")
    with pytest.raises(CheckpointError, match=r"finished run of 640 examples.*--allow-longer"):
        quiet(longer, workdir=tmp_path)
    with pytest.raises(CheckpointError, match=r"cannot be measured in train\.steps"):
        quiet(ramped(), workdir=tmp_path)
    result = quiet(longer, workdir=tmp_path, allow_longer=True)
    lines = read_log(tmp_path)
    assert_every_step_once_and_examples_add_up(lines)
    (change,) = [r for r in lines if r.get("event") == "steps_change"]
    assert (change["from_examples"], change["to_examples"]) == (640, 1000)
    assert result.summary["examples_seen"] == 640 + 3 * 128  # 1024: at or past 1000


def test_auto_whose_noise_scale_samples_no_step_before_the_last_is_refused(tmp_path):
    from cli_run import jaxkit  # in-process: what the command prints and writes

    # 320 examples at a first global batch of 32: 10 steps; every=10 samples only the 10th,
    # after which no step is left to train at a doubled batch.
    work = tmp_path / "run"
    line = ["train", "mlp_digits", "batch.global_batch_size=32", "batch.schedule=auto"]
    line += ["batch.max_global_batch_size=64", "train.steps=null", "train.examples=320"]
    out = jaxkit(*line, "train.noise_scale_every=10", "--workdir", str(work))
    assert out.returncode == 2 and out.stdout == f"workdir: {work}\n" and not work.exists(), out
    assert out.stderr == (
        "jaxkit: error: train.noise_scale_every=10 samples no step before the last of this "
        "batch.schedule=auto run (train.examples=320 is 10 optimizer steps at its first "
        "global batch 32), so it would train at a fixed batch: sample every N < 10 steps\n"
    )
    config = load_config("mlp_digits")
    apply_overrides(config, [*line[2:], "train.noise_scale_every=9"])
    assert schedule_from_config(run_config(config), SHAPE_8).kind == "auto"  # step 9 samples

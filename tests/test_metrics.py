"""The run directory as TensorBoard and a profiler see it."""

import json

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from jaxkit.config import ConfigError, apply_overrides, load_config, parse_profile_steps
from jaxkit.records.metrics import read_metrics
from jaxkit.train.loop import train


def digits_run(workdir, *overrides):
    config = load_config("mlp_digits")
    apply_overrides(
        config, ["train.steps=6", "train.log_every=2", "train.eval_every=3", *overrides]
    )
    return train(config, workdir, progress=False, echo=lambda *a: None)


def test_tensorboard_scalars_and_text_match_the_metrics(tmp_path):
    result = digits_run(tmp_path)
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {
        "train/loss",
        "train/learning_rate",
        "train/grad_norm",
        "train/skipped_micro_batches",
        "throughput/examples_per_s",
        "throughput/mfu",
        "eval/loss",
        "eval/accuracy",
    } <= tags
    train_records = [r for r in result.records if "loss" in r]
    loss_events = events.Scalars("train/loss")
    assert [e.step for e in loss_events] == [2, 4, 6] == [r["step"] for r in train_records]
    for event, record in zip(loss_events, train_records, strict=True):
        assert event.value == pytest.approx(record["loss"], rel=1e-6)  # stored as float32
    for key in ("mfu", "hfu"):
        logged = [e.value for e in events.Scalars(f"throughput/{key}")]
        assert logged == pytest.approx([r[key] for r in train_records], rel=1e-6)
    evals = [r for r in result.records if "eval_loss" in r]
    assert [e.step for e in events.Scalars("eval/loss")] == [3, 6]
    assert events.Scalars("eval/accuracy")[-1].value == pytest.approx(evals[-1]["eval_accuracy"])
    assert {"plan/text_summary", "config/text_summary"} <= set(events.Tags()["tensors"])
    plan_text = events.Tensors("plan/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "global_batch_size" in plan_text and "= 8 × 4 × 1" in plan_text


def test_profile_steps_write_a_trace_of_the_window(tmp_path):
    digits_run(tmp_path, "train.profile_steps=2:4")
    for pattern in ("*.xplane.pb", "perfetto_trace.json.gz"):  # xprof and Perfetto
        traces = list((tmp_path / "profile").rglob(pattern))
        assert len(traces) == 1 and traces[0].stat().st_size > 0, pattern
    assert len(read_metrics(tmp_path)) == 5  # the run itself went on as usual


@pytest.mark.parametrize(
    "text,match", [("2", "is not START:END"), ("4:2", "0 <= START < END"), ("0:99", "<= train")]
)
def test_bad_profile_windows_are_config_errors(text, match):
    with pytest.raises(ConfigError, match=match):
        parse_profile_steps(text, 10)
    assert parse_profile_steps("", 10) is None and parse_profile_steps("3:5", 10) == (3, 5)


def test_metrics_of_an_interrupted_run_are_readable(tmp_path):
    lines = [json.dumps({"step": 1, "loss": 2.0}), json.dumps({"step": 2, "loss": 1.5})]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 3, "lo')
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]


def test_two_run_dirs_opened_in_the_same_second_keep_both_event_files(tmp_path):
    from jaxkit.records.metrics import RunDir

    first = RunDir(tmp_path)
    first.log({"step": 1, "loss": 1.0})
    second = RunDir(tmp_path, resume_after_step=0)  # a restart within the same second
    second.log({"step": 1, "loss": 2.0})
    first.close()
    second.close()
    files = sorted((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert len(files) == 2, files

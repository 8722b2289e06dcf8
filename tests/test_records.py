"""What a finished run's summary says."""

import pytest

from jaxkit.records.steps import format_summary


def test_a_held_out_split_of_one_repeated_byte_is_summarised():
    summary = {
        "steps": 3,
        "wall_time_s": 1.0,
        "median_step_time_s": None,
        "eval_loss": 0.25,
        "eval_accuracy": 1.0,
        "unigram_entropy": 0.0,  # every held-out byte the same
        "skipped_micro_batches": 0,
    }
    text = format_summary(summary)  # no division by the zero entropy
    assert "eval loss 0.2500" in text


def test_the_eval_line_gives_the_loss_as_a_share_of_the_unigram_entropy():
    """The percentage is eval loss ÷ unigram entropy, and the line says so: it read as a
    share of the held-out bytes evaluated ("(168% of it)")."""
    summary = {
        "steps": 3,
        "wall_time_s": 1.0,
        "median_step_time_s": None,
        "eval_loss": 1.5,
        "eval_accuracy": 0.5,
        "unigram_entropy": 3.0,
        "skipped_micro_batches": 0,
    }
    line = format_summary(summary).splitlines()[-1]
    assert line == (
        "  eval loss 1.500 nats/byte, 50% of the unigram entropy of the held-out bytes "
        "evaluated (3.000 nats/byte)"
    )


def test_a_cpu_peak_below_what_the_run_achieved_is_called_stale():
    """A CPU peak cached while the machine was busy reads low ever after: a run printed
    MFU 126% without a word. Above 100% of a measured peak, the summary says what to do."""
    summary = {
        "steps": 3,
        "wall_time_s": 1.0,
        "median_step_time_s": 0.5,
        "examples_per_s": 128.0,
        "first_step_s": 0.1,
        "eval_loss": None,
        "skipped_micro_batches": 0,
        "model_flops_per_step": 3e9,
        "hardware_flops_per_step": 3e9,
        "peak_source": "f32 matmul measured on 8 CPU devices (/c/cpu_peak.json)",
    }
    for fraction, stale in ((0.5, False), (1.26, True)):
        text = format_summary(summary | {"mfu": fraction, "hfu": fraction})
        assert ("delete cpu_peak.json" in text) is stale, text
    table = summary | {"mfu": 1.26, "hfu": 1.26, "peak_source": "H100 float32 peak from the table"}
    assert "delete cpu_peak.json" not in format_summary(table)
    assert "H100 float32 peak from the table is below what this device ran" in format_summary(table)


def test_an_mfu_above_100_percent_says_why_it_compares_with_nothing():
    """docs/training.md's bigram model of your own counts 6 × all its params per token, its
    embedding table too, which the step reads by lookup: 2.01× the matmuls it runs (a run's
    own figures below), so it printed MFU 121% (149% on another machine) without a word."""
    summary = {
        "steps": 60,
        "wall_time_s": 9.3,
        "median_step_time_s": 0.0681,
        "examples_per_s": 939.5,
        "first_step_s": 0.2,
        "eval_loss": None,
        "skipped_micro_batches": 0,
        "model_flops_per_step": 405012480.0,
        "hardware_flops_per_step": 201326592.0,
        "mfu": 1.212,
        "hfu": 0.6025,
        "peak_source": "f32 matmul measured on 8 CPU devices (/c/cpu_peak.json)",
    }
    lines = format_summary(summary).splitlines()
    at = next(i for i, line in enumerate(lines) if "MFU 121.2% (HFU 60.2%)" in line)
    assert lines[at + 1].startswith("  MFU above 100% is no share of the peak")
    assert "2.01× the matmul FLOPs the step runs" in lines[at + 1]
    assert "delete cpu_peak.json" not in "\n".join(lines)  # the peak is not what is wrong
    below = format_summary(summary | {"mfu": 0.99, "hfu": 0.49})
    assert "MFU above 100%" not in below
    none_run = format_summary(summary | {"hardware_flops_per_step": 0.0, "hfu": 0.0})
    assert "it runs no matmul" in none_run


def _train_cli(tmp_path, docs, *overrides):
    """`jaxkit train` in-process on prepared prompt/completion documents, one per row."""
    from jaxkit import cli
    from tests.small_configs import SMALL_LM
    from tests.token_dirs import write_prepared

    scored_eval = [([1], [2, 3])] * 8
    write_prepared(tmp_path / "data", {"train": docs, "eval": scored_eval})
    argv = ["train", "lm_tiny", *SMALL_LM, "data.seq_len=8", "data.source=tokens",
            f"data.path={tmp_path / 'data'}", "data.rows=documents", "model.vocab_size=257",
            "batch.global_batch_size=8", "batch.per_device_batch_size=1",
            "train.log_every=1", "train.eval_every=0", "checkpoint.every=0",
            *overrides, "--no-progress", "--workdir", str(tmp_path / "run")]  # fmt: skip
    return cli.main(argv)


# At data.seq_len=8 a row's targets are its document's tokens 1..8: a 12-byte prompt fills
# them all (weight 0); a 1-byte prompt leaves 2 completion bytes and the end (weight 3).
UNSCORED, SCORED = ([5] * 12, [6, 7]), ([1], [2, 3])


def test_a_train_split_that_scores_nothing_is_refused_before_training(tmp_path, capsys):
    code = _train_cli(tmp_path, [UNSCORED] * 40, "train.steps=3")
    err = capsys.readouterr().err
    assert code == 2 and "the 40 training rows score no target" in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_step_that_scores_nothing_is_logged_with_no_loss(tmp_path, capsys):
    """A global batch of prompts only has loss 0 / 0: null, never 0, and scored_targets
    says why; the steps that score something keep their loss."""
    import json

    import numpy as np

    from jaxkit.data.sources import global_batch_rows

    docs = [UNSCORED] * 72 + [SCORED] * 8
    steps = 6
    assert _train_cli(tmp_path, docs, f"train.steps={steps}") == 0
    out = capsys.readouterr().out
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    records = [r for r in map(json.loads, lines) if "loss" in r]
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    # Each step's rows, in the kit's data order; their weight from the documents themselves.
    weights = np.array([0 if d is UNSCORED else 3 for d in docs])
    expected = [int(weights[global_batch_rows(s, 8, 80, seed=0)].sum()) for s in range(steps)]
    assert 0 in expected and any(expected), expected  # the order gives both kinds of step
    assert [r["scored_targets"] for r in records] == expected
    for r, scored in zip(records, expected, strict=True):
        if scored:
            assert r["loss"] > 0, r
        else:
            assert r["loss"] is None, r
    assert out.count("loss none (no scored target)") == expected.count(0)


def test_the_unigram_baseline_covers_the_rows_the_eval_read(tmp_path, capsys):
    """train.eval_examples=8 evaluates 8 held-out rows: the baseline is their targets'
    entropy, not every held-out byte's."""
    import json

    import numpy as np

    from jaxkit import cli
    from tests.small_configs import SMALL_LM

    rng = np.random.default_rng(0)
    text = rng.integers(32, 127, size=10_000).astype(np.uint8)
    # The held-out tail (the last 10%) opens with 8 rows of 16 alternating bytes: their
    # targets (bytes 1..128) are 64 a's and 64 b's, entropy ln 2; the rest is near uniform.
    text[9000 : 9000 + 129] = np.frombuffer(b"ab" * 65, dtype=np.uint8)[:129]
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(text.tobytes())
    argv = ["train", "lm_tiny", *SMALL_LM, "data.source=text", f"data.path={corpus}",
            "data.eval_fraction=0.1", "batch.global_batch_size=8", "batch.per_device_batch_size=1",
            "train.steps=1", "train.eval_examples=8", "checkpoint.every=0",
            "--no-progress", "--workdir", str(tmp_path / "run")]  # fmt: skip
    assert cli.main(argv) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["unigram_entropy"] == pytest.approx(np.log(2), rel=1e-12)  # float64 sums
    assert "of the held-out bytes evaluated" in capsys.readouterr().out

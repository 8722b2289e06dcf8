"""What a finished run's summary says."""

from jaxkit.records import format_summary


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

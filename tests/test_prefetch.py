"""Batches loaded ahead on a background thread: the same batches, in the same order, as
loading each in the step's path; a wrong guess is reloaded, never handed out."""

import threading

import jax
import numpy as np
import pytest
from small_configs import SMALL_LM
from test_batch_schedule import quiet, ramped, train_records
from token_dirs import padded_prompt_completion

from jaxkit.config import apply_overrides, load_config
from jaxkit.data.prefetch import Prefetcher


class Loads:
    """A load function that records which thread loaded which key, under which plan."""

    def __init__(self, fail_on=None):
        self.calls, self.fail_on = [], fail_on

    def __call__(self, key, plan):
        self.calls.append((key, plan, threading.current_thread().name))
        if key == self.fail_on:
            raise OSError(f"cannot read {key}")
        return (key, plan)


def test_the_next_batches_load_on_the_thread_before_they_are_asked_for():
    loads = Loads()
    prefetcher = Prefetcher(loads, depth=2)
    assert prefetcher.get(0, "a", iter([(1, "a"), (2, "a"), (3, "a")])) == (0, "a")
    # Only the first `depth` of what comes next, loaded without another get().
    for key in (1, 2):
        assert prefetcher.pending[key].future.result(timeout=10) == (key, "a")
    assert set(prefetcher.pending) == {1, 2}
    assert prefetcher.get(1, "a", iter([(2, "a"), (3, "a")])) == (1, "a")
    assert prefetcher.get(2, "a", iter([(3, "a")])) == (2, "a")
    assert prefetcher.get(3, "a") == (3, "a")
    prefetcher.close()
    assert [c[0] for c in loads.calls] == [0, 1, 2, 3]  # each key loaded once, in order
    assert loads.calls[0][2] == threading.current_thread().name  # nothing ahead of it
    assert all(c[2].startswith("jaxkit-prefetch") for c in loads.calls[1:])
    assert prefetcher.misses == 0


def test_a_batch_loaded_under_another_plan_is_reloaded():
    """The auto ramp changed K after the loop guessed: the guess is not handed out."""
    loads = Loads()
    prefetcher = Prefetcher(loads, depth=2)
    prefetcher.get(0, "K=2", iter([(1, "K=2")]))
    prefetcher.pending[1].future.result(timeout=10)
    assert prefetcher.get(1, "K=4") == (1, "K=4")
    assert prefetcher.misses == 1
    prefetcher.close()


def test_a_load_error_reaches_the_loop_and_depth_zero_loads_inline():
    prefetcher = Prefetcher(Loads(fail_on=1), depth=2)
    prefetcher.get(0, "a", iter([(1, "a")]))
    with pytest.raises(OSError, match="cannot read 1"):
        prefetcher.get(1, "a")
    prefetcher.close()
    loads = Loads()
    inline = Prefetcher(loads, depth=0)
    inline.get(0, "a", iter([(1, "a")]))
    assert inline.pending == {} and len(loads.calls) == 1


@pytest.fixture(scope="module")
def padded_rows(tmp_path_factory):
    """Overrides for lm_tiny on padded prompt/completion rows that weigh 2 to 7 targets."""
    return padded_prompt_completion(tmp_path_factory.mktemp("padded"))


@pytest.mark.parametrize("accumulation", ["multisteps", "fused"])
def test_training_with_and_without_prefetch_is_the_same_run(accumulation, padded_rows):
    """Through a batch schedule (K = 1, 2, 4 over three stages): the loop's guesses cross
    stage boundaries, and every step sees the batches it would have loaded itself.

    Rows of unequal weight: a micro-batch's rows are the same under every stage (stages
    change only K), but its loss weights are scaled by its global batch's weight, so a
    micro-batch loaded under the stage before (equal-weight rows scale the same) trains
    another step."""
    runs = {}
    for depth in (0, 3):
        # ramped's stages on lm_tiny's rows: 8 devices × 4 rows, K = 1, 2, 4.
        config = ramped(f"train.prefetch={depth}", f"train.accumulation={accumulation}")
        config.model, config.data = load_config("lm_tiny").model, load_config("lm_tiny").data
        apply_overrides(
            config,
            # The noise scale's small batch is loaded apart from the prefetcher, and its
            # gradient is another program: off.
            [*SMALL_LM, *padded_rows, "train.noise_scale_every=0"],
        )
        result = quiet(config, devices=jax.devices()[:8])
        runs[depth] = result
    a, b = (train_records(runs[d]) for d in (0, 3))
    assert [r["grad_accum_steps"] for r in a][-1] == 4  # the ramp reached its last stage
    assert [r["loss"] for r in a] == [r["loss"] for r in b]  # bit for bit
    for x, y in zip(
        jax.tree.leaves(jax.device_get(runs[0].state.params)),
        jax.tree.leaves(jax.device_get(runs[3].state.params)),
        strict=True,
    ):
        np.testing.assert_array_equal(x, y)
    assert runs[3].summary["input_wait_s"] >= 0

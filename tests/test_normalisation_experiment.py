"""`jaxkit experiment normalisation` end to end: on padded rows its numbers are the runs'
own (the first step's losses recomputed here from the model's forward pass), its spreads
and distances are those of the curves it saved, and naive drifts by far more than the
exact runs' round-off; on rows that all weigh the same it says naive equals exact.

The CLI runs share a compilation cache: a split's naive run compiles the programs of its
exact run again, and the cache makes that a load, so the tests stay a few compiles long.
"""

import json

import jax
import numpy as np
import optax
import pytest
from cli_run import jaxkit  # in-process: what the command prints and writes
from flax import nnx
from small_configs import SMALL_LM
from test_equivalence import LOSS_RTOL
from test_experiments import _rows
from token_dirs import padded_prompt_completion

from jaxkit import experiments
from jaxkit.batch.schedule import plan_from_config
from jaxkit.config import apply_overrides, load_config, run_config
from jaxkit.data.sources import global_batch_rows, make_sources
from jaxkit.experiments import Split, normalisation
from jaxkit.mesh import make_mesh, mesh_shape
from jaxkit.models import build_model
from jaxkit.step.train_step import build

SMALL = [*SMALL_LM, "batch.global_batch_size=32", "optimizer.warmup_steps=2"]
# K = 1 on 8 devices and K = 8 on 4: the exact runs agree across both K and the device
# count, and naive drifts between them. A third split would add two runs and the
# compiles of its K while asking nothing new (default_splits is tested on its own below).
SPLITS = "8x4x1,4x1x8"
STEPS = 4


@pytest.fixture(scope="module")
def padded(tmp_path_factory):
    """Overrides that train on padded prompt/completion documents of 2 to 7 targets."""
    return padded_prompt_completion(tmp_path_factory.mktemp("prompt_completion"))


def first_step_losses(overrides, accums):
    """Step 1's exact loss and each K's naive one, from the initial params' forward pass on
    the global batch: Σ w·loss / Σ w, and the mean over K micro-batches of the same."""
    config = load_config("lm_tiny")
    # The 8×4×1 split's mesh and plan: its init program, which the experiment compiled,
    # comes from the compile cache (every split starts from the same params).
    apply_overrides(config, [*SMALL, *overrides, "batch.per_device_batch_size=4"])
    mesh = make_mesh(config.mesh.to_dict(), jax.devices()[:8])
    setup = build(run_config(config), plan_from_config(run_config(config), mesh_shape(mesh)), mesh)
    params = jax.device_get(setup.init(jax.random.key(config.train.seed)).params)
    with nnx.use_eager_sharding(False):
        graphdef, _ = nnx.split(
            nnx.eval_shape(lambda: build_model(run_config(config), nnx.Rngs(0)))
        )
    source, _ = make_sources(run_config(config))
    batch = source[global_batch_rows(0, 32, len(source), config.train.seed)]
    # One compiled forward pass and cross-entropy on one device, not an op at a time.
    forward = jax.jit(
        lambda p, x, t: optax.softmax_cross_entropy_with_integer_labels(
            nnx.merge(graphdef, p)(x), t
        )
    )
    params = jax.device_put(params, jax.devices()[0])
    token_loss = np.asarray(forward(params, batch["inputs"], batch["targets"]), np.float64)
    row_loss = (batch["weights"] * token_loss).sum(axis=1)
    row_weight = batch["weights"].sum(axis=1, dtype=np.float64)
    naive = {}
    for k in accums:  # micro-batch m holds global rows [m·32/K, (m+1)·32/K)
        micro_loss = row_loss.reshape(k, -1).sum(axis=1)
        micro_weight = row_weight.reshape(k, -1).sum(axis=1)
        naive[k] = float(np.mean(micro_loss / micro_weight))
    return row_loss.sum() / row_weight.sum(), naive


def test_naive_drifts_with_k_on_padded_rows_and_exact_does_not(padded, tmp_path):
    out = tmp_path / "norm"
    done = jaxkit(
        "experiment", "normalisation", "lm_tiny", *SMALL, *padded,
        "--steps", str(STEPS), "--splits", SPLITS, "--out", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    numbers = json.loads((out / "normalisation.json").read_text())
    runs = numbers["runs"]
    assert [(r["split"], r["normalisation"]) for r in runs] == [
        (s, n) for s in ("8×4×1", "4×1×8") for n in ("exact", "naive")
    ]
    assert numbers["runs_done"] == numbers["runs_planned"] == 4
    curves = {(r["split"], r["normalisation"]): np.array(r["losses"]) for r in runs}
    assert all(len(c) == STEPS for c in curves.values())

    # Step 1 trains from the same params everywhere: its loss is the forward pass's.
    exact_1, naive_1 = first_step_losses(padded, [1, 8])
    for r in runs:
        want = exact_1 if r["normalisation"] == "exact" else naive_1[r["grad_accum_steps"]]
        assert r["losses"][0] == pytest.approx(want, rel=LOSS_RTOL), r["split"]
    assert abs(naive_1[8] / exact_1 - 1) > 1e-3  # the premise: rows weigh differently

    # The summary, recomputed from the curves.
    ref = curves[("8×4×1", "exact")]
    for norm in ("exact", "naive"):
        spread = np.ptp(np.stack([c for (_, n), c in curves.items() if n == norm]), axis=0)
        assert numbers[f"{norm}_spread"]["abs"] == pytest.approx(spread.max(), rel=1e-12)
        assert numbers[f"{norm}_spread"]["rel"] == pytest.approx((spread / ref).max(), rel=1e-12)
    exact_spread, naive_spread = numbers["exact_spread"], numbers["naive_spread"]
    assert numbers["naive_spread_over_exact_spread"] == pytest.approx(
        naive_spread["abs"] / exact_spread["abs"]
    )
    for r in runs:
        diff = np.abs(curves[(r["split"], r["normalisation"])] - ref)
        assert r["max_abs_diff_vs_reference"] == pytest.approx(diff.max(), rel=1e-12)
        assert r["max_rel_diff_vs_reference"] == pytest.approx((diff / ref).max(), rel=1e-12)
        assert r["final_loss"] == r["losses"][-1]
    # The claims: K = 1 is exact by construction; exact agrees to round-off (test_equivalence
    # bounds it by LOSS_RTOL); naive moves with K by far more. Measured: exact 7.9e-8
    # relative, naive 3.5e-3, 45,000× the exact spread.
    np.testing.assert_array_equal(curves[("8×4×1", "naive")], ref)
    assert exact_spread["rel"] < LOSS_RTOL
    assert naive_spread["abs"] > 100 * exact_spread["abs"]
    assert naive_spread["rel"] > 1e-3
    assert not numbers["naive_equals_exact"]
    assert numbers["row_weights"]["min"] < numbers["row_weights"]["max"]

    # The report's table is the JSON's numbers.
    report = (out / "report.md").read_text()
    rows = _rows(report, "split")
    assert len(rows) == len(runs)
    for row, r in zip(rows, runs, strict=True):
        assert row[:3] == [r["split"], str(r["grad_accum_steps"]), r["normalisation"]]
        assert float(row[3]) == pytest.approx(r["final_loss"], abs=5e-7)
        assert float(row[4]) == pytest.approx(r["eval_loss"], abs=5e-7)
        assert float(row[5]) == pytest.approx(r["max_abs_diff_vs_reference"], rel=5e-3, abs=0)
        assert float(row[6]) == pytest.approx(r["max_rel_diff_vs_reference"], rel=5e-3, abs=0)
    spreads = {r[0]: r for r in _rows(report, "spread across splits (max over steps of max − min)")}
    assert float(spreads["exact runs (round-off)"][1]) == pytest.approx(
        exact_spread["abs"], rel=5e-3
    )
    assert float(spreads["naive runs"][1]) == pytest.approx(naive_spread["abs"], rel=5e-3)
    ratio = numbers["naive_spread_over_exact_spread"]
    assert f"Naive curves differ by up to {naive_spread['abs']:.2e}" in report
    assert f"{ratio:,.0f}× the exact runs' spread" in report
    assert "Naive equals exact" not in report and "Partial" not in report
    assert (out / "loss_curves.png").stat().st_size > 0


def test_on_rows_that_weigh_the_same_the_report_says_naive_equals_exact(tmp_path):
    out = tmp_path / "norm"
    # The padded rows' vocabulary (bytes take 256 of its 257): the programs of this split
    # are the ones the test above compiled, loaded from the compile cache. One split with
    # K > 1 is what the claim needs: with K = 1, naive is exact whatever the rows weigh.
    done = jaxkit(
        "experiment", "normalisation", "lm_tiny", *SMALL, "model.vocab_size=257",
        "--steps", "3", "--splits", "4x1x8", "--out", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    numbers = json.loads((out / "normalisation.json").read_text())
    curves = {(r["split"], r["normalisation"]): r["losses"] for r in numbers["runs"]}
    # Every row weighs seq_len = 16: each micro-batch's own mean is the global one, the
    # loader's scales are the same floats, and naive trains bit for bit as exact does.
    assert list(curves) == [("4×1×8", "exact"), ("4×1×8", "naive")]
    np.testing.assert_array_equal(curves[("4×1×8", "naive")], curves[("4×1×8", "exact")])
    assert numbers["naive_equals_exact"]
    assert numbers["row_weights"] == {"rows": 96, "min": 16.0, "max": 16.0, "mean": 16.0}
    report = (out / "report.md").read_text()
    assert "**Naive equals exact here:**" in report
    assert "The rows of this config all weigh the same (16 targets each)" in report
    assert "Naive curves differ" not in report

    refused = jaxkit("experiment", "normalisation", "lm_tiny", "--splits", "4x4x1", "--out", "x")
    assert refused.returncode == 2 and "not the config's 64" in refused.stderr
    refused = jaxkit("experiment", "normalisation", "lm_tiny", "--lr-scaling", "sqrt")
    assert refused.returncode == 2 and "--lr-scaling applies to experiment" in refused.stderr


def test_ctrl_c_leaves_a_partial_report_with_the_runs_done(padded, tmp_path, monkeypatch):
    calls = []
    real = normalisation.train_split

    def train_then_interrupt(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(normalisation, "train_split", train_then_interrupt)
    config = load_config("lm_tiny")
    apply_overrides(config, [*SMALL, *padded])
    with pytest.raises(experiments.Interrupted):
        experiments.run(
            "normalisation", config, tmp_path, experiments.Options(steps=2, splits=SPLITS)
        )
    report = (tmp_path / "report.md").read_text()
    assert "interrupted after 1 of 4 runs" in report
    assert [r[:3] for r in _rows(report, "split")] == [["8×4×1", "1", "exact"]]
    assert "No naive run has finished yet." in report
    numbers = json.loads((tmp_path / "normalisation.json").read_text())
    assert (numbers["runs_done"], numbers["runs_planned"]) == (1, 4)


def test_a_stop_before_the_first_run_leaves_no_earlier_experiments_numbers(tmp_path, monkeypatch):
    # OUT holds a finished experiment's report and numbers; this one is stopped as its first
    # run trains, before any drawing.
    (tmp_path / "report.md").write_text("# an earlier experiment's report\n")
    earlier = {"runs_done": 4, "runs_planned": 4, "steps": 20}
    (tmp_path / "normalisation.json").write_text(json.dumps(earlier))

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(normalisation, "train_split", interrupt)
    options = experiments.Options(steps=2, splits="8x4x1,8x2x2")
    with pytest.raises(experiments.Interrupted):
        experiments.run("normalisation", load_config("mlp_digits"), tmp_path, options)
    assert "interrupted after 0 of 4 runs" in (tmp_path / "report.md").read_text()
    # It stayed, 4 of 4 runs done, beside the report of this one's 0.
    assert not (tmp_path / "normalisation.json").exists()


@pytest.mark.parametrize(
    "global_batch,live,want",
    [
        (32, 8, "8×4×1 8×2×2 8×1×4 4×1×8"),
        (64, 8, "8×8×1 8×4×2 8×2×4 4×2×8"),
        (32, 6, "4×8×1 4×4×2 4×2×4 2×2×8"),  # the most devices that take 4 rows each
        (12, 3, "3×4×1 3×2×2 3×1×4 1×1×12"),
        (8, 1, "1×8×1 1×4×2 1×2×4"),  # no fewer devices
    ],
)
def test_default_splits_vary_k_on_the_live_devices(global_batch, live, want):
    splits = normalisation.default_splits(global_batch, live)
    assert " ".join(s.name for s in splits) == want
    assert all(s.devices * s.per_device * s.accum == global_batch for s in splits)


def test_default_splits_refuse_a_batch_four_does_not_divide():
    with pytest.raises(experiments.ExperimentError, match="give --splits"):
        normalisation.default_splits(30, 8)


def test_with_k_1_everywhere_the_verdict_says_naive_is_exact_by_construction():
    a, b = Split(8, 4, 1), Split(4, 8, 1)
    curve = np.array([3.0, 2.5, 2.0])
    losses = {
        normalisation.Unit(a, "exact"): curve,
        normalisation.Unit(a, "naive"): curve,
        normalisation.Unit(b, "exact"): curve + 1e-7,
        normalisation.Unit(b, "naive"): curve + 1e-7,
    }
    numbers = normalisation.summarise(losses, dict.fromkeys(losses, 1.0), a)
    assert numbers["naive_equals_exact"]
    assert numbers["exact_spread"]["abs"] == pytest.approx(1e-7, rel=1e-6)
    weights = np.array([3.0, 9.0])  # rows that weigh differently: K = 1 still makes it exact
    said = normalisation.verdict(numbers, [a, b], weights)
    assert said.startswith("**Naive equals exact here:**") and "every split has K = 1" in said


def test_a_step_that_scores_nothing_gives_no_relative_number_not_nan():
    """A global batch of prompts only is logged with loss null: read as NaN, every
    comparison skips that step, and the JSON stays valid (null where the log has null)."""
    a, b = Split(8, 4, 1), Split(8, 1, 4)

    def logged(*losses):
        return normalisation.step_losses([{"loss": x, "step": i} for i, x in enumerate(losses)])

    ref = logged(None, 2.0, 1.0)
    losses = {
        normalisation.Unit(a, "exact"): ref,
        normalisation.Unit(a, "naive"): ref,
        normalisation.Unit(b, "exact"): ref + 1e-7,
        normalisation.Unit(b, "naive"): logged(None, 2.2, 1.05),
    }
    numbers = normalisation.summarise(losses, dict.fromkeys(losses, 1.0), a)
    text = json.dumps(numbers, allow_nan=False)  # raises on NaN or inf
    assert numbers["naive_spread"]["rel"] == pytest.approx(0.1)  # 0.2 / 2.0, step 0 skipped
    assert numbers["naive_spread"]["abs"] == pytest.approx(0.2)
    worst = max(r["max_rel_diff_vs_reference"] for r in numbers["runs"])
    assert worst == pytest.approx(0.1) and "NaN" not in text
    assert all(r["losses"][0] is None for r in numbers["runs"])
    zero = {u: np.zeros(3) for u in losses}  # scored steps with loss 0: nothing relative
    numbers = normalisation.summarise(zero, dict.fromkeys(losses, 0.0), a)
    assert numbers["naive_spread"]["rel"] is None
    json.dumps(numbers, allow_nan=False)

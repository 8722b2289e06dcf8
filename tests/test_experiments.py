"""Each experiment end to end on the digits MLP: its report's tables say what they should."""

import os
import re
import signal
import sys

import doc_blocks
import numpy as np
import pytest
from cli_run import jaxkit, python_c

from jaxkit import experiments
from jaxkit.config import apply_overrides, load_config
from jaxkit.experiments import common, equivalence
from jaxkit.train.loop import train


def _digits(*overrides):
    config = load_config("mlp_digits")
    apply_overrides(config, list(overrides))
    return config


def _rows(report: str, first_header: str) -> list[list[str]]:
    """The body rows of the Markdown table whose header starts with `first_header`."""
    lines = report.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first_header} |"))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def test_equivalence_overlays_the_seed_splits_and_finds_them_equal(tmp_path):
    command = "jaxkit experiment equivalence mlp_digits --steps 10"
    out = jaxkit(*command.split()[1:], "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr
    report = (tmp_path / "report.md").read_text()
    rows = _rows(report, "split")
    assert [r[0] for r in rows] == ["1×32×1", "4×8×1", "2×8×2", "1×8×4"]
    # The kit's equivalence tolerance (tests/test_equivalence.py): 2e-6 relative loss.
    assert all(float(r[3]) < 2e-6 for r in rows)
    assert all(r[6].endswith("KiB") for r in rows)  # compiled memory per device
    assert (tmp_path / "loss_curves.png").stat().st_size > 0
    assert "Partial" not in report
    # The command prints the table report.md holds.
    table = [line for line in report.splitlines() if line.startswith("|")]
    printed = out.stdout.splitlines()
    assert printed[-len(table) - 1 : -1] == table
    assert printed[-1] == f"report: {(tmp_path / 'report.md').resolve()}"

    # docs/experiments.md's block, line by line, paths aside. Final losses within 2e-6
    # relative: the tests' compile flags may reorder float32 sums, as the splits do; the
    # differences are round-off, held under that tolerance; memory within 0.5%, as in
    # docs/batch-plan.md; the step times are one machine's, which the page says.
    shown = doc_blocks.shown("docs/experiments.md", command)
    assert len(shown) == len(printed)
    for expected, line in zip(shown, printed, strict=True):
        if not expected.startswith("| ") or expected.startswith("| split"):
            head = expected.split(" /", 1)[0]  # up to the output directory, whose path varies
            assert doc_blocks.same_line(head, line.split(" /", 1)[0], 2e-6), (expected, line)
            continue
        want, got = _cells(expected), _cells(line)
        assert got[0] == want[0]
        assert float(got[1]) == pytest.approx(float(want[1]), rel=2e-6), (expected, line)
        assert float(want[3]) < 2e-6 and float(got[3]) < 2e-6
        assert _kib(got[6]) == pytest.approx(_kib(want[6]), rel=0.005), (expected, line)


def _cells(row: str) -> list[str]:
    return [cell.strip() for cell in row.strip("|").split("|")]


def _kib(cell: str) -> float:
    value, unit = cell.split()
    return float(value) * {"KiB": 1, "MiB": 1024}[unit]


def test_equivalence_runs_the_splits_on_the_configs_mesh(tmp_path):
    options = experiments.Options(steps=2, splits="4x8x1,2x8x2")
    quiet = {"echo": lambda s: None}
    fsdp = experiments.run(
        "equivalence", _digits("mesh.data=1", "mesh.fsdp=-1"), tmp_path / "f", options, **quiet
    ).read_text()
    assert "4×8×1 on 1×4×1, 2×8×2 on 1×2×1" in fsdp
    data = experiments.run("equivalence", _digits(), tmp_path / "d", options, **quiet).read_text()
    assert "4×8×1 on 4×1×1, 2×8×2 on 2×1×1" in data
    # The same split holds less per device when fsdp shards the state...
    assert _kib(_rows(fsdp, "split")[0][6]) < _kib(_rows(data, "split")[0][6])
    # ... and trains the same model.
    assert all(float(r[3]) < 2e-6 for r in _rows(fsdp, "split"))


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["mesh.tensor=2"], "split 4×8×1: a split's 4 devices are its data-parallel ranks"),
        (["mesh.data=4"], "split 2×8×2: mesh data=4 × fsdp=1 × tensor=1 has"),
        (["mesh.data=1", "mesh.fsdp=-1", "model.hidden_size=126"], "split 4×8×1: model.hidden"),
    ],
)
def test_equivalence_refuses_a_mesh_a_split_cannot_take_before_training(
    tmp_path, overrides, message
):
    with pytest.raises(experiments.ExperimentError, match=message):
        experiments.run(
            "equivalence",
            _digits(*overrides),
            tmp_path,
            experiments.Options(steps=2, splits="4x8x1,2x8x2"),
        )
    assert not (tmp_path / "report.md").exists()  # refused before any split trained


def _second_split_raises(monkeypatch, error: BaseException) -> None:
    """equivalence trains its first split, then raises `error` as the second starts."""
    calls = []
    real = equivalence.train_split

    def train_then_raise(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise error
        return real(*args, **kwargs)

    monkeypatch.setattr(equivalence, "train_split", train_then_raise)


def test_ctrl_c_leaves_a_partial_report_that_says_so(tmp_path, monkeypatch):
    _second_split_raises(monkeypatch, KeyboardInterrupt())
    with pytest.raises(experiments.Interrupted):
        experiments.run("equivalence", _digits(), tmp_path, experiments.Options(steps=2))
    report = (tmp_path / "report.md").read_text()
    assert "interrupted after 1 of 4 splits" in report
    assert [r[0] for r in _rows(report, "split")] == ["1×32×1"]


def test_an_error_leaves_a_partial_report_that_names_it(tmp_path, monkeypatch):
    _second_split_raises(monkeypatch, RuntimeError("the second split broke"))
    with pytest.raises(RuntimeError, match="the second split broke"):
        experiments.run("equivalence", _digits(), tmp_path, experiments.Options(steps=2))
    report = (tmp_path / "report.md").read_text()
    assert "stopped by an error after 1 of 4 splits (RuntimeError)" in report
    assert "still running" not in report
    assert [r[0] for r in _rows(report, "split")] == ["1×32×1"]


def test_a_running_report_is_redrawn_when_redraw_seconds_have_passed_and_at_the_end(
    tmp_path, monkeypatch
):
    clock = [0.0]
    monkeypatch.setattr(common.time, "monotonic", lambda: clock[0])
    report = common.Report(tmp_path, "units")
    drawn: list[list[int]] = []
    seen: list[str] = []  # report.md as each unit starts
    done: list[int] = []

    def do_unit(unit: int) -> None:
        path = tmp_path / "report.md"
        seen.append(path.read_text() if path.exists() else "")
        clock[0] += 20.0  # each unit takes 20 s: two of them pass REDRAW_SECONDS (30 s)
        done.append(unit)

    def render(r: common.Report) -> None:
        drawn.append(list(done))
        r.text(f"units done: {done}")

    common.drive(report, [1, 2, 3, 4], do_unit, render, "units", echo=lambda _: None)
    assert common.REDRAW_SECONDS == 30.0
    assert drawn == [[1, 2], [1, 2, 3, 4]]  # at 40 s (not 20 s, nor 60 s), and at the end
    # Written at once, before any unit: a report left in the directory by an earlier
    # experiment does not pass for this one's; no figure yet.
    assert "0 of 4 units done, still running" in seen[0] and "units done:" not in seen[0]
    assert seen[1] == seen[0]  # unit 1 ended at 20 s: not redrawn
    assert "2 of 4 units done, still running" in seen[2]
    assert "units done: [1, 2]" in seen[3]  # unit 3 ended 20 s after the drawing: kept
    final = (tmp_path / "report.md").read_text()
    assert "units done: [1, 2, 3, 4]" in final and "Partial" not in final


def test_ctrl_c_during_the_last_drawing_leaves_a_report_that_says_so(tmp_path):
    report = common.Report(tmp_path, "units")
    drawings: list[int] = []

    def render(r: common.Report) -> None:
        drawings.append(1)
        if len(drawings) == 1:  # the drawing after the last unit, a long one on a CPU
            raise KeyboardInterrupt
        r.text("both units drawn")

    with pytest.raises(experiments.Interrupted):
        common.drive(report, [1, 2], lambda _: None, render, "units", echo=lambda _: None)
    text = (tmp_path / "report.md").read_text()
    assert "interrupted after 2 of 2 units" in text and "both units drawn" in text


def test_sigterm_between_units_leaves_a_report_that_says_so(tmp_path):
    report = common.Report(tmp_path, "units")
    done: list[int] = []
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

    def do_unit(unit: int) -> None:
        if unit == 2:  # a job's SIGTERM (a requeue, a preemption) outside any training
            signal.raise_signal(signal.SIGTERM)
        done.append(unit)

    with pytest.raises(experiments.Interrupted) as stop:
        common.drive(report, [1, 2, 3], do_unit, lambda r: None, "units", echo=lambda _: None)
    assert stop.value.signal_name == "SIGTERM" and done == [1]
    text = (tmp_path / "report.md").read_text()
    assert "terminated (SIGTERM) after 1 of 3 units" in text
    assert {sig: signal.getsignal(sig) for sig in before} == before  # the caller's are back


class _CollectedWithACtrlC:
    """Its finalizer runs the handler, as jax's garbage-collection callback may: Python hands
    the KeyboardInterrupt raised there to sys.unraisablehook and drops it."""

    def __del__(self) -> None:
        signal.raise_signal(signal.SIGINT)


def test_a_ctrl_c_whose_exception_was_dropped_still_stops_the_experiment(tmp_path, monkeypatch):
    report = common.Report(tmp_path, "units")
    done: list[int] = []
    printed: list[BaseException | None] = []  # what Python would print as "Exception ignored"
    monkeypatch.setattr(sys, "unraisablehook", lambda args: printed.append(args.exc_value))

    def do_unit(unit: int) -> None:
        if unit == 1:
            _CollectedWithACtrlC()  # dropped at once
        done.append(unit)

    with pytest.raises(experiments.Interrupted) as stop:
        common.drive(report, [1, 2, 3], do_unit, lambda r: None, "units", echo=lambda _: None)
    assert stop.value.signal_name == "SIGINT" and done == [1]  # unit 2 never started
    assert "interrupted after 1 of 3 units" in (tmp_path / "report.md").read_text()
    # The stop is handled: its dropped exception printed a traceback of the handler (as
    # "Exception ignored in: <function _xla_gc_callback ...>") before the stop's own line.
    assert printed == []


def test_a_ctrl_c_dropped_during_the_last_drawing_still_stops_the_experiment(tmp_path, monkeypatch):
    """Every unit is done and the final drawing runs when the Ctrl-C comes, inside a
    finalizer, so Python drops its exception: the experiment stops all the same (exit 130
    from the command), with a report that says so, instead of returning as finished."""
    report = common.Report(tmp_path, "units")
    monkeypatch.setattr(sys, "unraisablehook", lambda args: None)
    drawings: list[int] = []

    def render(r: common.Report) -> None:
        drawings.append(1)
        if len(drawings) == 1:  # the drawing after the last unit
            _CollectedWithACtrlC()  # dropped at once
        r.text("both units drawn")

    with pytest.raises(experiments.Interrupted) as stop:
        common.drive(report, [1, 2], lambda _: None, render, "units", echo=lambda _: None)
    assert stop.value.signal_name == "SIGINT"
    text = (tmp_path / "report.md").read_text()
    assert "interrupted after 2 of 2 units" in text and "both units drawn" in text


def test_a_ctrl_c_at_a_units_last_step_stops_the_experiment(tmp_path):
    sent = []

    def press_ctrl_c(line):  # the last step's line, once the loop is past its last stop check
        if line.startswith("step      3  loss") and not sent:
            sent.append(True)
            os.kill(os.getpid(), signal.SIGINT)

    config = _digits("train.steps=3", "train.log_every=1", "train.eval_every=0")
    result = train(config, None, progress=False, echo=press_ctrl_c)
    # The run itself finishes (nothing is left to resume), but says a stop came ...
    assert sent and not result.stopped and result.stop_requests == ("SIGINT",)
    # ... which an experiment training its next unit must not drop.
    with pytest.raises(experiments.Interrupted) as stop:
        common.stopped_by(result)
    assert stop.value.signal_name == "SIGINT"


# `jaxkit experiment` as the console script runs it; SIGTERM as the second split starts.
SIGTERM_AT_SECOND_SPLIT = r"""
import signal, sys

from jaxkit import cli
from jaxkit.experiments import equivalence

real, calls = equivalence.train_split, []


def train_split(*args, **kwargs):
    calls.append(1)
    if len(calls) == 2:
        signal.raise_signal(signal.SIGTERM)
    return real(*args, **kwargs)


equivalence.train_split = train_split
sys.exit(cli.main(sys.argv[1:]))
"""


def test_sigterm_in_an_experiment_exits_143_with_a_partial_report(tmp_path):
    argv = ["experiment", "equivalence", "mlp_digits", "--steps", "2"]
    argv += ["--splits", "1x32x1,2x16x1", "--out", str(tmp_path)]
    done = python_c(SIGTERM_AT_SECOND_SPLIT, *argv)
    assert done.returncode == 143, done.stderr[-2000:]
    report = tmp_path / "report.md"
    assert done.stdout.splitlines()[-1] == (
        f"terminated (SIGTERM): partial report at {report.resolve()}"
    )
    text = report.read_text()
    assert "terminated (SIGTERM) after 1 of 2 splits" in text
    assert [r[0] for r in _rows(text, "split")] == ["1×32×1"]


# `jaxkit experiment` as the console script runs it; the signal in ARGV[1] comes while the
# splits are checked, before the first trains, and its KeyboardInterrupt (if any) is dropped
# as a garbage-collection callback drops it ("Exception ignored"): timing alone decided that.
STOP_DURING_THE_CHECKS = r"""
import contextlib, signal, sys

from jaxkit import cli
from jaxkit.experiments import equivalence

real, name = equivalence.check_splits, sys.argv.pop(1)


def check_splits(*args, **kwargs):
    with contextlib.suppress(KeyboardInterrupt):
        signal.raise_signal(getattr(signal, name))
    return real(*args, **kwargs)


equivalence.check_splits = check_splits
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.mark.parametrize(
    "name, code, line",
    [
        ("SIGINT", 130, "jaxkit: interrupted"),
        ("SIGTERM", 143, "jaxkit: terminated (SIGTERM) before training started: nothing to save"),
    ],
)
def test_a_stop_before_the_first_unit_leaves_at_once_with_its_status(tmp_path, name, code, line):
    out = tmp_path / "out"
    argv = ["experiment", "equivalence", "mlp_digits", "--steps", "2"]
    argv += ["--splits", "1x32x1,2x16x1", "--out", str(out)]
    done = python_c(STOP_DURING_THE_CHECKS, name, *argv)
    # Ctrl-C trained every split and exited 0; SIGTERM killed the process without a word.
    assert done.returncode == code, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1] == line
    assert not out.exists() and "writing" not in done.stdout


class _Left(Exception):  # noqa: N818 — stands for the process leaving, as Python's default does
    pass


def test_a_stop_as_the_report_is_announced_leaves_that_report(tmp_path):
    def leave(signum, frame):
        raise _Left

    previous = signal.signal(signal.SIGINT, leave)  # what was in place before the report
    try:
        report = common.Report(tmp_path / "out", "units")
        assert not (tmp_path / "out").exists()  # made by the first write, not before
        done: list[int] = []

        def echo(line: str) -> None:  # Ctrl-C as the report's path is printed
            signal.raise_signal(signal.SIGINT)

        with pytest.raises(experiments.Interrupted):
            common.drive(report, [1, 2], done.append, lambda r: None, "units", echo=echo)
        assert signal.getsignal(signal.SIGINT) is leave
    finally:
        signal.signal(signal.SIGINT, previous)
    assert done == []
    text = (tmp_path / "out" / "report.md").read_text()
    assert "interrupted after 0 of 2 units" in text


def test_a_global_batch_size_given_twice_is_refused_before_any_training(tmp_path):
    options = experiments.Options(steps=2, global_batch_sizes="40,16,16")
    with pytest.raises(
        experiments.ExperimentError, match="--global-batch-sizes: 16 is given twice"
    ):
        experiments.run("batch-size", _digits(), tmp_path / "twice", options)
    assert not (tmp_path / "twice").exists()


@pytest.mark.parametrize("name", ["equivalence", "normalisation"])
def test_a_split_given_twice_is_refused_before_any_training(tmp_path, name):
    out = tmp_path / "twice"
    done = jaxkit(
        "experiment", name, "mlp_digits", "--splits", "1x32x1,4x8x1,1x32x1",
        "--steps", "2", "--out", str(out),
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].endswith("--splits: 1×32×1 is given twice")
    assert not out.exists()


@pytest.mark.parametrize("bad", ["0x32x1", "4x-8x1", "4x8x0"])
def test_a_split_with_a_factor_below_one_is_refused_as_such(tmp_path, bad):
    out = tmp_path / "out"
    done = jaxkit(
        "experiment", "equivalence", "mlp_digits", "--splits", f"4x8x1,{bad}", "--out", str(out)
    )
    # It said "split 0×32×1 makes a global batch of 0, not the config's 32" (-32 for
    # 4×-8×1), where --global-batch-sizes says a batch must be positive.
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        f"jaxkit: error: --splits: {bad!r}: devices, per-device batch and accumulation steps "
        "must each be at least 1"
    )
    assert not out.exists()


def test_a_global_batch_size_the_mesh_cannot_split_is_refused_not_dropped(tmp_path):
    out = tmp_path / "out"
    done = jaxkit(
        "experiment", "batch-size", "mlp_digits", "--global-batch-sizes", "30,32",
        "--steps", "2", "--out", str(out),
    )  # fmt: skip
    # 30 rows on 8 devices: it trained 32 alone, exited 0 and said so only in report.md.
    assert done.returncode == 2, done.stdout
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("jaxkit: error: --global-batch-sizes: 30: ") and "16, 24, 32" in last
    assert not out.exists()


def test_batch_size_says_what_a_batch_that_does_not_divide_the_budget_trains(tmp_path, capsys):
    options = experiments.Options(steps=3, global_batch_sizes="40,16")
    report = experiments.run("batch-size", _digits(), tmp_path, options).read_text()
    progress = capsys.readouterr().err
    assert "global batch 40" in progress and "learning_rate" not in progress  # not the config
    # 3 steps × 32 = 96 examples: 40 trains 2 whole steps (80 examples), 16 six (96).
    assert "Every run sees" not in report
    assert "16: 6 steps, 96 examples, 40: 2 steps, 80 examples" in report


def test_equivalence_relative_loss_difference_is_each_steps_not_the_curves():
    ref, other = equivalence.Split(1, 32, 1), equivalence.Split(4, 8, 1)
    run = {"params": {"w": np.zeros(2)}, "step_s": None, "memory": None}
    results = {
        ref: {**run, "losses": np.array([100.0, 1.0])},
        other: {**run, "losses": np.array([100.0, 1.1])},
    }
    _, worst_loss, _ = equivalence._splits_table(results, ref)
    # 0.1 off a loss of 1 is 10%, whatever the first step's loss was (not 0.1 / 100).
    assert worst_loss == pytest.approx(0.1)


def test_memory_is_flat_in_accumulation_and_grows_with_the_batch(tmp_path):
    options = experiments.Options(max_per_device_batch=8, rss_points=1)
    report = experiments.run("memory", _digits(), tmp_path, options).read_text()
    parts = dict((r[0], r[1]) for r in _rows(report, "part"))
    assert parts["MultiSteps accumulator (acc_grads), at K > 1"] == parts["params"]
    by_batch = _rows(report, "per_device_batch_size")
    assert [r[0] for r in by_batch] == ["1", "2", "4", "8"]
    sizes = [_kib(r[1]) for r in by_batch]
    assert sizes == sorted(sizes) and sizes[0] < sizes[-1]
    by_accum = _rows(report, "grad_accum_steps")
    assert [r[0] for r in by_accum] == ["1", "2", "4", "8"]
    # MultiSteps: the same program for every K > 1; K = 1 holds no accumulator, at least
    # its bytes less.
    assert len({r[1] for r in by_accum[1:]}) == 1
    assert _kib(by_accum[0][1]) <= _kib(by_accum[1][1]) - _kib(parts["params"])
    measured = _rows(report, "per_device_batch_size | compiled estimate")
    assert len(measured) == 1 and _kib(measured[0][2]) > 0
    for name in ("memory_vs_batch.png", "memory_vs_accum.png"):
        assert (tmp_path / name).stat().st_size > 0


def _kib(text: str) -> float:
    value, unit = text.split()
    return float(value) * {"B": 1 / 1024, "KiB": 1, "MiB": 1024, "GiB": 1024**2}[unit]


def test_throughput_sweeps_batch_and_accumulation(tmp_path):
    options = experiments.Options(steps=2, max_per_device_batch=2)
    report = experiments.run("throughput", _digits(), tmp_path, options).read_text()
    rows = _rows(report, "per_device_batch_size")
    got = [(int(r[0]), int(r[1]), int(r[2])) for r in rows]
    # b = 1, 2 at K = 1, then K = 2, 4, 8 at the configured b = 4; G = 8 devices × b × K.
    assert got == [(1, 1, 8), (2, 1, 16), (4, 2, 64), (4, 4, 128), (4, 8, 256)]
    assert all(float(r[4].replace(",", "")) > 0 and r[6].endswith("%") for r in rows)
    assert (tmp_path / "throughput.png").stat().st_size > 0
    predicted, measured = [int(r[9]) for r in rows], [int(r[10]) for r in rows]
    assert sorted(predicted) == sorted(measured) == [1, 2, 3, 4, 5]
    # No remat for an MLP: the planner ranks the widest per-device batch first, then the
    # fewest accumulation steps at one batch.
    assert [int(r[9]) for r in rows if int(r[1]) == 1] == [5, 4]
    assert [int(r[9]) for r in rows if int(r[0]) == 4] == [1, 2, 3]
    # Measured: model FLOP/s = model FLOPs per step / step time; the ranks follow them.
    rates = [float(r[4].replace(",", "")) for r in rows]  # examples/s ∝ model FLOP/s here
    assert [rates.index(x) for x in sorted(rates, reverse=True)] == [
        measured.index(i) for i in range(1, 6)
    ]
    assert "agree on" in report


def test_throughput_ranks_remat_policies_of_a_language_model(tmp_path, monkeypatch):
    from jaxkit.experiments import throughput

    # The remat points run at K = 1; the accumulation sweep (K = 2, 4, 8 at the config's
    # policy) is test_throughput_sweeps_batch_and_accumulation's claim, not this one's.
    monkeypatch.setattr(throughput, "ACCUM_SWEEP", (1,))
    config = load_config("llama_tiny")
    apply_overrides(
        config,
        [
            "model.d_model=32",
            "model.mlp_dim=48",
            "model.num_layers=1",  # one block to recompute is enough to rank full below none
            "data.seq_len=16",
            "data.max_bytes=60000",
            "batch.per_device_batch_size=1",
            "batch.global_batch_size=8",
        ],
    )
    options = experiments.Options(steps=2, max_per_device_batch=1)
    report = experiments.run("throughput", config, tmp_path, options).read_text()
    rows = {(int(r[0]), int(r[1]), r[7]): r for r in _rows(report, "per_device_batch_size")}
    assert set(rows) == {(1, 1, "none"), (1, 1, "dots"), (1, 1, "full")}
    # Full remat recomputes forward matmuls: the planner ranks it below none at the same
    # split, and its HFU is above its MFU.
    full, none = rows[(1, 1, "full")], rows[(1, 1, "none")]
    assert int(full[9]) > int(none[9])
    assert float(full[8].rstrip("%")) > float(full[6].rstrip("%"))


def test_batch_size_runs_see_the_same_examples_with_scaled_rates(tmp_path):
    options = experiments.Options(steps=4, global_batch_sizes="16,32,64", lr_scaling="sqrt")
    report = experiments.run("batch-size", _digits(), tmp_path, options).read_text()
    rows = _rows(report, "global_batch_size")
    assert [(int(r[0]), int(r[2])) for r in rows] == [(16, 8), (32, 4), (64, 2)]
    rates = [float(r[3]) for r in rows]
    assert rates[1] == pytest.approx(3e-3)  # the config's rate at its own batch of 32
    assert rates[0] == pytest.approx(3e-3 * (16 / 32) ** 0.5, rel=1e-3)
    assert rates[2] == pytest.approx(3e-3 * (64 / 32) ** 0.5, rel=1e-3)
    assert (tmp_path / "loss_vs_examples.png").is_file()
    assert (tmp_path / "loss_vs_steps.png").is_file()


def test_noise_scale_reports_a_critical_batch(tmp_path):
    config = _digits()  # 8 × 4 × 1: K = 1 reads the noise scale too
    report = experiments.run(
        "noise-scale", config, tmp_path, experiments.Options(steps=30)
    ).read_text()
    table = dict((r[0], r[1]) for r in _rows(report, "quantity"))
    b_simple = float(table["critical batch size ≈ B_simple (rows)"].replace(",", ""))
    assert b_simple > 0
    assert float(table["global batch / B_simple"]) == pytest.approx(32 / b_simple, rel=0.01)
    assert re.search(r"The configured global batch is (below|near|above) it", report)


def test_the_cli_writes_the_report_and_exits_2_on_a_bad_request(tmp_path):
    from cli_run import jaxkit  # in-process: what the command prints and writes

    out = jaxkit(
        "experiment",
        "noise-scale",
        "mlp_digits",
        "batch.per_device_batch_size=1",
        "train.noise_scale_every=0",  # said to be ignored: the experiment samples every step
        "--steps",
        "3",
        "--out",
        str(tmp_path / "ns"),
    )
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "ns" / "report.md").is_file()
    assert f"report: {tmp_path / 'ns' / 'report.md'}" in out.stdout
    note = "Sampled every step; train.noise_scale_every=0 ignored."
    assert out.stdout.splitlines()[0] == note
    report = (tmp_path / "ns" / "report.md").read_text()
    assert note in report.splitlines() and "| critical batch size ≈ B_simple" in report
    out = jaxkit("experiment", "equivalence", "mlp_digits", "--splits", "4x8", "--out", "x")
    assert out.returncode == 2 and "DEVICESxPER_DEVICExACCUM" in out.stderr
    out = jaxkit("experiment", "equivalence", "mlp_digits", "--splits", "4x4x1", "--out", "x")
    assert out.returncode == 2 and "not the config's 32" in out.stderr


def test_batch_ramp_runs_four_batches_on_the_same_examples(tmp_path):
    # 8 steps of the small batch: the auto ramp samples at steps 2, 4 and 6 before its last.
    config = _digits("train.noise_scale_every=2")
    report = experiments.run(
        "batch-ramp", config, tmp_path, experiments.Options(steps=8)
    ).read_text()
    rows = {r[0]: r for r in _rows(report, "run")}
    assert list(rows) == ["fixed 32", "fixed 128", "ramp 32→64→128", "auto 32→≤128"]
    # 8 steps of 32 = 256 examples: 2 steps of 128; the ramp 2 × 32, 1 × 64, 1 × 128.
    assert [(rows[n][1], int(rows[n][2]), rows[n][3]) for n in list(rows)[:3]] == [
        ("32", 8, "256"),
        ("128", 2, "256"),
        ("32→64→128", 4, "256"),
    ]
    assert rows["fixed 32"][5] != "not reached"  # its own final loss, by its last step
    # K = 1 on 8 devices × 4 rows: auto starts there too (its small batch is the global
    # batch's first row, not a micro-batch), so no run changes the per-device batch.
    assert "auto 32→≤128" in rows and "-> 2 for every run" not in report
    assert (tmp_path / "loss_vs_examples.png").is_file()


@pytest.mark.parametrize(
    ("every", "why"),
    [
        ("0", "train.noise_scale_every=0 turns off the gradient noise scale"),
        ("8", "train.noise_scale_every=8 samples no step before the last of this"),
    ],
)
def test_batch_ramp_refuses_an_auto_arm_that_cannot_read_the_noise_scale(tmp_path, every, why):
    # It trained the other three runs and left the auto one out, in a line of report.md.
    out = tmp_path / "ramp"
    line = ["experiment", "batch-ramp", "mlp_digits", f"train.noise_scale_every={every}"]
    ran = jaxkit(*line, "--steps", "8", "--out", str(out))
    assert ran.returncode == 2 and not out.exists(), ran
    assert ran.stderr.startswith(f"jaxkit: error: auto 32→≤128: {why}"), ran.stderr
    assert ran.stderr.count("\n") == 1 and "report.md" not in ran.stdout


def test_a_refused_split_leaves_no_out_and_says_nothing_of_a_report(tmp_path, capsys):
    # 16 devices pass the mesh's shape rules; only training would find 8: refused up front.
    from jaxkit import cli

    out = tmp_path / "eq"
    assert (
        cli.main(
            ["experiment", "equivalence", "mlp_digits", "--splits", "16x2x1", "--out", str(out)]
        )
        == 2
    )
    printed, err = capsys.readouterr()
    assert "report.md" not in printed and not out.exists()
    assert err.splitlines() == [
        "jaxkit: error: split 16×2×1 needs 16 devices; 8 are available "
        "(--host-devices N simulates more on the CPU)"
    ]


def test_a_unit_the_data_cannot_serve_is_refused_before_the_first_trains(tmp_path, monkeypatch):
    # Per-device batches 1..256 at K = 1: only the last, a global batch of 8 × 256 = 2,048,
    # exceeds the digits' training rows, and used to be refused after the seven before it.
    trained = []
    monkeypatch.setattr(common, "train", lambda *a, **k: trained.append(a) or 1 / 0)
    options = experiments.Options(steps=2, max_per_device_batch=256)
    with pytest.raises(experiments.ExperimentError) as refused:
        experiments.run("throughput", _digits(), tmp_path / "t", options, echo=lambda s: None)
    message = str(refused.value)
    assert message.startswith("per_device_batch_size=256 grad_accum_steps=1: ")
    assert "global_batch_size=2048 exceeds the" in message
    assert trained == [] and not (tmp_path / "t").exists()


@pytest.mark.parametrize("why", ["is beyond the sweep", "did not compile"])
def test_memory_sweeps_accumulation_at_the_largest_batch_the_batch_sweep_found(
    tmp_path, monkeypatch, why
):
    # The config's per-device batch is 4. Either the sweep stops at 2, or a compiler (as a
    # TPU's does past its HBM) refuses more than 2 rows per device: accumulation is then
    # compiled at 2, not at a batch that was never found to fit.
    from jaxkit.experiments import memory
    from jaxkit.plan import costs

    monkeypatch.setattr(memory, "ACCUM_SWEEP", (1, 2))  # two points make the claim
    top = 2
    if why == "did not compile":
        top, real = 4, costs.step_cost

        def refusing(config, plan, devices):
            if plan.per_device_batch_size > 2:
                raise costs.OutOfMemory("RESOURCE_EXHAUSTED: more than 2 rows per device")
            return real(config, plan, devices)

        monkeypatch.setattr(costs, "step_cost", refusing)
    options = experiments.Options(max_per_device_batch=top, rss_points=0)
    report = experiments.run("memory", _digits(), tmp_path, options, echo=lambda s: None)
    report = report.read_text()
    assert f"(per_device_batch_size = 2: the config's 4 {why})" in report
    by_batch = dict((r[0], r[1]) for r in _rows(report, "per_device_batch_size"))
    by_accum = _rows(report, "grad_accum_steps")
    assert [r[0] for r in by_accum] == ["1", "2"]
    # MultiSteps at K = 1 is the batch sweep's own program at 2 rows per device.
    assert by_accum[0][1] == by_batch["2"]

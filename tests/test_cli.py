"""The CLI end to end, as a user runs it: in a new process where the claim is about one (a
run from the command line, signals, a device count set before JAX starts), in this one where
it is about what a command prints, writes and returns (tests/cli_run.py)."""

import json
import os
import signal
import subprocess
import sys

import cli_run
import pytest

from jaxkit import cli as cli_lib
from jaxkit.config import run_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def jaxkit(*args, timeout=300):
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run(
        [sys.executable, "-m", "jaxkit", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=env,
    )


def run(*args):
    """`jaxkit ARGS` in this process (tests/cli_run.py), or in a new one where the line sets
    a device count, which only a process that has not started JAX can do."""
    return jaxkit(*args) if "--host-devices" in args else cli_run.jaxkit(*args)


def refused(*args):
    """`jaxkit ARGS` in this process, for a line refused before JAX starts (a command that
    starts it fails the test): a device count on the line never takes effect."""
    return cli_run.jaxkit(*args, before_jax=True)


def test_plan_json_on_a_good_config():
    out = run("plan", "lm_tiny", "--host-devices", "4", "--json")
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert plan["mesh_shape"] == {"data": 4, "fsdp": 1, "tensor": 1}
    assert (
        plan["data_parallel_size"],
        plan["per_device_batch_size"],
        plan["grad_accum_steps"],
    ) == (4, 4, 4)
    assert (plan["global_batch_size"], plan["micro_batch_size"]) == (64, 16)
    assert (plan["seq_len"], plan["tokens_per_step"], plan["learning_rate"]) == (128, 8192, 3e-3)


def test_plan_table_and_overrides():
    out = run(
        "plan",
        "mlp_digits",
        "batch.per_device_batch_size=null",
        "batch.grad_accum_steps=2",
        "optimizer.lr_scaling=linear",
        "optimizer.reference_batch_size=16",
        "--host-devices",
        "2",
    )
    assert out.returncode == 0, out.stderr
    assert "per_device_batch_size | 8" in out.stdout and "= 2 × 8 × 2" in out.stdout
    assert "0.006" in out.stdout  # 3e-3 × 32/16


def test_plan_errors_exit_nonzero_with_the_reason():
    # On this process's 8 devices (conftest), as `--host-devices 8` gives a new one.
    bad = run("plan", "mlp_digits", "batch.global_batch_size=30", "--json")
    assert bad.returncode == 2 and bad.stdout == ""
    assert "data_parallel_size × per_device_batch_size × grad_accum_steps" in bad.stderr
    assert "32, 64" in bad.stderr
    typo = run("plan", "mlp_digits", "batch.per_device=4")
    assert typo.returncode == 2 and "batch.per_device_batch_size" in typo.stderr
    mesh = run("plan", "mlp_digits", "mesh.data=3")
    assert mesh.returncode == 2 and "8 are available" in mesh.stderr


def test_train_refuses_data_too_small_before_training(tmp_path):
    # 8,000 bytes: 7,600 for training, 59 rows of 128, fewer than one global batch of 64.
    out = run("train", "lm_tiny", "data.max_bytes=8000", "--workdir", str(tmp_path / "r"))
    assert out.returncode == 2 and "global_batch_size=64 exceeds the 59 training rows" in out.stderr
    assert "Traceback" not in out.stderr and not (tmp_path / "r" / "metrics.jsonl").exists()


def test_train_writes_config_plan_and_metrics(tmp_path):
    workdir = tmp_path / "run"
    out = jaxkit(  # options before CONFIG, between overrides and at the end, as users type
        "train",
        "--host-devices",
        "8",
        "lm_tiny",
        "train.steps=4",
        "train.log_every=2",
        "--no-progress",
        "train.eval_every=2",
        "train.eval_examples=32",
        "--workdir",
        str(workdir),
        "data.max_bytes=20000",
        "model.num_layers=1",
        "model.d_model=32",
        "model.num_heads=2",
        "model.mlp_dim=64",
        "data.seq_len=16",
        "--allow-longer",  # nothing to extend in a new run; the flag reaches loop.train
    )
    assert out.returncode == 0, out.stderr
    assert "tokens_per_step" in out.stdout and "nats/byte" in out.stdout
    assert json.loads((workdir / "config.json").read_text())["train"]["steps"] == 4
    assert json.loads((workdir / "plan.json").read_text())["grad_accum_steps"] == 2
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    train_records = [r for r in records if "loss" in r]
    eval_records = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in train_records] == [2, 4]
    assert [r["step"] for r in eval_records] == [2, 4]
    for key in (
        "step",
        "micro_step",
        "loss",
        "learning_rate",
        "grad_norm",
        "examples_seen",
        "tokens_seen",
        "step_time_s",
        "examples_per_s",
    ):
        assert key in train_records[0], key
    assert train_records[1]["micro_step"] == 8 and train_records[1]["examples_seen"] == 256
    assert train_records[1]["tokens_seen"] == 256 * 16
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["eval_loss"] == eval_records[-1]["eval_loss"] and summary["unigram_entropy"] > 2


def test_train_reports_bad_choices_without_a_traceback(tmp_path):
    out = run("train", "mlp_digits", "model.kind=cnn", "--workdir", str(tmp_path / "r"))
    assert (
        out.returncode == 2
        and "model.kind='cnn': must be one of transformer, llama, mlp, or package.module:factory"
        in out.stderr
    )
    assert "Traceback" not in out.stderr


def _refused(out, *fragments):
    """A usage error: exit status 2, the reason on stderr, no traceback, nothing on stdout."""
    assert out.returncode == 2, (out.returncode, out.stdout, out.stderr)
    assert "error:" in out.stderr and "Traceback" not in out.stderr, out.stderr
    for fragment in fragments:
        assert fragment in out.stderr, (fragment, out.stderr)


def test_all_splits_says_which_device_counts_it_left_out_and_why():
    # mesh.data=8 fits only 8 of the 8, 4, 2, 1 devices --all-splits considers; a global
    # batch of 8 has one split there to compile.
    one_split = ("batch.global_batch_size=8", "batch.per_device_batch_size=1")
    out = run("plan", "mlp_digits", "mesh.data=8", *one_split, "--all-splits")
    assert out.returncode == 0, out.stderr
    assert "every split on 8 cpu devices" in out.stdout
    for n in (4, 2, 1):
        assert f"left out: {n} devices (mesh data=8 × fsdp=1 × tensor=1 has" in out.stdout
    out = run("plan", "mlp_digits", "mesh.data=8", *one_split, "--all-splits", "--json")
    assert sorted(json.loads(out.stdout)["left_out_device_counts"]) == ["1", "2", "4"]
    # None of the counts asked for: refused, each count with its reason.
    out = run("plan", "mlp_digits", "mesh.data=8", "--all-splits", "--device-counts", "4,2")
    _refused(out, "no split on any of the device counts: 4 devices: mesh data=8", "; 2 devices")


def test_plan_options_anywhere_on_the_line():
    lines = [
        ("--host-devices", "2", "--json", "mlp_digits", "batch.per_device_batch_size=8"),
        ("mlp_digits", "--host-devices", "2", "batch.per_device_batch_size=8", "--json"),
        ("--json", "mlp_digits", "batch.per_device_batch_size=8", "--host-devices", "2"),
    ]
    plans = []
    for line in lines:
        out = run("plan", *line)
        assert out.returncode == 0, (line, out.stderr)
        plans.append(json.loads(out.stdout))
    assert plans[0] == plans[1] == plans[2]
    p = plans[0]
    assert (p["data_parallel_size"], p["per_device_batch_size"], p["grad_accum_steps"]) == (2, 8, 2)


def test_experiment_train_and_report_options_anywhere_on_the_line(tmp_path):
    # Each line is parsed whole and then refused for a reason found after parsing, so the
    # refusal shows the options were read, wherever they stood.
    out = run(
        "experiment",
        "--steps",
        "2",
        "equivalence",
        "--host-devices",
        "2",
        "mlp_digits",
        "--splits",
        "3x3x1",
        "train.seed=1",
        "--out",
        str(tmp_path / "exp"),
    )
    _refused(out, "split 3×3×1 makes a global batch of 9, not the config's 32")
    out = refused(
        "train",
        "--no-progress",
        "mlp_digits",
        "--workdir",
        str(tmp_path / "run"),
        "train.steps=0",
        "--allow-longer",
        "--host-devices",
        "2",
    )
    _refused(out, "train.steps=0: must be null or an integer in [1, 2147483648)")
    assert not (tmp_path / "run").exists()
    out = run("report", str(tmp_path / "a"), "--out", str(tmp_path / "o"), str(tmp_path / "b"))
    _refused(out, "a has no metrics.jsonl")


def test_help_lists_the_commands_and_their_flags():
    top = run("--help")
    assert top.returncode == 0 and all(c in top.stdout for c in ("plan", "train", "experiment"))
    plan = run("plan", "--help")
    assert plan.returncode == 0 and "--max-per-device-batch" in plan.stdout
    train = run("train", "--help")
    assert train.returncode == 0 and "--allow-longer" in train.stdout
    assert "learning-rate schedule is re-laid" in " ".join(train.stdout.split())


def test_lr_scaling_none_is_the_documented_string():
    out = run("plan", "mlp_digits", "optimizer.lr_scaling=none", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["lr_scaling"] == "none"
    _refused(run("plan", "mlp_digits", "train.steps=None"), "write train.steps=null")


@pytest.mark.parametrize(
    "command,override,message",
    [
        ("plan", "mesh.data=null", "mesh.data=null: must be a positive axis size"),
        ("plan", "train.eval_batches=1", "train.eval_batches was replaced by train.eval_examples"),
        ("plan", "train.noise_scale_decay=1", "train.noise_scale_decay=1.0: must be in [0, 1)"),
        ("train", "train.log_every=0", "train.log_every=0: must be an integer ≥ 1"),
        (
            "train",
            "train.steps=-5",
            "train.steps=-5: must be null or an integer in [1, 2147483648)",
        ),
        ("train", "optimizer.learning_rate=nan", "optimizer.learning_rate=nan: must be a finite"),
        ("train", "checkpoint.keep=0", "checkpoint.keep=0: must be an integer ≥ 1"),
        ("experiment", "optimizer.learning_rate=nan", "optimizer.learning_rate=nan"),
    ],
)
def test_bad_values_are_refused_before_any_work(tmp_path, command, override, message):
    out_dir = str(tmp_path / "r")
    line = {
        "plan": ["plan", "mlp_digits", override],
        "train": ["train", "mlp_digits", override, "--workdir", out_dir],
        "experiment": ["experiment", "equivalence", "mlp_digits", override, "--out", out_dir],
    }[command]
    out = refused(*line, "--host-devices", "2")
    _refused(out, f"jaxkit: error: {message}")
    assert out.stdout == "" and not (tmp_path / "r").exists()


def test_heads_and_uneven_shards_are_refused_before_compiling(tmp_path):
    _refused(
        run("plan", "lm_tiny", "model.num_heads=3"),
        "model.d_model=128 is not divisible by model.num_heads=3",
    )
    _refused(
        run("plan", "lm_tiny", "mesh.data=1", "mesh.tensor=8"),  # 4 heads on 8 devices
        "model.num_heads=4 is not divisible by mesh.tensor=8",
    )
    uneven_fsdp = ("model.d_model=36", "model.num_heads=4", "mesh.fsdp=8", "mesh.data=1")
    _refused(
        run("plan", "lm_tiny", *uneven_fsdp), "model.d_model=36 is not divisible by mesh.fsdp=8"
    )
    out = run(
        "train",
        "mlp_digits",
        "model.hidden_size=100",
        "mesh.tensor=8",
        "mesh.data=1",
        "--workdir",
        str(tmp_path / "r"),
    )
    _refused(out, "model.hidden_size=100 is not divisible by mesh.tensor=8")
    assert out.stdout == "" and not (tmp_path / "r").exists()
    # Fine on the 8 live devices (tensor=8), uneven on 3 (tensor=3).
    out = run(
        "plan",
        "mlp_digits",
        "mesh.data=1",
        "mesh.tensor=-1",
        "--all-splits",
        "--device-counts",
        "8,3",
    )
    _refused(out, "--device-counts 3: model.hidden_size=128 is not divisible by mesh.tensor=3")


@pytest.mark.parametrize(
    "line,message",
    [
        (["plan", "mlp_digits", "--host-devices", "0"], "--host-devices: must be at least 1"),
        (["plan", "mlp_digits", "--host-devices", "x"], "--host-devices: 'x' is not an integer"),
        # 100,000 simulated devices ran out of memory after minutes, exit 137
        (["plan", "mlp_digits", "--host-devices", "100000"], "is more than 1024"),
        (["plan", "mlp_digits", "--memory-budget", "1GiB"], "--memory-budget applies only"),
        (["plan", "mlp_digits", "--device-counts", "4"], "--device-counts applies only"),
        (
            ["plan", "mlp_digits", "--all-splits", "--max-per-device-batch"],
            "two modes: give one",
        ),
        (["experiment", "memory", "mlp_digits", "--splits", "1x32x1"], "--splits applies to"),
        (["experiment", "equivalence", "--rss-points", "1"], "--rss-points applies to"),
        (["experiment", "equivalence", "--steps", "0"], "--steps: must be at least 1"),
        (["experiment", "memory", "--max-per-device-batch", "0"], "must be at least 1"),
        (["train", "mlp_digits", "--num-processes", "0"], "--num-processes: must be at least 1"),
        (["plan", "no_such_config"], "no config 'no_such_config'"),
        (["plan", "mlp_digits", "train.steps"], "not of the form dotted.key=value"),
        ([], "required: command"),
        (["plan", "mlp_digits", "--all-splits", "--memory-budget", "1e999"], "not a memory size"),
        (["plan", "mlp_digits", "--all-splits", "--memory-budget", "0.5"], "at least one byte"),
        (["plan", "mlp_digits", "--all-splits", "--device-counts", "8,x"], "comma-separated"),
        (["report", "no/such/run"], "no/such/run has no metrics.jsonl"),
        (["train", "mlp_digits", "--workdir", ""], "--workdir: an empty path"),
        (["report", "run", "--out", " "], "--out: an empty path"),
        (["experiment", "equivalence", "mlp_digits", "--splits", ""], "--splits: '' is not"),
        (["train", "lm_tiny", "data.eval_fraction=1e-17"], "the eval split is empty"),
    ],
)
def test_usage_errors_exit_2_without_a_traceback(line, message):
    # The lines that give --host-devices are refused as they are parsed, before JAX starts.
    _refused(refused(*line) if "--host-devices" in line else run(*line), message)


def test_unwritable_output_directories_are_refused_first(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    for line in (
        ["train", "mlp_digits", "--workdir", str(blocker / "run")],
        ["experiment", "equivalence", "mlp_digits", "--out", str(blocker / "exp")],
        ["report", str(tmp_path), "--out", str(blocker / "report")],
    ):
        out = run(*line)
        _refused(out, f"{blocker} is a file, not a directory")
        assert "workdir:" not in out.stdout  # refused before the run starts


def test_a_directory_root_cannot_write_in_is_refused_first(capsys):
    """os.access says yes to root for /proc, where no file can be made: the run went on to a
    traceback from orbax's makedirs instead of exit 2."""
    assert cli_lib.main(["train", "mlp_digits", "--workdir", "/proc/jaxkit-run"]) == 2
    err = capsys.readouterr().err
    assert "--workdir /proc/jaxkit-run: /proc is not writable" in err and "Traceback" not in err


def signal_before_training(tmp_path, sig):
    """`jaxkit train lm_tiny` sent `sig` once its plan is printed, while its step compiles:
    (exit status, stderr). The cache is its own and empty, so the compile takes seconds."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxkit", "train", "lm_tiny", "--workdir", str(tmp_path / "r")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=ROOT, JAXKIT_CACHE_DIR=str(tmp_path / "cache")),
    )
    for line in proc.stdout:
        if line.startswith("batch plan"):
            break
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    return proc.returncode, err


def test_sigterm_before_training_starts_is_one_line_and_143(tmp_path):
    """A preemption during the compile dumped a native stack trace (exit 143 all the same)."""
    code, err = signal_before_training(tmp_path, signal.SIGTERM)
    assert code == 143, (code, err[-2000:])
    assert "terminated (SIGTERM) before training started: nothing to save" in err
    assert "stack trace" not in err and "Traceback" not in err


def test_ctrl_c_before_training_starts_exits_130(tmp_path):
    code, err = signal_before_training(tmp_path, signal.SIGINT)
    assert code == 130, (code, err[-2000:])
    assert "jaxkit: interrupted" in err and "Traceback" not in err


def test_max_per_device_batch_announces_each_compile_as_it_starts(capsys):
    # In-process: the claim is about what is printed, and where, not about a process.
    import re

    import jax

    from jaxkit import cli
    from jaxkit.batch.schedule import plan_from_config
    from jaxkit.config import load_config
    from jaxkit.plan import costs

    one = costs.split_config(
        run_config(load_config("mlp_digits")), 1, 1
    )  # what the search compiles first
    shape = {"data": 8, "fsdp": 1, "tensor": 1}
    need = costs.step_cost(one, plan_from_config(one, shape), jax.devices()).memory_bytes
    argv = ["plan", "mlp_digits", "--max-per-device-batch", "--memory-budget", str(need), "--json"]
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    result = json.loads(out)  # stdout is the JSON document alone
    # 1 fits, 2 does not: two compiles
    assert result["max_per_device_batch_size"] == 1 and result["compiles"] == 2
    lines = err.splitlines()
    started = [
        re.fullmatch(r"  per_device_batch_size=(\d+): compiling \((\S+) s into the search\)", x)
        for x in lines
    ]
    assert [int(m[1]) for m in started if m] == [1, 2]
    elapsed = [float(m[2]) for m in started if m]
    # The search's own clock starts a moment after the CLI's, and .1f rounds up by 0.05 s.
    assert elapsed == sorted(elapsed) and elapsed[-1] <= result["seconds"] + 0.1
    for b, memory in result["tried"].items():  # each start comes before its result
        begun = lines.index(
            next(x for x in lines if x.startswith(f"  per_device_batch_size={b}: compiling"))
        )
        ended = lines.index(f"  per_device_batch_size={b}: {costs.format_bytes(memory)}")
        assert begun < ended

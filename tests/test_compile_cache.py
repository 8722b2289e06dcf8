"""The persistent compilation cache: a second run reads its programs back, changes no
number, and a cache that cannot be used costs one warning line, never a failure.

JAX opens its cache once per process, so the claims about runs are checked on processes:
each run below is a fresh `python -m jaxkit` with its own JAXKIT_CACHE_DIR.
"""

import concurrent.futures
import errno
import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from small_configs import SMALL_LM

from jaxkit import cli as cli_lib
from jaxkit.config import run_config
from jaxkit.plan import compile_cache, costs, peak, targets

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = ["lm_tiny", *SMALL_LM, "train.steps=3", "train.log_every=1", "checkpoint.every=0"]
# Wraps the loop so the run also writes its final params, as raw float32 bytes: two runs'
# params then compare bit for bit.
KEEP_PARAMS = """
import jax, numpy as np, jaxkit.train.loop as loop
_train = loop.train
def train(config, workdir, **kwargs):
    result = _train(config, workdir, **kwargs)
    leaves = [np.asarray(x, np.float32) for x in jax.tree.leaves(result.state.params)]
    open(f"{workdir}/params.bin", "wb").write(b"".join(x.tobytes() for x in leaves))
    return result
loop.train = train
"""


def fresh_cache(cache_dir):
    """A cache directory with no program in it, holding this machine's measured CPU peak
    (MFU's denominator, which the kit keeps beside the programs) as one that has run before
    does: each run here would otherwise spend seconds timing matmuls that no claim below is
    about. The figure is the session cache's, measured at most once per session."""
    peak.cpu_peak(jax.devices())  # the 8 devices a run here trains on
    cache_dir.mkdir(parents=True)
    shutil.copy(peak.cache_dir() / "cpu_peak.json", cache_dir / "cpu_peak.json")
    return cache_dir


def run(cache_dir, workdir, *extra, env_extra=None, prelude=""):
    """`jaxkit train RUN` in a fresh process: (exit status, summary, losses, stderr)."""
    env = dict(os.environ, PYTHONPATH=ROOT, JAXKIT_CACHE_DIR=str(cache_dir), **(env_extra or {}))
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    code = (
        prelude
        + KEEP_PARAMS
        + "import sys; from jaxkit.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    args = ["train", *RUN, "--workdir", str(workdir), "--no-progress", *extra]
    out = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=env,
    )
    summary, losses = None, None
    if out.returncode == 0:
        summary = json.loads((workdir / "summary.json").read_text())
        records = [
            json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()
        ]
        losses = [(r["loss"], r["grad_norm"]) for r in records if "loss" in r]
        losses += [r["eval_loss"] for r in records if "eval_loss" in r]
    return out.returncode, summary, losses, out.stderr


def params(workdir):
    return (workdir / "params.bin").read_bytes()


def warning_lines(stderr):
    return [line for line in stderr.splitlines() if line.startswith("warning:")]


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    """A cold run that fills a fresh cache, then a warm run that reads it."""
    root = tmp_path_factory.mktemp("cache")
    cold = run(fresh_cache(root / "cache"), root / "cold")
    warm = run(root / "cache", root / "warm")
    return root, cold, warm


def test_a_warm_run_reads_its_step_and_changes_no_number(warm):
    root, (code_a, cold, losses_a, err_a), (code_b, hot, losses_b, err_b) = warm
    assert code_a == 0, err_a[-2000:]
    assert code_b == 0, err_b[-2000:]
    assert (cold["compile_cache_hit"], hot["compile_cache_hit"]) == (False, True)
    assert any(p.name.endswith("-cache") for p in (root / "cache" / "xla").iterdir())
    # Tracing and lowering are part of the wait, cached or not.
    for summary in (cold, hot):
        assert 0 < summary["trace_s"] < summary["compile_s"]
    # The same executable: every logged number and every parameter bit agree.
    assert losses_a == losses_b
    assert (cold["memory_bytes"], cold["final_loss"]) == (hot["memory_bytes"], hot["final_loss"])
    assert cold["hardware_flops_per_step"] == hot["hardware_flops_per_step"]
    assert params(root / "cold") == params(root / "warm")
    assert not warning_lines(err_a) and not warning_lines(err_b)


def test_no_compile_cache_neither_reads_nor_writes(warm):
    root, _, (_, _, losses, _) = warm
    before = sorted(p.name for p in (root / "cache" / "xla").iterdir())
    code, summary, losses_off, err = run(root / "cache", root / "off", "--no-compile-cache")
    assert code == 0, err[-2000:]
    assert summary["compile_cache_hit"] is False  # a warm cache was there, and not read
    assert sorted(p.name for p in (root / "cache" / "xla").iterdir()) == before
    assert losses_off == losses


def test_two_processes_filling_one_cache_at_once(warm, tmp_path):
    _, _, (_, _, losses, _) = warm
    cache = fresh_cache(tmp_path / "cache")
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda i: run(cache, tmp_path / f"w{i}"), range(2)))
    for code, _, losses_now, err in results:
        assert code == 0, err[-2000:]
        assert losses_now == losses
        assert len(warning_lines(err)) <= 1, err[-3000:]


@pytest.fixture
def session_cache(monkeypatch, tmp_path):
    """JAX's cache in this process pointed at `tmp_path` for one test, its one-warning
    state fresh, and the warnings hook installed over pytest's own."""
    from jax._src import compilation_cache  # private: JAX has no public way to reopen it

    monkeypatch.setattr(compile_cache, "_warned", [])
    monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)
    monkeypatch.setenv("JAXKIT_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    names = ("jax_enable_compilation_cache", "jax_compilation_cache_dir")
    before = {name: getattr(jax.config, name) for name in names}
    compilation_cache.reset_cache()  # JAX opens its cache once per process
    assert compile_cache.enable() == str(tmp_path / "xla")
    yield tmp_path / "xla"
    compilation_cache.reset_cache()
    for name, value in before.items():
        jax.config.update(name, value)


def fresh_program(seed):
    """A jitted function no other test compiles, and its input."""

    def f(x):
        return jnp.tanh(x @ x + seed).sum()

    return jax.jit(f), jnp.ones((8, 8))


def test_a_damaged_entry_costs_one_warning_line_and_is_written_anew(session_cache, capsys):
    f, x = fresh_program(0.25)
    expected = float(f(x))
    entries = [p for p in session_cache.iterdir() if p.name.startswith("jit_f-")]
    assert entries
    for entry in entries:  # cut short, as by a writer killed mid-write
        if entry.name.endswith("-cache"):
            entry.write_bytes(entry.read_bytes()[:20])
    jax.clear_caches()  # the next call reads the persistent cache again
    f, x = fresh_program(0.25)
    assert float(f(x)) == expected
    lines = [line for line in capsys.readouterr().err.splitlines() if "warning:" in line]
    assert len(lines) == 1 and "compile cache" in lines[0] and "rm -rf" in lines[0]
    rewritten = [p for p in session_cache.iterdir() if p.name.endswith("-cache")]
    assert all(len(p.read_bytes()) > 20 for p in rewritten if p.name.startswith("jit_f-"))
    with compile_cache.cache_events() as events:  # whole again: read back, no warning
        jax.clear_caches()
        f, x = fresh_program(0.25)
        assert float(f(x)) == expected
    assert events.hits and not events.misses
    assert "warning:" not in capsys.readouterr().err


def test_a_full_disk_costs_one_warning_line(session_cache, monkeypatch, capsys):
    def full(self, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    # JAX writes its entries through etils' epath where it is installed (it is: orbax needs
    # it), else pathlib: both fail as a full disk does.
    from jax._src import path as jax_path

    monkeypatch.setattr(pathlib.Path, "write_bytes", full)
    monkeypatch.setattr(jax_path.Path, "write_bytes", full, raising=False)
    for seed in (0.5, 0.75):  # two programs, two failed writes: one line
        f, x = fresh_program(seed)
        assert np.isclose(
            float(f(x)), float(np.tanh(np.ones((8, 8)) @ np.ones((8, 8)) + seed).sum())
        )
    lines = [line for line in capsys.readouterr().err.splitlines() if "warning:" in line]
    assert len(lines) == 1 and "No space left" in lines[0]


def test_a_cache_directory_that_cannot_be_written_costs_one_warning_line(monkeypatch, capsys):
    monkeypatch.setattr(compile_cache, "_warned", [])
    with tempfile.NamedTemporaryFile() as blocker:  # a file where the directory would go
        monkeypatch.setenv("JAXKIT_CACHE_DIR", blocker.name)
        monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
        before = jax.config.jax_enable_compilation_cache
        try:
            assert compile_cache.enable() is None
            assert not compile_cache.in_use()
        finally:
            jax.config.update("jax_enable_compilation_cache", before)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("warning:") and "cannot be written" in lines[0]


def test_a_user_set_jax_cache_directory_wins(monkeypatch, tmp_path):
    before = {
        name: getattr(jax.config, name)
        for name in ("jax_enable_compilation_cache", "jax_compilation_cache_dir")
    }
    try:
        monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "theirs"))
        monkeypatch.setenv("JAXKIT_CACHE_DIR", str(tmp_path / "ours"))
        assert compile_cache.enable() == str(tmp_path / "theirs")
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "theirs")
        monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")
        assert compile_cache.enable() == str(tmp_path / "ours" / "xla")
        assert compile_cache.enable(False) is None
        assert not compile_cache.in_use()
    finally:
        for name, value in before.items():
            jax.config.update(name, value)


# One split of a small model on a v5litepod-8's 8 chips: b=1, K=1. The MLP: its TPU
# program compiles in a quarter of the tiny LM's time, and the cache sees a lowered program
# and chips whatever the model.
TARGET_PLAN = ["mlp_digits", "batch.global_batch_size=8", "batch.per_device_batch_size=1"]


def plan_json(capsys, *args, target="v5litepod-8"):
    line = ["plan", *TARGET_PLAN, "--target", target, "--json", "--all-splits", *args]
    assert cli_lib.main(line) == 0
    return json.loads(capsys.readouterr().out)


def test_a_second_target_plan_compiles_nothing(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("JAXKIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(compile_cache, "plans_enabled", True)  # as a fresh process has it
    compiles = []
    real = costs._compile
    monkeypatch.setattr(costs, "_compile", lambda lowered: compiles.append(1) or real(lowered))
    first = plan_json(capsys)
    assert compiles and len(list((tmp_path / "plans").glob("*.json"))) == len(compiles)
    assert not (tmp_path / "xla").exists()  # JAX's cache cannot read a TPU program back
    compiles.clear()
    second = plan_json(capsys)
    assert compiles == []
    for a, b in zip(first["splits"], second["splits"], strict=True):
        assert a.pop("compile_cache_hit") is False
        assert b.pop("compile_cache_hit") is True
        for key in ("compile_s", "trace_s"):
            a.pop(key), b.pop(key)
    assert first == second
    # Other chips of the same layout (a v6e-8 is 2x4 as well) compile for themselves: v5e's
    # figures read for them would be off.
    v6e = plan_json(capsys, target="v6e-8")
    assert compiles and not v6e["splits"][0]["compile_cache_hit"]
    assert v6e["splits"][0]["memory_bytes"] != first["splits"][0]["memory_bytes"]
    compiles.clear()
    # Damaged entries are compiled again, with one warning line, and the same figures.
    for entry in (tmp_path / "plans").glob("*.json"):
        entry.write_text("{not json")
    monkeypatch.setattr(compile_cache, "_warned", [])
    third = plan_json(capsys)
    assert compiles
    assert capsys.readouterr().err.count("warning:") <= 1
    for a, c in zip(first["splits"], third["splits"], strict=True):
        assert a["memory_bytes"] == c["memory_bytes"]
    # Entries whose figures were read off the program by other rules (costs.FIGURES: the
    # FLOP and traffic counts) are compiled again, not read back.
    compiles.clear()
    monkeypatch.setattr(costs, "FIGURES", costs.FIGURES + 1)
    fourth = plan_json(capsys)
    assert compiles and not any(s["compile_cache_hit"] for s in fourth["splits"])
    assert [s["memory_bytes"] for s in fourth["splits"]] == [
        s["memory_bytes"] for s in first["splits"]
    ]
    # --no-compile-cache turns the plan cache off too.
    assert (
        cli_lib.main(["plan", *TARGET_PLAN, "--target", "v5litepod-8", "--no-compile-cache"]) == 0
    )
    assert compile_cache.plans_enabled is False
    assert all(compile_cache.read_plan(e.stem) is None for e in (tmp_path / "plans").glob("*.json"))


def test_the_plan_key_holds_the_compiler_flags_that_jax_keys_its_own_cache_on(monkeypatch):
    """XLA_FLAGS, LIBTPU_INIT_ARGS and `--xla*` arguments change what the TPU compiler
    allocates, so a plan made under other flags compiles again; the dump and debug flags
    JAX's own cache key leaves out change nothing. Held against JAX's own rule: two settings
    give one plan key exactly when they give JAX's flag hash one value."""
    from jax._src import cache_key

    chips = [types.SimpleNamespace(device_kind="TPU v5 lite")] * 8
    settings = {
        "none": ({}, []),
        "tests'": ({"XLA_FLAGS": "--xla_backend_optimization_level=0"}, []),
        "dumped": ({"XLA_FLAGS": "--xla_dump_to=/tmp/d --xla_dump_hlo_as_text"}, []),
        "dumped too": ({"XLA_FLAGS": "--xla_dump_to=/tmp/e"}, ["--xla_dump_hlo_pass_re=.*"]),
        "libtpu": ({"LIBTPU_INIT_ARGS": "--xla_tpu_enable_latency_hiding_scheduler=false"}, []),
        "xla": ({"XLA_FLAGS": "--xla_tpu_enable_latency_hiding_scheduler=false"}, []),
        "argv": ({}, ["--xla_tpu_enable_latency_hiding_scheduler=false"]),
        "two": ({"XLA_FLAGS": "--xla_a=1 --xla_b=2"}, []),
        "two swapped": ({"XLA_FLAGS": "--xla_b=2", "LIBTPU_INIT_ARGS": "--xla_a=1"}, []),
        "other value": ({"XLA_FLAGS": "--xla_a=1 --xla_b=3"}, []),
    }
    plan_keys, jax_keys = {}, {}
    for name, (env, argv) in settings.items():
        for variable in ("XLA_FLAGS", "LIBTPU_INIT_ARGS"):
            monkeypatch.delenv(variable, raising=False)
        for variable, value in env.items():
            monkeypatch.setenv(variable, value)
        monkeypatch.setattr(sys, "argv", ["jaxkit", "plan", *argv])
        plan_keys[name] = compile_cache.plan_key("module @step {}", chips)
        digest = hashlib.sha256()
        cache_key._hash_xla_flags(digest, cache_key.get_flag_prefixes())
        jax_keys[name] = digest.hexdigest()
    same = {(a, b) for a in settings for b in settings if plan_keys[a] == plan_keys[b]}
    assert same == {(a, b) for a in settings for b in settings if jax_keys[a] == jax_keys[b]}
    assert plan_keys["none"] == plan_keys["dumped"] == plan_keys["dumped too"]
    # Where a flag is given is no matter.
    assert plan_keys["libtpu"] == plan_keys["xla"] == plan_keys["argv"]
    assert plan_keys["two"] == plan_keys["two swapped"]
    assert len({plan_keys[n] for n in ("none", "tests'", "libtpu", "two", "other value")}) == 5


def test_a_refusal_is_cached_as_a_refusal(monkeypatch, tmp_path):
    monkeypatch.setenv("JAXKIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(compile_cache, "plans_enabled", True)
    calls = []

    def refuse(lowered):
        calls.append(1)
        raise costs.OutOfMemory("RESOURCE_EXHAUSTED: Used 20.00G of 15.75G hbm")

    monkeypatch.setattr(costs, "_compile", refuse)
    from jaxkit.batch.schedule import plan_from_config
    from jaxkit.config import load_config
    from jaxkit.mesh import resolve_mesh_shape

    config = load_config("mlp_digits")  # a small program to lower: the compile is refused
    devices = targets.target_devices(targets.parse_target("v5litepod-8"))
    plan = plan_from_config(
        run_config(config), resolve_mesh_shape(config.mesh.to_dict(), len(devices))
    )
    for _ in range(2):
        with pytest.raises(costs.OutOfMemory) as err:
            costs.step_cost(run_config(config), plan, devices)
        assert err.value.needed_bytes == 20 * 2**30  # read back from the cached message
    assert calls == [1]


def test_a_cache_directory_that_cannot_be_written_still_measures_the_cpu_peak(
    monkeypatch, capsys, tmp_path
):
    """MFU's CPU peak is cached beside the programs: a cache path that is a file stopped the
    run with a traceback after the plan, --no-compile-cache or not."""
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the cache directory would go")
    monkeypatch.setenv("JAXKIT_CACHE_DIR", str(blocker))
    measured = peak.cpu_peak(jax.devices()[:1])
    assert measured.flops_per_s > 0 and "not cached" in measured.source
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and "cannot be cached" in lines[0]

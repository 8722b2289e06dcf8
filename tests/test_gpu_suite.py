"""benchmarks/gpu_suite.sh's first stage, on the CPU: what a GPU run checks before any
measurement, so that the suite cannot rot between the rare runs on a GPU.

The whole dry run (`bash benchmarks/gpu_suite.sh --dry-run`, minutes) runs by hand; this
runs only its import-and-one-step stage, in this process.
"""

import math

import jax
from script_module import load


def _suite():
    return load("benchmarks/gpu_suite.py")


def test_the_suite_takes_one_step_of_the_kit_and_resolves_the_hand_loops_config():
    found = _suite().smoke(dry_run=True)
    assert found["ok"] and found["jax"] == jax.__version__
    assert found["platform"] == "cpu" and found["device_kind"] == jax.devices()[0].device_kind
    # auto on a CPU is xla (cudnn on an NVIDIA GPU in bfloat16), the same for both loops.
    assert found["attention"] == found["hand_loop_attention"] == "xla"
    # One step of the shrunk lm_125m from its random init: the loss is near ln(256) ≈ 5.55,
    # the uniform over its 256 tokens; 0.5 is ten times what a random init moves it (0.04
    # in gpu_lm125m --small's first step), and a NaN or a wrong loss fails it.
    assert abs(found["loss"] - math.log(256)) < 0.5, found["loss"]


def test_the_suite_refuses_an_unknown_config_for_only():
    suite = _suite()
    assert suite.parse_args(["--only", "lm_125m,lm_1b"]).only == ["lm_125m", "lm_1b"]
    assert suite.parse_args(["--only", "lm_1b"]).budget_s == 180  # --only re-measures part
    try:
        suite.parse_args(["--only", "lm_7b"])
    except SystemExit as exit_:
        assert exit_.code == 2
    else:
        raise AssertionError("--only lm_7b was accepted")


def test_the_trace_samples_the_noise_scale_before_its_window_and_at_its_second_step():
    # The first sampled step traces, lowers and compiles the noise-scale program (5.0 s
    # for lm_125m against a 0.79 s step): a step before the window takes that, so the
    # second traced step records what sampling costs a step.
    from jaxkit.batch.noise_scale import samples_at
    from jaxkit.config import parse_profile_steps

    given = dict(o.split("=", 1) for o in _suite().trace_overrides("xla", 4, dry_run=False))
    steps = int(given["train.steps"])
    start, end = parse_profile_steps(given["train.profile_steps"], steps)
    every = int(given["train.noise_scale_every"])
    traced = list(range(start + 1, end + 1))  # metrics.jsonl's step numbers, 1 first
    sampled = [n for n in range(1, steps + 1) if samples_at(n, every)]
    assert len(traced) == 2 and traced[-1] <= steps
    assert [n for n in sampled if n in traced] == [traced[1]]
    assert any(n < traced[0] for n in sampled)


def test_the_hand_loop_benchmark_explains_an_mfu_above_100_percent(monkeypatch):
    # gpu_lm125m.py --small measured MFU 97-132% on a busy CPU and said nothing of it.
    from jaxkit.records.steps import above_the_peak

    monkeypatch.setattr("sys.argv", ["gpu_lm125m.py", "--small"])
    bench = load("benchmarks/gpu_lm125m.py")
    source = "f32 matmul measured on 1 CPU devices (cached in cpu_peak.json)"
    kit = {"kit_mfu": 0.97, "hand_mfu": 1.32, "model_flops_per_step": 1e9}
    kit["kit_compiled"] = {"hardware_per_model_flop": 0.9}
    lines = bench.peak_warning(kit, source)
    assert lines and lines == above_the_peak(
        {"mfu": 1.32, "hfu": 1.32 * 0.9, "peak_source": source}
        | {"model_flops_per_step": 1e9, "hardware_flops_per_step": 0.9e9}
    )
    assert "CPU peak was cached while this machine was busier" in lines[0]
    kit["hand_mfu"] = 0.99
    assert bench.peak_warning(kit, source) == []


def test_the_import_check_tells_the_extras_from_what_is_missing(tmp_path):
    # No wheel carried (tmp_path is empty): the kit's own dependencies the GPU image lacks
    # are missing; the packages of its extras (wandb, lm-eval), imported only where their
    # option is used, are listed apart. The dry run failed on them once the extras landed.
    found = _suite().imports(tmp_path)
    assert not found["ok"] and found["carried"] == []
    assert "ml-collections" in found["missing"] and "tensorboardx" in found["missing"]
    assert found["extras"]["wandb"] == "the wandb extra, imported by jaxkit/records/wandb_log.py"
    assert (
        found["extras"]["lm_eval"] == "the eval extra, imported by jaxkit/generate/lm_eval_model.py"
    )
    assert not {"wandb", "lm_eval"} & set(found["missing"])

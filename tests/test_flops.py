"""Model FLOPs (the architecture's, MFU's basis) and hardware FLOPs (the compiled matmuls,
loop bodies times their trips: HFU's basis)."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import pytest

from jaxkit.batch.schedule import plan_from_config
from jaxkit.config import apply_overrides, load_config, run_config
from jaxkit.plan import costs
from jaxkit.plan.flops import hardware_flops

# lm_tiny's widths on a Llama block: large enough that matmuls dominate the step.
LLAMA = ["model.num_layers=2", "data.seq_len=64", "data.max_bytes=60000"]
# Half the tiny models' widths: the same counts at a cheaper compile.
NARROW = ["model.d_model=64", "model.mlp_dim=128"]


def step_cost(name, *overrides, devices=4, per_device=2, accum=2, shrink=True):
    config = load_config(name)
    apply_overrides(config, [*(LLAMA if shrink else []), *overrides])
    split = costs.split_config(run_config(config), per_device, accum)
    plan = plan_from_config(split, {"data": devices, "fsdp": 1, "tensor": 1})
    return costs.step_cost(split, plan, jax.devices()[:devices])


def test_loop_bodies_count_once_per_trip():
    def f(w_NxDxD, x_BxD):
        def body(x, w):
            return jnp.tanh(x @ w), None

        return jnp.sum(jax.lax.scan(body, x_BxD, w_NxDxD)[0])

    w, x = jnp.ones((5, 64, 64)), jnp.ones((8, 64))
    forward = jax.jit(f).lower(w, x).compile()
    assert hardware_flops(forward.as_text()) == 5 * 2 * 8 * 64 * 64
    # The gradient: per trip the forward matmul again, and two for the backward.
    backward = jax.jit(jax.grad(f)).lower(w, x).compile()
    assert hardware_flops(backward.as_text()) == 5 * 3 * 2 * 8 * 64 * 64
    # XLA's own count sees the body once: what the two counts exist to correct.
    assert jax.jit(f).lower(w, x).compile().cost_analysis()["flops"] < 2 * 2 * 8 * 64 * 64


def test_gpu_gemm_calls_and_tpu_convolutions_count_as_matmuls():
    text = "\n".join(
        [
            "ENTRY %main (p0: f32[16,32], p1: f32[32,8]) -> f32[16,8] {",
            "  %p0 = f32[16,32]{1,0} parameter(0)",
            "  %p1 = f32[32,8]{1,0} parameter(1)",
            "  %gemm = (f32[16,8]{1,0}, s8[4194304]{0}) custom-call(%p0, %p1), "
            'custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":'
            '{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],'
            '"rhs_contracting_dimensions":["0"]}}}',
            "  %conv = f32[16,8]{1,0} convolution(%p0, %p1), dim_labels=bf_io->bf",
            "  ROOT %t = f32[16,8]{1,0} get-tuple-element(%gemm), index=0",
            "}",
        ]
    )
    assert hardware_flops(text) == 2 * (2 * 16 * 8 * 32)


@pytest.mark.parametrize("name", ["llama_tiny", "lm_tiny"])
def test_analytic_flops_match_the_compiled_step_unrolled_without_remat(name):
    cost = step_cost(name, shrink=False)  # the configs' own shapes: d 128, seq 128
    # XLA's count adds the elementwise work (norms, softmax, activations, the optimizer)
    # that the convention leaves out: 2-3% at these widths, less as models widen. The
    # compiled matmuls are what the convention counts.
    assert cost.flops_per_step == pytest.approx(cost.model_flops_per_step, rel=0.05)
    assert cost.hardware_flops_per_step == pytest.approx(cost.model_flops_per_step, rel=0.05)


def test_scan_and_remat_leave_model_flops_alone_and_remat_adds_hardware_flops():
    # At half the widths (NARROW): full remat's ratio 1.23 against 1.24 at lm_tiny's.
    base = step_cost("llama_tiny", *NARROW)
    scanned = step_cost("llama_tiny", *NARROW, "model.scan_layers=true")
    dots = step_cost("llama_tiny", *NARROW, "model.scan_layers=true", "model.remat=dots")
    full = step_cost("llama_tiny", *NARROW, "model.scan_layers=true", "model.remat=full")
    for other in (scanned, dots, full):
        assert other.model_flops_per_step == base.model_flops_per_step  # so MFU is too
    # Scanned: XLA's count sees one layer of two; the trip count restores the other.
    assert scanned.hardware_flops_per_step == pytest.approx(base.hardware_flops_per_step, rel=1e-3)
    assert scanned.flops_per_step < 0.8 * base.flops_per_step
    # dots keeps every matmul output: nothing to recompute that is a matmul.
    assert dots.hardware_flops_per_step == pytest.approx(base.hardware_flops_per_step, rel=1e-3)
    # full recomputes each block's forward matmuls (a third of its training matmuls); the
    # head and embedding lie outside the blocks, so the step's share is less than 4/3.
    ratio = full.hardware_flops_per_step / base.hardware_flops_per_step
    assert 1.15 < ratio < 4 / 3


def test_fused_accumulation_counts_its_micro_batch_loop():
    multisteps = step_cost("llama_tiny", *NARROW, accum=4)
    fused = step_cost("llama_tiny", *NARROW, "train.accumulation=fused", accum=4)
    assert fused.model_flops_per_step == multisteps.model_flops_per_step
    assert fused.hardware_flops_per_step == pytest.approx(
        multisteps.hardware_flops_per_step, rel=1e-3
    )


def _split(per_device, accum, remat, hardware, memory=10):
    plan = plan_from_config(
        costs.split_config(run_config(load_config("llama_tiny")), per_device, accum),
        {"data": 8, "fsdp": 1, "tensor": 1},
    )
    cost = costs.StepCost(
        argument_bytes=memory,
        output_bytes=0,
        alias_bytes=0,
        temp_bytes=0,
        flops_per_call=1.0,
        calls_per_step=accum,
        update_flops=0.0,
        compile_s=0.0,
        model_flops_per_call=100.0 / accum,
        hardware_flops_per_call=hardware / accum,
    )
    return costs.Split(devices=8, plan=plan, cost=cost, remat=remat)


def test_the_recommendation_weighs_recomputation_before_batch_size():
    none_small = _split(2, 4, "none", hardware=100, memory=8)
    full_large = _split(8, 1, "full", hardware=133, memory=9)
    dots_mid = _split(4, 2, "dots", hardware=100, memory=9)
    # The seeds' rule alone would take the largest batch (full remat, 8 rows); recomputing
    # a third more matmuls costs more than the narrower ones.
    assert costs.recommend([none_small, full_large], 10, devices=8) is none_small
    assert costs.recommend([none_small, full_large, dots_mid], 10, devices=8) is dots_mid
    # When only recomputation makes it fit, it is recommended.
    assert costs.recommend([none_small, full_large], 8, devices=8) is none_small
    none_big = _split(2, 4, "none", hardware=100, memory=12)
    assert costs.recommend([none_big, full_large], 10, devices=8) is full_large
    # Fewer matmul FLOPs executed than counted (XLA rewrote a matmul with a dimension of 1)
    # does not make a narrower batch faster: the wider one stays first.
    rewritten = _split(1, 8, "none", hardware=80, memory=5)
    assert costs.recommend([rewritten, none_small], 10, devices=8) is none_small


def test_plan_compares_remat_policies_per_split(tmp_path):
    from cli_run import jaxkit  # in-process: what the plan prints, not a process

    # One block at half llama_tiny's widths (a compile of two blocks costs more): full remat
    # executes 1.19 times the step's matmuls, the head lying outside the block; one block at
    # d_model 32, MLP 48 gave 1.152, too close to the bound below.
    tiny = [*NARROW, "model.num_layers=1", "data.seq_len=32", "data.max_bytes=60000"]
    args = [
        "plan",
        "llama_tiny",
        *tiny,
        "batch.global_batch_size=16",
        "batch.per_device_batch_size=2",
    ]
    out = jaxkit(
        *args,
        "--all-splits",
        "--device-counts",
        "8",
        "--remat",
        "full,none",
        "--json",
        "--memory-budget",
        "1GiB",
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    # Everything fits: the widest split without recomputation, though full was listed first.
    assert result["recommended"]["remat"] == "none"
    assert result["recommended"]["per_device_batch_size"] == 2
    splits = result["splits"]
    assert sorted((s["remat"], s["per_device_batch_size"]) for s in splits) == [
        ("full", 1),
        ("full", 2),
        ("none", 1),
        ("none", 2),
    ]
    by = {(s["remat"], s["per_device_batch_size"]): s for s in splits}
    for b in (1, 2):
        none, full = by[("none", b)], by[("full", b)]
        assert none["model_flops_per_step"] == full["model_flops_per_step"]
        assert none["hardware_flops_per_step"] == pytest.approx(
            none["model_flops_per_step"], rel=0.05
        )
        assert full["hardware_flops_per_step"] > 1.15 * none["hardware_flops_per_step"]
    # Without --remat, the config's own policy, in the JSON too (one split: 8 × 1 row).
    one = jaxkit(
        *args,
        *("batch.global_batch_size=8", "batch.per_device_batch_size=1", "model.remat=dots"),
        *("--all-splits", "--device-counts", "8", "--json"),
    )
    assert [s["remat"] for s in json.loads(one.stdout)["splits"]] == ["dots"]
    for bad, said in [
        (["--all-splits", "--remat", "some"], "'some' is not a policy"),
        (["--remat", "full"], "--remat applies only with --all-splits or --max-per-device-batch"),
    ]:
        out = jaxkit(*args, *bad)
        assert out.returncode == 2 and said in out.stderr, out.stderr
    out = jaxkit("plan", "mlp_digits", "--all-splits", "--remat", "full")
    assert out.returncode == 2 and "has no activation recompute policies" in out.stderr


def test_tpu_programs_count_their_loops_and_convolutions():
    """The TPU compiler states no trip count and writes matmuls as convolutions, batch
    dimensions as dilated windows (compiled for a described v5e slice, no TPU needed)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxkit.distributed import on_cloud_tpu_vm
    from jaxkit.plan.targets import parse_target, target_devices

    devices = target_devices(parse_target("v5litepod-8"))
    # Describing a slice does not make this process (or the ones it starts) a TPU VM.
    assert not on_cloud_tpu_vm() and "TPU_ACCELERATOR_TYPE" not in os.environ
    mesh = jax.make_mesh((8,), ("d",), devices=devices)

    def f(w_NxDxD, x_BxD):
        def body(x, w):
            return jnp.tanh(x @ w), None

        return jnp.sum(jax.lax.scan(body, x_BxD, w_NxDxD)[0])

    w = jax.ShapeDtypeStruct((5, 256, 256), jnp.float32, sharding=NamedSharding(mesh, P()))
    x = jax.ShapeDtypeStruct((64, 256), jnp.float32, sharding=NamedSharding(mesh, P("d")))
    backward = jax.jit(jax.grad(f)).lower(w, x).compile()
    assert hardware_flops(backward.as_text()) == 5 * 3 * 2 * 8 * 256 * 256  # 8 rows per chip
    # A whole step, attention's batched matmuls included (xla's attention: a TPU target's
    # auto takes splash, whose Pallas kernel states no FLOPs). Half lm_tiny's widths, one
    # layer and one row per chip: each compile for the chip costs less, and attention is
    # still a quarter of the step; rows stay 128 long, splash's block.
    config = load_config("lm_tiny")
    apply_overrides(config, [*NARROW, "model.num_layers=1", "model.attention=xla"])
    split = costs.split_config(run_config(config), 1, 1)
    plan = plan_from_config(split, {"data": 8, "fsdp": 1, "tensor": 1})
    cost = costs.step_cost(split, plan, devices)
    assert cost.hardware_flops_per_step == pytest.approx(cost.model_flops_per_step, rel=0.05)
    # With splash, what is counted is the step less attention's scores and weighted values:
    # 12 × layers × d_model × seq_len per token, over the chip's one row (flops.py).
    apply_overrides(config, ["model.attention=splash"])
    split = costs.split_config(run_config(config), 1, 1)
    with_splash = costs.step_cost(split, plan, devices)
    m, seq = split.model, split.data.seq_len
    kernel = 12 * m.num_layers * m.d_model * seq * seq
    assert with_splash.hardware_flops_per_step == pytest.approx(
        cost.model_flops_per_step - kernel, rel=1e-3
    )
    # Grouped-query attention, scanned: the projections become convolutions whose padded
    # window is wider than its input; only the taps on real input count (at these widths,
    # one row per chip as at eight, counting every tap gives 1.04 and 1.2 hardware FLOPs per
    # model FLOP).
    counts = []
    for scan in ("false", "true"):
        llama = load_config("llama_tiny")
        apply_overrides(llama, [*NARROW, f"model.scan_layers={scan}", "model.attention=xla"])
        split = costs.split_config(run_config(llama), 1, 1)
        cost = costs.step_cost(split, plan_from_config(split, plan_shape(plan)), devices)
        counts.append(cost.hardware_flops_per_step)
        assert cost.hardware_flops_per_step == pytest.approx(cost.model_flops_per_step, rel=0.01)
    assert counts[0] == pytest.approx(counts[1], rel=1e-6)


def test_tpu_windowed_matmuls_over_sharded_weights_count_each_trip():
    """With weights sharded along the contraction (fsdp), the TPU compiler gathers them in a
    loop of windowed matmuls whose counter is unsigned and steps by 2: each trip counts."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxkit.plan.targets import parse_target, target_devices

    mesh = jax.make_mesh((8,), ("d",), devices=target_devices(parse_target("v5litepod-8")))
    rows, d_in, d_out = 8192, 1024, 4096

    def f(w_IxO, x_BxI):
        return jnp.sum(jnp.tanh(x_BxI @ w_IxO).astype(jnp.float32))

    w = jax.ShapeDtypeStruct((d_in, d_out), jnp.bfloat16, sharding=NamedSharding(mesh, P("d")))
    x = jax.ShapeDtypeStruct((rows, d_in), jnp.bfloat16, sharding=NamedSharding(mesh, P("d")))
    text = jax.jit(jax.grad(f, argnums=(0, 1))).lower(w, x).compile().as_text()
    assert "windowed_dot_general" in text  # the loop this test is about
    # Forward, and the gradients of both operands, for this chip's rows.
    assert hardware_flops(text) == 3 * 2 * (rows // 8) * d_in * d_out


def test_tpu_fused_step_of_one_micro_step_runs_the_model_once():
    """Fused, K = 1, scanned layers across 2 data groups: compiled for a TPU, a scan of one
    micro-step ran the layer loops twice (2.33 hardware FLOPs per model FLOP)."""
    from jaxkit.plan.targets import parse_target, target_devices

    config = load_config("llama_tiny")
    apply_overrides(
        config,
        [
            *LLAMA,
            *NARROW,
            "model.scan_layers=true",
            "train.accumulation=fused",
            "mesh.data=2",
            "mesh.fsdp=-1",
        ],
    )
    split = costs.split_config(run_config(config), 2, 1)
    plan = plan_from_config(split, {"data": 2, "fsdp": 4, "tensor": 1})
    cost = costs.step_cost(split, plan, target_devices(parse_target("v5litepod-8")))
    assert cost.hardware_flops_per_step == pytest.approx(cost.model_flops_per_step, rel=0.01)


class _ReportedMemory:
    """What compiled.memory_analysis() gives, as the TPU compiler fills it in."""

    def __init__(self, temp: int, peak: int):
        self.argument_size_in_bytes, self.output_size_in_bytes = 1000, 900
        self.alias_size_in_bytes = 800  # the donated state: 1,100 bytes held
        self.temp_size_in_bytes, self.peak_memory_in_bytes = temp, peak


class _Compiled:
    def __init__(self, memory: _ReportedMemory):
        self.memory = memory

    def memory_analysis(self) -> _ReportedMemory:
        return self.memory

    def cost_analysis(self) -> dict[str, float]:
        return {"flops": 1.0}


def test_a_step_reported_with_no_temporaries_is_held_at_the_compiler_s_peak():
    """libtpu as jax 0.10 pins it reports 0 bytes of temporaries for some steps (below)
    next to a peak above the state: the peak stands in, so such a step is not planned as
    holding its state alone. Where temporaries are reported, they count as they are."""
    none_reported = costs.cost_of(_Compiled(_ReportedMemory(0, 5000)), 1, 0.0, 0.0)
    assert none_reported.memory_bytes == 5000
    reported = costs.cost_of(_Compiled(_ReportedMemory(3000, 5000)), 1, 0.0, 0.0)
    assert reported.memory_bytes == 1100 + 3000


def test_tpu_fused_full_remat_step_counts_its_temporaries():
    """For this program the TPU compiler of jax 0.10's libtpu reports 0 bytes of
    temporaries next to a peak above the state; jax 0.12's (libtpu 0.0.50.1) reports 4.6 MB
    of them (more than its own peak of 1.35 MB: docs/contributing.md#jax-012). Either way
    the step is not planned as holding its state alone. (One block at half llama_tiny's
    widths is such a program, as two blocks are.)"""
    from jaxkit import mesh as mesh_lib
    from jaxkit.plan.targets import parse_target, target_devices
    from jaxkit.step.train_step import build

    config = load_config("llama_tiny")
    apply_overrides(
        config,
        [
            *LLAMA,
            *NARROW,
            "model.num_layers=1",
            "model.remat=full",
            "train.accumulation=fused",
            "mesh.data=1",
            "mesh.fsdp=-1",
        ],
    )
    split = costs.split_config(run_config(config), 2, 1)
    plan = plan_from_config(split, {"data": 1, "fsdp": 8, "tensor": 1})
    mesh = mesh_lib.make_mesh(
        dataclasses.asdict(split.mesh), target_devices(parse_target("v5litepod-8"))
    )
    compiled, cost = costs.compile_setup_step(split, plan, build(split, plan, mesh))
    reported = compiled.memory_analysis()
    state = cost.argument_bytes + cost.output_bytes - cost.alias_bytes
    assert 0 < state < reported.peak_memory_in_bytes
    if reported.temp_size_in_bytes == 0:
        assert cost.memory_bytes == reported.peak_memory_in_bytes
    else:
        assert cost.memory_bytes == state + reported.temp_size_in_bytes


def plan_shape(plan):
    return {"data": plan.data_parallel_size, "fsdp": 1, "tensor": 1}


def test_plan_gives_model_flops_per_device_as_records_do_and_all_devices_by_name(capsys):
    """Every model_flops_per_step is per device; the whole mesh's is named so."""
    from jaxkit import cli

    # mlp_digits: 64 → 128 → 128 → 10, weights and biases; 6 × params per example
    # (docs/models-at-scale.md).
    params = (64 * 128 + 128) + (128 * 128 + 128) + (128 * 10 + 10)
    every = 6 * params * 32  # a global batch of 32 rows
    assert cli.main(["plan", "mlp_digits", "--json"]) == 0
    model = json.loads(capsys.readouterr().out)["model"]
    assert model["model_flops_per_step_all_devices"] == every
    assert model["model_flops_per_step"] == every / 8  # 8 devices
    assert cli.main(["plan", "mlp_digits"]) == 0
    assert "627 kFLOPs per optimizer step per device (model; 5.02 MFLOPs on all)" in (
        capsys.readouterr().out
    )


def test_lm_1b_docstring_states_the_models_own_flops_and_the_step_time_they_give():
    """The config's docstring promises a figure: it is the model's count (flops.py), and
    its step time at the MFU it states on 8 H100s follows from it and the peak table."""
    import importlib
    import re

    from jaxkit.plan.flops import model_flops_per_example
    from jaxkit.plan.peak import table_peak

    config = run_config(load_config("lm_1b"))
    plan = plan_from_config(config, {"data": 1, "fsdp": 8, "tensor": 1})
    flops = model_flops_per_example(config) * plan.global_batch_size
    doc = " ".join(importlib.import_module("configs.lm_1b").__doc__.split())
    stated = re.search(r"([\d.]+) PFLOP per optimizer step \(([\d,]+) tokens", doc)
    assert float(stated.group(1)) == round(flops / 1e15, 2)  # as printed: 3 figures
    assert int(stated.group(2).replace(",", "")) == plan.tokens_per_step
    mfu = int(re.search(r"at (\d+)% MFU", doc).group(1)) / 100
    step_s = flops / (8 * table_peak("H100", "bfloat16").flops_per_s * mfu)
    assert f"8 H100s (989 TFLOP/s bf16 each, jaxkit/plan/peak.py), {step_s:.1f} s a step" in doc

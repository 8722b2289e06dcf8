"""Model FLOPs (the architecture's, MFU's basis) and hardware FLOPs (the compiled matmuls,
loop bodies times their trips: HFU's basis)."""

import jax
import jax.numpy as jnp
import pytest

from jaxkit import costs
from jaxkit.batch_schedule import plan_from_config
from jaxkit.config import apply_overrides, load_config
from jaxkit.flops import hardware_flops

# lm_tiny's widths on a Llama block: large enough that matmuls dominate the step.
LLAMA = ["model.num_layers=2", "data.seq_len=64", "data.max_bytes=60000"]


def step_cost(name, *overrides, devices=4, per_device=2, accum=2, shrink=True):
    config = load_config(name)
    apply_overrides(config, [*(LLAMA if shrink else []), *overrides])
    split = costs.split_config(config, per_device, accum)
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
    base = step_cost("llama_tiny")
    scanned = step_cost("llama_tiny", "model.scan_layers=true")
    dots = step_cost("llama_tiny", "model.scan_layers=true", "model.remat=dots")
    full = step_cost("llama_tiny", "model.scan_layers=true", "model.remat=full")
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
    multisteps = step_cost("llama_tiny", accum=4)
    fused = step_cost("llama_tiny", "train.accumulation=fused", accum=4)
    assert fused.model_flops_per_step == multisteps.model_flops_per_step
    assert fused.hardware_flops_per_step == pytest.approx(
        multisteps.hardware_flops_per_step, rel=1e-3
    )

"""The compiled step as evidence: which collectives cross which mesh axes, how often.

The parser is checked against replica groups written out by hand and against programs
whose only collective is a psum over a named axis; the layout tests then pin what each
mesh costs in both accumulation modes.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from small_configs import SMALL_LM

from jaxkit.batch.schedule import plan_from_config
from jaxkit.config import apply_overrides, load_config, run_config
from jaxkit.mesh import make_mesh, mesh_shape
from jaxkit.plan import costs, step_time, traffic
from jaxkit.plan.hlo import (
    Collective,
    axes_spanned,
    bytes_per_call,
    collectives,
    device_groups,
    runs_per_call,
)
from jaxkit.plan.targets import parse_target, target_devices
from jaxkit.step.train_step import build

SHAPE = {"data": 2, "fsdp": 2, "tensor": 2}


@pytest.mark.parametrize(
    "line,groups",
    [
        ("replica_groups={{0,1},{2,3},{4,5},{6,7}}, use", [[0, 1], [2, 3], [4, 5], [6, 7]]),
        # iota(8) as 2×2×2, axes 1 and 2 swapped, rows of 2: devices 0,2 / 1,3 / 4,6 / 5,7.
        ("replica_groups=[4,2]<=[2,2,2]T(0,2,1), use", [[0, 2], [1, 3], [4, 6], [5, 7]]),
        ("replica_groups=[2,4]<=[8], use", [[0, 1, 2, 3], [4, 5, 6, 7]]),
        # Ids iota(8) as 2×2×2 with axes 0 and 1 swapped: [[[0,1],[4,5]],[[2,3],[6,7]]],
        # laid out as axes (1, 2, 4); groups run along axis_1: 0,2 / 1,3 / 4,6 / 5,7.
        (
            "replica_groups=mesh['axis_0'=1,'axis_1'=2,'axis_2'=4], "
            "device_ids=([2,2,2]T(1,0,2)) {'axis_1'}, use",
            [[0, 2], [1, 3], [4, 6], [5, 7]],
        ),
        # jax 0.12's XLA leaves the ids out where they run in mesh order: 4d + 2f + t.
        (
            "replica_groups=mesh['data'=2,'fsdp'=2,'tensor'=2] {'data'}, use",
            [[0, 4], [1, 5], [2, 6], [3, 7]],
        ),
        (
            "replica_groups=mesh['data'=2,'fsdp'=2,'tensor'=2] {'data','fsdp'}, use",
            [[0, 2, 4, 6], [1, 3, 5, 7]],
        ),
        ("source_target_pairs={{0,0},{1,2},{2,1},{3,3}}, meta", [[1, 2], [2, 1]]),
        ("replica_groups={}, use", [list(range(8))]),
    ],
)
def test_device_groups_read_every_format(line, groups):
    assert device_groups(line, 8) == groups


def test_axes_spanned_follow_mesh_order():
    # Mesh order: data is the slowest axis, tensor the fastest (device = 4d + 2f + t).
    assert axes_spanned([[0, 1], [2, 3]], SHAPE) == {"tensor"}
    assert axes_spanned([[0, 2]], SHAPE) == {"fsdp"}
    assert axes_spanned([[0, 4]], SHAPE) == {"data"}
    assert axes_spanned([[0, 1, 2, 3]], SHAPE) == {"fsdp", "tensor"}


# How the TPU compiler writes a reduce-scatter of a 128×128 gradient over 8 devices (cut
# down from a train step compiled for v5e:2x4): an all-reduce and the slice each device
# keeps, fused into an `all-reduce-scatter` computation, called from a while-loop body.
TPU_REDUCE_SCATTER = """\
HloModule step

%all-reduce-scatter.14 (input_0: f32[128,128]) -> f32[128,16] {
  %input_0 = f32[128,128]{0,1:T(8,128)S(1)} parameter(0)
  %all-reduce.111 = (f32[128,128]{0,1:T(8,128)}) all-reduce(%input_0), channel_id=1, \
replica_groups={{0,1,2,3,4,5,6,7}}, use_global_device_ids=true, to_apply=%add
  %get-tuple-element.405 = f32[128,128]{0,1:T(8,128)} get-tuple-element(%all-reduce.111), index=0
  ROOT %dynamic-slice.69 = f32[128,16]{0,1:T(8,128)S(1)} dynamic-slice(%get-tuple-element.405)
}

%body (p: f32[128,128]) -> f32[128,16] {
  %p = f32[128,128]{1,0} parameter(0)
  ROOT %fusion.398 = f32[128,16]{0,1:T(8,128)S(1)} fusion(%p), kind=kCustom, \
calls=%all-reduce-scatter.14
}

%after (q: f32[16]) -> f32[16] {
  %q = f32[16]{0} parameter(0)
  ROOT %all-reduce.7 = f32[16]{0} all-reduce(%q), replica_groups={{0,4},{1,5},{2,6},{3,7}}
}

ENTRY %main (x: f32[128,128]) -> f32[128,16] {
  %x = f32[128,128]{1,0} parameter(0)
  ROOT %while.1 = f32[128,16]{1,0} while(%x), condition=%cond, body=%body
}
"""


def test_a_tpu_all_reduce_scatter_fusion_counts_as_a_reduce_scatter():
    scatter, reduce = collectives(TPU_REDUCE_SCATTER, SHAPE)
    # Each device keeps an eighth of the 64 KiB it reduces, once per loop iteration.
    assert scatter == Collective("reduce-scatter", frozenset(SHAPE), 128 * 16 * 4, True)
    # A plain all-reduce elsewhere stays one.
    assert reduce == Collective("all-reduce", frozenset({"data"}), 16 * 4, False)


@pytest.mark.parametrize("axes", [("data",), ("fsdp",), ("tensor",), ("data", "fsdp")])
def test_a_psum_over_named_axes_is_found_crossing_exactly_those(axes):
    mesh = make_mesh(SHAPE)

    def total(x):
        return jax.lax.psum(x, axes)

    every = P(("data", "fsdp", "tensor"))  # one element per device, in and out
    f = jax.jit(jax.shard_map(total, mesh=mesh, in_specs=every, out_specs=every))
    x = jax.device_put(jnp.ones(8), NamedSharding(mesh, P(("data", "fsdp", "tensor"))))
    (found,) = collectives(f.lower(x).compile().as_text(), SHAPE)
    assert (found.kind, found.axes) == ("all-reduce", frozenset(axes))


def step_setup(mesh_overrides, mode, per_device, *extra, small=True):
    config = load_config("lm_tiny")
    apply_overrides(
        config,
        [
            *(SMALL_LM if small else []),
            "batch.global_batch_size=64",
            f"batch.per_device_batch_size={per_device}",
            "batch.grad_accum_steps=null",
            f"train.accumulation={mode}",
            *mesh_overrides,
            *extra,
        ],
    )
    config = run_config(config)
    mesh = make_mesh(dataclasses.asdict(config.mesh))
    plan = plan_from_config(config, mesh_shape(mesh))
    return config, plan, build(config, plan, mesh)


@functools.cache  # a program two tests read (2×2×2, fused, 2 rows per device) compiled once
def compiled_text(mesh_overrides, mode, per_device, tpu=False):
    """SMALL_LM's step lowered as compile_setup_step lowers it for the loop and compiled
    (for a described v5e:2x4 with `tpu`); without the FLOP counts compile_setup_step adds
    (about 0.5 CPU-s of each program's 2-3), which only the costs test reads."""
    config, plan, setup = step_setup(mesh_overrides, mode, per_device)
    if tpu:
        devices = target_devices(parse_target("v5e-8"))
        setup = build(config, plan, make_mesh(dataclasses.asdict(config.mesh), devices))
    lowered, _ = costs._lower(config, plan, setup)
    return plan, setup, lowered.compile().as_text()


def compiled_step(mesh_overrides, mode, per_device):
    """compiled_text's plan and setup, and the collectives in its program."""
    plan, setup, text = compiled_text(mesh_overrides, mode, per_device)
    return plan, setup, collectives(text, plan.mesh_shape)


def step_cost(mesh_overrides, mode, *extra):
    """compile_setup_step's cost of lm_tiny's step at 2 rows per device."""
    config, plan, setup = step_setup(mesh_overrides, mode, 2, *extra, small=False)
    return costs.compile_setup_step(config, plan, setup)[1]


def gradient_shard_bytes(setup):
    """Bytes of one device's shard of the gradient (the params' layout)."""
    return sum(
        4 * int(np.prod(s.shard_shape(x.shape)))
        for x, s in zip(
            jax.tree.leaves(jax.eval_shape(setup.init, jax.random.key(0)).params),
            jax.tree.leaves(setup.state_shardings.params),
            strict=True,
        )
    )


def data_reduced_bytes_per_step(plan, setup, found):
    """Bytes all-reduced across "data" per optimizer step, per device."""
    fused = setup.accumulation == "fused"
    calls = 1 if fused else plan.grad_accum_steps
    k = plan.grad_accum_steps
    return calls * bytes_per_call(found, "all-reduce", "data", loop_trips=k)


LAYOUTS = {
    "data=8": ("mesh.data=-1",),
    "fsdp=8": ("mesh.data=1", "mesh.fsdp=-1"),
    "2x2x2": ("mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"),
    "4x2": ("mesh.data=4", "mesh.tensor=-1"),  # data × tensor
}


@pytest.mark.parametrize("mode", ["multisteps", "fused"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_layout_crosses_only_the_axes_it_needs(layout, mode):
    plan, setup, found = compiled_step(LAYOUTS[layout], mode, 2)
    shape, k = plan.mesh_shape, plan.grad_accum_steps
    # Params and activations are never gathered across data: every data index holds whole
    # params (up to fsdp and tensor) and its own rows.
    assert runs_per_call(found, "all-gather", "data") == 0
    # Params are gathered across fsdp only where fsdp shards them.
    assert (runs_per_call(found, "all-gather", "fsdp") > 0) == (shape["fsdp"] > 1)
    # No gather is bigger than the largest parameter: each is gathered on its own.
    largest = max(
        4 * x.size for x in jax.tree.leaves(jax.eval_shape(setup.init, jax.random.key(0)).params)
    )
    assert max((c.result_bytes for c in found if c.kind == "all-gather"), default=0) <= largest
    # The gradient crosses data once per optimizer step in fused mode (one gradient's bytes,
    # plus a few scalars), and in every one of the K calls with MultiSteps (where the CPU
    # backend may all-reduce a gradient across all axes and slice it, for more bytes).
    crossings = data_reduced_bytes_per_step(plan, setup, found) / gradient_shard_bytes(setup)
    if shape["data"] == 1:
        assert runs_per_call(found, "all-reduce", "data") == 0
    elif mode == "fused":
        assert 1 <= crossings < 1.01, crossings
    else:
        assert k <= crossings <= 2 * k, (crossings, k)


@pytest.mark.parametrize("per_device,k", [(16, 1), (8, 2), (4, 4), (2, 8)])
def test_fused_reduces_the_gradient_across_data_once_per_step_for_any_k(per_device, k):
    plan, setup, found = compiled_step(LAYOUTS["2x2x2"], "fused", per_device)
    assert plan.grad_accum_steps == k
    # Outside the scan, so once per step (XLA may split the one psum into a few ops)...
    data_reductions = [c for c in found if c.kind == "all-reduce" and "data" in c.axes]
    assert data_reductions and not any(c.in_loop for c in data_reductions)
    # ... carrying one gradient, whatever K.
    crossings = data_reduced_bytes_per_step(plan, setup, found) / gradient_shard_bytes(setup)
    assert 1 <= crossings < 1.01


@pytest.mark.parametrize("layout", ["2x2x2", "fsdp=8"])
def test_fused_costs_what_multisteps_costs_on_sharded_meshes(layout):
    # The default lm_tiny's widths (on the shrunk one, fixed costs such as the K
    # micro-batches the fused call takes at once weigh more than they would on any model
    # worth sharding), one layer of its two: fused/multisteps memory 1.04 and 1.02 on the
    # two layouts, against 1.03 and 1.01 with both, at about half the compile.
    one_layer = "model.num_layers=1"
    multisteps = step_cost(LAYOUTS[layout], "multisteps", one_layer)
    fused = step_cost(LAYOUTS[layout], "fused", one_layer)
    assert fused.memory_bytes <= 1.10 * multisteps.memory_bytes
    assert abs(fused.flops_per_step / multisteps.flops_per_step - 1) <= 0.05


# The collective accounting of step_time.py against closed forms. A chip whose one link
# carries 1 B/s one way: an ICI collective's seconds are the bytes each chip sends.
UNIT = step_time.Chip(1.0, 1.0, 1.0, 1.0)


def step_traffic(layout, mode, per_device, tpu=False):
    plan, setup, text = compiled_text(LAYOUTS[layout], mode, per_device, tpu)
    found = traffic.transfers(text, list(setup.batch_sharding.mesh.devices.flat))
    calls = 1 if mode == "fused" else plan.grad_accum_steps
    return plan, setup, found, step_time.collective_traffic(found, calls, UNIT)


@pytest.mark.parametrize("mode", ["multisteps", "fused"])
def test_a_data_parallel_gradient_moves_its_ring_all_reduce_bytes(mode):
    # 8 data-parallel devices, K = 4 (the programs test_each_layout compiles). The gradient's
    # P bytes all-reduced over n devices send 2(n − 1)/n · P from each (plus a few scalars:
    # the loss and its weight): once per optimizer step fused, K times with MultiSteps.
    plan, setup, found, moved = step_traffic("data=8", mode, 2)
    n, k = 8, plan.grad_accum_steps
    assert k == 4
    ring = 2 * (n - 1) / n * gradient_shard_bytes(setup)
    reductions = 1 if mode == "fused" else k
    assert {t.kind for t in found} == {"all-reduce"}
    assert reductions * ring <= moved.ici_bytes <= reductions * ring + 64 * k
    assert moved.dcn_bytes == 0


def test_fsdp_gathers_the_params_once_per_micro_step_on_a_tpu():
    # On a described v5e:2x4 with fsdp = 8: every sharded param is gathered whole (its
    # (n − 1)/n share arriving at each chip) at least once per micro-step, and the fused
    # step of K = 4 micro-steps gathers exactly K times what K = 1 gathers (a known cost of
    # fsdp with accumulation); its gradients are reduced per micro-step too.
    n = 8
    one, setup, found_one, _ = step_traffic("fsdp=8", "fused", 8, tpu=True)
    four, _, found_four, _ = step_traffic("fsdp=8", "fused", 2, tpu=True)
    assert (one.grad_accum_steps, four.grad_accum_steps) == (1, 4)

    def gathered(found):
        return sum(t.runs * step_time._full_bytes(t) for t in found if t.kind == "all-gather")

    params = jax.eval_shape(setup.init, jax.random.key(0)).params
    sharded = sum(
        4 * x.size
        for x, s in zip(
            jax.tree.leaves(params), jax.tree.leaves(setup.state_shardings.params), strict=True
        )
        if s.shard_shape(x.shape) != x.shape
    )
    assert sharded <= gathered(found_one) <= 3 * sharded  # forward, and again for backward
    assert gathered(found_four) == 4 * gathered(found_one)
    sent = step_time.collective_traffic([t for t in found_one if t.kind == "all-gather"], 1, UNIT)
    assert sent.ici_bytes == pytest.approx((n - 1) / n * gathered(found_one))
    # The chips of a v5e:2x4 differ along both torus sides, neither a ring (16 chips are).
    assert {(t.group_size, t.torus_dims, t.wraps) for t in found_one} == {(8, 2, False)}

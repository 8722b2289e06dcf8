"""The predicted step time: its prices against closed forms, its HBM count against programs
whose traffic is known, a multi-slice program's DCN part, and what `jaxkit plan` says."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cli_run import jaxkit  # in-process
from jax.sharding import AxisType, Mesh
from test_hlo import LAYOUTS, gradient_shard_bytes, step_setup
from test_targets import TINY

from jaxkit.mesh import AXES
from jaxkit.plan import costs, step_time, targets, traffic
from jaxkit.step.train_step import build

W = 1e9  # one link's bytes per second, one way
CHIP = step_time.Chip(peak_flops_per_s=1e12, hbm_bytes_per_s=1e9, ici_link_bytes_per_s=W,
                      dcn_bytes_per_s=1e8)  # fmt: skip
V = 8 * 2**20  # the whole array's bytes


def moved(kind, result_bytes, group_size, slices=1, torus_dims=1, wraps=True, runs=1):
    t = traffic.Transfer(kind, result_bytes, runs, group_size, slices, torus_dims, wraps)
    return step_time.collective_traffic([t], 1, CHIP)


def test_ring_collectives_within_a_slice_cost_the_scaling_books_closed_forms():
    n = 8
    # An all-gather or a reduce-scatter of V bytes over n chips sends (n − 1)/n · V from
    # each; an all-reduce twice that. Over one ring (both directions): 2 W a chip.
    gather = moved("all-gather", V, n)
    assert gather.ici_bytes == pytest.approx((n - 1) / n * V)
    assert gather.ici_s == pytest.approx((n - 1) / n * V / (2 * W))
    scatter = moved("reduce-scatter", V // n, n)  # its result: one chip's share
    assert scatter.ici_bytes == pytest.approx(gather.ici_bytes)
    reduce = moved("all-reduce", V, n)
    assert reduce.ici_bytes == pytest.approx(2 * (n - 1) / n * V)
    # Without wraparound (a side shorter than a full ring) one direction: twice the time;
    # across two torus sides, twice the links: half the time.
    assert moved("all-reduce", V, n, wraps=False).ici_s == pytest.approx(2 * reduce.ici_s)
    assert moved("all-reduce", V, n, torus_dims=2).ici_s == pytest.approx(reduce.ici_s / 2)
    # A loop's collective runs each trip; none of this crosses the DCN.
    assert moved("all-reduce", V, n, runs=4).ici_bytes == pytest.approx(4 * reduce.ici_bytes)
    assert reduce.dcn_bytes == reduce.dcn_s == 0


def test_an_all_reduce_across_slices_is_priced_hierarchically():
    # 16 chips in 2 slices of 8: an ICI reduce-scatter and all-gather within each slice
    # (an all-reduce's bytes over 8), and a DCN all-reduce of 1/8 of V across the 2 slices.
    s, per_slice = 2, 8
    across = moved("all-reduce", V, s * per_slice, slices=s)
    assert across.ici_bytes == pytest.approx(2 * (per_slice - 1) / per_slice * V)
    assert across.dcn_bytes == pytest.approx(2 * (s - 1) / s * V / per_slice)
    assert across.dcn_s == pytest.approx(across.dcn_bytes / CHIP.dcn_bytes_per_s)


def test_the_prediction_is_its_slowest_resource_and_says_which():
    reduce = traffic.Transfer("all-reduce", V, 1, 8, 1, 1, True)
    p = step_time.predict(
        hardware_flops_per_step=2e9,  # 2 ms of compute
        hbm_bytes_per_step=1e6,  # 1 ms of HBM
        transfers=[reduce],  # 2 · 7/8 · V / 2 GB/s: 7.3 ms
        calls_per_step=1,
        model_flops_per_step=1e9,
        tokens_per_step=4096,
        devices=8,
        chip=CHIP,
        usd_per_chip_hour=2.0,
    )
    assert p.bound == "ici" and p.step_s == p.ici_s == pytest.approx(7 / 8 * V / W)
    assert p.tokens_per_s_per_device == pytest.approx(4096 / p.step_s / 8)
    assert p.mfu == pytest.approx(1e9 / p.step_s / 1e12)
    assert p.usd_per_billion_tokens == pytest.approx(2.0 * 8 * p.step_s / 3600 / 4096 * 1e9)
    # Fewer executed matmul FLOPs than the model's count are not a faster step.
    assert step_time.predict(
        hardware_flops_per_step=0.5e9, hbm_bytes_per_step=0, transfers=[],
        calls_per_step=1, model_flops_per_step=1e9, tokens_per_step=1, devices=1, chip=CHIP,
    ).compute_s == pytest.approx(1e-3)  # fmt: skip


def hbm(f, *args):
    compiled = jax.jit(f).lower(*args).compile()
    return traffic.hbm_bytes(compiled.as_text()), compiled.cost_analysis()["bytes accessed"]


def test_hbm_bytes_match_xla_without_loops_and_count_each_trip_with_them():
    x = jnp.zeros((1024, 1024))  # 4 MiB
    counted, xla = hbm(lambda x: x * 2 + 1, x)
    assert counted == xla == 2 * 4 * 2**20  # read once, written once

    def stack(buffer, update):  # 16 trips, each writing one 256 KiB slice of the stack
        def body(b, i):
            return jax.lax.dynamic_update_slice(b, update[None] * i, (i, 0, 0)), None

        return jax.lax.scan(body, buffer, jnp.arange(16))[0]

    counted, xla = hbm(stack, jnp.zeros((16, 256, 256)), jnp.zeros((256, 256)))
    piece = 256 * 256 * 4
    # The stack copied once into the loop's buffer (read and write), then per trip the
    # update read and its slice written in place; XLA's count takes one trip.
    assert counted == pytest.approx(2 * 16 * piece + 16 * 2 * piece, rel=1e-3)
    assert xla < counted


@pytest.fixture(scope="module")
def two_slices():
    """Two described v5e:2x2 slices: their 8 chips, slice by slice."""
    target = targets.parse_target("v5e:2x2", slices=2)
    devices = targets.target_devices(target)
    assert sorted({d.slice_index for d in devices}) == [0, 1]
    return sorted(devices, key=lambda d: (d.slice_index, d.id))


def slices_traffic(devices, mode):
    config, plan, setup = step_setup(LAYOUTS["data=8"], mode, 2)  # K = 4
    mesh = Mesh(np.array(devices).reshape(8, 1, 1), AXES, axis_types=(AxisType.Auto,) * 3)
    setup = build(config, plan, mesh)
    text = costs._lower(config, plan, setup)[0].compile().as_text()
    found = traffic.transfers(text, list(mesh.devices.flat))
    calls = 1 if mode == "fused" else plan.grad_accum_steps
    unit = step_time.Chip(1.0, 1.0, 1.0, 1.0)
    return found, step_time.collective_traffic(found, calls, unit), gradient_shard_bytes(setup)


def test_a_gradient_crosses_the_dcn_once_fused_and_each_micro_step_with_multisteps(two_slices):
    # Data parallel over 2 slices of 4 chips. The TPU compiler reduces within each slice
    # over the ICI and hands the DCN part to the Megascale runtime (a send per piece).
    found, fused, gradient = slices_traffic(two_slices, "fused")
    dcn = [t for t in found if t.slices > 1]
    assert dcn and all(t.kind == "all-reduce" and t.slices == 2 for t in dcn)
    assert all(t.slices == 1 and t.group_size == 4 for t in found if t not in dcn)
    # Each chip sends at most its gradient over the DCN once a step, at least a slice's
    # share of it (a reduce-scatter first).
    assert gradient / 4 <= fused.dcn_bytes <= gradient
    _, multisteps, _ = slices_traffic(two_slices, "multisteps")
    assert multisteps.dcn_bytes >= 4 * fused.dcn_bytes * 0.9  # K = 4 reductions, not 1


PRICED = ["plan", *TINY, "--target", "v5litepod-8", "--all-splits", "--json"]


def test_all_splits_on_a_target_predict_each_steps_time_and_price():
    out = jaxkit(*PRICED, "--usd-per-chip-hour", "1.2")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    for s in result["splits"]:
        parts = {b: s[f"{b}_s"] for b in step_time.BOUNDS}
        assert s["predicted_step_time_s"] == max(parts.values()) > 0
        assert s["bound"] == max(parts, key=parts.get)
        assert s["hbm_s"] > 0
        assert s["compute_s"] == pytest.approx(
            max(s["hardware_flops_per_step"], s["model_flops_per_step"]) / 197e12
        )
        tokens = s["global_batch_size"] * s["seq_len"]
        step = s["predicted_step_time_s"]
        assert s["tokens_per_s_per_device"] == pytest.approx(tokens / step / 8)
        assert s["predicted_mfu"] == pytest.approx(s["model_flops_per_step"] / step / 197e12)
        assert s["usd_per_billion_tokens"] == pytest.approx(1.2 * 8 * step / 3600 / tokens * 1e9)
        assert s["collective_bytes"]["ici"] > 0 and s["collective_bytes"]["dcn"] == 0
        assert s["dcn_s"] == 0  # one slice
    # The recommendation: the most predicted tokens per second per device.
    best = max(result["splits"], key=lambda s: s["tokens_per_s_per_device"])
    assert result["recommended"]["per_device_batch_size"] == best["per_device_batch_size"]
    text = jaxkit(*PRICED[:-1], "--usd-per-chip-hour", "1.2")
    assert "predicted step on v5litepod-8" in text.stdout and "USD/1B tokens" in text.stdout
    assert "the most predicted tokens per second per device" in text.stdout


def test_without_a_price_there_is_no_cost_and_without_tables_no_time(monkeypatch):
    out = jaxkit(*PRICED)
    assert out.returncode == 0, out.stderr
    assert all("usd_per_billion_tokens" not in s for s in json.loads(out.stdout)["splits"])
    bare = dataclasses.replace(targets.GENERATIONS["v5e"], dcn_bytes_per_s=0.0)
    monkeypatch.setitem(targets.GENERATIONS, "v5e", bare)
    text = jaxkit(*PRICED[:-1])
    assert text.returncode == 0, text.stderr
    assert "memory/device" in text.stdout  # memory is still planned
    assert "no predicted step time: it needs v5e's HBM, ICI and DCN bandwidths" in text.stdout
    assert "predicted_step_time_s" not in jaxkit(*PRICED).stdout


@pytest.mark.parametrize(
    "args,message",
    [
        (["--target", "v5e-8", "--slices", "0"], "--slices: must be at least 1, got 0"),
        (["--slices", "2"], "--slices applies only with --target"),
        (["--target", "v5e-8", "--all-splits", "--usd-per-chip-hour", "-1"], "not a positive"),
        (["--target", "v5e-8", "--all-splits", "--usd-per-chip-hour", "abc"], "not a positive"),
        (["--target", "v5e-8", "--all-splits", "--usd-per-chip-hour", "nan"], "not a positive"),
        (["--all-splits", "--usd-per-chip-hour", "1"], "applies only with --target"),
        (["--target", "v5e-8", "--usd-per-chip-hour", "1"], "applies only with --all-splits"),
        # The slices are checked before the batch: the error names the count there is.
        (
            ["--target", "v5e-8", "--slices", "2", "mesh.dcn_data=3"],
            "has 2 slices of 8 chips: mesh.dcn_data × mesh.dcn_fsdp = 3 × 1 = 3 slices, but the "
            "16 tpu devices are 2 slices: give mesh.dcn_data × mesh.dcn_fsdp = 2",
        ),
        # Slices in the config but not on the command line: --slices is named.
        (["--target", "v5e-8", "mesh.dcn_data=2"], "or plan 2 such slices: --slices 2"),
    ],
)
def test_bad_prices_and_slice_counts_are_one_line_and_exit_2(args, message):
    out = jaxkit("plan", "lm_tiny", *args)
    assert out.returncode == 2 and message in out.stderr, out.stderr
    assert out.stdout == ""


# A loop body as the TPU compiler writes one (cut down): one fusion updates a layer's slice
# of a stacked buffer in place and returns a new array beside it, another reads one layer of
# the stacked weights; the stacked arrays are 16 × 1 MiB, the loop runs 16 trips.
IN_PLACE = """\
HloModule m

%fused_update (param_0: f32[16,512,512], param_1: f32[512,512],\
 param_2: s32[]) -> (f32[16,512,512], f32[512,512]) {
  %param_0 = f32[16,512,512]{2,1,0} parameter(0)
  %param_1 = f32[512,512]{1,0} parameter(1)
  %param_2 = s32[]{:T(128)S(6)} parameter(2)
  %bitcast.1 = f32[1,512,512]{2,1,0} bitcast(%param_1)
  %dynamic-update-slice.1 = f32[16,512,512]{2,1,0} dynamic-update-slice(%param_0, %bitcast.1,\
 %param_2, %param_2, %param_2)
  %negate.1 = f32[512,512]{1,0} negate(%param_1)
  ROOT %tuple.1 = (f32[16,512,512]{2,1,0}, f32[512,512]{1,0}) tuple(%dynamic-update-slice.1,\
 %negate.1)
}

%fused_read (param_0.1: f32[16,512,512], param_1.1: s32[]) -> f32[512,512] {
  %param_0.1 = f32[16,512,512]{2,1,0} parameter(0)
  %param_1.1 = s32[]{:T(128)S(6)} parameter(1)
  %dynamic-slice.1 = f32[1,512,512]{2,1,0} dynamic-slice(%param_0.1, %param_1.1, %param_1.1,\
 %param_1.1), dynamic_slice_sizes={1,512,512}
  ROOT %bitcast.2 = f32[512,512]{1,0} bitcast(%dynamic-slice.1)
}

%body (p: (s32[], f32[16,512,512], f32[16,512,512])) -> (s32[], f32[16,512,512], f32[16,512,512]) {
  %p = (s32[], f32[16,512,512]{2,1,0}, f32[16,512,512]{2,1,0}) parameter(0)
  %i = s32[]{:T(128)S(6)} get-tuple-element(%p), index=0
  %stack = f32[16,512,512]{2,1,0} get-tuple-element(%p), index=1
  %weights = f32[16,512,512]{2,1,0} get-tuple-element(%p), index=2
  %layer = f32[512,512]{1,0} fusion(%weights, %i), kind=kLoop, calls=%fused_read
  %both = (f32[16,512,512]{2,1,0}, f32[512,512]{1,0}) fusion(%stack, %layer, %i), kind=kLoop,\
 calls=%fused_update
  %new = f32[16,512,512]{2,1,0} get-tuple-element(%both), index=0
  ROOT %t = (s32[], f32[16,512,512]{2,1,0}, f32[16,512,512]{2,1,0}) tuple(%i, %new, %weights)
}

ENTRY %main (a: f32[16,512,512], w: f32[16,512,512]) -> f32[16,512,512] {
  %a = f32[16,512,512]{2,1,0} parameter(0)
  %w = f32[16,512,512]{2,1,0} parameter(1)
  %zero = s32[]{:T(128)S(6)} constant(0)
  %init = (s32[], f32[16,512,512]{2,1,0}, f32[16,512,512]{2,1,0}) tuple(%zero, %a, %w)
  %loop = (s32[], f32[16,512,512]{2,1,0}, f32[16,512,512]{2,1,0}) while(%init),\
 condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"16"}}
  ROOT %out = f32[16,512,512]{2,1,0} get-tuple-element(%loop), index=1
}
"""


def test_slices_read_and_in_place_updates_count_their_slices_not_the_stack():
    mib = 2**20
    # Per trip: the read fusion reads one layer (1 MiB) and writes it (1 MiB); the update
    # fusion reads it (1 MiB), writes its slice of the stack in place (1 MiB, not 16) and
    # the negated copy (1 MiB). 5 MiB a trip, 16 trips.
    assert traffic.hbm_bytes(IN_PLACE) == 16 * 5 * mib


def test_two_slices_put_the_data_axis_over_the_dcn_and_price_it():
    tiny = [*TINY, "batch.global_batch_size=32"]  # 16 chips, 2 rows each
    out = jaxkit("plan", *tiny, "--target", "v5e-8", "--slices", "2", "--all-splits", "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert (result["num_slices"], result["num_devices"], result["num_hosts"]) == (2, 16, 2)
    split = result["splits"][0]  # per_device_batch_size 2, K = 1
    assert split["data_parallel_size"] == 16 and split["dcn_shape"]["data"] == 2
    assert split["collective_bytes"]["dcn"] > 0 and split["dcn_s"] > 0
    # The dcn keys, where given, say which axis spans the slices.
    out = jaxkit("plan", *tiny, "mesh.dcn_fsdp=2", "--target", "v5e-8", "--slices", "2", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["dcn_shape"] == {"data": 1, "fsdp": 2}


def test_a_classifier_is_priced_per_example_not_per_token():
    out = jaxkit(
        "plan", "mlp_digits", "batch.global_batch_size=16", "batch.per_device_batch_size=2",
        "--target", "v5e-8", "--all-splits", "--usd-per-chip-hour", "1", "--json",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    for s in json.loads(out.stdout)["splits"]:
        assert s["tokens_per_step"] is None
        step, rows = s["predicted_step_time_s"], s["global_batch_size"]
        assert s["examples_per_s_per_device"] == pytest.approx(rows / step / 8)
        assert s["usd_per_billion_examples"] == pytest.approx(8 * step / 3600 / rows * 1e9)
        assert "tokens_per_s_per_device" not in s and "usd_per_billion_tokens" not in s


def test_one_multisteps_program_serves_every_k_and_is_priced_per_k():
    # MultiSteps compiles one program per per-device batch, whatever K (K is its argument),
    # and the plan cache keeps that program's figures: read back for another K, its
    # collectives and HBM bytes count K calls, not the K of the plan that wrote them.
    def splits(global_batch):
        out = jaxkit(*PRICED, f"batch.global_batch_size={global_batch}")
        assert out.returncode == 0, out.stderr
        return {s["per_device_batch_size"]: s for s in json.loads(out.stdout)["splits"]}

    # 1 row a device: K = 2, then K = 4 (at K = 1 the step keeps no accumulator: another
    # program)
    k2, k4 = splits(16)[1], splits(32)[1]
    assert (k2["grad_accum_steps"], k4["grad_accum_steps"]) == (2, 4)
    assert k4["compile_cache_hit"]  # the same program
    assert k4["collective_bytes"]["ici"] == pytest.approx(2 * k2["collective_bytes"]["ici"])
    assert k4["hbm_s"] == pytest.approx(2 * k2["hbm_s"])

"""Mesh layouts side by side: tokens/s, memory per device and the collectives they cost.

For lm_tiny as configured and lm_tiny widened (d_model 512, MLP 2048, 8 heads, 4 layers), on
data=8, fsdp=8, 2×2×2 (data × fsdp × tensor) and 4×2 (data × tensor), in both accumulation
modes: tokens/s (mean step time of a short run of jaxkit's own loop, first step excluded;
the median of --repeats rounds, each round running every layout once, so that a slow spell
of a shared machine falls on all of them), the compiled memory per device, and per
optimizer step the collectives by kind and by the mesh axes they cross (counted in the
compiled HLO). Ratios are against data=8 with MultiSteps, in this one run. And per layout
the gradient noise scale's share of a step: its one-row gradient (train_step.Setup's
small_batch_grad_sq, on one device where params are whole on each, by the mesh otherwise,
with the collectives that costs) timed against a MultiSteps optimizer step, interleaved,
medians of --repeats × 5: its share of a step when every step samples, and at the default
train.noise_scale_every (the other steps never dispatch it).

Run: python benchmarks/sharding.py [--host-devices 8] [--steps 12] [--wide-steps 3]
     [--repeats 3] [--models default,wide] [--no-run]   (--no-run: compile and count only)
     [--tpu-topology v5e:2x4]   (compile for a TPU slice, without a TPU: needs libtpu
                                 installed; implies --no-run)
     [--gpu-topology 1x1x8]     (compile for a host of 8 GPUs like the one attached,
                                 slices x hosts x GPUs per host; implies --no-run)
Writes benchmarks/results/sharding.json (sharding-<topology>.json for a topology).

The CPU backend reduces a sharded gradient with an all-reduce and a slice; the TPU and GPU
compilers emit reduce-scatters, so a topology shows what the layouts cost on the hardware
they are for.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import pathlib
import statistics
import time

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--host-devices", type=int, default=8)
parser.add_argument("--steps", type=int, default=12, help="timed optimizer steps, default model")
parser.add_argument("--wide-steps", type=int, default=3, help="timed steps, widened model")
parser.add_argument("--repeats", type=int, default=3, help="rounds over every layout")
parser.add_argument("--models", default="default,wide")
parser.add_argument("--no-run", action="store_true", help="compile and count only")
topology = parser.add_mutually_exclusive_group()
topology.add_argument("--tpu-topology", help="compile for this TPU topology, e.g. v5e:2x4")
topology.add_argument("--gpu-topology", help="compile for GPUs like the attached, e.g. 1x1x8")
parser.add_argument("--out", help="default benchmarks/results/sharding[-TOPOLOGY].json")
args = parser.parse_args()
RESULTS = pathlib.Path(__file__).parent / "results"
if args.out is None:
    named = args.tpu_topology or (args.gpu_topology and f"gpu-{args.gpu_topology}")
    suffix = f"-{named.replace(':', '-')}" if named else ""
    args.out = str(RESULTS / f"sharding{suffix}.json")

import jax

jax.config.update("jax_num_cpu_devices", args.host_devices)  # used where there is no accelerator

from jaxkit.batch.noise_scale import SMALL_BATCH_ROWS
from jaxkit.batch.schedule import plan_from_config
from jaxkit.config import BASE_KEYS, apply_overrides, load_config, run_config
from jaxkit.data.sources import load_micro_batch, load_small_batch, make_sources
from jaxkit.mesh import make_mesh, mesh_shape
from jaxkit.plan import costs
from jaxkit.plan.hlo import collectives
from jaxkit.sections import RunConfig
from jaxkit.step.train_step import build
from jaxkit.train.loop import train

if args.tpu_topology:  # devices of a TPU slice described, not attached: compile only
    from jax.experimental import topologies

    args.no_run = True
    DEVICES = topologies.get_topology_desc(platform="tpu", topology_name=args.tpu_topology).devices
elif args.gpu_topology:  # the attached GPU's kind, as many as the topology says
    from jax.experimental import topologies

    args.no_run = True
    DEVICES = topologies.get_topology_desc(platform="cuda", topology=args.gpu_topology).devices
else:
    DEVICES = jax.devices()

MODELS = {
    "default": [],
    "wide": [
        "model.d_model=512",
        "model.mlp_dim=2048",
        "model.num_heads=8",
        "model.num_layers=4",
        "batch.global_batch_size=32",
        "batch.per_device_batch_size=4",
        "batch.grad_accum_steps=null",
    ],
}
LAYOUTS = {
    "data=8": ["mesh.data=-1"],
    "fsdp=8": ["mesh.data=1", "mesh.fsdp=-1"],
    "2x2x2": ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"],
    "4x2": ["mesh.data=4", "mesh.tensor=-1"],
}


def config_for(model: str, layout: str, mode: str, steps: int):
    config = load_config("lm_tiny")
    apply_overrides(
        config,
        [
            *MODELS[model],
            *LAYOUTS[layout],
            f"train.accumulation={mode}",
            f"train.steps={steps}",
            f"train.log_every={steps}",
            "train.eval_examples=32",
            "data.max_bytes=2000000",
        ],
    )
    return config


def collectives_per_step(config: RunConfig) -> dict[str, int]:
    """'kind across axes' -> executions per optimizer step, from the compiled step."""
    mesh = make_mesh(dataclasses.asdict(config.mesh), DEVICES)
    plan = plan_from_config(config, mesh_shape(mesh))
    setup = build(config, plan, mesh)
    compiled, cost = costs.compile_setup_step(config, plan, setup)
    k = plan.grad_accum_steps
    calls = 1 if setup.accumulation == "fused" else k
    counts: collections.Counter[str] = collections.Counter()
    for c in collectives(compiled.as_text(), mesh_shape(mesh)):
        counts[f"{c.kind} across {'+'.join(sorted(c.axes)) or 'none'}"] += calls * c.runs(k)
    return {
        "grad_accum_steps": k,
        "memory_bytes": cost.memory_bytes,
        **dict(sorted(counts.items())),
    }


EVERY = next(k.default for k in BASE_KEYS if k.name == "train.noise_scale_every")


def noise_scale_share(config: RunConfig) -> dict:
    """The noise scale's one-row gradient against an optimizer step (K MultiSteps calls),
    timed in turn, each to completion; medians, and its share of a step that samples."""
    mesh = make_mesh(dataclasses.asdict(config.mesh), DEVICES)
    plan = plan_from_config(config, mesh_shape(mesh))
    setup = build(config, plan, mesh)
    step, _ = costs.compile_setup_step(config, plan, setup)
    state = setup.init(jax.random.key(0))
    source, _ = make_sources(config)
    k = plan.grad_accum_steps
    micro = [load_micro_batch(source, 0, m, plan, 0, setup.batch_sharding) for m in range(k)]
    rows = load_small_batch(source, 0, SMALL_BATCH_ROWS, 0, setup.small_batch_sharding)
    hyper = setup.hyper(plan)
    small = setup.small_batch_grad_sq
    collectives_small = 0
    if hasattr(small, "lower"):  # sharded params: the devices take it together
        collectives_small = len(
            collectives(small.lower(state.params, rows).compile().as_text(), mesh_shape(mesh))
        )
    step_s, small_s = [], []
    for i in range(1 + 5 * args.repeats):  # the first of each: warm-up
        start = time.perf_counter()
        for batch in micro:
            state, _ = step(state, batch, hyper)
        jax.block_until_ready(state)
        middle = time.perf_counter()
        jax.block_until_ready(small(state.params, rows))
        end = time.perf_counter()
        if i:
            step_s.append(middle - start)
            small_s.append(end - middle)
    t_step, t_small = statistics.median(step_s), statistics.median(small_s)
    return {
        "step_s": t_step,
        "small_batch_grad_s": t_small,
        "small_batch_collectives": collectives_small,
        "share_every_step": t_small / (t_step + t_small),
        "noise_scale_every": EVERY,
        f"share_every_{EVERY}": t_small / EVERY / (t_step + t_small / EVERY),
    }


def main() -> None:
    rows = []
    print(f"mesh layouts on {len(DEVICES)} x {DEVICES[0].device_kind}")
    for model in args.models.split(","):
        steps = args.steps if model == "default" else args.wide_steps
        configs = {
            (layout, mode): config_for(model, layout, mode, steps)
            for layout in LAYOUTS
            for mode in ("multisteps", "fused")
        }
        found = {
            key: {"model": model, "layout": key[0], "mode": key[1]}
            | collectives_per_step(run_config(c))
            for key, c in configs.items()
        }
        rates: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
        for _ in range(0 if args.no_run else args.repeats):
            for key, config in configs.items():
                summary = train(config, progress=False, echo=lambda *a: None).summary
                rates[key].append(summary["tokens_per_s"])
        base = found[("data=8", "multisteps")]
        for key, row in found.items():
            if rates[key]:
                row["tokens_per_s"] = statistics.median(rates[key])
                row["tokens_per_s_rounds"] = rates[key]
            rows.append(row)
            speed = (
                f"{row['tokens_per_s']:>9,.0f} tokens/s "
                f"({row['tokens_per_s'] / base['tokens_per_s']:.2f}x data=8)"
                if "tokens_per_s" in row
                else ""
            )
            print(
                f"{model:>7} {row['layout']:>6} {row['mode']:>10} K={row['grad_accum_steps']:<2} "
                f"{row['memory_bytes'] / 2**20:8.1f} MiB "
                f"({row['memory_bytes'] / base['memory_bytes']:.2f}x) {speed}",
                flush=True,
            )
            print(
                "    per optimizer step: "
                + ", ".join(
                    f"{v} {k}"
                    for k, v in row.items()
                    if k.startswith(("all-", "reduce-", "collective-"))
                ),
                flush=True,
            )
        for layout in LAYOUTS if not args.no_run else ():
            share = noise_scale_share(run_config(config_for(model, layout, "multisteps", steps)))
            rows.append({"model": model, "layout": layout, "noise_scale": share})
            print(
                f"{model:>7} {layout:>6} noise scale: one-row gradient "
                f"{share['small_batch_grad_s'] * 1e3:7.1f} ms "
                f"({share['small_batch_collectives']} collectives) against a step of "
                f"{share['step_s'] * 1e3:7.1f} ms: {share['share_every_step']:.1%} of a step "
                f"sampling every step, {share[f'share_every_{EVERY}']:.1%} every {EVERY}",
                flush=True,
            )
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

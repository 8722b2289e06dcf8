"""MultiSteps against fused accumulation, side by side in one process.

For the tiny LM on simulated devices at K = 1, 4 and 16 micro-steps of per-device batch 4:
bytes all-reduced per optimizer step (counted in the compiled HLO) and time per optimizer
step (median over a short run of jaxkit's own loop), for train.accumulation = multisteps
and fused.

Run: python benchmarks/accumulation.py [--host-devices 8] [--steps 12]
Writes benchmarks/results/accumulation.json.

With --memory, nothing runs: each split of a global batch of 32 of lm_tiny widened to
d_model 256 and MLP 1024 is compiled in both modes, as `jaxkit plan --all-splits` prices it,
for this machine's 8 CPU devices on data=2 × fsdp=2 × tensor=2 and for a TPU --target on
data=2 × fsdp=4 (libtpu aborts on the fused step of a 2×2×2 mesh), and the per-device memory
(arguments, temporaries, the plan's total) of each is written to
benchmarks/results/accumulation_memory.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--host-devices", type=int, default=8)
parser.add_argument("--steps", type=int, default=12, help="optimizer steps per timed run")
parser.add_argument(
    "--out", default=str(pathlib.Path(__file__).parent / "results" / "accumulation.json")
)
parser.add_argument("--memory", action="store_true", help="compile-only memory per split")
parser.add_argument("--target", default="v5litepod-8", help="the TPU slice --memory plans for")
args = parser.parse_args()
if args.memory and args.out.endswith("accumulation.json"):
    args.out = args.out.removesuffix(".json") + "_memory.json"

import jax

jax.config.update("jax_num_cpu_devices", args.host_devices)

from jaxkit.batch.schedule import plan_from_config
from jaxkit.config import apply_overrides, load_config, run_config
from jaxkit.data.sources import load_global_batch, load_micro_batch, make_sources
from jaxkit.mesh import make_mesh, mesh_shape
from jaxkit.plan import costs
from jaxkit.plan.hlo import bytes_per_call, collectives, runs_per_call
from jaxkit.plan.targets import parse_target, target_devices
from jaxkit.sections import RunConfig
from jaxkit.step.train_step import build
from jaxkit.train.loop import train

WIDE = ["model.d_model=256", "model.mlp_dim=1024", "batch.global_batch_size=32"]
MESHES = {
    "cpu": ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"],
    "tpu": ["mesh.data=2", "mesh.fsdp=4", "mesh.tensor=1"],
}


def lm(mode: str, accum: int, steps: int):
    config = load_config("lm_tiny")
    apply_overrides(
        config,
        [
            "batch.global_batch_size=null",
            "batch.per_device_batch_size=4",
            f"batch.grad_accum_steps={accum}",
            f"train.steps={steps}",
            f"train.log_every={steps}",
            "train.eval_examples=32",
            f"train.accumulation={mode}",
            "data.max_bytes=2000000",
        ],
    )
    return config


def all_reduced_bytes_per_step(config: RunConfig) -> tuple[int, int]:
    mesh = make_mesh(dataclasses.asdict(config.mesh))
    plan = plan_from_config(config, mesh_shape(mesh))
    setup = build(config, plan, mesh)
    source, _ = make_sources(config)
    state = setup.init(jax.random.key(0))
    k = plan.grad_accum_steps
    if setup.accumulation == "fused":
        batch, calls = load_global_batch(source, 0, plan, 0, setup.fused_batch_sharding), 1
    else:
        batch, calls = load_micro_batch(source, 0, 0, plan, 0, setup.batch_sharding), k
    hlo = setup.step.lower(state, batch, setup.hyper(plan)).compile().as_text()
    found = collectives(hlo, mesh_shape(mesh))
    ops = calls * runs_per_call(found, "all-reduce", loop_trips=k)
    return ops, calls * bytes_per_call(found, "all-reduce", loop_trips=k)


def memory_rows(platform: str, devices) -> list[dict]:
    """Compiled per-device memory of every split of WIDE in both modes on `devices`."""
    rows = []
    for mode in ("multisteps", "fused"):
        config = load_config("lm_tiny")
        apply_overrides(config, [*WIDE, *MESHES[platform], f"train.accumulation={mode}"])
        run = run_config(config)
        splits = costs.enumerate_splits(run, [len(devices)])
        for split in costs.with_costs(run, splits, devices):
            cost = split.cost
            rows.append(
                {
                    "platform": platform,
                    "device_kind": devices[0].device_kind,
                    "mesh": split.plan.mesh_shape,
                    "mode": mode,
                    "per_device_batch_size": split.plan.per_device_batch_size,
                    "grad_accum_steps": split.plan.grad_accum_steps,
                    "memory_bytes": cost.memory_bytes if cost else None,
                    "argument_bytes": cost.argument_bytes if cost else None,
                    "temp_bytes": cost.temp_bytes if cost else None,
                }
            )
    return rows


def memory_main() -> None:
    rows = memory_rows("cpu", jax.devices()[:8])
    rows += memory_rows("tpu", target_devices(parse_target(args.target)))
    mib = 2**20
    for platform in MESHES:
        mine = [r for r in rows if r["platform"] == platform]
        print(f"{platform} ({mine[0]['device_kind']}, {mine[0]['mesh']}): MiB per device")
        print("  b × K    multisteps (temp, args)       fused (temp, args)   fused/multisteps")
        for ms in (r for r in mine if r["mode"] == "multisteps"):
            fu = next(
                r
                for r in mine
                if r["mode"] == "fused"
                and r["per_device_batch_size"] == ms["per_device_batch_size"]
            )
            cell = lambda r: (  # noqa: E731
                f"{r['memory_bytes'] / mib:6.2f} ({r['temp_bytes'] / mib:6.2f}, "
                f"{r['argument_bytes'] / mib:5.2f})"
            )
            print(
                f"  {ms['per_device_batch_size']:>2} × {ms['grad_accum_steps']:<2}  {cell(ms)}  "
                f"{cell(fu)}  {fu['memory_bytes'] / ms['memory_bytes']:.3f}"
            )
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=2) + "\n")
    print(f"wrote {out}")


def main() -> None:
    if args.memory:
        return memory_main()
    rows = []
    print(
        f"accumulation modes on {args.host_devices} x {jax.devices()[0].platform}, tiny LM, "
        f"per-device batch 4, {args.steps} steps per run"
    )
    for k in (1, 4, 16):
        for mode in ("multisteps", "fused"):
            config = lm(mode, k, args.steps)
            ops, nbytes = all_reduced_bytes_per_step(run_config(config))
            result = train(config, progress=False, echo=lambda *a: None)
            step_s = result.summary["median_step_time_s"]
            rows.append(
                {
                    "grad_accum_steps": k,
                    "mode": mode,
                    "all_reduces_per_step": ops,
                    "bytes_all_reduced_per_step": nbytes,
                    "step_time_s": step_s,
                }
            )
            print(
                f"K={k:>2} {mode:>10}: {ops:>3} all-reduces, {nbytes / 2**20:7.2f} MiB "
                f"all-reduced per optimizer step, {step_s * 1e3:8.1f} ms per step",
                flush=True,
            )
    for k in (1, 4, 16):
        ms, fu = (r for r in rows if r["grad_accum_steps"] == k)
        print(
            f"K={k:>2}: fused/multisteps time per step {fu['step_time_s'] / ms['step_time_s']:.3f},"
            f" bytes {fu['bytes_all_reduced_per_step'] / ms['bytes_all_reduced_per_step']:.3f}"
        )
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

"""The train state's copies of the params, and the compiled memory, per split on a TPU slice.

lm_125m (the config's own layers, unrolled unless --scan-layers) with fsdp over every chip of
--target (default v5litepod-8: 8 v5e chips) and --rows rows a chip, compiled ahead of time by
costs.step_cost from shapes alone (libtpu compiles for a described slice; nothing runs):

- MultiSteps at K = 1 (global batch = rows × chips): the state holds no accumulator;
- MultiSteps at the config's global batch (K > 1): it holds MultiSteps' accumulator;
- fused at the same K: it sums inside the step, and holds none between steps.

Per split: the params' bytes per chip, the state's (`state_bytes` of `jaxkit plan --json`),
the state in params' worth (AdamW: params and two moments, 3.0; with an accumulator, 4.0),
and the compiled argument and peak (argument + output − alias + temp) bytes per chip.

Run: python benchmarks/state_memory.py [--target v5litepod-8] [--rows 8] [--scan-layers]
Writes benchmarks/results/state_memory.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--config", default="lm_125m")
parser.add_argument("--target", default="v5litepod-8", help="a Cloud TPU slice")
parser.add_argument("--rows", type=int, default=8, help="rows a chip per micro-batch")
parser.add_argument("--scan-layers", action="store_true", help="one scanned block")
parser.add_argument(
    "--out", default=str(pathlib.Path(__file__).parent / "results" / "state_memory.json")
)
args = parser.parse_args()
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # a described TPU slice compiles from the CPU

import jax

jax.config.update("jax_platforms", "cpu")

from jaxkit import mesh as mesh_lib
from jaxkit.batch.plan import format_table
from jaxkit.batch.schedule import plan_from_config
from jaxkit.config import apply_overrides, load_config, run_config
from jaxkit.plan import costs
from jaxkit.plan.targets import parse_target, target_devices
from jaxkit.step.train_step import abstract_state, build


def split(mode: str, global_batch: int, devices: list) -> dict:
    config = load_config(args.config)
    apply_overrides(
        config,
        [
            "mesh.data=1",
            "mesh.fsdp=-1",
            f"model.scan_layers={str(args.scan_layers).lower()}",
            f"train.accumulation={mode}",
            "batch.grad_accum_steps=null",
            f"batch.global_batch_size={global_batch}",
            f"batch.per_device_batch_size={args.rows}",
        ],
    )
    run = run_config(config)
    mesh = mesh_lib.make_mesh(dataclasses.asdict(run.mesh), devices)
    plan = plan_from_config(run, mesh_lib.mesh_shape(mesh))
    params = mesh_lib.bytes_per_device(abstract_state(build(run, plan, mesh)).params)
    cost = costs.step_cost(run, plan, devices)
    return {
        "accumulation": mode,
        "grad_accum_steps": plan.grad_accum_steps,
        "global_batch_size": plan.global_batch_size,
        "params_bytes": params,
        "state_bytes": cost.state_bytes,
        "params_worth": cost.state_bytes / params,
        "argument_bytes": cost.argument_bytes,
        "peak_bytes": cost.memory_bytes,
        "temp_bytes": cost.temp_bytes,
    }


def main() -> None:
    target = parse_target(args.target)
    devices = list(target_devices(target))
    rows_per_step = args.rows * len(devices)
    global_batch = load_config(args.config).batch.global_batch_size
    print(f"{args.config} (scan_layers={args.scan_layers}), fsdp on {target.describe()}")
    results = []
    for mode, batch in (
        ("multisteps", rows_per_step),
        ("multisteps", global_batch),
        ("fused", global_batch),
    ):
        results.append(split(mode, batch, devices))
        print(f"  compiled {mode} K={results[-1]['grad_accum_steps']}", flush=True)
    rows = [
        (
            r["accumulation"],
            r["grad_accum_steps"],
            costs.format_bytes(r["params_bytes"]),
            costs.format_bytes(r["state_bytes"]),
            f"{r['params_worth']:.2f}",
            costs.format_bytes(r["argument_bytes"]),
            costs.format_bytes(r["peak_bytes"]),
        )
        for r in results
    ]
    header = ("accumulation", "K", "params", "state", "params' worth", "argument", "peak")
    print(format_table(header, rows))
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {"config": args.config, "target": args.target, "rows": args.rows, "splits": results},
            indent=2,
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

"""Memory per chip against the attention kernel, compiled for a TPU slice from this machine.

lm_125m (Llama-style, d_model 768, 12 layers of 12 heads of 64, seq 1024, bfloat16 matmuls)
without remat, layers scanned (as benchmarks/remat_memory.py compiles it), on --target
(default v5litepod-8: 8 v5e chips of 16 GiB, data-parallel over every chip), with
model.attention = xla (the (rows × heads × L × L) probabilities materialised and kept for
the backward pass) and splash (Pallas's splash attention, jaxkit/models/attention.py):

1. the compiled memory per chip (argument + output − alias + temp) at --batch rows per chip;
2. the largest per-device batch whose step fits the chip's HBM (costs.max_per_device_batch:
   doubling, then bisection).

Compile only: libtpu compiles for a described slice (jaxkit/plan/targets.py); nothing runs.

Run: python benchmarks/attention.py [--target v5litepod-8] [--config lm_125m] [--batch 8]
Writes benchmarks/results/attention.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import platform
import time

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--target", default="v5litepod-8", help="a Cloud TPU slice")
parser.add_argument("--config", default="lm_125m")
parser.add_argument("--batch", type=int, default=8, help="per-device batch of the comparison")
parser.add_argument("--kernels", default="xla,splash")
parser.add_argument(
    "--out", default=str(pathlib.Path(__file__).parent / "results" / "attention.json")
)
args = parser.parse_args()
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # a described TPU slice compiles from the CPU

import jax

jax.config.update("jax_platforms", "cpu")

from jaxkit import mesh as mesh_lib
from jaxkit.batch.schedule import plan_from_config
from jaxkit.config import apply_overrides, load_config, run_config
from jaxkit.plan import costs
from jaxkit.plan.targets import parse_target, target_devices


def main() -> None:
    target = parse_target(args.target)
    devices, budget = list(target_devices(target)), target.generation.hbm_bytes
    print(f"{args.config}, remat none, scanned layers, on {target.describe()}", flush=True)
    rows = []
    for kernel in args.kernels.split(","):
        config = load_config(args.config)
        apply_overrides(
            config, [f"model.attention={kernel}", "model.remat=none", "model.scan_layers=true"]
        )
        run = run_config(config)
        split = costs.split_config(run, args.batch, 1)
        shape = mesh_lib.resolve_mesh_shape(dataclasses.asdict(split.mesh), len(devices))
        start = time.perf_counter()
        try:
            cost = costs.step_cost(split, plan_from_config(split, shape), devices)
            at_batch = {"memory_bytes": cost.memory_bytes, "temp_bytes": cost.temp_bytes}
        except costs.OutOfMemory as err:
            at_batch = {"memory_bytes": None, "needed_bytes": err.needed_bytes}
        at_batch["compile_s"] = time.perf_counter() - start
        shown = at_batch["memory_bytes"] or at_batch.get("needed_bytes")
        print(
            f"  {kernel}: b={args.batch}: {costs.format_bytes(shown or 0)}"
            + ("" if at_batch["memory_bytes"] else " needed (does not fit)"),
            flush=True,
        )

        def progress(b: int, memory: int | None, kernel: str = kernel) -> None:
            text = costs.format_bytes(memory) if memory is not None else "refused (HBM)"
            print(f"  {kernel}: search b={b}: {text}", flush=True)

        found = costs.max_per_device_batch(run, devices, budget, progress=progress)
        rows.append(
            {
                "attention": kernel,
                "per_device_batch_size": args.batch,
                **at_batch,
                "max_per_device_batch_size": found.per_device_batch_size,
                "memory_bytes_at_max": found.cost.memory_bytes if found.cost else None,
                "search_compiles": found.compiles,
                "search_s": found.seconds,
            }
        )
        print(f"  {kernel}: largest per-device batch that fits: {found.per_device_batch_size}")
    result = {
        "config": args.config,
        "remat": "none",
        "scan_layers": True,
        "target": args.target,
        "target_description": target.describe(),
        "memory_budget_bytes": budget,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs (compile only)",
        "jax": jax.__version__,
        "rows": rows,
    }
    pathlib.Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

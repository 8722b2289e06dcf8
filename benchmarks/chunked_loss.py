"""Memory per device with the loss taken whole or in chunks (model.loss_chunk_tokens),
compiled for a TPU slice.

1. Grid: lm_125m (Llama-style, d_model 768, 12 layers, seq 1024, vocabulary 50304, bfloat16
   matmuls, tied head, model.remat=none) at per-device batch 1, 4 and 8 (grad_accum_steps 1)
   and each --chunks size (0: the whole logits), compiled ahead of time for --target (default
   v5litepod-8, 8 v5e chips of 16 GiB HBM; the config's mesh, data-parallel over every chip)
   by costs.step_cost on abstract inputs: nothing is allocated or run. Per point: the
   compiled memory per device (argument + output − alias + temp), its temporaries, and
   whether it fits the chip's HBM; a step the compiler refuses is recorded with the bytes it
   said it needed.
2. Search: per chunk size, the largest per-device batch whose step fits the chip's HBM
   without remat, by costs.max_per_device_batch (doubling, then bisection).

Layers are scanned (model.scan_layers=true), as in benchmarks/remat_memory.py, whose search
gave the 6 rows per chip this one starts from: one compiled block keeps each compile short.
Attention is the config's `auto`, which is splash on a TPU target.

Run: python benchmarks/chunked_loss.py [--target v5litepod-8] [--batches 1,4,8]
     [--chunks 0,256] [--search-chunks 0,256] [--no-search]
Writes benchmarks/results/chunked_loss.json.
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
parser.add_argument("--config", default="lm_125m")
parser.add_argument("--target", default="v5litepod-8", help="a Cloud TPU slice")
parser.add_argument("--batches", default="1,4,8", help="the grid's per-device batches")
parser.add_argument("--chunks", default="0,256", help="the grid's model.loss_chunk_tokens")
parser.add_argument("--search-chunks", default="0,256", help="chunk sizes to search the batch of")
parser.add_argument("--no-search", action="store_true", help="the grid only")
parser.add_argument(
    "--out", default=str(pathlib.Path(__file__).parent / "results" / "chunked_loss.json")
)
args = parser.parse_args()
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # a described TPU slice compiles from the CPU

import jax

jax.config.update("jax_platforms", "cpu")

from jaxkit import mesh as mesh_lib
from jaxkit.batch.schedule import plan_from_config
from jaxkit.config import load_config, run_config
from jaxkit.plan import costs
from jaxkit.plan.targets import parse_target, target_devices
from jaxkit.sections import RunConfig


def numbers(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def model_config(chunk: int) -> RunConfig:
    config = load_config(args.config)
    config.model.scan_layers = True
    config.model.remat = "none"
    config.model.loss_chunk_tokens = chunk
    return run_config(config)


def point(chunk: int, b: int, devices, budget: int) -> dict:
    """One compile of the K=1 step at per-device batch `b`: its memory, or the refusal."""
    split = costs.split_config(model_config(chunk), b, 1)
    shape = mesh_lib.resolve_mesh_shape(dataclasses.asdict(split.mesh), len(devices))
    start = time.perf_counter()
    row: dict = {"loss_chunk_tokens": chunk, "per_device_batch_size": b}
    try:
        cost = costs.step_cost(split, plan_from_config(split, shape), devices)
    except costs.OutOfMemory as err:
        return {**row, "fits": False, "memory_bytes": None, "needed_bytes": err.needed_bytes}
    return {
        **row,
        "fits": cost.memory_bytes <= budget,
        "memory_bytes": cost.memory_bytes,
        "temp_bytes": cost.temp_bytes,
        "argument_bytes": cost.argument_bytes,
        "compile_s": round(time.perf_counter() - start, 1),
    }


def main() -> None:
    target = parse_target(args.target)
    devices, budget = list(target_devices(target)), target.generation.hbm_bytes
    out: dict = {
        "config": args.config,
        "target": target.describe(),
        "memory_budget_bytes": budget,
        "machine": platform.node(),
        "jax": jax.__version__,
        "grid": [],
        "largest_batch": [],
    }
    path = pathlib.Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        path.write_text(json.dumps(out, indent=1) + "\n")

    for b in numbers(args.batches):
        for chunk in numbers(args.chunks):
            row = point(chunk, b, devices, budget)
            out["grid"].append(row)
            gib = (row["memory_bytes"] or row["needed_bytes"] or 0) / 2**30
            print(f"b={b} chunk={chunk}: {gib:.2f} GiB fits={row['fits']}", flush=True)
            save()
    if args.no_search:
        return
    for chunk in numbers(args.search_chunks):
        found = costs.max_per_device_batch(model_config(chunk), devices, budget)
        memory = found.cost.memory_bytes if found.cost else None
        out["largest_batch"].append(
            {
                "loss_chunk_tokens": chunk,
                "per_device_batch_size": found.per_device_batch_size,
                "memory_bytes": memory,
                "compiles": found.compiles,
                "seconds": round(found.seconds, 1),
                "tried": {str(b): m for b, m in sorted(found.tried.items())},
            }
        )
        print(f"chunk={chunk}: largest per-device batch {found.per_device_batch_size}", flush=True)
        save()


if __name__ == "__main__":
    main()

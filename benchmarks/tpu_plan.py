"""Planning for Cloud TPU slices from this machine: compile time per split, and the largest
per-device batch that fits a chip.

For lm_tiny at GPT-2-small shapes (d_model 768, 12 layers and heads, MLP 3072, 1024 tokens
per row, a 50304-token vocabulary, float32): each split of a global batch of 128 compiled
for --split-target (its compile seconds, memory and FLOPs per chip), then the largest
per-device batch under each --search-targets chip's HBM by compile-only search. Nothing
runs; libtpu must be installed (pip install -e ".[tpu-plan]").

Each split compiles with its 12 blocks unrolled and scanned (`--scan-layers both`, the two
interleaved so a busy machine slows both alike), for the compile seconds each layout costs.

Run: python benchmarks/tpu_plan.py [--split-target v5litepod-8] [--scan-layers both]
     [--search-targets v5litepod-8,v4-8] [--no-search] [--no-splits]
Writes benchmarks/results/tpu_plan.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import time

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--split-target", default="v5litepod-8")
parser.add_argument("--search-targets", default="v5litepod-8,v4-8")
parser.add_argument("--no-search", action="store_true", help="compile the splits only")
parser.add_argument("--no-splits", action="store_true", help="search the batch only")
parser.add_argument(
    "--scan-layers",
    choices=("false", "true", "both"),
    default="both",
    help="compile the splits unrolled, scanned, or both (default)",
)
parser.add_argument(
    "--out", default=str(pathlib.Path(__file__).parent / "results" / "tpu_plan.json")
)
args = parser.parse_args()
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compiling for a described slice: no TPU needed

from jaxkit.config import apply_overrides, load_config, run_config
from jaxkit.mesh import resolve_mesh_shape
from jaxkit.plan import compile_cache, costs
from jaxkit.plan.targets import parse_target, target_devices
from jaxkit.sections import RunConfig

# Compile seconds are what the splits measure: no plan comes from the cache of earlier ones.
compile_cache.plans_enabled = False

GPT2_SMALL_SHAPES = [
    "model.d_model=768",
    "model.num_layers=12",
    "model.num_heads=12",
    "model.mlp_dim=3072",
    "data.seq_len=1024",
    "model.vocab_size=50304",
    "batch.global_batch_size=128",
    "batch.per_device_batch_size=8",
    "batch.grad_accum_steps=null",
]


def gpt2_config() -> RunConfig:
    config = load_config("lm_tiny")
    apply_overrides(config, GPT2_SMALL_SHAPES)
    return run_config(config)


def main() -> None:
    results: dict = {"model": "lm_tiny at GPT-2-small shapes", "overrides": GPT2_SMALL_SHAPES}
    config = gpt2_config()
    target = parse_target(args.split_target)
    devices = target_devices(target)
    print(target.describe(), flush=True)
    splits = [] if args.no_splits else costs.enumerate_splits(config, [len(devices)])

    layouts = {"false": [False], "true": [True], "both": [False, True]}[args.scan_layers]
    rows = []
    for split in splits:
        for scan in layouts:
            layout = dataclasses.replace(
                config, model=dataclasses.replace(config.model, scan_layers=scan)
            )
            (costed,) = costs.with_costs(layout, [split], devices)
            c = costed.cost
            memory = costs.format_bytes(c.memory_bytes) if c else "refused (HBM)"
            print(
                f"  b={split.plan.per_device_batch_size:<3} K={split.plan.grad_accum_steps:<3} "
                f"{'scanned ' if scan else 'unrolled'} "
                + (f"compile {c.compile_s:6.1f} s  " if c else "")
                + f"{memory:>10}"
                + (f"  {costs.format_flops(c.flops_per_step)}FLOPs/step/chip" if c else ""),
                flush=True,
            )
            rows.append(
                {
                    "per_device_batch_size": split.plan.per_device_batch_size,
                    "grad_accum_steps": split.plan.grad_accum_steps,
                    "scan_layers": scan,
                    **(c.to_json() if c else {"out_of_memory": str(costed.out_of_memory)}),
                }
            )
    results["splits"] = {"target": target.name, "rows": rows}
    results["searches"] = []
    for name in [] if args.no_search else args.search_targets.split(","):
        target = parse_target(name)
        devices = target_devices(target)
        budget = target.generation.hbm_bytes
        resolve_mesh_shape(dataclasses.asdict(config.mesh), len(devices))  # the mesh fits the slice
        start = time.perf_counter()
        search = costs.max_per_device_batch(
            config,
            devices,
            budget,
            progress=lambda b, m, name=name: print(
                f"  {name} b={b}: "
                + (costs.format_bytes(m) if m is not None else "refused by the compiler (HBM)"),
                flush=True,
            ),
        )
        print(
            f"{target.describe()}: largest per-device batch {search.per_device_batch_size} "
            f"({search.compiles} compiles, {time.perf_counter() - start:.0f} s)",
            flush=True,
        )
        results["searches"].append(
            {
                "target": name,
                "memory_budget_bytes": budget,
                "max_per_device_batch_size": search.per_device_batch_size,
                "compiles": search.compiles,
                "seconds": search.seconds,
                "tried": {str(b): m for b, m in sorted(search.tried.items())},
                "out_of_memory": {str(b): str(e) for b, e in sorted(search.refused.items())},
            }
        )
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

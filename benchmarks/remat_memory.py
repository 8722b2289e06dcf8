"""Memory per device and recomputation against the remat policy, compiled for a TPU slice.

1. Grid: lm_125m (Llama-style, d_model 768, 12 layers, seq 1024, vocabulary 50304, bfloat16
   matmuls) with model.remat = none, dots and full, at per-device batch 1, 2, 4, 8 and 16
   (grad_accum_steps 1), each compiled ahead of time for --target (default v5litepod-8,
   8 v5e chips of 16 GiB HBM; the config's mesh, data-parallel over every chip) by
   costs.step_cost on abstract inputs: nothing is allocated or run, libtpu compiles for a
   described slice (jaxkit/plan/targets.py). Per point: the compiled memory per device
   (argument + output − alias + temp), whether it fits the chip's HBM, and hardware FLOPs
   (the compiled matmuls, recomputation included) per model FLOP. A step the TPU compiler
   refuses as out of memory (costs.OutOfMemory) is recorded as "does not fit", with the
   bytes it said it needed (a lower bound). --target cpu compiles for the local CPU devices
   instead (no memory limit there; --host-devices of them).
2. Search: per policy, the largest per-device batch whose step fits the chip's HBM
   (targets' generation.hbm_bytes, as `jaxkit plan --target` budgets it), by
   costs.max_per_device_batch (doubling, then bisection: about 2·log2(answer) compiles),
   for --search-models on --search-targets.

Layers are scanned (model.scan_layers=true, for every model and point, lm_125m included,
whose own config unrolls them): one compiled block keeps each compile to seconds.

Run: python benchmarks/remat_memory.py [--target v5litepod-8] [--batches 1,2,4,8,16]
     [--policies none,dots,full] [--search-models lm_125m,lm_350m,lm_1b]
     [--search-targets v5litepod-8,v4-8] [--search-policies none,dots,full]
     [--no-grid] [--no-search] [--no-scan] [--append]
Writes benchmarks/results/remat_memory.json (after each point of the search, so a long run
keeps what it finished; --append adds searches to the file's, skipping those it holds).
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
parser.add_argument("--config", default="lm_125m", help="the grid's model")
parser.add_argument("--target", default="v5litepod-8", help="a Cloud TPU slice, or cpu")
parser.add_argument("--host-devices", type=int, default=1, help="CPU devices for --target cpu")
parser.add_argument("--batches", default="1,2,4,8,16", help="the grid's per-device batches")
parser.add_argument("--policies", default="none,dots,full", help="the grid's remat policies")
parser.add_argument("--search-models", default="lm_125m,lm_350m,lm_1b")
parser.add_argument("--search-targets", default="v5litepod-8,v4-8")
parser.add_argument("--search-policies", default="none,dots,full")
parser.add_argument("--no-grid", action="store_true", help="the batch searches only")
parser.add_argument("--no-search", action="store_true", help="the grid only")
parser.add_argument(
    "--no-scan", action="store_true", help="keep each config's own model.scan_layers"
)
parser.add_argument(
    "--append",
    action="store_true",
    help="keep the searches already in --out (and its grid with --no-grid); add the new ones",
)
parser.add_argument(
    "--out", default=str(pathlib.Path(__file__).parent / "results" / "remat_memory.json")
)
args = parser.parse_args()
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # a described TPU slice compiles from the CPU

import jax

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", args.host_devices)

from jaxkit import mesh as mesh_lib
from jaxkit.batch.schedule import plan_from_config
from jaxkit.config import load_config, run_config
from jaxkit.plan import costs
from jaxkit.plan.targets import parse_target, target_devices
from jaxkit.sections import RunConfig
from jaxkit.step.train_step import check_on_mesh


def split_list(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def model_config(name: str) -> RunConfig:
    config = load_config(name)
    if not args.no_scan:
        config.model.scan_layers = True
    return run_config(config)


def slice_of(name: str) -> tuple[str, list, int | None, str]:
    """(name, devices, HBM per device or None, description) of a target."""
    if name == "cpu":
        devices = jax.devices()[: args.host_devices]
        return name, devices, None, f"{len(devices)} local CPU device(s), no memory limit"
    target = parse_target(name)
    return name, list(target_devices(target)), target.generation.hbm_bytes, target.describe()


def point(config: RunConfig, b: int, devices, budget: int | None) -> dict:
    """One compile of the K=1 step at per-device batch `b`: its cost, or the refusal."""
    split = costs.split_config(config, b, 1)
    shape = mesh_lib.resolve_mesh_shape(dataclasses.asdict(split.mesh), len(devices))
    check_on_mesh(split, shape)
    start = time.perf_counter()
    try:
        cost = costs.step_cost(split, plan_from_config(split, shape), devices)
    except costs.OutOfMemory as err:
        return {
            "per_device_batch_size": b,
            "fits": False,
            "memory_bytes": None,
            "out_of_memory": str(err),
            "needed_bytes": err.needed_bytes,
            "compile_s": time.perf_counter() - start,
        }
    ratio = cost.hardware_flops_per_step / cost.model_flops_per_step
    return {
        "per_device_batch_size": b,
        "fits": None if budget is None else cost.memory_bytes <= budget,
        **cost.to_json(),
        "hardware_per_model_flop": ratio,
    }


def memory_cell(p: dict) -> str:
    if p["memory_bytes"] is None:
        needed = p["needed_bytes"]
        return "no fit" + (f" >{costs.format_bytes(needed)}" if needed else "")
    mark = "" if p["fits"] in (None, True) else " (over)"
    return costs.format_bytes(p["memory_bytes"]) + mark


def grid(results: dict) -> None:
    name, devices, budget, described = slice_of(args.target)
    config = model_config(args.config)
    policies, batches = split_list(args.policies), [int(b) for b in split_list(args.batches)]
    print(f"grid: {args.config} (scan_layers={config.model.scan_layers}) on {described}")
    rows = []
    for policy in policies:
        pconfig = costs.with_remat(config, policy)
        for b in batches:
            p = {"remat": policy, **point(pconfig, b, devices, budget)}
            rows.append(p)
            ratio = p.get("hardware_per_model_flop")
            print(
                f"  remat={policy:<4} b={b:<3} {memory_cell(p):>22}  "
                + (f"hardware/model FLOPs {ratio:.3f}  " if ratio is not None else "")
                + f"compile {p['compile_s']:.1f} s",
                flush=True,
            )
    results["grid"] = {
        "config": args.config,
        "scan_layers": bool(config.model.scan_layers),
        "seq_len": config.data.seq_len,
        "target": name,
        "target_description": described,
        "num_devices": len(devices),
        "device_kind": devices[0].device_kind,
        "memory_budget_bytes": budget,
        "rows": rows,
    }
    write(results)

    budget_text = f" (HBM {costs.format_bytes(budget)})" if budget else ""
    print(f"\nmemory per device, {args.config} on {name}{budget_text}")
    header = f"{'remat':<6}" + "".join(f"{'b=' + str(b):>24}" for b in batches)
    print(header)
    for policy in policies:
        cells = [memory_cell(r) for r in rows if r["remat"] == policy]
        print(f"{policy:<6}" + "".join(f"{c:>24}" for c in cells))
    print(f"\nhardware FLOPs / model FLOPs, {args.config} on {name}")
    print(f"{'remat':<6}" + "".join(f"{'b=' + str(b):>10}" for b in batches))
    for policy in policies:
        ratios = [r.get("hardware_per_model_flop") for r in rows if r["remat"] == policy]
        cells = ["-" if x is None else f"{x:.3f}" for x in ratios]
        print(f"{policy:<6}" + "".join(f"{c:>10}" for c in cells))


def search(results: dict) -> None:
    models, targets = split_list(args.search_models), split_list(args.search_targets)
    policies = split_list(args.search_policies)
    prior = results.get("search") or {"rows": [], "runs": []}  # kept with --append
    rows = prior["rows"]
    results["search"] = {
        "scan_layers": "forced true" if not args.no_scan else "each config's own",
        "runs": [
            *prior.get("runs", []),
            {"models": models, "targets": targets, "policies": policies},
        ],
        "rows": rows,
    }
    done = {(r["target"], r["model"], r["remat"]) for r in rows}
    for target_name in targets:
        name, devices, budget, described = slice_of(target_name)
        if budget is None:
            print(f"search: {name} has no memory limit; skipped")
            continue
        print(f"\nsearch on {described}", flush=True)
        for model in models:
            config = model_config(model)
            shape = mesh_lib.resolve_mesh_shape(dataclasses.asdict(config.mesh), len(devices))
            check_on_mesh(config, shape)
            for policy in policies:
                if (name, model, policy) in done:
                    print(f"  {model} remat={policy}: in the results already (--append)")
                    continue
                pconfig = costs.with_remat(config, policy)

                def progress(b: int, memory: int | None, tag=f"{model} remat={policy}") -> None:
                    text = costs.format_bytes(memory) if memory is not None else "refused (HBM)"
                    print(f"  {tag} b={b}: {text}", flush=True)

                found = costs.max_per_device_batch(pconfig, devices, budget, progress=progress)
                c = found.cost
                rows.append(
                    {
                        "target": name,
                        "model": model,
                        "remat": policy,
                        "scan_layers": bool(config.model.scan_layers),
                        "mesh_shape": shape,
                        "memory_budget_bytes": budget,
                        "max_per_device_batch_size": found.per_device_batch_size,
                        "memory_bytes": c.memory_bytes if c else None,
                        "hardware_per_model_flop": (
                            c.hardware_flops_per_step / c.model_flops_per_step if c else None
                        ),
                        "compiles": found.compiles,
                        "seconds": found.seconds,
                        "tried": {str(b): m for b, m in sorted(found.tried.items())},
                        "out_of_memory": {
                            str(b): {"message": str(e), "needed_bytes": e.needed_bytes}
                            for b, e in sorted(found.refused.items())
                        },
                    }
                )
                write(results)
                print(
                    f"  => {model} remat={policy} on {name}: largest per-device batch "
                    f"{found.per_device_batch_size}"
                    + (f" ({costs.format_bytes(c.memory_bytes)})" if c else "")
                    + f", {found.compiles} compiles, {found.seconds:.0f} s",
                    flush=True,
                )
    if not rows:
        return
    every_policy = list(dict.fromkeys(r["remat"] for r in rows))
    print("\nlargest per-device batch within the chip's HBM (memory at that batch)")
    print(f"{'target':<13} {'model':<9} " + "".join(f"{p:>20}" for p in every_policy))
    for target_name in dict.fromkeys(r["target"] for r in rows):
        for model in dict.fromkeys(r["model"] for r in rows):
            cells = []
            for policy in every_policy:
                key = (target_name, model, policy)
                found_rows = [r for r in rows if (r["target"], r["model"], r["remat"]) == key]
                if not found_rows:
                    cells.append("-")
                    continue
                r = found_rows[0]
                mem = f" ({costs.format_bytes(r['memory_bytes'])})" if r["memory_bytes"] else ""
                cells.append(f"{r['max_per_device_batch_size']}{mem}")
            if any(c != "-" for c in cells):
                print(f"{target_name:<13} {model:<9} " + "".join(f"{c:>20}" for c in cells))


def write(results: dict) -> None:
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")


def main() -> None:
    results: dict = {
        "what": "compiled memory per device and hardware/model FLOPs against model.remat; "
        "compile-only (nothing runs)",
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores",
        "jax": jax.__version__,
        "invocations": [{**vars(args), "load_average_start": os.getloadavg()}],
    }
    out = pathlib.Path(args.out)
    if args.append and out.exists():  # keep the file's searches (and its grid, with --no-grid)
        prior = json.loads(out.read_text())
        results["invocations"] = prior.get("invocations", []) + results["invocations"]
        results["search"] = prior.get("search")
        if args.no_grid and "grid" in prior:
            results["grid"] = prior["grid"]
    start = time.perf_counter()
    if not args.no_grid:
        grid(results)
    if not args.no_search:
        search(results)
    results["invocations"][-1]["seconds"] = time.perf_counter() - start
    results["invocations"][-1]["load_average_end"] = os.getloadavg()
    write(results)
    print(f"wrote {args.out} ({results['invocations'][-1]['seconds']:.0f} s)")


if __name__ == "__main__":
    main()

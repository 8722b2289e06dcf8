"""Compile time against depth: scanned layers against unrolled ones.

The lm_125m train step (Llama-style, bfloat16 matmuls, d_model 768, MLP 2048, vocabulary
50304) at num_layers 2, 6, 12 and 24, each with model.scan_layers true (one block,
lax.scan over a stacked layer axis) and false (a Python loop: every layer traced and
compiled), compiled ahead of time by costs.step_cost on abstract inputs (shapes, dtypes and
shardings; nothing allocated or executed) on the local CPU devices (one by default), at
per_device_batch_size 1 and grad_accum_steps 1 (costs.split_config). For each point:
compile seconds as StepCost.compile_s reports them (trace, lower and compile), and, from a
separate lowering of the same step, the trace-and-lower seconds alone. One warm-up compile
runs first so that backend start-up is not charged to the first row, and each point is
compiled --repeats times (each time from a fresh build: nothing is cached between them),
the fastest reported: on a shared machine the slowest runs measure the neighbours. The
process CPU seconds of each compile are reported beside the wall seconds: they hardly move
with a neighbour's load.

Expect: scanned nearly flat in depth (the compiler sees one layer body), unrolled growing
about linearly with it.

Run: python benchmarks/compile_depth.py [--layers 2,6,12,24] [--seq-len 1024]
     [--config lm_125m] [--host-devices 1] [--remat none] [--repeats 2]
Writes benchmarks/results/compile_depth.json.
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
parser.add_argument("--layers", default="2,6,12,24", help="comma-separated num_layers")
parser.add_argument("--seq-len", type=int, default=1024, help="data.seq_len (tokens per row)")
parser.add_argument("--host-devices", type=int, default=1, help="CPU devices to compile for")
parser.add_argument("--remat", default="none", help="model.remat for every point")
parser.add_argument("--repeats", type=int, default=2, help="compiles per point; the fastest")
parser.add_argument(
    "--out", default=str(pathlib.Path(__file__).parent / "results" / "compile_depth.json")
)
args = parser.parse_args()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", args.host_devices)

from jaxkit import mesh as mesh_lib
from jaxkit.batch.schedule import plan_from_config
from jaxkit.config import load_config, run_config
from jaxkit.plan import costs
from jaxkit.sections import RunConfig
from jaxkit.step.train_step import build
from jaxkit.train.checkpoint import abstract_state


def point_config(num_layers: int, scan: bool) -> RunConfig:
    config = load_config(args.config)
    config.model.num_layers = num_layers
    config.model.scan_layers = scan
    config.model.remat = args.remat
    config.data.seq_len = args.seq_len
    return costs.split_config(run_config(config), per_device_batch_size=1, grad_accum_steps=1)


def plan_of(config: RunConfig, devices):
    shape = mesh_lib.resolve_mesh_shape(dataclasses.asdict(config.mesh), len(devices))
    return plan_from_config(config, shape)


def lower_seconds(config: RunConfig, devices) -> float:
    """Trace and lower the step (no XLA compile): the front end's share of compile_s."""
    plan = plan_of(config, devices)
    start = time.perf_counter()
    setup = build(config, plan, mesh_lib.make_mesh(dataclasses.asdict(config.mesh), devices))
    state = abstract_state(setup)
    batch = costs.abstract_batch(config, plan, setup)
    setup.step.lower(state, batch, costs.abstract_hyper(setup))
    return time.perf_counter() - start


def compile_point(config: RunConfig, devices) -> tuple[costs.StepCost, float]:
    """The step's cost, and the process CPU seconds of the whole step_cost call (every
    thread; a little more than the compile: the optimizer update's lowering and the HLO
    read for FLOPs too). CPU seconds hardly move with a neighbour's load; wall seconds do."""
    start = time.process_time()
    cost = costs.step_cost(config, plan_of(config, devices), devices)
    return cost, time.process_time() - start


def main() -> None:
    devices = jax.devices()[: args.host_devices]
    layers = [int(n) for n in args.layers.split(",")]
    print(
        f"{args.config} train step, seq_len {args.seq_len}, per-device batch 1, K=1, "
        f"remat {args.remat}: compile-only on {len(devices)} x {devices[0].device_kind} "
        f"({os.cpu_count()} CPU cores)",
        flush=True,
    )
    start = time.perf_counter()
    compile_point(point_config(1, True), devices)  # warm-up: backend and import costs
    print(f"  warm-up compile (1 layer, scanned): {time.perf_counter() - start:.1f} s", flush=True)

    load_start = os.getloadavg()
    rows = []
    for n in layers:
        row: dict = {"num_layers": n}
        for scan in (True, False):
            name = "scanned" if scan else "unrolled"
            config = point_config(n, scan)
            lower_s = min(lower_seconds(config, devices) for _ in range(args.repeats))
            tries = [compile_point(config, devices) for _ in range(args.repeats)]
            cost = min((c for c, _ in tries), key=lambda c: c.compile_s)
            cpu_s = min(t for _, t in tries)
            row[name] = {
                "compile_s": cost.compile_s,
                "compile_s_all": [c.compile_s for c, _ in tries],
                "cpu_s": cpu_s,
                "cpu_s_all": [t for _, t in tries],
                "trace_lower_s": lower_s,
                "memory_bytes": cost.memory_bytes,
                "model_flops_per_step": cost.model_flops_per_step,
                "hardware_flops_per_step": cost.hardware_flops_per_step,
            }
            print(
                f"  layers={n:>2} {name:>8}: compile {cost.compile_s:7.1f} s "
                f"(trace+lower {lower_s:5.1f} s; CPU {cpu_s:6.1f} s), "
                f"{costs.format_bytes(cost.memory_bytes)}, "
                f"hardware/model FLOPs "
                f"{cost.hardware_flops_per_step / cost.model_flops_per_step:.2f}",
                flush=True,
            )
        row["unrolled_over_scanned"] = row["unrolled"]["compile_s"] / row["scanned"]["compile_s"]
        row["unrolled_over_scanned_cpu"] = row["unrolled"]["cpu_s"] / row["scanned"]["cpu_s"]
        rows.append(row)

    print(
        f"\n{'layers':>6} {'scanned s':>10} {'unrolled s':>11} {'ratio':>6}   "
        f"{'scanned CPU s':>13} {'unrolled CPU s':>14} {'ratio':>6}"
    )
    for r in rows:
        print(
            f"{r['num_layers']:>6} {r['scanned']['compile_s']:>10.1f} "
            f"{r['unrolled']['compile_s']:>11.1f} {r['unrolled_over_scanned']:>6.2f}   "
            f"{r['scanned']['cpu_s']:>13.1f} {r['unrolled']['cpu_s']:>14.1f} "
            f"{r['unrolled_over_scanned_cpu']:>6.2f}"
        )
    first, last = rows[0], rows[-1]
    growth = {k: last[k]["compile_s"] / first[k]["compile_s"] for k in ("scanned", "unrolled")}
    growth_cpu = {k: last[k]["cpu_s"] / first[k]["cpu_s"] for k in ("scanned", "unrolled")}
    print(
        f"from {first['num_layers']} to {last['num_layers']} layers: scanned x"
        f"{growth['scanned']:.2f}, unrolled x{growth['unrolled']:.2f} (wall); scanned x"
        f"{growth_cpu['scanned']:.2f}, unrolled x{growth_cpu['unrolled']:.2f} (CPU)"
    )
    results = {
        "config": args.config,
        "what": "compile seconds of the train step (costs.step_cost: trace, lower, XLA "
        "compile; nothing executed), scanned against unrolled layers",
        "seq_len": args.seq_len,
        "per_device_batch_size": 1,
        "grad_accum_steps": 1,
        "remat": args.remat,
        "repeats": args.repeats,
        "devices": f"{len(devices)} x {devices[0].device_kind}",
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores",
        "jax": jax.__version__,
        "load_average_1_5_15min": {"start": load_start, "end": os.getloadavg()},
        "rows": rows,
        "growth_first_to_last": growth,
        "growth_first_to_last_cpu": growth_cpu,
    }
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

"""Predicted step times against published TPU measurements we did not make.

Each row configures a model, slice(s), batch split, sequence length and remat as its source
did, compiles that one split for the described slice(s) with the TPU compiler (nothing
runs; libtpu must be installed: pip install -e ".[tpu-plan]") and prints the measured step
beside the plan's predicted lower bound (step_time.py) and their ratio. The claim under
test: every prediction is a lower bound no worse than 2.5× below the measurement
(measured / predicted in [1.0, 2.5]).

Sources (cited in docs/benchmarks.md, "Predicted against published steps"):
- tpu-recipes, training/trillium: MaxText Llama 3.1-8B at 8,192 tokens a row, pure FSDP,
  per-device batch 3 on v6e-8 (3.443 s a step) and 4 on v6e-256 (4.546 s).
- axlearn, experiments/text/gpt/fuji.py: Fuji-70B v2 (80 layers, d_model 8192, 64 heads,
  8 key/value heads, MLP 28,672, vocab 32,768, 4,096 tokens a row, 1,024 rows a step),
  mesh data=-1 × fsdp=256: one v6e-256 with 4 accumulation steps (19.5 s), four v6e-256
  slices over the DCN (4.9 s), four v5e-256 slices (14.3736 s).

The sources' remat policies offload activations to the host, which jaxkit does not; the rows
use model.remat=full (the nearest policy that fits a chip: everything recomputed), so the
predicted compute counts the recomputation that full remat adds. Every row runs the splash
attention kernel, as its source runs a flash kernel; so the accumulation row runs MultiSteps
(splash does not run in jaxkit's fused step yet). Under pure fsdp the two modes move the
same bytes: each micro-step reduce-scatters its gradient over the fsdp axis either way.

Run: python benchmarks/published_steps.py [--rows NAME,...] [--timeout 600]
Writes benchmarks/results/published_steps.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compiling for described slices: no TPU needed

LLAMA_31_8B = [
    "model.d_model=4096",
    "model.num_layers=32",
    "model.num_heads=32",
    "model.num_kv_heads=8",
    "model.mlp_dim=14336",
    "model.vocab_size=128256",
    "model.rope_theta=500000.0",
    "data.seq_len=8192",
]
FUJI_70B = [
    "model.d_model=8192",
    "model.num_layers=80",
    "model.num_heads=64",
    "model.num_kv_heads=8",
    "model.mlp_dim=28672",
    "model.vocab_size=32768",
    "model.rope_theta=500000.0",
    "data.seq_len=4096",
    "batch.global_batch_size=1024",
]
COMMON = [
    "data.source=synthetic",
    "model.param_dtype=float32",
    "model.compute_dtype=bfloat16",
    "model.remat=full",
    "model.scan_layers=true",
    "model.tie_embeddings=false",
]
RECIPES = "tpu-recipes training/trillium (MaxText)"
FUJI = "axlearn experiments/text/gpt/fuji.py"


@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    source: str
    target: str
    slices: int
    overrides: tuple[str, ...]
    measured_s: float


ROWS = [
    Row(
        "llama3.1-8b v6e-8",
        RECIPES,
        "v6e-8",
        1,
        (*LLAMA_31_8B, "mesh.data=1", "mesh.fsdp=-1", "batch.per_device_batch_size=3",
         "batch.grad_accum_steps=1", "batch.global_batch_size=null"),
        3.443,
    ),
    Row(
        "llama3.1-8b v6e-256",
        RECIPES,
        "v6e-256",
        1,
        (*LLAMA_31_8B, "mesh.data=1", "mesh.fsdp=-1", "batch.per_device_batch_size=4",
         "batch.grad_accum_steps=1", "batch.global_batch_size=null"),
        4.546,
    ),
    Row(
        "fuji-70b v6e-256 K=4",
        FUJI,
        "v6e-256",
        1,
        (*FUJI_70B, "mesh.data=-1", "mesh.fsdp=256", "batch.grad_accum_steps=4",
         "batch.per_device_batch_size=null", "train.accumulation=multisteps"),
        19.5,
    ),
    Row(
        "fuji-70b 4 x v6e-256",
        FUJI,
        "v6e-256",
        4,
        (*FUJI_70B, "mesh.data=-1", "mesh.fsdp=256", "mesh.dcn_data=4",
         "batch.grad_accum_steps=1", "batch.per_device_batch_size=null"),
        4.9,
    ),
    Row(
        "fuji-70b 4 x v5e-256",
        FUJI,
        "v5litepod-256",
        4,
        (*FUJI_70B, "mesh.data=-1", "mesh.fsdp=256", "mesh.dcn_data=4",
         "batch.grad_accum_steps=1", "batch.per_device_batch_size=null"),
        14.3736,
    ),
]  # fmt: skip


def measure(row: Row) -> dict:
    """Compiles the row's split for its slice(s) and predicts its step (in this process)."""
    from jaxkit.batch.schedule import plan_from_config
    from jaxkit.config import apply_overrides, load_config, run_config
    from jaxkit.plan import costs, planning
    from jaxkit.plan.targets import parse_target

    config = load_config("llama_tiny")
    apply_overrides(config, [*COMMON, *row.overrides])
    target = parse_target(row.target, row.slices)
    started = time.perf_counter()
    request = planning.request(run_config(config), target=target)
    split = costs.Split(len(request.devices), plan_from_config(request.config, request.shape))
    (split,) = costs.with_costs(request.config, [split], request.devices)
    seconds = time.perf_counter() - started
    out: dict = {"row": row.name, "measured_s": row.measured_s, "compile_s": seconds}
    out |= {"plan": split.plan.to_json(), "target": target.describe()}
    if split.out_of_memory is not None:
        return out | {"out_of_memory": str(split.out_of_memory)}
    assert split.cost is not None
    predicted = planning.prediction(request, split)
    assert predicted is not None
    out |= {"memory_bytes": split.cost.memory_bytes, **predicted.to_json()}
    return out | {"ratio": row.measured_s / predicted.step_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", help="comma-separated row names (default: all)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a row may take")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument(
        "--out", default=str(pathlib.Path(__file__).parent / "results" / "published_steps.json")
    )
    args = parser.parse_args()
    by_name = {row.name: row for row in ROWS}
    if args.child:
        print(json.dumps(measure(by_name[args.child])))
        return
    names = args.rows.split(",") if args.rows else list(by_name)
    unknown = [n for n in names if n not in by_name]
    if unknown:
        sys.exit(f"--rows: unknown {unknown}; the rows are {list(by_name)}")
    results = []
    for name in names:
        print(f"{name}: compiling ...", file=sys.stderr, flush=True)
        try:
            done = subprocess.run(
                [sys.executable, __file__, "--child", name],
                capture_output=True,
                text=True,
                timeout=args.timeout,
            )
        except subprocess.TimeoutExpired:
            results.append({"row": name, "error": f"did not compile in {args.timeout:.0f} s"})
            continue
        if done.returncode != 0:
            error = (done.stderr.strip().splitlines() or ["?"])[-1]
            results.append({"row": name, "error": error})
            continue
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(table(results))
    path = pathlib.Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1))
    print(f"wrote {path}")


def table(results: list[dict]) -> str:
    from jaxkit.batch.plan import format_table
    from jaxkit.plan.costs import format_seconds

    rows = []
    for r in results:
        if "predicted_step_time_s" not in r:
            why = r.get("error") or f"out of memory: {r.get('out_of_memory')}"
            rows.append((r["row"], "", "", "", why, "", "", "", "", ""))
            continue
        rows.append(
            (
                r["row"],
                f"{r['measured_s']:.4g} s",
                format_seconds(r["predicted_step_time_s"]),
                f"{r['ratio']:.2f}",
                r["bound"],
                *(format_seconds(r[f"{b}_s"]) for b in ("compute", "hbm", "ici", "dcn")),
                f"{100 * r['predicted_mfu']:.1f}%",
            )
        )
    header = ("row", "measured", "predicted", "measured/predicted", "bound", "compute", "hbm")
    return format_table((*header, "ici", "dcn", "predicted MFU"), rows)


if __name__ == "__main__":
    main()

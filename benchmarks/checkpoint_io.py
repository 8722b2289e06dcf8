"""How long a checkpoint holds up training, and how big it is on disk.

For the tiny LM (whole train state) and a ~100M-parameter Transformer (params only), it
saves a few times and reports, side by side: the time save() blocks the training loop
(async: the device-to-host copy and bookkeeping), the total time until the checkpoint is
complete on disk, and the checkpoint's size on disk against the raw bytes of the state.

Run: python benchmarks/checkpoint_io.py [--host-devices 8] [--saves 3]
Writes benchmarks/results/checkpoint_io.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import statistics
import tempfile
import time

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--host-devices", type=int, default=8)
parser.add_argument("--saves", type=int, default=3)
parser.add_argument(
    "--out", default=str(pathlib.Path(__file__).parent / "results" / "checkpoint_io.json")
)
args = parser.parse_args()

import jax

jax.config.update("jax_num_cpu_devices", args.host_devices)

from jaxkit.batch.schedule import Position, plan_from_config
from jaxkit.config import apply_overrides, load_config, run_config
from jaxkit.data.sources import load_micro_batch, make_sources
from jaxkit.mesh import make_mesh, mesh_shape
from jaxkit.step.train_step import build
from jaxkit.train.checkpoint import STEP_PREFIX, Checkpointer


def measure(name: str, overrides: list[str], params_only: bool) -> dict:
    config_dict = load_config("lm_tiny")
    apply_overrides(config_dict, overrides)
    config = run_config(config_dict)
    mesh = make_mesh(dataclasses.asdict(config.mesh))
    setup = build(config, plan_from_config(config, mesh_shape(mesh)), mesh)
    state = setup.init(jax.random.key(0))
    if not params_only:  # a few steps, so the optimizer moments are not all zeros
        plan = plan_from_config(config, mesh_shape(mesh))
        source, _ = make_sources(config)
        for i in range(3 * plan.grad_accum_steps):
            step, micro = divmod(i, plan.grad_accum_steps)
            first = step * plan.global_batch_size
            batch = load_micro_batch(source, first, micro, plan, 0, setup.batch_sharding)
            state, metrics = setup.step(state, batch, setup.hyper(plan))
            jax.block_until_ready(metrics)
    tree = state.params if params_only else state
    jax.block_until_ready(tree)
    raw = sum(x.nbytes for x in jax.tree.leaves(tree))
    params = sum(x.size for x in jax.tree.leaves(state.params))
    blocking, total, sizes = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Checkpointer(pathlib.Path(tmp) / "checkpoints", keep=args.saves, warn=print)
        for i in range(args.saves):
            start = time.perf_counter()
            ckpt.save(Position(step=i + 1), tree, {"note": name})
            blocking.append(time.perf_counter() - start)
            ckpt.wait()
            total.append(time.perf_counter() - start)
            step_dir = pathlib.Path(tmp) / "checkpoints" / f"{STEP_PREFIX}_{i + 1}"
            sizes.append(sum(f.stat().st_size for f in step_dir.rglob("*") if f.is_file()))
        ckpt.close()
    row = {
        "model": name,
        "parameters": params,
        "saved": "params" if params_only else "whole train state",
        "raw_bytes": raw,
        "disk_bytes": statistics.median(sizes),
        "disk_over_raw": statistics.median(sizes) / raw,
        "blocking_s": statistics.median(blocking),
        "total_s": statistics.median(total),
        "blocking_fraction": statistics.median(blocking) / statistics.median(total),
    }
    print(
        f"{name:>12} {params / 1e6:7.1f}M params  {row['saved']:>17}  raw {raw / 2**20:8.1f} MiB"
        f"  disk {row['disk_bytes'] / 2**20:8.1f} MiB ({row['disk_over_raw']:.2f}x)  "
        f"blocking {row['blocking_s'] * 1e3:7.1f} ms / total {row['total_s'] * 1e3:7.1f} ms "
        f"({row['blocking_fraction']:.0%})",
        flush=True,
    )
    return row


def main() -> None:
    print(
        f"checkpoint save on {args.host_devices} x {jax.devices()[0].platform}, "
        f"median of {args.saves} saves"
    )
    rows = [
        measure("lm_tiny", ["data.max_bytes=100000"], params_only=False),
        measure(
            "lm_100m",
            [
                "model.d_model=768",
                "model.num_layers=12",
                "model.num_heads=12",
                "model.mlp_dim=3072",
                "data.seq_len=1024",
                "data.max_bytes=100000",
            ],
            params_only=True,
        ),
    ]
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

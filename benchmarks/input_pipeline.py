"""The input pipeline against the step: loader time per micro-step, step time, and examples/s
with and without prefetch, on token files, side by side in one process.

Storage slower than this machine's page cache (a bucket, a busy disk) is emulated by a
delay added to every read of rows: by default 0, 0.5, 0.9 and 2 times the compute time of
a micro-step, measured first (a run with prefetch and no delay), so the same sweep brackets
the step on a CPU and on a GPU. Prefetch (train.prefetch=2) should hide the loader
entirely while a load is shorter than a micro-step: the loop's wait for data after the
first batch is then ~0, and examples/s the step's own pace.

Run: python benchmarks/input_pipeline.py [--host-devices 8] [--steps 40]
     [--delay-fractions 0,0.5,0.9,2 | --delays-ms 0,10,40] [--data DIR]
Prints a table and writes benchmarks/results/input_pipeline.json.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import statistics
import sys
import tempfile
import time

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--host-devices", type=int, default=8)
parser.add_argument("--steps", type=int, default=40, help="optimizer steps per timed run")
parser.add_argument(
    "--delay-fractions", default="0,0.5,0.9,2", help="read delays, in micro-step compute times"
)
parser.add_argument("--delays-ms", help="read delays in ms, instead of --delay-fractions")
parser.add_argument("--tokens", type=int, default=20_000_000, help="written when no --data")
parser.add_argument("--data", help="token files to read (default: random ones written here)")
parser.add_argument(
    "--out", default=str(pathlib.Path(__file__).parent / "results" / "input_pipeline.json")
)
args = parser.parse_args()

import jax

jax.config.update("jax_num_cpu_devices", args.host_devices)

import numpy as np

from jaxkit import data as data_lib
from jaxkit import loop as loop_lib
from jaxkit.batch_schedule import plan_from_config
from jaxkit.config import apply_overrides, load_config
from jaxkit.mesh import make_mesh, mesh_shape
from jaxkit.train_step import build


class Slow:
    """A source whose every read of rows takes `delay_s` longer: slower storage."""

    def __init__(self, inner: data_lib.Source, delay_s: float) -> None:
        self.inner, self.delay_s = inner, delay_s

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, rows):
        time.sleep(self.delay_s)
        return self.inner[rows]

    def row_weight_sums(self, rows):
        return data_lib.row_weight_sums(self.inner, rows)


def write_tokens(out: pathlib.Path, count: int) -> None:
    """nanoGPT-style flat uint16 files of byte-valued ids, in four shards."""
    ids = np.random.default_rng(0).integers(0, 256, size=count).astype("<u2")
    for i, part in enumerate(np.array_split(ids, 4)):
        part.tofile(out / f"train-{i}.bin")


def config_for(path: str, prefetch: int):
    config = load_config("lm_tiny")
    apply_overrides(
        config,
        [
            "data.source=tokens",
            f"data.path={path}",
            f"train.prefetch={prefetch}",
            f"train.steps={args.steps}",
            f"train.log_every={args.steps}",
            "train.eval_every=0",
            "train.eval_examples=64",
            "checkpoint.every=0",
        ],
    )
    return config


def loader_ms(config, delay_s: float, reads: int = 30) -> float:
    """Median ms to read and place one micro-batch (rows, weights, device transfer)."""
    mesh = make_mesh(config.mesh.to_dict())
    plan = plan_from_config(config, mesh_shape(mesh))
    setup = build(config, plan, mesh)
    source = Slow(data_lib.make_sources(config)[0], delay_s)
    times = []
    for i in range(reads):
        start = time.perf_counter()
        batch = data_lib.load_micro_batch(
            source, i * plan.global_batch_size, 0, plan, 0, setup.batch_sharding
        )
        jax.block_until_ready(batch)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def run(config, delay_s: float) -> dict:
    real = data_lib.make_sources
    loop_lib.data_lib.make_sources = lambda c: (Slow(real(c)[0], delay_s), real(c)[1])
    try:
        summary = loop_lib.train(config, progress=False, echo=lambda *a: None).summary
    finally:
        loop_lib.data_lib.make_sources = real
    micro_steps = (args.steps - 1) * summary["grad_accum_steps"]  # after the first step's
    return {
        "examples_per_s": summary["examples_per_s"],
        "median_step_ms": 1e3 * summary["median_step_time_s"],
        "wait_ms_per_micro_step": 1e3 * summary["input_wait_after_first_s"] / micro_steps,
        "grad_accum_steps": summary["grad_accum_steps"],
    }


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = args.data
        if path is None:
            write_tokens(pathlib.Path(tmp), args.tokens)
            path = tmp
        pace = run(config_for(path, 2), 0.0)
        compute_ms = pace["median_step_ms"] / pace["grad_accum_steps"]
        print(f"compute: {compute_ms:.1f} ms per micro-step (prefetch 2, no delay)", flush=True)
        if args.delays_ms:
            delays = [float(d) for d in args.delays_ms.split(",")]
        else:
            delays = [float(f) * compute_ms for f in args.delay_fractions.split(",")]
        rows = []
        for delay_ms in delays:
            delay_s = delay_ms / 1e3
            load = loader_ms(config_for(path, 0), delay_s)
            inline = run(config_for(path, 0), delay_s)
            ahead = run(config_for(path, 2), delay_s)
            row = {
                "delay_ms": delay_ms,
                "load_ms_per_micro_step": load,
                "compute_ms_per_micro_step": compute_ms,
                "prefetch_0": inline,
                "prefetch_2": ahead,
                "speedup": ahead["examples_per_s"] / inline["examples_per_s"],
            }
            rows.append(row)
            print(
                f"delay {delay_ms:6.1f} ms | load {load:7.1f} ms | compute {compute_ms:6.1f}"
                f" ms | no prefetch {inline['examples_per_s']:7.1f} ex/s, waits "
                f"{inline['wait_ms_per_micro_step']:6.1f} ms | prefetch 2 "
                f"{ahead['examples_per_s']:7.1f} ex/s, waits {ahead['wait_ms_per_micro_step']:6.1f}"
                f" ms | ×{row['speedup']:.2f}",
                flush=True,
            )
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "machine": platform.processor() or platform.machine(),
        "device": jax.devices()[0].device_kind,
        "python": sys.version,
    }
    results = {"args": vars(args), "meta": meta, "pace": pace, "rows": rows}
    out.write_text(json.dumps(results, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

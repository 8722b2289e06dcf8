"""The input pipeline against the step: loader time per micro-step, step time, and examples/s
with and without prefetch, on token files, side by side in one process.

Storage slower than this machine's page cache (a bucket, a busy disk) is emulated by a
delay added to every read of rows: by default 0, 0.5, 0.9 and 2 times the compute time of
a micro-step, measured first (a run with prefetch and no delay), so the same sweep brackets
the step on a CPU and on a GPU. Prefetch (train.prefetch=2) should hide the loader
entirely while a load is shorter than a micro-step: the loop's wait for data after the
first batch is then ~0, and examples/s the step's own pace.

Then a mixture of three sources (data.mixture, weights 0.6/0.3/0.1) against one source:
rows per second through the loader (a micro-batch's rows found, read, weighted and placed
on the devices), the two read in turn, with the target of at least 0.9 times one source's;
and the loop's wait for data with prefetch 2 (the mixture off the step's critical path).

Run: python benchmarks/input_pipeline.py [--host-devices 8] [--steps 40]
     [--delay-fractions 0,0.5,0.9,2 | --delays-ms 0,10,40] [--data DIR] [--mixture-only]
Prints a table and writes benchmarks/results/input_pipeline.json.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
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
    "--mixture-only", action="store_true", help="only the mixture against one source, no delays"
)
parser.add_argument("--reads", type=int, default=200, help="loader reads of each, mixture part")
parser.add_argument(
    "--out", default=str(pathlib.Path(__file__).parent / "results" / "input_pipeline.json")
)
args = parser.parse_args()

import jax

jax.config.update("jax_num_cpu_devices", args.host_devices)

import numpy as np

from jaxkit.batch.schedule import plan_from_config
from jaxkit.config import apply_overrides, load_config, run_config
from jaxkit.data import sources as data_lib
from jaxkit.mesh import make_mesh, mesh_shape
from jaxkit.sections import RunConfig
from jaxkit.step.train_step import build
from jaxkit.train import loop as loop_lib


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

    def __getattr__(self, name: str):  # a mixture's order and by_source, read as they are
        return getattr(self.inner, name)


def write_tokens(out: pathlib.Path, count: int, seed: int = 0) -> None:
    """nanoGPT-style flat uint16 files of byte-valued ids, in four shards."""
    ids = np.random.default_rng(seed).integers(0, 256, size=count).astype("<u2")
    for i, part in enumerate(np.array_split(ids, 4)):
        part.tofile(out / f"train-{i}.bin")


# The mixture's sources: NAME -> weight (their token files: three directories, or --data thrice).
MIXTURE = {"web": 0.6, "code": 0.3, "math": 0.1}


def config_for(path: str | dict[str, str], prefetch: int):
    """lm_tiny on the token files at `path`, or on the mixture of {NAME: path} (MIXTURE's
    weights)."""
    if isinstance(path, dict):
        mixture = {name: {"path": p, "weight": MIXTURE[name]} for name, p in path.items()}
        data = "data.mixture=" + json.dumps(mixture)
    else:
        data = f"data.path={path}"
    config = load_config("lm_tiny")
    apply_overrides(
        config,
        [
            "data.source=tokens",
            data,
            f"train.prefetch={prefetch}",
            f"train.steps={args.steps}",
            f"train.log_every={args.steps}",
            "train.eval_every=0",
            "train.eval_examples=64",
            "checkpoint.every=0",
        ],
    )
    return config


def loader_ms(config: RunConfig, delay_s: float, reads: int = 30) -> float:
    """Median ms to read and place one micro-batch (rows, weights, device transfer)."""
    mesh = make_mesh(dataclasses.asdict(config.mesh))
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


def loader_rates(configs: dict[str, RunConfig], reads: int) -> dict[str, dict]:
    """Rows per second of each config's loader, the configs read in turn (a busy machine
    slows them alike): `loader` is a micro-batch's load_micro_batch (rows found, read,
    weighted, placed on the devices, as the loop asks), `host` the same without placing."""
    built = {}
    for name, config in configs.items():
        mesh = make_mesh(dataclasses.asdict(config.mesh))
        plan = plan_from_config(config, mesh_shape(mesh))
        with contextlib.redirect_stdout(None):  # foreign token files' one warning line each
            source = data_lib.make_sources(config)[0]
        built[name] = plan, build(config, plan, mesh).batch_sharding, source
    times: dict[str, dict[str, list[float]]] = {n: {"loader": [], "host": []} for n in built}
    for i in range(reads):
        for name, (plan, sharding, source) in built.items():
            first = i * plan.global_batch_size
            start = time.perf_counter()
            rows = data_lib.source_rows(source, first, plan.micro_batch_size, 0)
            data_lib.row_weight_sums(source, rows)
            source[rows]
            middle = time.perf_counter()
            batch = data_lib.load_micro_batch(source, first, 0, plan, 0, sharding)
            jax.block_until_ready(batch)
            end = time.perf_counter()
            times[name]["host"].append(middle - start)
            times[name]["loader"].append(end - middle)
    return {
        name: {
            kind: built[name][0].micro_batch_size / statistics.median(seconds)
            for kind, seconds in kinds.items()
        }
        for name, kinds in times.items()
    }


def mixture_part(one: str, three: dict[str, str]) -> dict:
    """The three-source mixture against one source: loader rows/s, and training with
    prefetch 2 (examples/s, the loop's wait for data)."""
    configs = {
        "one source": run_config(config_for(one, 0)),
        "mixture of 3": run_config(config_for(three, 0)),
    }
    rates = loader_rates(configs, args.reads)
    ratio = {
        kind: rates["mixture of 3"][kind] / rates["one source"][kind] for kind in ("loader", "host")
    }
    with contextlib.redirect_stdout(None):
        trained = {"one source": run(config_for(one, 2), 0.0)}
        trained["mixture of 3"] = run(config_for(three, 2), 0.0)
    for name in configs:
        row, pace = rates[name], trained[name]
        print(
            f"{name:12s} | loader {row['loader']:8.0f} rows/s (host alone {row['host']:8.0f}) |"
            f" prefetch 2: {pace['examples_per_s']:7.1f} ex/s, step {pace['median_step_ms']:6.1f}"
            f" ms, waits {pace['wait_ms_per_micro_step']:5.2f} ms per micro-step",
            flush=True,
        )
    holds = ratio["loader"] >= 0.9
    pace = trained["mixture of 3"]["examples_per_s"] / trained["one source"]["examples_per_s"]
    print(
        f"mixture / one source: loader rows/s ×{ratio['loader']:.2f} (host alone "
        f"×{ratio['host']:.2f}; target ≥ 0.9 on the loader: {'holds' if holds else 'MISSED'}),"
        f" training ex/s ×{pace:.2f}",
        flush=True,
    )
    return {
        "weights": MIXTURE,
        "rates": rates,
        "ratio": ratio,
        "target_holds": holds,
        "prefetch_2": trained,
    }


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
        three = dict.fromkeys(MIXTURE, path)
        if path is None:
            for i, name in enumerate(MIXTURE):  # three sources of a third of the tokens each
                (pathlib.Path(tmp) / name).mkdir()
                write_tokens(pathlib.Path(tmp) / name, args.tokens // len(MIXTURE), seed=i)
                three[name] = str(pathlib.Path(tmp) / name)
            path = three["web"]
        mixed = mixture_part(path, three)  # type: ignore[arg-type]
        if args.mixture_only:
            _write({"mixture": mixed})
            return
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
            load = loader_ms(run_config(config_for(path, 0)), delay_s)
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
    _write({"pace": pace, "rows": rows, "mixture": mixed})


def _write(results: dict) -> None:
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "machine": platform.processor() or platform.machine(),
        "device": jax.devices()[0].device_kind,
        "python": sys.version,
    }
    out.write_text(json.dumps({"args": vars(args), "meta": meta} | results, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

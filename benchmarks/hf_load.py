"""Loading a Hugging Face checkpoint (model.init_from=hf:DIR): time and host memory.

Writes once a random Llama checkpoint of TinyLlama-1.1B's shape in bfloat16 (d_model 2048,
22 blocks, 32 query and 4 key/value heads, vocabulary 32,000, untied: 1.1B params, 2.2 GB,
one safetensors file per block and an index), then starts 2 processes × 4 simulated CPU
devices that form one fsdp=8 mesh and each load it with `jaxkit.hf.load.load_params` into
float32 params sharded as a run's train state is. Each process reports its load time, its
device bytes (its shards: half the model) and its resident memory sampled every 5 ms:
the peak above what it held before the load, less its device bytes, is what the load cost
on the host besides the params themselves, set against the largest tensor. (The optimizer
state a run adds afterwards is left out: it is not the load's.)

Run: python benchmarks/hf_load.py [--dir DIR]   (DIR keeps the checkpoint between runs)
Writes benchmarks/results/hf_load.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROCESSES, DEVICES_PER_PROCESS = 2, 4
# TinyLlama-1.1B's config.json, as names.hf_config_from_model writes it from these keys.
MODEL: dict[str, Any] = {
    "kind": "llama",
    "vocab_size": 32000,
    "d_model": 2048,
    "num_layers": 22,
    "num_heads": 32,
    "num_kv_heads": 4,
    "mlp_dim": 5632,
    "tie_embeddings": False,
    "rope_theta": 10000.0,
    "norm_eps": 1e-5,
    "head_dim": None,
    "rope_scaling": None,
    "param_dtype": "bfloat16",
}


def write_checkpoint(directory: pathlib.Path) -> None:
    """Random bfloat16 tensors of MODEL's shape: a file per block, one for the rest."""
    import ml_dtypes
    import safetensors.numpy

    from jaxkit.hf import names
    from jaxkit.sections import LlamaModel

    if (directory / "model.safetensors.index.json").is_file():
        return
    directory.mkdir(parents=True, exist_ok=True)
    m = LlamaModel(**MODEL)
    rng = np.random.default_rng(0)
    groups: dict[str, dict[str, names.HfTensor]] = {}
    for t in names.hf_tensors(m):
        file = "model-rest.safetensors" if t.layer is None else f"model-{t.layer:03d}.safetensors"
        groups.setdefault(file, {})[t.name] = t
    weight_map: dict[str, str] = {}
    for file, tensors in groups.items():
        arrays = {
            name: (rng.standard_normal(t.shape, np.float32) * 0.02).astype(ml_dtypes.bfloat16)
            for name, t in tensors.items()
        }
        safetensors.numpy.save_file(arrays, str(directory / file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(arrays, file)
    cfg = names.hf_config_from_model(m, torch_dtype="bfloat16")
    (directory / "config.json").write_text(json.dumps(cfg, indent=2))
    index = {"metadata": {}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


class Sampler(threading.Thread):
    """The peak of RssAnon (heap: copies, device buffers) and VmRSS (also the mapped file
    pages read), every 5 ms."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak_anon = self.peak_rss = 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            self.peak_anon = max(self.peak_anon, _status_kib("RssAnon"))
            self.peak_rss = max(self.peak_rss, _status_kib("VmRSS"))
            time.sleep(0.005)


def worker(process_id: int, port: int, directory: pathlib.Path) -> None:
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", DEVICES_PER_PROCESS)
    jax.distributed.initialize(f"127.0.0.1:{port}", PROCESSES, process_id)

    from jaxkit.batch.schedule import plan_from_config
    from jaxkit.config import apply_overrides, load_config, run_config
    from jaxkit.hf import load as hf_load
    from jaxkit.mesh import make_mesh, mesh_shape
    from jaxkit.models.llama import llama_model
    from jaxkit.step.train_step import abstract_state, build

    config = load_config("llama_tiny")
    # llama_tiny's options (float32 params, unrolled blocks); the sizes are config.json's.
    apply_overrides(config, [f"model.init_from=hf:{directory}", "mesh.data=1", "mesh.fsdp=8"])
    hf_load.apply_init_from(config)
    run = run_config(config)
    mesh = make_mesh(dataclasses.asdict(run.mesh))
    setup = build(run, plan_from_config(run, mesh_shape(mesh)), mesh)
    shapes = abstract_state(setup).params
    sampler = Sampler()
    before_anon, before_rss = _status_kib("RssAnon"), _status_kib("VmRSS")
    sampler.start()
    start = time.perf_counter()
    params = hf_load.load_params(directory, llama_model(run), shapes, setup.state_shardings.params)
    jax.block_until_ready(params)
    load_s = time.perf_counter() - start
    sampler.done.set()
    sampler.join()
    leaves = jax.tree.leaves(params)
    device_bytes = sum(s.data.nbytes for x in leaves for s in x.addressable_shards)
    model_bytes = sum(x.nbytes for x in leaves)
    largest = max(leaves, key=lambda x: x.size)
    # A spot check against the file: this process's first shard of the embedding table.
    import safetensors

    table = params["embed"]["embedding"].addressable_shards[0]
    with safetensors.safe_open(str(directory / "model-rest.safetensors"), "numpy") as f:
        want = f.get_slice("model.embed_tokens.weight")[table.index].astype(np.float32)
    assert np.array_equal(np.asarray(table.data), want)
    kib = 1024
    print(
        json.dumps(
            {
                "process": process_id,
                "load_s": round(load_s, 2),
                "params": int(sum(x.size for x in leaves)),
                "model_bytes_float32": model_bytes,
                "device_bytes": device_bytes,
                "device_share": round(device_bytes / model_bytes, 4),
                "largest_tensor_bytes_float32": largest.nbytes,
                "largest_tensor_bytes_bfloat16": largest.nbytes // 2,
                "rss_anon_before_bytes": before_anon * kib,
                "rss_anon_peak_bytes": sampler.peak_anon * kib,
                "rss_peak_bytes": sampler.peak_rss * kib,
                "rss_before_bytes": before_rss * kib,
                # What the load held on the host beyond its own shards.
                "anon_peak_minus_device_bytes": (sampler.peak_anon - before_anon) * kib
                - device_bytes,
                "rss_peak_minus_device_bytes": (sampler.peak_rss - before_rss) * kib - device_bytes,
            }
        ),
        flush=True,
    )
    jax.distributed.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", help="where the checkpoint is written once (default: a temp dir)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "hf_load.json"))
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker, args.port, pathlib.Path(args.dir))
        return
    with tempfile.TemporaryDirectory(prefix="hf-load-") as temp:
        directory = pathlib.Path(args.dir or temp)
        start = time.perf_counter()
        write_checkpoint(directory)
        written_s = time.perf_counter() - start
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        d = str(directory)
        procs = [
            subprocess.Popen(
                [sys.executable, __file__, "--worker", str(i), "--port", str(port), "--dir", d],
                stdout=subprocess.PIPE,
                env=env,
                text=True,
            )
            for i in range(PROCESSES)
        ]
        reports = []
        for proc in procs:
            out, _ = proc.communicate(timeout=1200)
            if proc.returncode:
                raise SystemExit(f"a loading process failed with status {proc.returncode}")
            reports.append(json.loads(out.strip().splitlines()[-1]))
        size = sum(p.stat().st_size for p in directory.glob("*.safetensors"))
    result = {
        "model": MODEL,
        "processes": PROCESSES,
        "devices_per_process": DEVICES_PER_PROCESS,
        "mesh": {"data": 1, "fsdp": 8, "tensor": 1},
        "checkpoint_bytes": size,
        "checkpoint_written_s": round(written_s, 1),
        "per_process": reports,
    }
    pathlib.Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    mib = 2**20
    print(f"{reports[0]['params']:,} params, {size / mib:,.0f} MiB of bfloat16 safetensors")
    print("process  load s  device MiB (share)  RSS above start − device MiB  largest tensor MiB")
    for r in reports:
        print(
            f"{r['process']:>7}  {r['load_s']:>6.1f}  {r['device_bytes'] / mib:>8,.0f} "
            f"({r['device_share']:.0%})  anon {r['anon_peak_minus_device_bytes'] / mib:,.0f}, "
            f"all {r['rss_peak_minus_device_bytes'] / mib:,.0f}  "
            f"{r['largest_tensor_bytes_float32'] / mib:,.0f} (float32)"
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

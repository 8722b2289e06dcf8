"""Peak FLOP/s per device, for model FLOPs utilisation (MFU).

Accelerators: the vendors' dense matmul peaks per chip, looked up by `device.device_kind`.
The f32 column is what an f32 matmul reaches at JAX's default precision: one bf16 pass on
TPU (so the bf16 peak), TF32 tensor cores on A100/H100/H200.

CPUs have no table entry: the kit times a large f32 matmul on every device at once (the
simulated devices share the cores, so the per-device peak is the aggregate over the
device count) and caches the figure per machine, device count and jax version.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import platform
import sys
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

# device_kind substring → (bf16, f32 at default precision) dense FLOP/s per chip. The more
# specific names come first: "TPU v5 lite" must not match "TPU v5".
PEAK_FLOPS: dict[str, tuple[float, float]] = {
    "TPU v6 lite": (918e12, 918e12),  # v6e
    "TPU v6e": (918e12, 918e12),
    "TPU v5 lite": (197e12, 197e12),  # v5e
    "TPU v5e": (197e12, 197e12),
    "TPU v5p": (459e12, 459e12),
    "TPU v5": (459e12, 459e12),  # v5p reports "TPU v5"
    "TPU v4": (275e12, 275e12),
    "H200": (989e12, 494e12),
    "H100 PCIe": (756e12, 378e12),
    "H100": (989e12, 494e12),  # SXM
    "A100": (312e12, 156e12),
}


@dataclasses.dataclass(frozen=True)
class Peak:
    flops_per_s: float  # per device
    source: str  # where the figure comes from, for reports

    def to_json(self) -> dict:
        return {"peak_flops_per_s": self.flops_per_s, "peak_source": self.source}


def table_peak(device_kind: str, dtype: str = "float32") -> Peak | None:
    for name, (bf16, f32) in PEAK_FLOPS.items():
        if name.lower() in device_kind.lower():
            value = bf16 if dtype == "bfloat16" else f32
            return Peak(value, f"{name} {dtype} peak from the kit's table")
    return None


def cache_dir() -> pathlib.Path:
    """$JAXKIT_CACHE_DIR, else $XDG_CACHE_HOME/jaxkit, else ~/.cache/jaxkit."""
    if os.environ.get("JAXKIT_CACHE_DIR"):
        return pathlib.Path(os.environ["JAXKIT_CACHE_DIR"])
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (pathlib.Path(xdg) if xdg else pathlib.Path.home() / ".cache") / "jaxkit"


def measure_matmul_peak(devices: Sequence[jax.Device], size: int = 512, chain: int = 8) -> float:
    """FLOP/s per device of `chain` back-to-back f32 (size × size) matmuls on every device.

    The best of ten timed runs after a warm-up; each device multiplies its own matrices,
    so simulated CPU devices compete for the cores as they do in training.
    """
    n = len(devices)
    mesh = jax.make_mesh((n,), ("d",), devices=devices)
    sharding = NamedSharding(mesh, P("d"))
    rng = np.random.default_rng(0)
    a = jax.device_put(rng.standard_normal((n, size, size), dtype=np.float32) / size, sharding)

    @jax.jit
    def run(x: jax.Array) -> jax.Array:
        for _ in range(chain):
            x = jnp.einsum("nij,njk->nik", x, a)
        return x

    jax.block_until_ready(run(a))
    best = float("inf")
    for _ in range(10):
        start = time.perf_counter()
        jax.block_until_ready(run(a))
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 * chain / best


def cpu_peak(devices: Sequence[jax.Device]) -> Peak:
    """The measured matmul peak per CPU device, from the cache when this machine has one."""
    key = f"{platform.processor() or platform.machine()}|cpus={os.cpu_count()}|"
    key += f"devices={len(devices)}|jax={jax.__version__}"
    path = cache_dir() / "cpu_peak.json"
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        cached = {}
    where = str(path)
    if key not in cached:
        cached[key] = measure_matmul_peak(devices)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(cached, indent=1))
            tmp.replace(path)  # atomic: a concurrent reader sees the old or the new file
        except OSError as err:  # a cache that cannot be written costs a measurement, no run
            where = "not cached"
            print(
                f"warning: the measured CPU peak cannot be cached in {path} ({err}); "
                "it is measured again at each run",
                file=sys.stderr,
            )
    return Peak(float(cached[key]), f"f32 matmul measured on {len(devices)} CPU devices ({where})")


def device_peak(devices: Sequence[jax.Device], dtype: str = "float32") -> Peak | None:
    """Peak FLOP/s per device for a run on `devices`; None for an unknown accelerator."""
    kind = devices[0].device_kind
    if devices[0].platform == "cpu":
        return cpu_peak(devices)
    return table_peak(kind, dtype)

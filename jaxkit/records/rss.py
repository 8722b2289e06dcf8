"""Measured resident memory of one train step on CPU, to check the compiler's estimate.

Run in a fresh process (`python -m jaxkit.records.rss JSON`; `measure_in_subprocess` does it), as
the process's own history would blur the figure. The step is compiled and run once to
warm the runtime, everything is freed, and then, from that baseline, a second state and
batch are created and one step runs while a thread samples the resident set size; the
growth to its peak is what the step used. glibc is told to serve every allocation of
64 KiB or more with its own mapping (MALLOC_MMAP_THRESHOLD_), so freed buffers leave the
resident set instead of lingering in the heap. Linux only (/proc/self/statm).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import subprocess
import sys
import threading
import time

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def supported() -> bool:
    return sys.platform.startswith("linux") and os.path.exists("/proc/self/statm")


class PeakSampler:
    """Samples the resident set size every `interval` seconds in a thread; keeps the peak."""

    def __init__(self, interval: float = 0.0005):
        self.interval, self.peak = interval, rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            time.sleep(self.interval)

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())


def measure(config_dict: dict, per_device_batch_size: int, devices: int) -> dict:
    """Resident growth of one step of `config_dict` at this per-device batch (K = 1)."""
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", devices)
    import numpy as np

    from jaxkit import mesh as mesh_lib
    from jaxkit.batch.schedule import plan_from_config
    from jaxkit.config import saved_run_config
    from jaxkit.plan import costs
    from jaxkit.step.train_step import build

    config = costs.split_config(saved_run_config(config_dict), per_device_batch_size, 1)
    mesh = mesh_lib.make_mesh(dataclasses.asdict(config.mesh))
    plan = plan_from_config(config, mesh_lib.mesh_shape(mesh))
    setup = build(config, plan, mesh)
    step, cost = costs.compile_setup_step(config, plan, setup)
    specs = costs.abstract_batch(config, plan, setup)
    init = setup.init.lower(jax.random.key(0)).compile()

    def one_step() -> None:
        state = init(jax.random.key(0))
        batch = {
            k: jax.device_put(np.zeros(s.shape, s.dtype), s.sharding) for k, s in specs.items()
        }
        state, metrics = step(state, batch, setup.hyper(plan))
        jax.block_until_ready((state, metrics))

    one_step()  # warm: thread pools, runtime caches
    gc.collect()
    time.sleep(0.05)
    baseline = rss_bytes()
    with PeakSampler() as sampler:
        one_step()
    return {
        "per_device_batch_size": per_device_batch_size,
        "devices": devices,
        "estimate_bytes": cost.memory_bytes * devices,  # all simulated devices in this process
        "measured_bytes": sampler.peak - baseline,
    }


def measure_in_subprocess(
    config_dict: dict, per_device_batch_size: int, devices: int = 1, timeout: float = 300
) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    args = json.dumps({"config": config_dict, "b": per_device_batch_size, "devices": devices})
    proc = subprocess.run(
        [sys.executable, "-m", "jaxkit.records.rss", args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"memory probe failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    request = json.loads(sys.argv[1])
    print(json.dumps(measure(request["config"], request["b"], request["devices"])))

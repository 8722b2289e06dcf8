"""The compiler's memory estimate against measured resident memory, and the batch search.

1. For several per-device batches of the tiny LM on one CPU device: the compiled estimate
   (argument + output − alias + temp) against the resident-set growth of one step measured
   in a fresh process (jaxkit/records/rss.py), and the prediction error. Target: within 10%.
2. The compile-only search for the largest per-device batch under a budget: how many
   compiles and seconds it takes, and the batch it finds run once, measured the same way,
   to confirm it fits.

Run: python benchmarks/memory_estimate.py [--batches 8,32,128,256] [--budget 400MiB]
Writes benchmarks/results/memory_estimate.json.
"""

from __future__ import annotations

import argparse
import json
import pathlib

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--config", default="lm_tiny")
parser.add_argument("--batches", default="8,32,128,256")
parser.add_argument("--budget", default="400MiB", help="for the search, per device")
parser.add_argument(
    "--out", default=str(pathlib.Path(__file__).parent / "results" / "memory_estimate.json")
)
args = parser.parse_args()

import jax

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 1)

from jaxkit.config import load_config, run_config
from jaxkit.plan import costs
from jaxkit.records import rss

config = load_config(args.config)
results: dict = {"config": args.config, "devices": "1 CPU device", "points": []}
print(f"{args.config}, one CPU device: compiled estimate vs measured RSS growth of one step")
print(f"{'per_device_batch':>16} {'estimate':>12} {'measured':>12} {'error':>8}")
for b in (int(x) for x in args.batches.split(",")):
    point = rss.measure_in_subprocess(config.to_dict(), b, devices=1)
    point["error"] = point["measured_bytes"] / point["estimate_bytes"] - 1
    results["points"].append(point)
    print(
        f"{b:>16} {costs.format_bytes(point['estimate_bytes']):>12} "
        f"{costs.format_bytes(point['measured_bytes']):>12} {point['error']:>+8.1%}"
    )

budget = costs.parse_bytes(args.budget)
search = costs.max_per_device_batch(run_config(config), jax.devices(), budget)
check = rss.measure_in_subprocess(config.to_dict(), search.per_device_batch_size, devices=1)
results["search"] = {
    "budget_bytes": budget,
    "found_per_device_batch": search.per_device_batch_size,
    "estimate_bytes": search.cost.memory_bytes if search.cost else None,
    "compiles": search.compiles,
    "seconds": search.seconds,
    "tried": search.tried,
    "run_once_measured_bytes": check["measured_bytes"],
    "run_once_fits": check["measured_bytes"] <= budget,
}
s = results["search"]
print(
    f"\nsearch under {costs.format_bytes(budget)}: per_device_batch={s['found_per_device_batch']} "
    f"({costs.format_bytes(s['estimate_bytes'])} estimated) in {s['compiles']} compiles, "
    f"{s['seconds']:.1f} s; run once: {costs.format_bytes(s['run_once_measured_bytes'])} "
    f"measured, {'fits' if s['run_once_fits'] else 'DOES NOT FIT'}"
)
out = pathlib.Path(args.out)
out.parent.mkdir(parents=True, exist_ok=True)
out.write_text(json.dumps(results, indent=2) + "\n")

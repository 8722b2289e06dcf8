"""What the persistent compilation cache saves: each run cold (an empty cache), then warm.

Every run is a fresh process with its own JAXKIT_CACHE_DIR, as a user's second command is:

- the default job (`jaxkit train`, lm_tiny on 8 simulated devices, a few steps);
- llama_tiny with its layers scanned and unrolled;
- lm_125m unrolled on 8 simulated devices, compile only (the step the loop would run);
- `jaxkit plan lm_125m --target v5litepod-8 --all-splits` (TPU compiles, the plan cache).

For each: `compile_s` (the whole wait for the step program), `trace_s` (tracing and
lowering, which no cache skips), their difference (compiling, or reading the cache), and
the whole command's wall time. Goals, warm against cold: compile_s − trace_s at most 10%
for every run; compile_s at most 35% for the default job and 20% for lm_125m; the whole
`plan --target` command at most 10%.

Run: python benchmarks/compile_cache.py [--steps 5] [--skip-target]
Prints a table and writes benchmarks/results/compile_cache.json.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=5, help="optimizer steps of each train run")
parser.add_argument("--skip-target", action="store_true", help="leave out the TPU plan")
parser.add_argument(
    "--out", default=str(pathlib.Path(__file__).parent / "results" / "compile_cache.json")
)
args = parser.parse_args()

# lm_125m's step compiled as the loop compiles it, in a process of its own; prints the cost.
COMPILE_ONLY = """
import dataclasses, json, sys, jax
jax.config.update("jax_num_cpu_devices", 8)
from jaxkit.plan import compile_cache, costs
from jaxkit import mesh as mesh_lib
compile_cache.enable()
from jaxkit.batch.schedule import schedule_from_config
from jaxkit.config import apply_overrides, load_config, run_config
from jaxkit.step.train_step import build
config_dict = load_config(sys.argv[1])
apply_overrides(config_dict, sys.argv[2:])
config = run_config(config_dict)
mesh = mesh_lib.make_mesh(dataclasses.asdict(config.mesh), jax.devices())
schedule = schedule_from_config(config, mesh_lib.mesh_shape(mesh))
setup = build(config, schedule.first, mesh, schedule)
_, cost = costs.compile_setup_step(config, schedule.first, setup)
print(json.dumps(cost.to_json()))
"""


def command(argv: list[str], cache: pathlib.Path) -> tuple[float, str]:
    env = dict(os.environ, JAXKIT_CACHE_DIR=str(cache), PYTHONPATH=str(ROOT))
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    start = time.perf_counter()
    out = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, env=env)
    wall = time.perf_counter() - start
    if out.returncode:
        sys.exit(f"{' '.join(argv)} failed:\n{out.stderr[-3000:]}")
    return wall, out.stdout


def train_case(name: str, overrides: list[str]):
    def once(cache: pathlib.Path, work: pathlib.Path) -> dict:
        workdir = work / f"run-{len(list(work.iterdir()))}"
        argv = [sys.executable, "-m", "jaxkit", "train", name, *overrides]
        argv += [f"train.steps={args.steps}", "--workdir", str(workdir), "--no-progress"]
        wall, _ = command(argv, cache)
        summary = json.loads((workdir / "summary.json").read_text())
        return {k: summary[k] for k in ("compile_s", "trace_s", "compile_cache_hit")} | {
            "wall_s": wall
        }

    return once


def compile_case(name: str, overrides: list[str]):
    def once(cache: pathlib.Path, work: pathlib.Path) -> dict:
        del work
        wall, out = command([sys.executable, "-c", COMPILE_ONLY, name, *overrides], cache)
        cost = json.loads(out.strip().splitlines()[-1])
        return {k: cost[k] for k in ("compile_s", "trace_s", "compile_cache_hit")} | {
            "wall_s": wall
        }

    return once


def plan_case(name: str, target: str):
    def once(cache: pathlib.Path, work: pathlib.Path) -> dict:
        del work
        argv = [sys.executable, "-m", "jaxkit", "plan", name, "--target", target]
        wall, out = command([*argv, "--all-splits", "--json"], cache)
        splits = json.loads(out)["splits"]
        compiled = [s for s in splits if "compile_s" in s]
        return {
            "compile_s": sum(s["compile_s"] for s in compiled),
            "trace_s": sum(s["trace_s"] for s in compiled),
            "compile_cache_hit": all(s["compile_cache_hit"] for s in compiled),
            "splits": len(splits),
            "wall_s": wall,
        }

    return once


CASES = {
    "default job (lm_tiny, 8 devices)": train_case("lm_tiny", []),
    "llama_tiny, scanned layers": train_case("llama_tiny", ["model.scan_layers=true"]),
    "llama_tiny, unrolled layers": train_case("llama_tiny", ["model.scan_layers=false"]),
    "lm_125m unrolled, compile only": compile_case("lm_125m", ["model.scan_layers=false"]),
}
if not args.skip_target:
    CASES["plan lm_125m --target v5litepod-8 --all-splits"] = plan_case("lm_125m", "v5litepod-8")

results = {}
for label, once in CASES.items():
    with tempfile.TemporaryDirectory() as tmp:
        cache, work = pathlib.Path(tmp) / "cache", pathlib.Path(tmp) / "work"
        work.mkdir()
        cold = once(cache, work)
        warm = once(cache, work)
    results[label] = {"cold": cold, "warm": warm}
    print(f"{label}: cold {cold}, warm {warm}", file=sys.stderr)


def ratio(a: float, b: float) -> str:
    return f"{a / b:.0%}" if b else "-"


header = "| run | compile_s cold → warm | trace_s cold → warm | compile − trace | whole command |"
print(header)
print("|---|---|---|---|---|")
for label, r in results.items():
    c, w = r["cold"], r["warm"]
    assert w["compile_cache_hit"] and not c["compile_cache_hit"], (label, c, w)
    rest_c, rest_w = c["compile_s"] - c["trace_s"], w["compile_s"] - w["trace_s"]
    print(
        f"| {label} | {c['compile_s']:.2f} → {w['compile_s']:.2f} s "
        f"({ratio(w['compile_s'], c['compile_s'])}) | {c['trace_s']:.2f} → {w['trace_s']:.2f} s "
        f"| {rest_c:.2f} → {rest_w:.2f} s ({ratio(rest_w, rest_c)}) "
        f"| {c['wall_s']:.1f} → {w['wall_s']:.1f} s ({ratio(w['wall_s'], c['wall_s'])}) |"
    )
out = pathlib.Path(args.out)
out.parent.mkdir(parents=True, exist_ok=True)
out.write_text(json.dumps({"steps": args.steps, "cpu_count": os.cpu_count(), **results}, indent=1))
print(f"wrote {out}", file=sys.stderr)

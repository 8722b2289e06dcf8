"""New tokens per second of `jaxkit sample`'s key/value cache against recomputing the prefix.

Both paths are jaxkit/generate/sampling.py's own, on one random-init model per config (speed does
not depend on training): the key/value cache the built-in models decode with, and the path
a model of your own takes (no cache: the whole prefix through the model at every step,
rows padded on the right), which a Sampler takes when its `decoding` names no cache. Both
draw with the same keys at temperature 1 (`jaxkit sample`'s default), so they generate the
same tokens: the table counts how many agree.

Points: llama_tiny at 256 and 1,024 new tokens, lm_tiny up to its data.seq_len (its learned
positions end there, prompt included), each after one prompt of 8 bytes (a bucket of 16)
per row. Each program is the pair `Sampler.generate` runs (`Sampler._program`'s prefill
and `Sampler._advance`'s steps, for the arguments `Sampler._batch` gives them, every new
token in one call as without a progress bar), compiled ahead of time: compile time (tracing,
lowering and compiling) is reported apart from generation, which is the compiled program's
call until its tokens are on the host, the median of --repeats calls (--recompute-repeats
for the recomputed path, whose long points take the most time) after a first, untimed one
(an executable's first call also sets it up) unless that first call took 15 s or more.
Nothing stops a row early: there is no stop id.

Target: the cache at least 5x the recomputed path's new tokens per second at 1,024 new
tokens. The cache's memory per sequence is its key and value arrays for one row, as
jaxkit/models/kv_cache.py allocates them (layers x slots x key/value heads x head width, twice, in
the compute dtype; slots = the prompt's bucket + the new tokens).

Run: python benchmarks/sample.py [--host-devices 1] [--rows 1] [--repeats 3]
     [--recompute-repeats 1] [--new-tokens 256,1024] [--configs llama_tiny,lm_tiny] [--small]
Prints a table and writes benchmarks/results/sample.json. --small shrinks the models
(d_model 32, data.seq_len 32) and the points (16 and 64 new tokens) to check the script in
seconds; its target is not checked (no point has 1,024 new tokens).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import platform
import statistics
import time

import jax
import numpy as np
from flax import nnx

from jaxkit import mesh as mesh_lib
from jaxkit.config import apply_overrides, load_config, run_config
from jaxkit.generate import sampling
from jaxkit.models import build_model, layers
from jaxkit.models.kv_cache import Cache
from jaxkit.models.lm import lm_model, lm_seq_len
from jaxkit.sections import RunConfig

PROMPT = b"def main"  # 8 bytes: a prompt bucket of 16
TARGET_NEW_TOKENS = 1024
TARGET_RATIO = 5.0
WARM_ENOUGH_S = 15.0  # a first call this long is timed as it is (its setup is under 1%)
SMALL = ["model.d_model=32", "model.mlp_dim=64", "data.seq_len=32"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host-devices", type=int, default=1, help="simulated CPU devices")
    parser.add_argument("--rows", type=int, default=1, help="prompts generated together")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls of the cache's")
    parser.add_argument(
        "--recompute-repeats", type=int, default=1, help="timed calls of the recomputed path's"
    )
    parser.add_argument(
        "--new-tokens", default=None, help="llama_tiny's points (default 256,1024; 16,64 --small)"
    )
    parser.add_argument(
        "--configs", default="llama_tiny,lm_tiny", help="the models measured, of these two"
    )
    parser.add_argument("--small", action="store_true", help="shrunk models and points")
    parser.add_argument(
        "--out", default=str(pathlib.Path(__file__).parent / "results" / "sample.json")
    )
    args = parser.parse_args(argv)
    default = "16,64" if args.small else "256,1024"
    args.new_tokens = [int(n) for n in (args.new_tokens or default).split(",") if n.strip()]
    args.configs = [name for name in args.configs.split(",") if name.strip()]
    if not set(args.configs) <= {"llama_tiny", "lm_tiny"}:
        parser.error(f"--configs: llama_tiny and/or lm_tiny, not {','.join(args.configs)}")
    return args


def model_config(name: str, small: bool) -> RunConfig:
    config = load_config(name)
    apply_overrides(config, SMALL if small else [])
    return run_config(config)


def samplers(config: RunConfig, devices: list) -> tuple:
    """(the cache's Sampler, the recomputed path's) on the same random-init params."""
    with nnx.use_eager_sharding(False):
        model = build_model(config, nnx.Rngs(0))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    mesh = mesh_lib.make_mesh(dataclasses.asdict(config.mesh), devices)
    cached = sampling.Sampler(config, mesh, params)
    recomputed = sampling.Sampler(config, mesh, params)
    # What a model of your own declares: no cache, the same position bound.
    recomputed.decoding = dataclasses.replace(cached.decoding, cache=None)
    return cached, recomputed


def cache_bytes_per_sequence(sampler, slots: int) -> int:
    """The key and value arrays of one row, as generation allocates them (no memory used)."""
    layers_, kv_heads, head_dim = sampler.decoding.cache
    dtype = layers.dtypes(sampler.config.model)[1]
    cache = jax.eval_shape(lambda: Cache.empty(layers_, 1, slots, kv_heads, head_dim, dtype))
    return sum(a.size * a.dtype.itemsize for a in (cache.k_NxBxSxGxK, cache.v_NxBxSxGxK))


def timed(sampler, prompts: list[list[int]], new: int, repeats: int) -> dict:
    """generate()'s program for `prompts`: its compile, then `repeats` calls."""
    settings = sampling.Settings()  # temperature 1, every token kept: the command's default
    longest = max(map(len, prompts))
    B, bucket = sampler.rows_per_batch(len(prompts)), sampler.prompt_bucket(longest)
    eos_E = np.full((8,), -1, np.int32)  # no stop id (-1 is never drawn): all `new` tokens
    programs = sampler._program(B, bucket, new, settings, len(eos_E), False)
    tokens, where, rows = sampler._batch(prompts, B, bucket, 0, new, longest)
    start = time.perf_counter()
    lowered = programs[0].lower(sampler.params, tokens, where, rows)
    compiled_start = lowered.compile()
    # The prefill's state, as the advance program takes it (laid out as the prefill left it).
    state = jax.tree.map(
        lambda info, sharding: jax.ShapeDtypeStruct(info.shape, info.dtype, sharding=sharding),
        lowered.out_info,
        compiled_start.output_shardings,
    )
    advance_args = (where, rows, np.uint32(0), eos_E, np.int32(new))
    advance = sampler._advance(programs, state, settings)
    compiled_advance = advance.lower(sampler.params, state, *advance_args).compile()
    compile_s = time.perf_counter() - start

    def call() -> float:
        """The prefill, then every new token in one call, as generate() runs a batch."""
        nonlocal tokens_BxN
        start = time.perf_counter()
        state = compiled_start(sampler.params, tokens, where, rows)
        state = compiled_advance(sampler.params, state, *advance_args)
        tokens_BxN = np.asarray(state[-3])
        return time.perf_counter() - start

    tokens_BxN = None
    first_call_s = call()
    # An executable's first call also sets it up (50-130 ms measured here): a warm-up, unless
    # the call is so long that the setup is under 1% of it.
    times = [first_call_s] if first_call_s >= WARM_ENOUGH_S else []
    times += [call() for _ in range(repeats - len(times))]
    generate_s = statistics.median(times)
    return {
        "compile_s": round(compile_s, 3),
        "generate_s": generate_s,
        "generate_s_each": times,
        "first_call_s": first_call_s,
        "tokens_per_s": len(prompts) * new / generate_s,
        "prompt_bucket": bucket,
        "batch_rows": B,
        "tokens": tokens_BxN[: len(prompts)].tolist(),
    }


def leading_agreement(a: list[list[int]], b: list[list[int]]) -> int:
    """The fewest leading tokens any row's two samples share."""
    agree = []
    for row_a, row_b in zip(a, b, strict=True):
        same = [x == y for x, y in zip(row_a, row_b, strict=True)] + [False]
        agree.append(same.index(False))
    return min(agree)


def point(
    name: str, config: RunConfig, cached, recomputed, new: int, args: argparse.Namespace
) -> dict:
    prompts = [list(PROMPT)] * args.rows
    cache = timed(cached, prompts, new, args.repeats)
    recompute = timed(recomputed, prompts, new, args.recompute_repeats)
    m = lm_model(config)
    return {
        "config": name,
        "model": f"{m.kind}, d_model {m.d_model}, {m.num_layers} layers, {m.num_heads} heads",
        "new_tokens": new,
        "rows": args.rows,
        "prompt_tokens": len(PROMPT),
        "cache": {k: v for k, v in cache.items() if k != "tokens"},
        "recompute": {k: v for k, v in recompute.items() if k != "tokens"},
        "ratio": cache["tokens_per_s"] / recompute["tokens_per_s"],
        "tokens_agree": leading_agreement(cache["tokens"], recompute["tokens"]),
        "cache_slots": cache["prompt_bucket"] + new,
        "cache_bytes_per_sequence": cache_bytes_per_sequence(cached, cache["prompt_bucket"] + new),
    }


def table(points: list[dict]) -> list[str]:
    lines = [
        "| model | new tokens | cache tokens/s | recompute tokens/s | ratio | compile s "
        "(cache / recompute) | cache per sequence | tokens agree |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for p in points:
        c, r = p["cache"], p["recompute"]
        lines.append(
            f"| {p['config']} | {p['new_tokens']:,} | {c['tokens_per_s']:,.0f} | "
            f"{r['tokens_per_s']:,.1f} | {p['ratio']:.1f}x | {c['compile_s']:.2f} / "
            f"{r['compile_s']:.2f} | {p['cache_bytes_per_sequence'] / 2**10:,.0f} KiB "
            f"({p['cache_slots']:,} slots) | {p['tokens_agree']:,} / {p['new_tokens']:,} |"
        )
    return lines


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    devices = jax.devices()[: args.host_devices]
    load_before = os.getloadavg()
    wall, cpu = time.perf_counter(), time.process_time()
    points = []
    for name in args.configs:
        config = model_config(name, args.small)
        cached, recomputed = samplers(config, devices)
        # lm_tiny's learned positions end at data.seq_len, prompt included.
        news = args.new_tokens if name == "llama_tiny" else [lm_seq_len(config) - len(PROMPT)]
        for new in news:
            points.append(point(name, config, cached, recomputed, new, args))
            p = points[-1]
            print(
                f"{name} {new} new: cache {p['cache']['tokens_per_s']:,.0f} tokens/s, "
                f"recompute {p['recompute']['tokens_per_s']:,.1f} tokens/s ({p['ratio']:.1f}x)",
                flush=True,
            )
    at_target = [p for p in points if p["config"] == "llama_tiny"]
    at_target = [p for p in at_target if p["new_tokens"] == TARGET_NEW_TOKENS]
    ratio = at_target[0]["ratio"] if at_target else None
    results = {
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "cpu_count": os.cpu_count(),
        "devices": f"{len(devices)} x {devices[0].platform}",
        "jax": jax.__version__,
        "small": args.small,
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        # On a shared machine the CPU seconds say more of what an idle one would take.
        "wall_s": round(time.perf_counter() - wall, 1),
        "cpu_s": round(time.process_time() - cpu, 1),
        "points": points,
        "target": {
            "new_tokens": TARGET_NEW_TOKENS,
            "ratio_at_least": TARGET_RATIO,
            "ratio": ratio,
            "holds": None if ratio is None else ratio >= TARGET_RATIO,
        },
    }
    print(
        f"\njaxkit sample: the key/value cache against recomputing the prefix, {args.rows} "
        f"row(s) on {results['devices']}: {results['wall_s']:.0f} s ({results['cpu_s']:.0f} "
        f"s of CPU) at a load average of {load_before[0]:.1f} before, "
        f"{results['load_average_after'][0]:.1f} after"
    )
    print("\n".join(table(points)))
    if ratio is None:
        print(f"target: cache >= {TARGET_RATIO:g}x at {TARGET_NEW_TOKENS:,} new tokens: not run")
    else:
        holds = "holds" if ratio >= TARGET_RATIO else "does NOT hold"
        print(
            f"target: cache >= {TARGET_RATIO:g}x at {TARGET_NEW_TOKENS:,} new tokens: "
            f"{ratio:.1f}x, {holds}"
        )
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {out}")
    return results


if __name__ == "__main__":
    # Before JAX starts its backend (importing jaxkit does not): a test calls main() on its own.
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", parse_args().host_devices)
    main()

"""lm_125m on one GPU in bfloat16: the kit's train step against a hand-written JAX loop,
and the planner's recommended split against the measured best.

1. Kit against hand (always): the config (default lm_125m: Llama-style, 124M params,
   bfloat16 matmuls, seq 1024) at --per-device-batch rows (default 16) and K = 1 on the
   first device. The kit: jaxkit.step.train_step.build, its step compiled ahead of time
   (costs.compile_setup_step, as the loop does) and called as the loop calls it, with
   MultiSteps, the float32 gradient accumulator and the non-finite guard inside. The hand
   loop: the same model (jaxkit.models.build_model from the same config, the same initial
   params), one plain jax.jit step: value_and_grad of the float32 cross-entropy on the
   logits, optax.chain(clip_by_global_norm, adamw) with the config's hyperparameters at
   the peak learning rate, state donated, no MultiSteps. Both run the same device-resident
   batches (the config's data source), the same warm-up, then --repeats paired windows of
   --steps steps each (kit window, then hand window), each timed to block_until_ready.
   Reported: tokens/s and MFU of each, and kit/hand throughput (median of the pairs;
   target >= 0.97). MFU = model FLOPs per step (jaxkit.plan.flops.model_flops_per_example ×
   rows) / step time / peak (jaxkit.plan.peak.table_peak(device_kind, "bfloat16"); a CPU has
   no table entry and uses the kit's measured f32 matmul peak, so its MFU is only
   indicative). The two loops' losses are printed side by side as a check that they train
   the same model the same way.
2. Splits (--splits): the `jaxkit plan CONFIG --all-splits --remat none,dots,full` logic on
   this one device: costs.enumerate_splits of the config's global batch, each split and
   policy compiled and costed as costs.with_costs does (the compiled program is kept and
   timed, not compiled twice), costs.recommend under the device's memory limit
   (--memory-budget overrides; a CPU reports none: every split fits). Then every split
   that fits is timed for --split-steps optimizer steps (K micro-steps each, after one
   warm-up step): the recommended split's tokens/s against the measured best.

--attention sets model.attention (jaxkit/models/attention.py); the default, auto, runs cuDNN's flash
attention on an NVIDIA GPU in bfloat16 and xla elsewhere. Both loops build the model from the
resolved config, so they run the same kernel; run once per kernel to compare them (cudnn is
checked only here, on a GPU: the tests have none).

--small shrinks everything for a machine without a GPU (d_model 128, 2 layers, 4 heads,
MLP 384, seq 128, vocabulary 256, per-device batch 4, and global batch 32 for --splits):
it proves the script runs; its timings mean little.

Run: python benchmarks/gpu_lm125m.py [--config lm_125m] [--per-device-batch 16]
     [--remat none|dots|full] [--attention auto|xla|cudnn] [--steps 20] [--warmup 3] [--repeats 3]
     [--splits [--split-remat none,dots,full] [--split-batches 4,8,16] [--split-steps 3]
      [--global-batch N] [--memory-budget 70GiB]] [--small]
     e.g. python benchmarks/gpu_lm125m.py --config lm_350m --remat dots --splits
Writes benchmarks/results/gpu_lm125m.json (device kind included).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import pathlib
import platform
import statistics
import time

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--config", default="lm_125m")
parser.add_argument("--per-device-batch", type=int, default=None, help="default 16 (4 --small)")
parser.add_argument("--remat", default=None, help="model.remat; default the config's")
parser.add_argument(
    "--attention",
    default=None,
    help="model.attention: auto, xla, cudnn (an NVIDIA GPU in bfloat16) or splash (a TPU); "
    "default the config's (auto); both loops run the kernel it resolves to on this device",
)
parser.add_argument("--steps", type=int, default=20, help="steps per timed window")
parser.add_argument("--warmup", type=int, default=3, help="untimed steps of each loop first")
parser.add_argument("--repeats", type=int, default=3, help="paired (kit, hand) windows")
parser.add_argument("--splits", action="store_true", help="also planner vs measured splits")
parser.add_argument("--split-remat", default="none,dots,full")
parser.add_argument("--split-batches", default="", help="per-device batches to try; '' = all")
parser.add_argument("--split-steps", type=int, default=3, help="timed optimizer steps per split")
parser.add_argument("--global-batch", type=int, default=None, help="for --splits")
parser.add_argument("--memory-budget", default=None, help="for --splits, e.g. 70GiB")
parser.add_argument("--small", action="store_true", help="shrunk shapes, for a CPU")
parser.add_argument(
    "--out", default=str(pathlib.Path(__file__).parent / "results" / "gpu_lm125m.json")
)
args = parser.parse_args()

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxkit import mesh as mesh_lib
from jaxkit.batch.schedule import plan_from_config
from jaxkit.config import load_config, run_config
from jaxkit.data.sources import load_micro_batch, make_sources
from jaxkit.models import build_model
from jaxkit.models.lm import lm_seq_len
from jaxkit.plan import costs
from jaxkit.plan.flops import model_flops_per_example
from jaxkit.plan.peak import device_peak, table_peak
from jaxkit.records.steps import above_the_peak
from jaxkit.sections import RunConfig
from jaxkit.step.optimizer import Hyper
from jaxkit.step.train_step import build, check_on_mesh, with_kernel

SMALL = {
    "model.d_model": 128,
    "model.num_layers": 2,
    "model.num_heads": 4,
    "model.num_kv_heads": 4,
    "model.mlp_dim": 384,
    "data.seq_len": 128,
    "model.vocab_size": 256,
}


def base_config():
    config = load_config(args.config)
    if args.small:
        for key, value in SMALL.items():
            section, name = key.split(".")
            config[section][name] = value
        config.batch.global_batch_size = 32
        config.batch.per_device_batch_size = 4
    if args.remat is not None:
        config.model.remat = args.remat
    if args.attention is not None:
        config.model.attention = args.attention
    if args.global_batch is not None:
        config.batch.global_batch_size = args.global_batch
    return config


def peak_of(device: jax.Device) -> tuple[float, str]:
    found = table_peak(device.device_kind, "bfloat16")
    if found is None:  # a CPU (or an unknown accelerator): the kit's measured figure
        found = device_peak([device], "bfloat16")
    if found is None:
        return float("nan"), "unknown device: no peak"
    return found.flops_per_s, found.source


def block(tree) -> None:
    jax.block_until_ready(tree)


# ---------------------------------------------------------------- 1. kit against hand ---


def hand_loop(config: RunConfig, params, device, lr: float):
    """A plain jit step over the same model: (params, opt_state) donated, no MultiSteps."""
    with nnx.use_eager_sharding(False):  # the structure only: the params are the kit's
        graphdef = nnx.split(nnx.eval_shape(lambda: build_model(config, nnx.Rngs(0))))[0]
    o = config.optimizer
    scanned = config.model.scan_layers

    def matrices(tree):  # decay matrices only; a scanned layer axis does not make one
        def is_matrix(path, p):
            stacked = scanned and any(getattr(k, "key", None) == "blocks" for k in path)
            return p.ndim - stacked >= 2

        return jax.tree_util.tree_map_with_path(is_matrix, tree)

    clip = optax.clip_by_global_norm(o.grad_clip_norm) if o.grad_clip_norm > 0 else optax.identity()
    tx = optax.chain(
        clip, optax.adamw(lr, b1=o.b1, b2=o.b2, weight_decay=o.weight_decay, mask=matrices)
    )

    def loss_fn(p, batch):
        logits = nnx.merge(graphdef, p)(batch["inputs"]).astype(jnp.float32)
        labels = batch["targets"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    @functools.partial(jax.jit, donate_argnums=0)
    def step(state, batch):
        p, opt_state = state
        loss, grads = jax.value_and_grad(loss_fn)(p, batch)
        updates, opt_state = tx.update(grads, opt_state, p)
        return (optax.apply_updates(p, updates), opt_state), loss

    params = jax.device_put(params, device)
    return step, (params, jax.device_put(tx.init(params), device))


def timed_window(run_step, state, batches):
    """Seconds per step over `batches`, timed to the last step's completion; losses."""
    losses = []
    block(state)
    start = time.perf_counter()
    for batch in batches:
        state, loss = run_step(state, batch)
        losses.append(loss)
    block(state)
    seconds = (time.perf_counter() - start) / len(batches)
    return state, seconds, [float(x) for x in losses]


def compare(config: RunConfig, device, peak: float) -> dict:
    b = args.per_device_batch or (4 if args.small else 16)
    config = costs.split_config(config, b, 1)
    mesh = mesh_lib.make_mesh(dataclasses.asdict(config.mesh), [device])
    shape = mesh_lib.mesh_shape(mesh)
    check_on_mesh(config, shape)
    plan = plan_from_config(config, shape)
    setup = build(config, plan, mesh)
    start = time.perf_counter()
    kit_step, cost = costs.compile_setup_step(config, plan, setup)
    print(f"  kit step compiled in {time.perf_counter() - start:.1f} s", flush=True)
    kit_state = setup.init(jax.random.key(config.train.seed))
    host_params = jax.device_get(kit_state.params)  # the hand loop starts where the kit does
    hand_step, hand_state = hand_loop(config, host_params, device, plan.learning_rate)
    del host_params
    hyper = Hyper(np.int32(1), np.float32(plan.learning_rate))  # K=1, the peak rate

    source, _ = make_sources(config)
    n = args.warmup + args.steps * args.repeats
    batches = [
        load_micro_batch(
            source, i * plan.global_batch_size, 0, plan, config.train.seed, setup.batch_sharding
        )
        for i in range(n)
    ]
    block(batches)

    def kit(state, batch):
        state, metrics = kit_step(state, batch, hyper)  # host scalars, as the loop passes
        return state, metrics["loss"]

    warm = batches[: args.warmup]
    start = time.perf_counter()
    kit_state, _, kit_warm = timed_window(kit, kit_state, warm)
    print(f"  kit warm-up ({args.warmup} steps) {time.perf_counter() - start:.1f} s", flush=True)
    start = time.perf_counter()
    hand_state, _, hand_warm = timed_window(hand_step, hand_state, warm)
    print(
        f"  hand warm-up ({args.warmup} steps, compile included) "
        f"{time.perf_counter() - start:.1f} s",
        flush=True,
    )
    tokens = plan.micro_batch_size * lm_seq_len(config)
    flops = model_flops_per_example(config) * plan.micro_batch_size
    kit_times, hand_times, ratios = [], [], []
    kit_losses, hand_losses = list(kit_warm), list(hand_warm)
    for r in range(args.repeats):
        window = batches[args.warmup + r * args.steps : args.warmup + (r + 1) * args.steps]
        kit_state, t_kit, lk = timed_window(kit, kit_state, window)
        hand_state, t_hand, lh = timed_window(hand_step, hand_state, window)
        kit_times.append(t_kit)
        hand_times.append(t_hand)
        ratios.append(t_hand / t_kit)  # kit throughput / hand throughput
        kit_losses += lk
        hand_losses += lh
        print(
            f"  pair {r + 1}/{args.repeats}: kit {t_kit * 1e3:8.2f} ms/step "
            f"({tokens / t_kit:10.0f} tok/s, MFU {flops / t_kit / peak:6.1%}) | hand "
            f"{t_hand * 1e3:8.2f} ms/step ({tokens / t_hand:10.0f} tok/s, MFU "
            f"{flops / t_hand / peak:6.1%}) | kit/hand {t_hand / t_kit:.3f}",
            flush=True,
        )
    memory = {}
    with contextlib.suppress(Exception):  # CPUs have no memory stats
        memory = {k: v for k, v in (device.memory_stats() or {}).items() if "bytes" in k}
    t_kit, t_hand = statistics.median(kit_times), statistics.median(hand_times)
    max_gap = max(abs(a - b) for a, b in zip(kit_losses, hand_losses, strict=True))
    print(
        f"  losses, step 1 -> {len(kit_losses)}: kit {kit_losses[0]:.4f} -> {kit_losses[-1]:.4f}"
        f" | hand {hand_losses[0]:.4f} -> {hand_losses[-1]:.4f} (largest gap {max_gap:.2e})"
    )
    return {
        "per_device_batch_size": b,
        "grad_accum_steps": 1,
        "tokens_per_step": tokens,
        "model_flops_per_step": flops,
        "kit_compiled": {
            "memory_bytes": cost.memory_bytes,
            "hardware_per_model_flop": cost.hardware_flops_per_step / cost.model_flops_per_step,
            "compile_s": cost.compile_s,
        },
        "kit_step_s": t_kit,
        "hand_step_s": t_hand,
        "kit_tokens_per_s": tokens / t_kit,
        "hand_tokens_per_s": tokens / t_hand,
        "kit_mfu": flops / t_kit / peak,
        "hand_mfu": flops / t_hand / peak,
        "kit_over_hand": statistics.median(ratios),
        "pair_ratios": ratios,
        "target": ">= 0.97",
        "kit_step_s_all": kit_times,
        "hand_step_s_all": hand_times,
        "losses": {"kit": kit_losses, "hand": hand_losses, "largest_gap": max_gap},
        "device_memory_stats": memory,
    }


def peak_warning(kit: dict, peak_source: str) -> list[str]:
    """The train summary's line on an MFU above 100% (jaxkit.records.steps), for either loop's."""
    mfu = max(kit["kit_mfu"], kit["hand_mfu"])
    # The hand loop runs the kit's model: its hardware FLOPs per model FLOP, as compiled.
    per_model_flop = kit["kit_compiled"]["hardware_per_model_flop"]
    return above_the_peak(
        {
            "mfu": mfu,
            "hfu": mfu * per_model_flop,
            "peak_source": peak_source,
            "model_flops_per_step": kit["model_flops_per_step"],
            "hardware_flops_per_step": kit["model_flops_per_step"] * per_model_flop,
        }
    )


# --------------------------------------------------- 2. planner against measured splits ---


def time_split(config: RunConfig, split: costs.Split, setup, program, device) -> float:
    """Seconds per optimizer step (K micro-steps) of `split`, after one warm-up step."""
    plan = split.plan
    source, _ = make_sources(config)
    micro = [
        load_micro_batch(source, 0, m, plan, config.train.seed, setup.batch_sharding)
        for m in range(plan.grad_accum_steps)
    ]
    hyper = Hyper(np.int32(plan.grad_accum_steps), np.float32(plan.learning_rate))
    state = setup.init(jax.random.key(config.train.seed))

    def optimizer_step(state):
        for batch in micro:
            state, _ = program(state, batch, hyper)
        return state

    state = optimizer_step(state)  # warm-up
    block(state)
    start = time.perf_counter()
    for _ in range(args.split_steps):
        state = optimizer_step(state)
    block(state)
    return (time.perf_counter() - start) / args.split_steps


def splits(config: RunConfig, device, peak: float) -> dict:
    policies = [p.strip() for p in args.split_remat.split(",") if p.strip()]
    wanted = {int(b) for b in args.split_batches.split(",") if b.strip()}
    shape = mesh_lib.resolve_mesh_shape(dataclasses.asdict(config.mesh), 1)
    check_on_mesh(config, shape)
    found = costs.enumerate_splits(config, [1])
    found = [s for s in found if not wanted or s.plan.per_device_batch_size in wanted]
    if not found:
        raise SystemExit("--splits: no split of the global batch on one device")
    if args.memory_budget:
        budget = costs.parse_bytes(args.memory_budget)
    else:
        budget = costs.device_memory_bytes(device)
    g = found[0].plan.global_batch_size
    print(
        f"\nsplits of global batch {g} on 1 x {device.device_kind}, remat "
        f"{', '.join(policies)}; budget "
        + (costs.format_bytes(budget) if budget else "none (the device reports no limit)"),
        flush=True,
    )
    mesh = mesh_lib.make_mesh(dataclasses.asdict(config.mesh), [device])
    costed, programs = [], {}
    for policy in policies:
        for s in found:
            s = dataclasses.replace(s, remat=policy)
            p = s.plan
            cfg = costs.split_config(
                costs.with_remat(config, policy), p.per_device_batch_size, p.grad_accum_steps
            )
            setup = build(cfg, p, mesh)
            try:  # as costs.with_costs, keeping the program to time it
                program, cost = costs.compile_setup_step(cfg, p, setup)
                s = dataclasses.replace(s, cost=cost)
                programs[s.key] = (cfg, setup, program)
            except costs.OutOfMemory as err:
                s = dataclasses.replace(s, out_of_memory=err)
            costed.append(s)
            c = s.cost
            print(
                f"  remat={policy:<4} b={p.per_device_batch_size:<4} K={p.grad_accum_steps:<4} "
                + (
                    f"{costs.format_bytes(c.memory_bytes):>10}, hardware/model "
                    f"{s.hardware_per_model_flop:.3f}, compile {c.compile_s:.1f} s"
                    if c
                    else "refused by the compiler (memory)"
                ),
                flush=True,
            )
    chosen = costs.recommend(costed, budget if budget else 1 << 62, 1)
    rows = []
    for s in costed:
        p, c = s.plan, s.cost
        row = {
            "per_device_batch_size": p.per_device_batch_size,
            "grad_accum_steps": p.grad_accum_steps,
            "remat": s.remat,
            "memory_bytes": c.memory_bytes if c else None,
            "hardware_per_model_flop": s.hardware_per_model_flop,
            "fits": bool(c) and (budget is None or c.memory_bytes <= budget),
            "recommended": chosen is not None and s.key == chosen.key,
            "optimizer_step_s": None,
        }
        if row["fits"]:
            cfg, setup, program = programs.pop(s.key)
            try:
                t = time_split(cfg, s, setup, program, device)
            except jax.errors.JaxRuntimeError as err:  # compiled, but the device ran out
                if "RESOURCE_EXHAUSTED" not in str(err):
                    raise
                row["run_error"] = str(err).splitlines()[0]
                print(f"  remat={s.remat} b={p.per_device_batch_size}: out of memory at run")
            else:
                row["optimizer_step_s"] = t
                row["tokens_per_s"] = g * lm_seq_len(config) / t
                row["mfu"] = model_flops_per_example(cfg) * g / t / peak
                print(
                    f"  remat={s.remat:<4} b={p.per_device_batch_size:<4} "
                    f"K={p.grad_accum_steps:<4} {t:8.3f} s/step {row['tokens_per_s']:10.0f} "
                    f"tok/s MFU {row['mfu']:6.1%}"
                    + ("  <- recommended" if row["recommended"] else ""),
                    flush=True,
                )
            del setup, program
        rows.append(row)
    programs.clear()
    timed = [r for r in rows if r["optimizer_step_s"]]
    best = min(timed, key=lambda r: r["optimizer_step_s"]) if timed else None
    rec = next((r for r in rows if r["recommended"]), None)
    out = {
        "global_batch_size": g,
        "memory_budget_bytes": budget,
        "policies": policies,
        "rows": rows,
        "recommended": rec,
        "measured_best": best,
    }
    if best and rec and rec["optimizer_step_s"]:
        out["recommended_over_best_throughput"] = best["optimizer_step_s"] / rec["optimizer_step_s"]
        order = sorted(timed, key=lambda r: r["optimizer_step_s"])
        out["recommended_rank"] = order.index(rec) + 1
        print(
            f"  planner: remat={rec['remat']} b={rec['per_device_batch_size']} "
            f"K={rec['grad_accum_steps']} | measured best: remat={best['remat']} "
            f"b={best['per_device_batch_size']} K={best['grad_accum_steps']} | recommended at "
            f"{out['recommended_over_best_throughput']:.1%} of the best's tokens/s, rank "
            f"{out['recommended_rank']} of {len(timed)}"
        )
    return out


def resolved_config(device: jax.Device) -> RunConfig:
    """The config both loops run on `device`: auto resolved as a run there resolves it; a
    kernel it cannot run is refused (benchmarks/gpu_suite.py's first stage calls this)."""
    return with_kernel(run_config(base_config()), [device])


def main() -> None:
    device = jax.devices()[0]
    config = resolved_config(device)
    peak, peak_source = peak_of(device)
    print(
        f"{args.config}{' (--small)' if args.small else ''} on 1 x {device.device_kind} "
        f"({device.platform}); remat {config.model.remat}, attention "
        f"{config.model.attention}, scan_layers "
        f"{config.model.scan_layers}, compute {config.model.compute_dtype}; "
        f"peak {peak / 1e12:.3g} TFLOP/s ({peak_source})",
        flush=True,
    )
    results: dict = {
        "config": args.config,
        "small": args.small,
        "overrides": SMALL if args.small else {},
        "remat": config.model.remat,
        "attention": config.model.attention,
        "scan_layers": config.model.scan_layers,
        "seq_len": config.data.seq_len,
        "device_kind": device.device_kind,
        "platform": device.platform,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores",
        "jax": jax.__version__,
        "peak_flops_per_s": peak,
        "peak_source": peak_source,
        "argv": vars(args),
        "load_average_start": os.getloadavg(),  # the machine may be shared
    }
    print("\n1. kit step against a hand-written jit loop", flush=True)
    results["kit_vs_hand"] = kit = compare(config, device, peak)
    print(
        f"\nkit {kit['kit_tokens_per_s']:.0f} tok/s (MFU {kit['kit_mfu']:.1%}) | hand "
        f"{kit['hand_tokens_per_s']:.0f} tok/s (MFU {kit['hand_mfu']:.1%}) | kit/hand "
        f"{kit['kit_over_hand']:.3f} (median of {args.repeats} pairs, range "
        f"{min(kit['pair_ratios']):.3f}-{max(kit['pair_ratios']):.3f}; target >= 0.97)",
        flush=True,
    )
    for line in peak_warning(kit, peak_source):
        print(line.strip(), flush=True)
    if args.splits:
        results["splits"] = splits(config, device, peak)
    results["load_average_end"] = os.getloadavg()
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

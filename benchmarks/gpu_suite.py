"""The GPU suite's stages, in order (benchmarks/gpu_suite.sh installs the kit, then runs this).

1. smoke: the kit imports and takes one optimizer step on this jax (lm_125m shrunk to one
   narrow layer, one device, the kernel `auto` picks), and gpu_lm125m.py resolves its
   config: seconds, and the suite stops here if it fails.
2. measure: lm_125m, lm_350m and lm_1b in bfloat16 with model.attention cudnn and xla, each
   at the largest per-device batch of its list that fits (an out-of-memory run moves to the
   next one down; xla starts at the batch cudnn fitted), K = 1: the kit against
   benchmarks/gpu_lm125m.py's hand-written loop with the same kernel (one process per run,
   so an out-of-memory run leaves nothing behind): tokens/s, MFU, HFU, compiled and peak
   memory. Runs go in PRIORITY order until --budget-s is spent; what is left is listed as
   skipped, for --only to take.
3. traces: a `train.profile_steps` trace of two optimizer steps (the second samples the
   noise scale, whose program a step before the trace compiled) of the fastest lm_125m and
   lm_1b runs, through `jaxkit train`, its Perfetto file copied flat to
   OUT/<config>-trace.json.gz and held under 16 MiB.
4. imports (--dry-run only): every module the stages import resolves to the standard
   library, a package of the GPU image (IMAGE) or a wheel carried in .whl/.

All figures go to OUT/gpu_suite.json (OUT: $OUT, else --out). --dry-run runs every stage on
the CPU with tiny shapes (gpu_lm125m.py --small; cudnn is left out: it needs an NVIDIA GPU).

Run: bash benchmarks/gpu_suite.sh [--dry-run] [--only lm_125m,lm_1b] [--budget-s 300]
"""

from __future__ import annotations

import argparse
import ast
import importlib.metadata
import json
import os
import pathlib
import re
import runpy
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Per-device batches to try, largest first (H100, 80 GiB, the configs' remat).
BATCHES = {"lm_125m": [32, 16, 8], "lm_350m": [16, 8, 4], "lm_1b": [8, 4, 2]}
KERNELS = ("cudnn", "xla")
# What to measure first when time runs short: the goals' configs with cuDNN.
PRIORITY = [
    ("lm_125m", "cudnn"),
    ("lm_1b", "cudnn"),
    ("lm_125m", "xla"),
    ("lm_350m", "cudnn"),
    ("lm_1b", "xla"),
    ("lm_350m", "xla"),
]
TRACED = ("lm_125m", "lm_1b")
MAX_TRACE_BYTES = 16 * 2**20  # what one file back from the GPU machine may weigh
MAX_OUT_FILES = 8
# The GPU image's Python packages (docs: the device tool's KINDS.md, read 2026-11-17).
_IMAGE_TEXT = """absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio
attrs botorch build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy
coverage cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax
e3nn einops equinox etils execnet filelock flatbuffers flax fonttools formulaic frozenlist
fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna
imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2
joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml
markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack
multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda
numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse
nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13
nvidia-nvtx onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum
opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip
pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo
pygments pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov
pytest-mock pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests
rich sacrebleu safetensors scikit-build-core scikit-image scikit-learn scipy seaborn
sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers
statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl
tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric
torchmetrics torchvision tqdm transformers treescope triton typer typing-extensions
typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl
zipp"""
IMAGE = _IMAGE_TEXT.split()


def _name(dist: str) -> str:
    return dist.lower().replace("_", "-").replace(".", "-")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="every stage on the CPU, tiny")
    parser.add_argument("--only", default="", help="configs to measure, e.g. lm_125m,lm_1b")
    parser.add_argument(
        "--budget-s", type=float, default=None, help="for measure: 300 s, 180 with --only"
    )
    parser.add_argument("--stages", default="smoke,measure,traces,imports")
    parser.add_argument("--out", default=None, help="where $OUT is unset: a folder to write")
    args = parser.parse_args(argv)
    args.only = [c for c in args.only.split(",") if c]
    unknown = [c for c in args.only if c not in BATCHES]
    if unknown:
        parser.error(f"--only {','.join(unknown)}: not one of {', '.join(BATCHES)}")
    if args.budget_s is None:  # a CPU's dry run is slow, and its timings mean nothing
        args.budget_s = 1200.0 if args.dry_run else 180.0 if args.only else 300.0
    return args


def _python(*argv: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """A Python of this interpreter and path, from the repository root."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run(
        [sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def smoke(dry_run: bool) -> dict:
    """One optimizer step of the kit on one device of this jax; raises if it cannot."""
    import jax

    from jaxkit.config import apply_overrides, load_config, run_config
    from jaxkit.step.train_step import with_kernel
    from jaxkit.train.loop import train

    start = time.perf_counter()
    config = load_config("lm_125m")
    # One layer, narrow and short: the compile is most of the stage's seconds.
    small = ["model.d_model=64", "model.num_layers=1", "model.num_heads=2"]
    small += ["model.num_kv_heads=2", "model.mlp_dim=128", "data.seq_len=64"]
    small += ["model.vocab_size=256", "batch.global_batch_size=4", "batch.per_device_batch_size=4"]
    small += ["train.steps=1", "train.eval_every=0", "train.eval_examples=4", "mesh.data=1"]
    apply_overrides(config, small)
    device = jax.devices()[0]
    kernel = with_kernel(run_config(config), [device], warn=lambda *a: None).model.attention
    result = train(config, None, devices=[device], progress=False, echo=lambda *a: None)
    loss = [r for r in result.records if "loss" in r][-1]["loss"]  # the eval's follows
    # The hand loop's script imports, and resolves its config, on this jax (its --small:
    # `python benchmarks/gpu_lm125m.py --small` once failed there on a moved function).
    hand = _gpu_lm125m()["resolved_config"](device)
    if not (loss == loss and 0 < loss < 20):  # ln(256) ≈ 5.5 at the start
        raise RuntimeError(f"one step of the kit gave loss {loss}")
    return {
        "ok": True,
        "jax": jax.__version__,
        "python": sys.version.split()[0],
        "device_kind": device.device_kind,
        "platform": device.platform,
        "attention": kernel,  # what auto ran: cudnn on an NVIDIA GPU in bfloat16
        "hand_loop_attention": hand.model.attention,
        "loss": loss,
        "seconds": time.perf_counter() - start,
        "dry_run": dry_run,
    }


def _gpu_lm125m() -> dict:
    """benchmarks/gpu_lm125m.py's functions, its flags as --small sets them."""
    argv = sys.argv
    sys.argv = ["gpu_lm125m.py", "--small"]  # the script reads its flags on import
    try:
        return runpy.run_path(str(ROOT / "benchmarks" / "gpu_lm125m.py"), run_name="gpu_lm125m")
    finally:
        sys.argv = argv


def _oom(text: str) -> bool:
    return any(s in text for s in ("RESOURCE_EXHAUSTED", "out of memory", "OutOfMemory"))


def _measure_one(config: str, kernel: str, batch: int, dry_run: bool, timeout: float) -> dict:
    """gpu_lm125m.py's kit-against-hand pairs for one run: its figures, or why there are none."""
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / "run.json"
        argv = ["benchmarks/gpu_lm125m.py", "--config", config, "--attention", kernel]
        argv += ["--per-device-batch", str(batch), "--out", str(out)]
        if dry_run:  # it proves the runs go; its timings mean nothing
            argv += ["--small", "--steps", "3", "--warmup", "1", "--repeats", "1"]
        else:
            argv += ["--steps", "10", "--warmup", "2", "--repeats", "2"]
        start = time.perf_counter()
        try:
            ran = _python(*argv, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"status": "timeout", "seconds": time.perf_counter() - start}
        row: dict = {"seconds": time.perf_counter() - start}
        if ran.returncode != 0:
            tail = (ran.stdout + ran.stderr)[-1500:]
            return row | {"status": "oom" if _oom(tail) else "failed", "tail": tail}
        found = json.loads(out.read_text())
    kit = found["kit_vs_hand"]
    compiled = kit["kit_compiled"]
    stats = kit.get("device_memory_stats", {})
    return row | {
        "status": "ok",
        "device_kind": found["device_kind"],
        "jax": found["jax"],
        "attention": found["attention"],
        "remat": found["remat"],
        "seq_len": found["seq_len"],
        "per_device_batch_size": batch,
        "kit_tokens_per_s": kit["kit_tokens_per_s"],
        "hand_tokens_per_s": kit["hand_tokens_per_s"],
        "kit_over_hand": kit["kit_over_hand"],
        "pair_ratios": kit["pair_ratios"],
        "kit_mfu": kit["kit_mfu"],
        "hand_mfu": kit["hand_mfu"],
        "kit_hfu": kit["kit_mfu"] * compiled["hardware_per_model_flop"],
        "compiled_memory_bytes": compiled["memory_bytes"],
        "peak_memory_bytes": stats.get("peak_bytes_in_use"),
        "compile_s": compiled["compile_s"],
        "peak_flops_per_s": found["peak_flops_per_s"],
        "losses_largest_gap": kit["losses"]["largest_gap"],
    }


def measure(args: argparse.Namespace) -> dict:
    """The PRIORITY runs (those of --only), each at the largest batch that fits, in budget."""
    start = time.monotonic()
    kernels = ("xla",) if args.dry_run else KERNELS  # cuDNN's attention needs an NVIDIA GPU
    todo = [(c, k) for c, k in PRIORITY if k in kernels and (not args.only or c in args.only)]
    runs, skipped, fitted = [], [], {}
    for config, kernel in todo:
        batches = BATCHES[config]
        if config in fitted:  # another kernel fitted it: start there
            batches = [b for b in batches if b <= fitted[config]]
        if args.dry_run:
            batches = [4]  # gpu_lm125m --small's
        for batch in batches:
            left = args.budget_s - (time.monotonic() - start)
            if left < 20:
                skipped.append(f"{config} {kernel}")
                break
            row = {"config": config, "kernel": kernel} | _measure_one(
                config, kernel, batch, args.dry_run, left
            )
            row.setdefault("per_device_batch_size", batch)
            runs.append(row)
            print(_line(row), flush=True)
            if row["status"] == "ok":
                fitted.setdefault(config, batch)
                break
            if row["status"] != "oom":
                break
    return {
        "budget_s": args.budget_s,
        "seconds": time.monotonic() - start,
        "runs": runs,
        "skipped": skipped,
    }


def _line(row: dict) -> str:
    what = f"  {row['config']:<8} {row['kernel']:<6} b={row['per_device_batch_size']:<3}"
    if row["status"] != "ok":
        return f"{what} {row['status']} after {row['seconds']:.0f} s"
    return (
        f"{what} kit {row['kit_tokens_per_s']:9.0f} tok/s MFU {row['kit_mfu']:6.1%} HFU "
        f"{row['kit_hfu']:6.1%} | hand {row['hand_tokens_per_s']:9.0f} tok/s | kit/hand "
        f"{row['kit_over_hand']:.3f} | {row['compiled_memory_bytes'] / 2**30:.1f} GiB compiled "
        f"({row['seconds']:.0f} s)"
    )


def traces(args: argparse.Namespace, measured: dict, out: pathlib.Path) -> dict:
    """A two-step trace of the fastest run of each TRACED config, copied flat into `out`."""
    found: dict = {}
    for config in TRACED:
        if args.only and config not in args.only:
            continue
        ok = [r for r in measured["runs"] if r["config"] == config and r["status"] == "ok"]
        if not ok:
            found[config] = {"status": "no run to trace"}
            continue
        best = max(ok, key=lambda r: r["kit_tokens_per_s"])
        found[config] = _trace(config, best, args.dry_run, out)
        print(f"  {config} trace: {found[config]}", flush=True)
    return found


def trace_overrides(kernel: str, per_device_batch_size: int, dry_run: bool) -> list[str]:
    """`jaxkit train`'s overrides for the trace of one run on the one device."""
    b = per_device_batch_size
    overrides = [f"model.attention={kernel}", f"batch.per_device_batch_size={b}"]
    overrides += [f"batch.global_batch_size={b}", "batch.grad_accum_steps=null"]
    overrides += ["mesh.data=-1", "mesh.fsdp=1", "mesh.tensor=1"]  # the one device
    # Steps 5 and 6 traced (profile_steps counts from 0); steps 3 and 6 sample the noise
    # scale: the 3rd compiles its program before the trace, so the 6th, the second traced
    # step, records what sampling costs a step, not its first trace, lowering and compile.
    overrides += ["train.steps=6", "train.profile_steps=4:6", "train.noise_scale_every=3"]
    overrides += ["train.eval_every=0", "train.eval_examples=4", "train.log_every=1"]
    if dry_run:
        overrides += ["model.d_model=128", "model.num_layers=2", "model.num_heads=4"]
        overrides += ["model.num_kv_heads=4", "model.mlp_dim=384", "data.seq_len=128"]
        overrides += ["model.vocab_size=256"]
    return overrides


def _trace(config: str, best: dict, dry_run: bool, out: pathlib.Path) -> dict:
    b = best["per_device_batch_size"]
    overrides = trace_overrides(best["kernel"], b, dry_run)
    with tempfile.TemporaryDirectory() as work:
        argv = ["-m", "jaxkit", "train", config, *overrides, "--workdir", work, "--no-progress"]
        if dry_run:  # one CPU device, as the GPU machine has one GPU (8 is the CPU default)
            argv += ["--host-devices", "1"]
        try:
            ran = _python(*argv, timeout=240)
        except subprocess.TimeoutExpired:
            return {"status": "timeout"}
        if ran.returncode != 0:
            return {"status": "failed", "tail": (ran.stdout + ran.stderr)[-1500:]}
        files = sorted(pathlib.Path(work, "profile").rglob("*.trace.json.gz"))
        if not files:
            return {"status": "no perfetto trace written"}
        size = files[-1].stat().st_size
        if size >= MAX_TRACE_BYTES:
            return {"status": "too large", "bytes": size}
        target = out / f"{config}-trace.json.gz"
        shutil.copyfile(files[-1], target)
    return {
        "status": "ok",
        "file": target.name,
        "bytes": size,
        "kernel": best["kernel"],
        "per_device_batch_size": b,
    }


def _imported(path: pathlib.Path) -> set[str]:
    """Top-level names `path` imports, but those in a `try` that catches ImportError (the
    optional ones, where the code has a way without them)."""
    tree = ast.parse(path.read_text(), str(path))
    optional: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try):
            caught = " ".join(ast.unparse(h.type) for h in node.handlers if h.type)
            if "ImportError" in caught or "ModuleNotFoundError" in caught:
                optional |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    names = set()
    for node in ast.walk(tree):
        if id(node) in optional:
            continue
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module.split(".")[0])
    return names


def imports(wheels: pathlib.Path) -> dict:
    """What the kit needs on the GPU machine, against what it will find there: every module
    the kit, gpu_lm125m.py and this script import (all but the standard library's and the
    optional ones), the kit's declared dependencies, and what each carried wheel requires,
    each from the GPU image (IMAGE) or a wheel in `wheels`. A package of one of the kit's
    extras (pyproject.toml's optional-dependencies: wandb, lm-eval, ...) is imported only
    where its option is used, which the suite never does: it is listed under "extras", not
    missing."""
    import tomllib

    carried = {_name(p.name.split("-")[0]) for p in wheels.glob("*.whl")}
    allowed = {_name(n) for n in IMAGE} | carried
    by_top = importlib.metadata.packages_distributions()
    sources = [*sorted((ROOT / "jaxkit").rglob("*.py")), *sorted((ROOT / "configs").glob("*.py"))]
    sources += [ROOT / "benchmarks" / "gpu_lm125m.py", ROOT / "benchmarks" / "gpu_suite.py"]
    local = {"jaxkit", "configs"}
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extra_of = {
        _name(re.split(r"[\s\[<>=!~;(]", requirement.strip(), maxsplit=1)[0]): extra
        for extra, requirements in project.get("optional-dependencies", {}).items()
        for requirement in requirements
    }
    missing: dict[str, str] = {}
    extras: dict[str, str] = {}
    for path in sources:
        for top in _imported(path):
            if top in sys.stdlib_module_names or top in local:
                continue
            dists = by_top.get(top, [])
            if any(_name(d) in allowed for d in dists):
                continue
            where = f"imported by {path.relative_to(ROOT)}"
            extra = next(
                (extra_of[n] for n in [*map(_name, dists), _name(top)] if n in extra_of), None
            )
            if extra is not None:
                extras[top] = f"the {extra} extra, {where}"
            else:
                missing[top] = f"{where} (from {dists or 'nowhere'})"
    needs = {"pyproject.toml": project["dependencies"]}
    for wheel in wheels.glob("*.whl"):
        with zipfile.ZipFile(wheel) as z:
            meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
            lines = z.read(meta).decode().splitlines()
        needs[wheel.name] = [
            line.split(":", 1)[1]
            for line in lines
            if line.startswith("Requires-Dist:") and "extra ==" not in line
        ]
    for who, requirements in needs.items():
        for requirement in requirements:
            name = _name(re.split(r"[\s\[<>=!~;(]", requirement.strip(), maxsplit=1)[0])
            if name not in allowed and name != "jaxkit":
                missing[name] = f"required by {who}"
    return {"carried": sorted(carried), "missing": missing, "extras": extras, "ok": not missing}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = pathlib.Path(os.environ.get("OUT") or args.out or tempfile.mkdtemp(prefix="gpu-suite-"))
    out.mkdir(parents=True, exist_ok=True)
    stages = args.stages.split(",")
    results: dict = {"argv": sys.argv[1:], "dry_run": args.dry_run, "only": args.only}
    report = out / "gpu_suite.json"

    def write() -> None:
        report.write_text(json.dumps(results, indent=2) + "\n")

    print(f"1. smoke: the kit's one step on this jax (writing {report})", flush=True)
    results["smoke"] = smoke(args.dry_run)  # raises: nothing else is worth the time
    print(f"  {results['smoke']}", flush=True)
    write()
    if "measure" in stages:
        print(f"2. measure (budget {args.budget_s:.0f} s)", flush=True)
        results["measure"] = measure(args)
        write()
    if "traces" in stages and "measure" in results:
        print("3. traces", flush=True)
        results["traces"] = traces(args, results["measure"], out)
        write()
    if "imports" in stages and args.dry_run:
        print("4. imports against the GPU image and .whl/", flush=True)
        results["imports"] = imports(ROOT / ".whl")
        print(f"  {results['imports']}", flush=True)
        write()
    files = [p for p in out.rglob("*") if p.is_file()]
    results["out_files"] = sorted(p.name for p in files)
    write()
    problems = []
    if len(files) > MAX_OUT_FILES:
        problems.append(f"{len(files)} files in {out}, more than {MAX_OUT_FILES}")
    if not results.get("imports", {"ok": True})["ok"]:
        problems.append(f"imports outside the image and .whl/: {results['imports']['missing']}")
    for problem in problems:
        print(f"gpu_suite: {problem}", file=sys.stderr)
    print(f"wrote {report}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

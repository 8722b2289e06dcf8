"""Notebook set-up: which runtime this is, JAX started to suit it, and the devices to use
(the CLI asks it too which platforms to start JAX on).

The notebooks in `notebooks/` run unchanged on a Colab TPU runtime with real chips and on a
CPU with simulated devices. The simulated device count must be set before JAX starts its
backend, so the runtime is recognised without starting it, from what an accelerator leaves
in the environment and in /dev. Only the standard library is imported at load time: a fresh
runtime uses this module to choose what to install before jaxkit's dependencies are there.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import pathlib
import re
import sys
import tomllib
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import jax

HOST_DEVICES = 8  # the notebooks' meshes go up to 8 devices
# Variables a TPU host sets: GKE and Cloud TPU VMs (TPU_*), Colab's older TPU runtime.
TPU_ENV = ("TPU_ACCELERATOR_TYPE", "TPU_WORKER_HOSTNAMES", "COLAB_TPU_ADDR")
# What JAX needs besides jaxkit's own requirements to use each runtime's accelerator.
JAX_EXTRA = {"tpu": "jax[tpu]", "gpu": "jax[cuda12]", "cpu": None}
# JAX's CUDA plugins (the PJRT plugin modules jax_plugins.xla_cudaNN that jax[cudaNN] installs).
CUDA_PLUGIN_VERSIONS = (12, 13)
# The packages a runtime's own jax is made of, which install_commands leaves as they are.
RUNTIME_JAX = ("jax", "jaxlib")


def detect_runtime(environ: Mapping[str, str] = os.environ, dev: str | os.PathLike = "/dev") -> str:
    """'tpu', 'gpu' or 'cpu', without starting JAX.

    TPU chips appear as /dev/accel* (v2 to v4) or as numbered VFIO groups (v5e and later);
    an NVIDIA GPU as /dev/nvidia0, 1, ... (nvidia-smi alone proves nothing: CPU images
    ship it). JAX_PLATFORMS=cpu in the environment means CPU whatever is present.
    """
    dev = pathlib.Path(dev)
    if environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu":  # asked for explicitly
        return "cpu"
    if any(environ.get(name) for name in TPU_ENV):
        return "tpu"
    if any(dev.glob("accel[0-9]*")) or any(p.name.isdigit() for p in dev.glob("vfio/*")):
        return "tpu"
    if any(p.name[len("nvidia") :].isdigit() for p in dev.glob("nvidia[0-9]*")):
        return "gpu"
    return "cpu"


def platforms_to_start(
    environ: Mapping[str, str] = os.environ,
    dev: str | os.PathLike = "/dev",
    found: Callable[[str], bool] | None = None,
) -> str | None:
    """What `jax_platforms` a command starts JAX with, or None to leave JAX its choice.

    With libtpu installed (the test and tpu-plan extras bring it), JAX starts it whatever the
    machine, and without a TPU libtpu prints `Failed to find host bounds` and an `E0000 ...
    INVALID_ARGUMENT` line on stderr before every command's output. Where no TPU is visible,
    JAX is kept to what is there: the CPU, or an NVIDIA GPU and the CPU when JAX's CUDA
    plugin is installed. JAX_PLATFORMS in the environment wins; an AMD GPU (/dev/kfd) or an
    NVIDIA GPU without the plugin leaves JAX its choice. `found(module)`: whether a module
    is installed (a test's stand-in).
    """
    if found is None:
        found = _module_installed
    if environ.get("JAX_PLATFORMS", "").strip() or not (
        found("libtpu") or environ.get("TPU_LIBRARY_PATH")
    ):
        return None
    runtime = detect_runtime(environ, dev)
    if runtime == "gpu":
        cuda = any(found(f"jax_plugins.xla_cuda{v}") for v in CUDA_PLUGIN_VERSIONS)
        return "cuda,cpu" if cuda else None
    if runtime == "cpu" and not pathlib.Path(dev, "kfd").exists():
        return "cpu"
    return None


def _module_installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # its parent package is missing
        return False


def installed_version(name: str) -> str | None:
    """The installed version of the distribution `name`, or None."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def install_commands(
    source: str, runtime: str, installed: Callable[[str], str | None] = installed_version
) -> list[list[str]]:
    """The pip commands that install the jaxkit checkout at `source` for `runtime`.

    A jax the runtime already has stays as it is: Colab's is paired with its libtpu or CUDA
    plugin, and jaxkit's bounds (pyproject.toml) would move it and break the pairing. So
    jaxkit goes in without its dependencies, then the ones missing, with jax and jaxlib
    held at the versions there. Without a jax, jaxkit comes with its tested versions and
    the build of jax for the runtime's accelerator.
    """
    pip = [sys.executable, "-m", "pip", "install", "-q"]
    if installed("jax") is None:
        extra = JAX_EXTRA[runtime]
        return [[*pip, "-e", source, *([extra] if extra else [])]]
    with open(os.path.join(source, "pyproject.toml"), "rb") as f:
        requirements = tomllib.load(f)["project"]["dependencies"]
    missing = []
    for requirement in requirements:
        found = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?", requirement)
        assert found is not None, requirement
        name, extras = found.groups()
        if name in RUNTIME_JAX:
            continue
        if installed(name) is None:
            missing.append(requirement)
        elif extras:  # what the extra brings, leaving the installed version as it is
            missing.append(name + extras)
    held = [f"{name}=={version}" for name in RUNTIME_JAX if (version := installed(name))]
    return [[*pip, "--no-deps", "-e", source], *([[*pip, *missing, *held]] if missing else [])]


def start_jax(host_devices: int = HOST_DEVICES) -> str:
    """Configures JAX for this runtime before its backend starts; returns the runtime.

    On a CPU runtime JAX is kept to the CPU and offers `host_devices` simulated devices. On
    an accelerator the CPU backend offers them too, as the fallback `devices()` uses when
    the runtime has fewer chips than a notebook's meshes need; and float32 matmuls run in
    full float32 (TPUs default to bfloat16 passes, recent GPUs to TF32), as the notebooks
    compare runs at float32 round-off.
    """
    import jax

    from jaxkit.plan import compile_cache

    runtime = detect_runtime()
    compile_cache.enable()  # a rerun cell or a restarted runtime compiles nothing twice
    try:
        if runtime == "cpu":
            jax.config.update("jax_platforms", "cpu")  # no probing for absent plugins
        else:
            jax.config.update("jax_default_matmul_precision", "highest")
        jax.config.update("jax_num_cpu_devices", host_devices)
    except RuntimeError as err:  # the backend already started: a cell run a second time
        if len(jax.devices("cpu")) != host_devices:
            raise RuntimeError(
                f"JAX started before it was asked for {host_devices} CPU devices; restart the "
                "runtime and run the notebook from its first cell"
            ) from err
    return runtime


def devices(count: int = HOST_DEVICES) -> list[jax.Device]:
    """`count` devices: the runtime's accelerators when it has that many, else simulated
    CPU devices (many Colab runtimes have a single TPU chip or GPU)."""
    import jax

    found: Sequence[jax.Device] = jax.devices()
    if len(found) < count:
        found = jax.devices("cpu")
    if len(found) < count:
        raise RuntimeError(
            f"{len(found)} devices, {count} needed: call jaxkit.notebook.start_jax({count}) "
            "before anything else touches JAX"
        )
    return list(found[:count])


def describe(chosen: Sequence[jax.Device]) -> str:
    """One line on the devices a notebook runs on, and why those."""
    import jax

    if chosen[0].platform != "cpu":
        return f"{len(chosen)} {chosen[0].device_kind} devices"
    line = f"{len(chosen)} simulated CPU devices on {os.cpu_count()} CPU cores"
    available = jax.devices()
    if available[0].platform != "cpu":
        line += (
            f": this runtime has {len(available)} {available[0].device_kind} device(s), "
            f"fewer than the {len(chosen)} the notebooks' meshes need"
        )
    return line

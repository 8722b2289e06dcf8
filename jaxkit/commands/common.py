"""What the commands share: argparse types, the options every JAX command takes, a config
loaded from the command line, and the checks and messages of a refusal (one line on stderr,
exit status 2)."""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
from collections.abc import Callable
from typing import TYPE_CHECKING

from jaxkit.config import UsageError as UsageError  # raised by commands as common.UsageError
from jaxkit.generate.source import HF_CONFIG

if TYPE_CHECKING:
    pass

DEFAULT_HOST_DEVICES = 8  # CPU devices simulated when no accelerator is present
MAX_HOST_DEVICES = 1024  # simulated devices share this machine's cores and memory
INTERRUPTED = 130  # the shell's status for a Ctrl-C
TERMINATED = 143  # and for SIGTERM (128 + 15)
TARGET_HELP = (
    "a Cloud TPU slice to plan for, from any machine: an accelerator type (v5litepod-16, "
    "v4-32, v5p-8, v6e-8) or a topology (v5e:4x4, v4:2x2x4). The TPU compiler (libtpu) "
    "compiles for its chips; nothing runs; the memory budget defaults to a chip's HBM"
)


def int_at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an integer ≥ `low`, refused as a usage error (exit status 2)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    return parse


def host_devices(text: str) -> int:
    """An argparse type: a simulated device count a machine can hold (100,000 ran out of
    memory after minutes instead of being refused)."""
    value = int_at_least(1)(text)
    if value > MAX_HOST_DEVICES:
        raise argparse.ArgumentTypeError(
            f"{value} simulated devices is more than {MAX_HOST_DEVICES}: they share this "
            "machine's cores and memory; plan a bigger slice with --target"
        )
    return value


def number(text: str) -> float:
    """`text` as a float, or argparse's error saying it is not a number."""
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None


def fraction(text: str) -> float:
    """An argparse type: a number strictly between 0 and 1."""
    value = number(text)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {text}")
    return value


def directory(text: str) -> str:
    """An argparse type: a path or URL; an empty one would quietly mean the default."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path: name a directory (or a gs:// URL)")
    return text


def add_common(parser: argparse.ArgumentParser) -> None:
    """CONFIG with its overrides, and the options of every command that starts JAX."""
    parser.add_argument(
        "args",
        nargs="*",
        metavar="[CONFIG] [key=value ...]",
        help="a config name in configs/ or a path to one (default lm_tiny), then overrides",
    )
    parser.add_argument(
        "--host-devices",
        type=host_devices,
        metavar="N",
        help=f"simulate N devices on the CPU and run there (default: {DEFAULT_HOST_DEVICES} "
        "CPU devices, used when JAX finds no accelerator)",
    )
    parser.add_argument(
        "--no-compile-cache",
        action="store_true",
        help="compile every program afresh: do not read or write the persistent compilation "
        "cache ($JAXKIT_CACHE_DIR/xla, or JAX_COMPILATION_CACHE_DIR; --target plans: "
        "$JAXKIT_CACHE_DIR/plans)",
    )


def error(err: Exception) -> int:
    """A user-facing refusal: one line on stderr, exit status 2, no traceback."""
    print(f"jaxkit: error: {err}", file=sys.stderr)
    return 2


def check_can_write(path: str, flag: str) -> None:
    """Fails before any work when a local directory can be neither found nor created.

    Nothing is created here: a run refused later must leave nothing on disk. URLs are
    left to the code that opens them.
    """
    from jaxkit.workdir import is_local

    if not is_local(path):
        return
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise UsageError(f"{flag} {path}: {probe} is a file, not a directory")
    try:  # a file made and removed: os.access answers yes to root where writes still fail
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as err:
        raise UsageError(f"{flag} {path}: {probe} is not writable ({err.strerror})") from None


def default_dir(name: str) -> str:
    """runs/NAME-TIMESTAMP, where a run or an experiment writes unless told otherwise."""
    return os.path.join("runs", f"{name}-{datetime.datetime.now():%Y%m%d-%H%M%S}")


def add_source(parser: argparse.ArgumentParser, hf_note: str = "", hf_keys: str = "") -> None:
    """SOURCE and its overrides, the command's positionals; `hf_keys` says what else an
    hf:DIR's overrides may set."""
    parser.add_argument(
        "source",
        type=directory,
        metavar="SOURCE",
        help="a run's workdir (its latest checkpoint, or --step N), or hf:DIR, a local "
        f"Hugging Face Llama directory (run under {HF_CONFIG}'s config, its shape from "
        f"config.json{hf_note})",
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help=f"mesh.*, model.attention or model.compute_dtype only{hf_keys}",
    )


def add_options(parser: argparse.ArgumentParser) -> None:
    """--step, and the options of every command that starts JAX."""
    parser.add_argument(
        "--step",
        type=int_at_least(0),
        metavar="N",
        help="a workdir's checkpoint of optimizer step N (default: the latest)",
    )
    parser.add_argument(
        "--host-devices",
        type=host_devices,
        metavar="N",
        help=f"simulate N devices on the CPU and run there (default: "
        f"{DEFAULT_HOST_DEVICES} CPU devices, used when JAX finds no accelerator)",
    )
    parser.add_argument(
        "--no-compile-cache",
        action="store_true",
        help="compile every program afresh: do not read or write the persistent compilation cache",
    )

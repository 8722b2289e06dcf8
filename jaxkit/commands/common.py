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

if TYPE_CHECKING:
    import ml_collections

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


def split_args(args: list[str]) -> tuple[str, list[str]]:
    """[CONFIG] [key=value ...]: the config's name (the default where none is given) and
    the overrides."""
    from jaxkit.config import DEFAULT_CONFIG

    if args and "=" not in args[0]:
        return args[0], args[1:]
    return DEFAULT_CONFIG, args


def load_config(
    args: list[str], workdir: str | None = None, notes: list[str] | None = None
) -> ml_collections.ConfigDict:
    """CONFIG with its overrides applied and every value checked (before JAX starts).
    `workdir`: train's, where a checkpoint there makes this a resume. `notes` gets a line
    for each value taken from elsewhere (model.vocab_size=null: the token files')."""
    from jaxkit.config import apply_overrides
    from jaxkit.config import load_config as load_named
    from jaxkit.hf.load import apply_init_from
    from jaxkit.token_files import take_vocabulary
    from jaxkit.validate import validate

    name, overrides = split_args(args)
    config = load_named(name)
    held: list[str] = []  # fields of a dict the config leaves null (model.rope_scaling.factor)
    apply_overrides(config, overrides, held=held)
    # model.init_from=hf:DIR: its architecture, or at a resume the checkpoint's, held against
    # every override, a field of a dict against the same field of config.json's value
    apply_init_from(config, overrides, workdir)
    apply_overrides(config, held)  # on the dict config.json gave; still null: refused
    taken = take_vocabulary(config)  # model.vocab_size=null: the token files' vocabulary
    if taken is not None and notes is not None:
        notes.append(taken)
    validate(config)
    return config


class UsageError(ValueError):
    """A command line that cannot be run as given (exit status 2)."""


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

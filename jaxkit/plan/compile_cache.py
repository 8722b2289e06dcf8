"""Compile once per machine: JAX's persistent compilation cache, and a cache of target plans.

Every `jaxkit train`, `plan` and `experiment`, and every notebook, writes the programs it
compiles to `$JAXKIT_CACHE_DIR/xla` (default `~/.cache/jaxkit/xla`), and the next run with
the same program on the same devices reads the executable back instead of compiling it.
The executable is the same binary, so no number changes. A `JAX_COMPILATION_CACHE_DIR`
the user set wins over the default directory; `--no-compile-cache` turns the cache off.
The directory is bounded (least recently used entries go first) at `MAX_BYTES`.

A plan for a described TPU slice (`--target`) cannot use JAX's cache: an executable
compiled for a topology without a TPU client is written but cannot be read back. What a
plan needs from each compile (its memory and FLOP counts, or the compiler's refusal) is
kept instead, in `$JAXKIT_CACHE_DIR/plans`, keyed by the lowered program, the target's
devices, the jax and libtpu versions and the compiler flags (XLA_FLAGS, LIBTPU_INIT_ARGS
and `--xla*` arguments, less the dump and debug flags JAX's own cache key leaves out).

The caches never make a run fail: a directory that cannot be written, an entry that cannot
be read, or a full disk costs one warning line and a normal compile.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import pathlib
import re
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TextIO

from jaxkit.plan.peak import cache_dir

MAX_BYTES = 4 * 2**30  # about a hundred lm_125m steps; the oldest read go first
# What JAX warns, once per program, when its cache cannot be read or written.
_JAX_CACHE_WARNINGS = (
    "Error reading persistent compilation cache entry",
    "Error writing persistent compilation cache entry",
)
_warned: list[str] = []  # the one warning line a process gives
plans_enabled = True  # --no-compile-cache: target plans compile afresh too


def xla_dir() -> pathlib.Path:
    return cache_dir() / "xla"


def plans_dir() -> pathlib.Path:
    return cache_dir() / "plans"


def warn_once(message: str, echo: Callable[[str], None] | None = None) -> None:
    """One line on stderr for the first problem with a cache in this process, none after."""
    if _warned:
        return
    _warned.append(message)
    (echo or (lambda line: print(line, file=sys.stderr)))(f"warning: {message}")


def _writable(directory: pathlib.Path) -> str | None:
    """None when files can be written in `directory` (made if missing), else why not."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".probe-"):
            pass
    except OSError as err:
        return f"{type(err).__name__}: {err.strerror or err}"
    return None


def enable(on: bool = True) -> str | None:
    """Turns JAX's persistent compilation cache on (or, `on=False`, off, including a
    directory set through JAX_COMPILATION_CACHE_DIR); returns the directory in use.

    Call before the first compile: JAX opens its cache once per process.
    """
    import jax

    if not on:
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    directory = os.environ.get("JAX_COMPILATION_CACHE_DIR") or str(xla_dir())
    problem = _writable(pathlib.Path(directory))
    if problem:
        warn_once(
            f"the compile cache {directory} cannot be written ({problem}); compiling as usual"
        )
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", directory)
    # Every program: a run's small ones add up, and a read costs less than any compile.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    if _option("jax_compilation_cache_max_size") == -1:  # the user's own bound wins
        # A bound also makes JAX lock the directory, so processes sharing it never read an
        # entry another is still writing.
        jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    _quiet_jax_cache_warnings()
    return directory


def _option(name: str) -> Any:
    import jax

    return getattr(jax.config, name)  # JAX's options are attributes mypy cannot see


def in_use() -> bool:
    """Whether JAX's persistent compilation cache is on in this process."""
    return bool(_option("jax_enable_compilation_cache") and _option("jax_compilation_cache_dir"))


def _quiet_jax_cache_warnings() -> None:
    """JAX warns once per program when an entry cannot be read or written; the first of
    those becomes the process's one warning line, the rest are dropped."""
    if getattr(warnings.showwarning, "_jaxkit", False):
        return
    shown = warnings.showwarning

    def show(
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: TextIO | None = None,
        line: str | None = None,
    ) -> None:
        text = str(message)
        if text.startswith(_JAX_CACHE_WARNINGS):
            if text.startswith(_JAX_CACHE_WARNINGS[0]):
                _drop_entries(text)
            directory = _option("jax_compilation_cache_dir")
            reason = text.split(": ", 1)[-1].splitlines()[0]
            warn_once(
                f"the compile cache could not be used for a program ({reason}); compiled it "
                f"instead. Clear the cache with `rm -rf {directory}`, or pass --no-compile-cache"
            )
            return
        shown(message, category, filename, lineno, file, line)

    show._jaxkit = True  # type: ignore[attr-defined]
    warnings.showwarning = show
    # Each program's warning text differs; let every one reach `show`, which keeps one.
    for prefix in _JAX_CACHE_WARNINGS:
        warnings.filterwarnings("always", message=prefix)


def _drop_entries(text: str) -> None:
    """Removes the entries of a program whose entry could not be read (cut short by a
    killed writer, or damaged), so that this compile writes it anew: JAX never overwrites
    an entry, and would otherwise warn and compile at every run. Entries are named by the
    program's name and a hash JAX does not say, so all of that program's entries go."""
    found = re.search(r"entry for '([^'/]+)'", text)
    directory = _option("jax_compilation_cache_dir")
    if not found or not directory:
        return
    for path in pathlib.Path(directory).glob(f"{glob.escape(found[1])}-*"):
        with contextlib.suppress(OSError):
            path.unlink()


class CacheEvents:
    """Counts JAX's cache hits and misses while open: whether a compile read the cache."""

    def __init__(self) -> None:
        self.hits = self.misses = 0

    def __call__(self, event: str, **kwargs: Any) -> None:
        if event == "/jax/compilation_cache/cache_hits":
            self.hits += 1
        elif event == "/jax/compilation_cache/cache_misses":
            self.misses += 1

    @property
    def hit(self) -> bool:
        """True when every program compiled while open came from the cache."""
        return self.hits > 0 and self.misses == 0


@contextmanager
def cache_events() -> Iterator[CacheEvents]:
    import jax

    events = CacheEvents()
    jax.monitoring.register_event_listener(events)
    try:
        yield events
    finally:
        jax.monitoring.unregister_event_listener(events)


def plan_key(lowered_text: str, devices: Any) -> str:
    """The key of a target plan's compile: the program, the chips, the compilers and the
    flags they were given."""
    import jax

    try:
        from importlib.metadata import version

        libtpu = version("libtpu")
    except Exception:  # not installed: no target plan gets this far
        libtpu = "none"
    chips = f"{len(devices)}x{devices[0].device_kind}" if len(devices) else "0"
    slices = {getattr(d, "slice_index", 0) for d in devices}
    if len(slices) > 1:  # several slices over the DCN are other chips than one slice of all
        chips += f" in {len(slices)} slices"
    digest = hashlib.sha256()
    for part in (lowered_text, chips, jax.__version__, libtpu, *compiler_flags()):
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()


def compiler_flags() -> list[str]:
    """The compiler flags a compile depends on, as JAX's own cache key takes them: those of
    XLA_FLAGS, LIBTPU_INIT_ARGS and the command line's `--xla*` arguments (and any prefix
    given to jax's `cache_key.add_flag_prefixes`), sorted, less the dump and debug flags JAX
    leaves out of its key (`xla_flags_to_exclude_from_cache_key`), which change no figure."""
    try:
        from jax._src import cache_key

        excluded = set(cache_key.xla_flags_to_exclude_from_cache_key)
        prefixes = ["--xla", *cache_key.get_flag_prefixes()]
    except (ImportError, AttributeError):  # moved in another jax: every flag counts, so a
        excluded, prefixes = set(), ["--xla"]  # plan may compile again, but never reads wrong
    flags = [
        *os.environ.get("XLA_FLAGS", "").split(),
        *os.environ.get("LIBTPU_INIT_ARGS", "").split(),
        *(arg for arg in sys.argv if arg.startswith(tuple(prefixes))),
    ]
    return sorted(flag for flag in flags if flag.split("=")[0] not in excluded)


def read_plan(key: str) -> dict | None:
    if not plans_enabled:
        return None
    path = plans_dir() / f"{key}.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        warn_once(f"the plan cache entry {path} cannot be read ({err}); compiling instead")
        return None


def write_plan(key: str, entry: dict) -> None:
    """Written whole or not at all (a temporary file renamed), so a reader never sees half."""
    if not plans_enabled:
        return
    directory = plans_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(
            "w", dir=directory, prefix=f".{key}-", suffix=".tmp", delete=False
        ) as f:
            json.dump(entry, f)
        os.replace(f.name, directory / f"{key}.json")
    except OSError as err:
        warn_once(f"the plan cache {directory} cannot be written ({err}); plans compile as usual")

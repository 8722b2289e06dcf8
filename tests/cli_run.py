"""`jaxkit ARGS` in this process: what `python -m jaxkit ARGS` does, minus the 3-4 s a new
process spends starting Python and importing JAX, flax and optax.

For claims about what a command prints, writes and returns. Claims about a process (the
console script, signals, a device count set before JAX starts, several processes) keep a
real one: `test_cli.jaxkit`.
"""

import contextlib
import io
import os
import subprocess
import sys
import warnings
from unittest import mock

import jax

from jaxkit import cli
from jaxkit.plan import compile_cache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What a command may change for the rest of the process, and the tests after it would see:
# JAX's platform and device count (set by _start_jax), its compile cache (--no-compile-cache
# turns it off) and the kit's plan cache.
_JAX_OPTIONS = (
    "jax_platforms",
    "jax_num_cpu_devices",
    "jax_enable_compilation_cache",
    "jax_compilation_cache_dir",
)


def jaxkit(
    *args: str, cwd: str | os.PathLike[str] = ROOT, before_jax: bool = False
) -> subprocess.CompletedProcess[str]:
    """Runs `jaxkit ARGS` from `cwd` (the repository root, as test_cli.jaxkit's process
    does), and returns its exit status, stdout and stderr as that process would.

    `before_jax`: a line the command refuses before it starts JAX, which may then set a
    device count (--host-devices takes effect only as JAX starts): a command that gets as
    far as starting JAX raises AssertionError instead."""
    if "--host-devices" in args and not before_jax:
        raise ValueError("--host-devices sets the device count before JAX starts: use a process")
    out, err = io.StringIO(), io.StringIO()
    options = {name: getattr(jax.config, name) for name in _JAX_OPTIONS}
    plans, previous_cwd, path = compile_cache.plans_enabled, os.getcwd(), list(sys.path)
    show = warnings.showwarning
    try:
        os.chdir(cwd)
        with contextlib.ExitStack() as stack:
            stack.enter_context(contextlib.redirect_stdout(out))
            stack.enter_context(contextlib.redirect_stderr(err))
            if before_jax:
                started = AssertionError(f"jaxkit {' '.join(args)}: JAX started before a refusal")
                stack.enter_context(mock.patch.object(cli, "_start_jax", side_effect=started))
            try:
                code = cli.main(list(args))
            except SystemExit as exit_:  # argparse's usage errors
                code = exit_.code if isinstance(exit_.code, int) else int(exit_.code is not None)
    finally:
        os.chdir(previous_cwd)
        sys.path[:] = path
        compile_cache.plans_enabled = plans
        warnings.showwarning = show
        for name, value in options.items():
            if getattr(jax.config, name) != value:
                jax.config.update(name, value)
    return subprocess.CompletedProcess(["jaxkit", *args], code, out.getvalue(), err.getvalue())


def python_c(source: str, *args: str) -> subprocess.CompletedProcess[str]:
    """`python -c SOURCE ARGS` in a new process from the repository root, the checkout on
    its path: a test's own stand-in for the console script (one that patches a function to
    send a signal at a chosen point, then calls `cli.main`), with stdout and stderr."""
    return subprocess.run(
        [sys.executable, "-c", source, *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=ROOT),
        timeout=300,
    )

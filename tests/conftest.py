"""8 simulated CPU devices for every test, set before JAX starts its backend."""

import os
import shutil
import sys
import tempfile

import jax
import pytest

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)
# The same for the CLI and notebook subprocesses: with libtpu installed (the test extra
# brings it for the TPU planning tests) JAX would otherwise probe for a TPU at start.
os.environ["JAX_PLATFORMS"] = "cpu"

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# jaxkit caches the measured CPU matmul peak (MFU's denominator) and the programs it
# compiles in $JAXKIT_CACHE_DIR (jaxkit/peak.py, jaxkit/compile_cache.py). The tests get one
# directory of their own for the session, set here at import so the CLI subprocesses and
# pytest-xdist's workers (started after this runs, in the controlling process) inherit it:
# the user's ~/.cache/jaxkit is never read or written, each device count is measured once
# per session, a program many tests compile (the tiny LM's step) is compiled once, and the
# directory goes when the session ends.
if "JAXKIT_TEST_SESSION_CACHE" not in os.environ:  # the controlling process
    os.environ["JAXKIT_TEST_SESSION_CACHE"] = tempfile.mkdtemp(prefix="jaxkit-test-cache-")
SESSION_CACHE_DIR = os.environ["JAXKIT_TEST_SESSION_CACHE"]
os.environ["JAXKIT_CACHE_DIR"] = SESSION_CACHE_DIR
os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)  # a developer's own stays out of the tests

from jaxkit import compile_cache  # noqa: E402  (after the variables it reads)

compile_cache.enable()


def pytest_sessionfinish(session, exitstatus):
    del exitstatus
    if not hasattr(session.config, "workerinput"):  # not an xdist worker: the owner
        shutil.rmtree(SESSION_CACHE_DIR, ignore_errors=True)


SLOW_TESTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "slow_tests.txt")


def pytest_collection_modifyitems(config, items):
    """Marks the tests slow_tests.txt lists (by file and function, every parameter)."""
    del config
    with open(SLOW_TESTS) as f:
        slow = {line.strip() for line in f if line.strip() and not line.startswith("#")}
    for item in items:
        if item.nodeid.split("[")[0] in slow:
            item.add_marker(pytest.mark.slow)

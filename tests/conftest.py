"""8 simulated CPU devices for every test, set before JAX starts its backend."""

import os
import shutil
import sys
import tempfile

import jax

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)
# The same for the CLI and notebook subprocesses: with libtpu installed (the test extra
# brings it for the TPU planning tests) JAX would otherwise probe for a TPU at start.
os.environ["JAX_PLATFORMS"] = "cpu"

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# jaxkit caches the measured CPU matmul peak (MFU's denominator) in $JAXKIT_CACHE_DIR,
# read at each use (jaxkit/peak.py). The tests get one directory of their own for the
# session, set here at import so the CLI subprocesses inherit it: the user's
# ~/.cache/jaxkit is never read or written, each device count is measured once per
# session, and the directory goes when the session ends.
SESSION_CACHE_DIR = tempfile.mkdtemp(prefix="jaxkit-test-cache-")
os.environ["JAXKIT_CACHE_DIR"] = SESSION_CACHE_DIR


def pytest_sessionfinish(session, exitstatus):
    del session, exitstatus
    shutil.rmtree(SESSION_CACHE_DIR, ignore_errors=True)

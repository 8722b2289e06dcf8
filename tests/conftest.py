"""8 simulated CPU devices for every test, set before JAX starts its backend."""

import os
import shutil
import subprocess
import sys
import tempfile

# The tests' programs are compiled with LLVM's optimisations off and with XLA's older CPU
# fusion emitters (XLA's HLO passes, which decide sharding, collectives, buffers and FLOP
# counts, all still run). The tests run a few steps of tiny shapes, where compiling is most
# of the time: LLVM's optimisations off took 40% off a compile, and the older emitters,
# measured over 20 of the suite's heaviest tests on 2 cores, 303 against 207 CPU-s (the
# programs' default, both on, 393). The machine code is also generated as one module, not
# split into parts for threads that 2 cores shared by 2 test workers cannot run in parallel
# anyway: compiling the tiny LM's step for each of its splits of 8 devices took 15.9-16.3
# CPU-s against 18.5-22.7 split (the default), with the same compiled memory. Every number
# a test compares is computed under the same flags (subprocesses inherit them), so no
# claim depends on the machine code.
TEST_XLA_FLAGS = (
    "--xla_backend_optimization_level=0",
    "--xla_cpu_use_fusion_emitters=false",  # gone from jax 0.12's XLA (only the new emitters)
    "--xla_cpu_parallel_codegen_split_count=1",
    # XLA 0.12 hands dots and the elementwise ops fused into them to YNNPACK where a
    # program's shapes suit it, which rounds each op to bfloat16 where XLA's own emitters
    # round a fused chain once: the one-device bfloat16 llama's gradients moved 2.6% from
    # float32 (0.8% without), so splits compared across programs differed by 3.7% in their
    # gradient norms by step 5 (docs/contributing.md#jax-012). jax 0.10's XLA knows the flag
    # too; there it moves only which float32 elements tip (test_equivalence.ROUNDOFF_ELEMENTS).
    "--xla_cpu_experimental_ynn_fusion_type=",
)


def _flags_xla_knows(flags: tuple[str, ...]) -> list[str]:
    """The flags the installed XLA accepts. XLA ends the process on a flag it does not know
    (a fatal log, "Unknown flag in XLA_FLAGS", no exception): every test process would die,
    so each flag is tried first in a process of its own (about 0.7 s each, once a session)."""

    def accepted(chosen: tuple[str, ...]) -> bool:
        env = {**os.environ, "XLA_FLAGS": " ".join(chosen), "JAX_PLATFORMS": "cpu"}
        probe = [sys.executable, "-c", "import jax; jax.devices('cpu')"]
        return subprocess.run(probe, env=env, capture_output=True, timeout=300).returncode == 0

    if accepted(flags):
        return list(flags)
    return [flag for flag in flags if accepted((flag,))]


# Tried once, in the controlling process; pytest-xdist's workers inherit the answer.
if "JAXKIT_TEST_XLA_FLAGS" not in os.environ:
    os.environ["JAXKIT_TEST_XLA_FLAGS"] = " ".join(_flags_xla_knows(TEST_XLA_FLAGS))
os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), os.environ["JAXKIT_TEST_XLA_FLAGS"]]
).strip()

import jax  # noqa: E402  (after XLA_FLAGS, which JAX reads as it starts)
import pytest  # noqa: E402

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)
# The same for the CLI and notebook subprocesses: with libtpu installed (the test extra
# brings it for the TPU planning tests) JAX would otherwise probe for a TPU at start.
os.environ["JAX_PLATFORMS"] = "cpu"

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# jaxkit caches the measured CPU matmul peak (MFU's denominator) and the programs it
# compiles in $JAXKIT_CACHE_DIR (jaxkit/plan/peak.py, jaxkit/plan/compile_cache.py). The tests
# get one directory of their own for the session, set here at import so the CLI subprocesses and
# pytest-xdist's workers (started after this runs, in the controlling process) inherit it:
# the user's ~/.cache/jaxkit is never read or written, each device count is measured once
# per session, a program many tests compile (the tiny LM's step) is compiled once, and the
# directory goes when the session ends.
if "JAXKIT_TEST_SESSION_CACHE" not in os.environ:  # the controlling process
    os.environ["JAXKIT_TEST_SESSION_CACHE"] = tempfile.mkdtemp(prefix="jaxkit-test-cache-")
SESSION_CACHE_DIR = os.environ["JAXKIT_TEST_SESSION_CACHE"]
os.environ["JAXKIT_CACHE_DIR"] = SESSION_CACHE_DIR
os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)  # a developer's own stays out of the tests

from jaxkit.plan import compile_cache  # noqa: E402  (after the variables it reads)

compile_cache.enable()


def pytest_sessionfinish(session, exitstatus):
    del exitstatus
    if not hasattr(session.config, "workerinput"):  # not an xdist worker: the owner
        shutil.rmtree(SESSION_CACHE_DIR, ignore_errors=True)


SLOW_TESTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "slow_tests.txt")


def _slow_tests() -> dict[str, float]:
    """slow_tests.txt: `file::function seconds` per line (the seconds of all its parameters)."""
    slow = {}
    with open(SLOW_TESTS) as f:
        for line in f:
            if line.strip() and not line.startswith("#"):
                name, seconds = line.split()
                slow[name] = float(seconds)
    return slow


def pytest_configure(config):
    # pytest-xdist's --dist loadfile hands out files with the most tests first by default,
    # which sends the few-but-slow files (a minute of compiles per test) last, where one
    # worker runs them while the other idles. The order set below is kept instead.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    """Marks the tests slow_tests.txt lists (by file and function, every parameter), and
    orders the files by their listed seconds, slowest first: with a file to a worker, the
    last files handed out are then the quick ones, and both workers finish together."""
    del config
    slow = _slow_tests()
    file_seconds: dict[str, float] = {}
    for name, seconds in slow.items():
        path = name.split("::")[0]
        file_seconds[path] = file_seconds.get(path, 0.0) + seconds
    for item in items:
        if item.nodeid.split("[")[0] in slow:
            item.add_marker(pytest.mark.slow)
    items.sort(key=lambda item: -file_seconds.get(item.nodeid.split("::")[0], 0.0))

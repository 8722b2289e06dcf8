import os
import subprocess
import sys

import jax
import pytest

from jaxkit import notebook

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize(
    "files,environ,expected",
    [
        ([], {}, "cpu"),
        (["accel0"], {}, "tpu"),  # TPU v2-v4 VM
        (["vfio/0", "vfio/vfio"], {}, "tpu"),  # TPU v5e and later: numbered VFIO groups
        (["vfio/vfio"], {}, "cpu"),  # the VFIO control node alone is no accelerator
        (["nvidia0", "nvidiactl"], {}, "gpu"),
        (["nvidiactl", "nvidia-uvm"], {}, "cpu"),  # driver nodes without a GPU
        ([], {"TPU_ACCELERATOR_TYPE": "v5litepod-8"}, "tpu"),
        (["accel0"], {"JAX_PLATFORMS": "cpu"}, "cpu"),  # asked for explicitly
    ],
)
def test_runtime_is_read_from_the_environment_and_dev(tmp_path, files, environ, expected):
    for name in files:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).touch()
    assert notebook.detect_runtime(environ, tmp_path) == expected


def test_without_a_jax_the_install_brings_the_tested_one_and_the_accelerator_build():
    def nothing(name):
        return None

    pip = [sys.executable, "-m", "pip", "install", "-q"]
    assert notebook.install_commands("/src", "cpu", nothing) == [[*pip, "-e", "/src"]]
    assert notebook.install_commands("/src", "tpu", nothing) == [[*pip, "-e", "/src", "jax[tpu]"]]


@pytest.mark.parametrize("runtime", ["tpu", "gpu", "cpu"])
def test_a_jax_already_there_is_left_as_it_is(runtime):
    # A Colab runtime: its own jax (newer than jaxkit's bound), flax and etils; no optax.
    there = {"jax": "0.12.0", "jaxlib": "0.12.0", "flax": "0.12.12", "etils": "1.5.0"}
    first, rest = notebook.install_commands(ROOT, runtime, there.get)
    pip = [sys.executable, "-m", "pip", "install", "-q"]
    assert first == [*pip, "--no-deps", "-e", ROOT]
    assert rest[: len(pip)] == pip
    wanted = rest[len(pip) :]
    # jax is held where it is, and nothing else names it (no jax[tpu], no bounded jax).
    held = [w for w in wanted if w.startswith("jax")]
    assert held == ["jax==0.12.0", "jaxlib==0.12.0"]
    assert "optax>=0.2.8,<=0.2.8" in wanted  # missing: with jaxkit's bounds
    assert not any(w.startswith("flax") for w in wanted)  # there: left as it is
    assert "etils[epath]" in wanted  # there, but its extra's packages may not be
    assert "orbax-checkpoint>=0.12.8,<=0.12.8" in wanted


def test_devices_are_the_simulated_cpus_here():
    chosen = notebook.devices(8)
    assert chosen == jax.devices()[:8]
    assert notebook.describe(chosen).startswith("8 simulated CPU devices")
    with pytest.raises(RuntimeError, match="9 needed"):
        notebook.devices(9)


@pytest.mark.parametrize(
    "files,environ,modules,expected",
    [
        ([], {}, {"libtpu"}, "cpu"),  # a CPU machine with the test extra
        ([], {}, set(), None),  # no libtpu: nothing to keep quiet
        (["accel0"], {}, {"libtpu"}, None),  # a TPU VM: JAX starts the chips
        ([], {"TPU_ACCELERATOR_TYPE": "v5litepod-8"}, {"libtpu"}, None),
        (["nvidia0"], {}, {"libtpu", "jax_plugins.xla_cuda12"}, "cuda,cpu"),
        (["nvidia0"], {}, {"libtpu"}, None),  # JAX would say it lacks a CUDA build
        (["kfd"], {}, {"libtpu"}, None),  # an AMD GPU, through ROCm
        ([], {"JAX_PLATFORMS": "tpu"}, {"libtpu"}, None),  # asked for explicitly
    ],
)
def test_without_a_tpu_commands_leave_libtpu_unstarted(tmp_path, files, environ, modules, expected):
    for name in files:
        (tmp_path / name).touch()
    assert notebook.platforms_to_start(environ, tmp_path, modules.__contains__) == expected


def test_a_command_on_a_cpu_machine_prints_nothing_from_libtpu():
    """With the test extra, every command printed libtpu's `Failed to find host bounds` and
    `E0000 ... INVALID_ARGUMENT` lines: JAX started libtpu on a machine without a TPU."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}  # as a user runs it
    # libtpu stays quiet while another process holds /tmp/libtpu_lockfile (a test planning a
    # TPU target in parallel); allowing a second load makes it speak whenever it starts.
    env.update(ALLOW_MULTIPLE_LIBTPU_LOAD="1", PYTHONPATH=ROOT)
    out = subprocess.run(
        [sys.executable, "-m", "jaxkit", "plan", "mlp_digits"],
        capture_output=True, text=True, timeout=300, cwd=ROOT, env=env,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "Failed to find host bounds" not in out.stderr, out.stderr
    assert "INVALID_ARGUMENT" not in out.stderr, out.stderr

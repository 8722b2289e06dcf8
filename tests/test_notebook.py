import sys

import jax
import pytest

from jaxkit import notebook


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


def test_install_command_adds_the_accelerator_build_of_jax():
    assert notebook.install_command("/src", "cpu") == [
        sys.executable, "-m", "pip", "install", "-q", "-e", "/src"
    ]  # fmt: skip
    assert notebook.install_command("/src", "tpu")[-1] == "jax[tpu]"


def test_devices_are_the_simulated_cpus_here():
    chosen = notebook.devices(8)
    assert chosen == jax.devices()[:8]
    assert notebook.describe(chosen).startswith("8 simulated CPU devices")
    with pytest.raises(RuntimeError, match="9 needed"):
        notebook.devices(9)

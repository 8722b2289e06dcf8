"""Every notebook runs top to bottom on CPU in a fresh kernel, and is committed stripped.

Each notebook ends with a cell that asserts what it demonstrates, so running it is a test
of the claim as well as of the code. The executed copy stays in memory; nothing is written
back. To strip a notebook before committing it: `python tests/test_notebooks.py NAME.ipynb`.
"""

import os
import pathlib
import sys

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

NOTEBOOK_DIR = pathlib.Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
# One cell's limit. The slowest cell (training four or five runs) takes well under a minute
# on 2 CPU cores; three minutes leaves room for a loaded machine and still ends a hang.
CELL_TIMEOUT_S = 180
# Notebook metadata a stripped notebook keeps; anything else (Colab's, widget state, run
# times) is noise in a diff.
KEPT_METADATA = {"kernelspec", "language_info"}


def strip(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """Outputs, execution counts and all but the kept metadata removed, in place."""
    nb.metadata = {k: v for k, v in nb.metadata.items() if k in KEPT_METADATA}
    nb.metadata.get("language_info", {}).pop("version", None)
    for cell in nb.cells:
        cell.metadata = {}
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    return nb


def test_there_are_notebooks():
    assert [p.name for p in NOTEBOOKS] == [
        "01_global_batch.ipynb",
        "02_memory_and_speed.ipynb",
        "03_sharding.ipynb",
        "04_resume_elsewhere.ipynb",
    ]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_committed_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    stripped = strip(nbformat.from_dict(nb))  # a deep copy
    assert nb == stripped, (
        f"{path.name} carries outputs, execution counts or metadata; strip it with "
        f"`python tests/test_notebooks.py notebooks/{path.name}`"
    )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_on_cpu(path):
    nb = nbformat.read(path, as_version=4)
    # A fresh kernel whose working directory is notebooks/, as when a notebook is opened
    # there. JAX_PLATFORMS keeps it on the CPU even where an accelerator is present.
    client = NotebookClient(
        nb,
        timeout=CELL_TIMEOUT_S,
        kernel_name="python3",
        resources={"metadata": {"path": str(NOTEBOOK_DIR)}},
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    # Line coverage stays out of the kernels: it would trace every Python call JAX makes in
    # them (tests/test_cli.py took 36% more CPU under it), and the lines a notebook reaches
    # are reached by the tests of their modules. A notebook's claim is its own assertions.
    env.pop("COVERAGE_PROCESS_CONFIG", None)
    try:
        client.execute(env=env)
    except CellExecutionError as err:
        pytest.fail(f"{path.name} failed:\n{err}", pytrace=False)


if __name__ == "__main__":
    for name in sys.argv[1:]:
        notebook = nbformat.read(name, as_version=4)
        nbformat.write(strip(notebook), name)
        print(f"stripped {name}")

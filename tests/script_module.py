"""A script of the repository (benchmarks/*.py, docs/generate.py), imported as a module:
its functions called in the test's process, the way the script's own entry point calls them."""

import importlib.util
import pathlib
from types import ModuleType

ROOT = pathlib.Path(__file__).resolve().parent.parent


def load(relative: str) -> ModuleType:
    """The script at ROOT/`relative`, executed afresh as a module."""
    path = ROOT / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

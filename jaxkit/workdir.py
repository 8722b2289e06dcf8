"""Workdirs as local paths or URLs: `gs://bucket/run` (with the `gcs` extra) or any other
path etils.epath understands.

Paths under a workdir are joined onto `as_path(workdir)`, an epath path, never a pathlib
one: `pathlib.Path("gs://b/run")` is `gs:/b/run`, a local directory named `gs:`.
"""

from __future__ import annotations

import importlib
import os

from etils import epath


def as_path(workdir: str | os.PathLike) -> epath.Path:
    """A local path or a URL; joins keep the URL's `scheme://`."""
    return epath.Path(workdir)


def is_local(path: str | os.PathLike) -> bool:
    """False for a URL (`gs://`, `s3://`, ...): an object store, where a rename is a copy.

    The same rule epath uses to pick a backend: a string with `://` is a URL.
    """
    return "://" not in os.fspath(path)


def absolute(workdir: str | os.PathLike) -> epath.Path:
    """A local workdir made absolute; a URL as it is (it has no working directory)."""
    if is_local(workdir):
        return epath.Path(os.path.abspath(workdir))
    return as_path(workdir)


def make_dirs(path: epath.Path) -> None:
    """Creates a local directory and its parents; object stores have no directories to
    create (a key's prefix is its folder), so a URL costs no round trip."""
    if is_local(path):
        path.mkdir(parents=True, exist_ok=True)


def missing_gcs_support(path: str | os.PathLike) -> str | None:
    """What to install before `path` can be used, or None when nothing is missing.

    For `gs://`, epath reaches the bucket through gcsfs, and orbax lists checkpoints through
    google-cloud-storage; both come with the `gcs` extra. Other URLs (s3://, ...) need
    their fsspec package, which fsspec names itself when it is missing.
    """
    if not os.fspath(path).startswith("gs://"):
        return None
    import fsspec

    missing = []
    try:
        fsspec.get_filesystem_class("gcs")  # gcsfs, or whatever a test registered instead
    except ImportError:
        missing.append("gcsfs")
    try:
        importlib.import_module("google.cloud.storage")
    except ImportError:
        missing.append("google-cloud-storage")
    if not missing:
        return None
    return (
        f"{path} is on Google Cloud Storage, which needs {' and '.join(missing)}: "
        "pip install 'jaxkit[gcs]' (or pip install -e '.[gcs]' in a checkout)"
    )


def write_text_atomic(path: epath.Path, text: str) -> None:
    """Writes `path` so that a reader sees the old text or the new, never half of one."""
    if is_local(path):
        tmp = path.parent / f".{path.name}.tmp"
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)  # a rename is atomic on a local file system
    else:
        # An object store makes an upload visible whole, when it completes, so one plain
        # write is atomic; a "rename" there is a copy and a delete, which is not.
        path.write_text(text, encoding="utf-8")


def profiler_can_write(path: str | os.PathLike) -> bool:
    """JAX's profiler writes through XLA's own file systems: local paths and gs:// only."""
    return is_local(path) or os.fspath(path).startswith("gs://")

"""Random-access data sources and the order that makes training topology-invariant.

Global batch i is rows perm_e[j·G : (j+1)·G] of a seeded permutation for epoch e
(i = e·batches_per_epoch + j). Micro-step m of that batch is its rows [m·M, (m+1)·M),
M = data_parallel_size × per_device_batch_size, and each process reads only the rows its
devices hold. The order depends on the seed and G alone, so any split of the same global
batch sees the same examples at every optimizer step.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import sysconfig
from collections.abc import Iterator
from typing import Protocol

import jax
import ml_collections
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxkit.batch_plan import BatchPlan

Rows = dict[str, np.ndarray]  # "inputs" and "targets", one entry per row asked for


class Source(Protocol):
    """Rows by index: what the loop needs of a data set."""

    def __len__(self) -> int: ...

    def __getitem__(self, rows: np.ndarray) -> Rows: ...


class DataError(ValueError):
    """A data source that cannot serve the plan or the config."""


@dataclasses.dataclass(frozen=True)
class ArraySource:
    """Rows of `inputs` and `targets`, read by index."""

    inputs: np.ndarray
    targets: np.ndarray
    seq_len: int | None = None  # tokens per row for sequence data

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, rows: np.ndarray) -> Rows:
        return {"inputs": self.inputs[rows], "targets": self.targets[rows]}


@dataclasses.dataclass(frozen=True)
class TokenWindows:
    """Next-byte prediction windows over a byte string: row r is bytes [r·L, r·L + L + 1)."""

    tokens: np.ndarray  # uint8
    seq_len: int

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, rows: np.ndarray) -> Rows:
        starts = np.asarray(rows, dtype=np.int64)[:, None] * self.seq_len
        window = self.tokens[starts + np.arange(self.seq_len + 1)].astype(np.int32)
        return {"inputs": window[:, :-1], "targets": window[:, 1:]}

    def unigram_entropy(self) -> float:
        """Entropy in nats/byte of the byte frequencies: what a context-free model achieves."""
        counts = np.bincount(self.tokens, minlength=256).astype(np.float64)
        p = counts[counts > 0] / counts.sum()
        return float(-(p * np.log(p)).sum())


def stdlib_corpus(max_bytes: int) -> bytes:
    """The Python standard library's .py files, concatenated in sorted path order."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    chunks, size = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts:
            continue
        data = path.read_bytes()
        chunks.append(data)
        size += len(data)
        if size >= max_bytes:
            break
    return b"".join(chunks)[:max_bytes]


def _split_tail(tokens: np.ndarray, eval_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    cut = int(len(tokens) * (1 - eval_fraction))
    return tokens[:cut], tokens[cut:]


def _split_shuffled(n: int, eval_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    order = np.random.default_rng(seed).permutation(n)
    cut = n - round(n * eval_fraction)
    return order[:cut], order[cut:]


def make_sources(config: ml_collections.ConfigDict) -> tuple[Source, Source]:
    """(train, eval) sources for a config's `data` section."""
    d = config.data
    sources: tuple[Source, Source]
    if not 0 < d.eval_fraction < 1:
        raise DataError(f"data.eval_fraction={d.eval_fraction} must lie strictly in (0, 1)")
    if d.source == "text":
        if d.path:
            path = pathlib.Path(d.path).expanduser()
            if not path.is_file():
                raise DataError(f"data.path={d.path!r} is not a readable file")
            raw = path.read_bytes()[: d.max_bytes]
        else:
            raw = stdlib_corpus(d.max_bytes)
        tokens = np.frombuffer(raw, dtype=np.uint8)
        train, held_out = _split_tail(tokens, d.eval_fraction)
        sources = TokenWindows(train, d.seq_len), TokenWindows(held_out, d.seq_len)
    elif d.source == "digits":
        from sklearn.datasets import load_digits

        images, labels = load_digits(return_X_y=True)
        images = (images / 16.0).astype(np.float32)
        train, held_out = _split_shuffled(len(images), d.eval_fraction, seed=1797)
        sources = (
            ArraySource(images[train], labels[train].astype(np.int32)),
            ArraySource(images[held_out], labels[held_out].astype(np.int32)),
        )
    elif d.source == "synthetic":
        sources = _synthetic(config)
    else:
        raise DataError(f"data.source={d.source!r} is not one of text, digits, synthetic")
    for name, size in (("train", len(sources[0])), ("eval", len(sources[1]))):
        if size == 0:
            raise DataError(f"data: the {name} split is empty; give more data")
    return sources


def _synthetic(config: ml_collections.ConfigDict) -> tuple[ArraySource, ArraySource]:
    """Learnable synthetic rows, fixed by the seed: a linear teacher, or counting sequences."""
    d, n = config.data, config.data.num_examples
    rng = np.random.default_rng(12345)
    if config.model.kind == "transformer":
        vocab = config.model.vocab_size
        start = rng.integers(0, vocab, size=(n, 1))
        stride = rng.integers(1, 4, size=(n, 1))
        window = ((start + stride * np.arange(d.seq_len + 1)) % vocab).astype(np.int32)
        rows = ArraySource(window[:, :-1], window[:, 1:], seq_len=d.seq_len)
    else:
        x = rng.normal(size=(n, d.num_features)).astype(np.float32)
        teacher = rng.normal(size=(d.num_features, config.model.num_classes))
        rows = ArraySource(x, np.argmax(x @ teacher, axis=1).astype(np.int32))
    train, held_out = _split_shuffled(n, d.eval_fraction, seed=54321)
    return (
        ArraySource(rows.inputs[train], rows.targets[train], rows.seq_len),
        ArraySource(rows.inputs[held_out], rows.targets[held_out], rows.seq_len),
    )


@functools.lru_cache(maxsize=4)
def _epoch_permutation(num_rows: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(num_rows)


def global_batch_rows(step: int, global_batch_size: int, num_rows: int, seed: int) -> np.ndarray:
    """Source rows of optimizer step `step`'s global batch; a partial last batch is dropped."""
    per_epoch = num_rows // global_batch_size
    if per_epoch == 0:
        raise DataError(
            f"global_batch_size={global_batch_size} exceeds the {num_rows} training rows"
        )
    epoch, j = divmod(step, per_epoch)
    perm = _epoch_permutation(num_rows, seed, epoch)
    return perm[j * global_batch_size : (j + 1) * global_batch_size]


def micro_batch_rows(
    step: int, micro: int, plan: BatchPlan, num_rows: int, seed: int
) -> np.ndarray:
    """Source rows of micro-step `micro` (0 ≤ micro < K) of optimizer step `step`."""
    rows = global_batch_rows(step, plan.global_batch_size, num_rows, seed)
    m = plan.micro_batch_size
    return rows[micro * m : (micro + 1) * m]


def process_row_range(sharding: jax.sharding.Sharding, num_rows: int) -> slice:
    """The contiguous rows of a row-sharded array that this process's devices hold."""
    row_slices = [
        slice(None) if idx is None else idx[0]  # None: the device holds every row
        for idx in sharding.addressable_devices_indices_map((num_rows,)).values()
    ]
    starts = [s.start or 0 for s in row_slices]
    stops = [num_rows if s.stop is None else s.stop for s in row_slices]
    lo, hi = min(starts), max(stops)
    held = sum(b - a for a, b in {(a, b) for a, b in zip(starts, stops, strict=True)})
    if held != hi - lo:
        raise ValueError("this process's devices do not hold one contiguous block of rows")
    return slice(lo, hi)


def to_global_array(
    rows: Rows, sharding: jax.sharding.Sharding, global_rows: int
) -> dict[str, jax.Array]:
    """Builds global arrays from this process's rows (all of them when there is one process)."""
    return {
        key: jax.make_array_from_process_local_data(
            sharding, value, (global_rows, *value.shape[1:])
        )
        for key, value in rows.items()
    }


def load_micro_batch(
    source: Source,
    step: int,
    micro: int,
    plan: BatchPlan,
    seed: int,
    sharding: jax.sharding.Sharding,
) -> dict[str, jax.Array]:
    """Micro-step `micro` of optimizer step `step`, sharded over the batch axes."""
    rows = micro_batch_rows(step, micro, plan, len(source), seed)
    local_rows = rows[process_row_range(sharding, len(rows))]
    return to_global_array(source[local_rows], sharding, len(rows))


def load_global_batch(
    source: Source, step: int, plan: BatchPlan, seed: int, sharding: jax.sharding.NamedSharding
) -> dict[str, jax.Array]:
    """Optimizer step `step`'s whole batch as (K, micro_batch, ...): micro-step m is row m.

    `sharding` splits the second axis over the batch axes, so each device holds its slice
    of every micro-batch, exactly the rows load_micro_batch would give it.
    """
    k, m = plan.grad_accum_steps, plan.micro_batch_size
    rows_KxM = global_batch_rows(step, plan.global_batch_size, len(source), seed).reshape(k, m)
    rows_sharding = jax.sharding.NamedSharding(sharding.mesh, P(*sharding.spec[1:]))
    local = process_row_range(rows_sharding, m)
    local_rows = rows_KxM[:, local]
    picked = source[local_rows.reshape(-1)]
    stacked = {key: v.reshape(k, -1, *v.shape[1:]) for key, v in picked.items()}
    return {
        key: jax.make_array_from_process_local_data(sharding, v, (k, m, *v.shape[2:]))
        for key, v in stacked.items()
    }


def _eval_batch_count(source: Source, plan: BatchPlan, count: int) -> int:
    m = plan.micro_batch_size
    available = len(source) // m
    if available == 0:
        raise DataError(
            f"the held-out split has {len(source)} rows, fewer than one micro-batch ({m}); "
            "raise data.eval_fraction or the data size, or lower the micro-batch"
        )
    return available if count <= 0 else min(count, available)


def eval_micro_batches(
    source: Source, plan: BatchPlan, count: int, sharding: jax.sharding.Sharding
) -> Iterator[dict[str, jax.Array]]:
    """The first `count` micro-batch-sized blocks of held-out rows; 0 = as many as fit."""
    m = plan.micro_batch_size
    local = process_row_range(sharding, m)
    for i in range(_eval_batch_count(source, plan, count)):
        rows = np.arange(i * m, (i + 1) * m)[local]
        yield to_global_array(source[rows], sharding, m)


def check_sources(train_source: Source, eval_source: Source, plan: BatchPlan) -> None:
    """Fails before training, not at the first eval, when a split cannot serve the plan."""
    global_batch_rows(0, plan.global_batch_size, len(train_source), seed=0)
    _eval_batch_count(eval_source, plan, 1)

"""Random-access data sources and the order that makes training topology-invariant.

The rows of the training set form one stream: seeded permutations of every row, epoch after
epoch, end to end (example e is row perm_{e // N}[e % N]). The data position is the number
of examples consumed, so an optimizer step of G rows that starts at position E reads stream
examples [E, E + G), whatever G was before it: a change of global batch neither skips nor
repeats a row. Micro-step m of that step is stream examples [E + m·M, E + (m+1)·M),
M = data_parallel_size × per_device_batch_size, and each process reads only the rows its
devices hold. The order depends on the seed and the position alone, so any split of the
same global batch sees the same examples at every optimizer step.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import os
import pathlib
import sysconfig
import threading
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxkit.batch import mixture
from jaxkit.batch.plan import BatchPlan
from jaxkit.batch.schedule import Position as Position  # re-exported for the loop
from jaxkit.config import ConfigError, is_lm
from jaxkit.sections import Data, RunConfig
from jaxkit.workdir import is_local

# "inputs" and "targets", one entry per row asked for, and "weights" where rows are not
# scored everywhere: one per target (float32; 0 = not scored, e.g. a prompt or padding).
Rows = dict[str, np.ndarray]
NORMALISATIONS = ("exact", "naive")


class Source(Protocol):
    """Rows by index: what the loop needs of a data set."""

    def __len__(self) -> int: ...

    def __getitem__(self, rows: np.ndarray) -> Rows: ...


def row_weight_sums(source: Source, rows: np.ndarray) -> np.ndarray:
    """Each row's total target weight (float64), from the source's own index where it keeps
    one (a row's length for unweighted rows): what a step's normaliser is made of."""
    own = getattr(source, "row_weight_sums", None)
    if own is not None:
        return np.asarray(own(rows), dtype=np.float64)
    picked = source[np.asarray(rows)]
    if "weights" in picked:
        return picked["weights"].reshape(len(rows), -1).sum(axis=1, dtype=np.float64)
    return np.full(len(rows), picked["targets"][0].size, dtype=np.float64)


class DataError(ValueError):
    """A data source that cannot serve the plan or the config."""


@dataclasses.dataclass(frozen=True)
class ArraySource:
    """Rows of `inputs` and `targets`, read by index."""

    inputs: np.ndarray
    targets: np.ndarray
    seq_len: int | None = None  # tokens per row for sequence data
    weights: np.ndarray | None = None  # one per target; None = every target weighs 1

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, rows: np.ndarray) -> Rows:
        out = {"inputs": self.inputs[rows], "targets": self.targets[rows]}
        if self.weights is not None:
            out["weights"] = self.weights[rows].astype(np.float32)
        return out


@dataclasses.dataclass(frozen=True)
class TokenWindows:
    """Next-byte prediction windows over a byte string: row r is bytes [r·L, r·L + L + 1)."""

    tokens: np.ndarray  # uint8
    seq_len: int

    def __len__(self) -> int:
        return max(len(self.tokens) - 1, 0) // self.seq_len

    def __getitem__(self, rows: np.ndarray) -> Rows:
        starts = np.asarray(rows, dtype=np.int64)[:, None] * self.seq_len
        window = self.tokens[starts + np.arange(self.seq_len + 1)].astype(np.int32)
        return {"inputs": window[:, :-1], "targets": window[:, 1:]}

    def row_weight_sums(self, rows: np.ndarray) -> np.ndarray:
        return np.full(len(rows), self.seq_len, dtype=np.float64)

    def unigram_entropy(self, rows: int | None = None) -> float:
        """Entropy in nats/byte of the byte frequencies of the targets of the first `rows`
        rows (default every row): what a context-free model achieves on the bytes an eval
        of those rows scores."""
        rows = len(self) if rows is None else rows
        targets = self.tokens[1 : rows * self.seq_len + 1]  # row r's are [r·L + 1, r·L + L]
        counts = np.bincount(targets, minlength=256).astype(np.float64)
        p = counts[counts > 0] / counts.sum()
        return float(-(p * np.log(p)).sum()) + 0.0  # + 0.0: one repeated byte gives 0, not -0


@functools.cache
def _stdlib_files() -> tuple[pathlib.Path, ...]:
    """The standard library's .py files in sorted path order, found once per process: the
    walk over its ~13,000 files (site-packages included) took a second each run."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    return tuple(path for path in sorted(root.rglob("*.py")) if "site-packages" not in path.parts)


def stdlib_corpus(max_bytes: int) -> bytes:
    """The Python standard library's .py files, concatenated in sorted path order."""
    chunks, size = [], 0
    for path in _stdlib_files():
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


def _seq_len(d: Data) -> int:
    """data.seq_len of a language model's rows (every LM config gives it: check_values)."""
    assert d.seq_len is not None
    return d.seq_len


def _max_bytes(d: Data) -> int:
    """data.max_bytes, which data.source=text requires (check_values)."""
    assert d.max_bytes is not None
    return d.max_bytes


def _vocab_size(config: RunConfig) -> int:
    """model.vocab_size of a language model (every LM kind requires it)."""
    vocab = getattr(config.model, "vocab_size", None)
    assert vocab is not None
    return int(vocab)


def make_sources(config: RunConfig) -> tuple[Source, Source]:
    """(train, eval) sources for a config's `data` section."""
    d = config.data
    sources: tuple[Source, Source]
    if not 0 < d.eval_fraction < 1:
        raise DataError(f"data.eval_fraction={d.eval_fraction} must lie strictly in (0, 1)")
    if d.source != "tokens":  # ids no tokenizer made: model.init_from's may refuse them
        _check_tokenizer(config, None)
    if d.source == "text":
        if d.path:
            path = pathlib.Path(d.path).expanduser()
            if not path.is_file():
                raise DataError(f"data.path={d.path!r} is not a readable file")
            raw = path.read_bytes()[: _max_bytes(d)]
        else:
            raw = stdlib_corpus(_max_bytes(d))
        tokens = np.frombuffer(raw, dtype=np.uint8)
        train, held_out = _split_tail(tokens, d.eval_fraction)
        sources = TokenWindows(train, _seq_len(d)), TokenWindows(held_out, _seq_len(d))
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
    elif d.source == "tokens":
        sources = _token_sources(config)
    else:
        raise DataError(f"data.source={d.source!r} is not one of text, digits, synthetic, tokens")
    for name, size in (("train", len(sources[0])), ("eval", len(sources[1]))):
        if size == 0:
            raise DataError(f"data: the {name} split is empty; give more data")
    return sources


def _token_sources(config: RunConfig) -> tuple[Source, Source]:
    """Token files' train and held-out rows, their ids checked against the vocabulary (and
    against model.init_from's tokenizer: jaxkit/data/tokenizer.py)."""
    from jaxkit.data import token_files
    from jaxkit.data import tokenizer as tokenizer_lib

    d = config.data
    if d.mixture:
        return _mixture_sources(config)
    assert d.path is not None  # data.source=tokens without a mixture names data.path
    try:
        train, held_out, facts = token_files.open_splits(d.path, d.token_dtype, d.eval_fraction)
        warning = _check_tokenizer(config, facts)
        _check_ids(config, train, held_out, facts, f"data.path={d.path!r}")
        rows, mask, seq_len = d.rows, d.document_mask, _seq_len(d)
        fingerprint = token_files.fingerprint(train, held_out, facts)
        notes = [warning] if warning else []
        if facts.get("layout") == "nanogpt":
            notes.append(nanogpt_note(d.path))
        note = "\n".join(notes) or None
        tokenizer = tokenizer_lib.record(facts)
        return (
            token_files.TokenRows(train, seq_len, rows, mask, fingerprint, note, tokenizer),
            token_files.TokenRows(held_out, seq_len, rows, mask, fingerprint),
        )
    except token_files.TokenFileError as e:
        raise DataError(str(e)) from None


def nanogpt_note(path: str) -> str:
    """What a run on `path`, token files in nanoGPT's layout, is told of its splits."""
    return (
        f"data: {path} is in nanoGPT's layout: training on train.bin, holding out val.bin "
        "(data.eval_fraction does not apply)"
    )


def _mixture_sources(config: RunConfig) -> tuple[Source, Source]:
    """data.mixture's sources, each opened and checked as data.path's one is, then checked
    against each other (one tokenizer, one token dtype), as one train and one held-out
    Source (jaxkit/batch/mixture.py)."""
    from jaxkit.data import token_files
    from jaxkit.data import tokenizer as tokenizer_lib

    d = config.data
    assert d.mixture is not None
    value, seq_len = dict(d.mixture), _seq_len(d)
    try:
        stages = mixture.stages(value, d.mixture_stages, seq_len)
    except ConfigError as e:
        raise DataError(str(e)) from None
    names = sorted(value)
    rows, mask = d.rows, d.document_mask
    trains, helds, notes = [], [], []
    said: dict[str, tuple[str, Any]] = {}
    foreign: list[str] = []
    read_by: dict[str, tuple[str, tuple]] = {}  # each token file: (source, its whole reading)
    for name in names:
        path, label = value[name]["path"], f"data.mixture.{name}.path={value[name]['path']!r}"
        try:
            train, held_out, facts = token_files.open_splits(
                path, d.token_dtype, d.eval_fraction, f"data.mixture.{name}.path"
            )
            warning = _check_tokenizer(config, facts, f"data.mixture.{name}.path={path}")
            _check_ids(config, train, held_out, facts, label)
            fingerprint = token_files.fingerprint(train, held_out, facts)
            trains.append(token_files.TokenRows(train, seq_len, rows, mask, fingerprint))
            helds.append(token_files.TokenRows(held_out, seq_len, rows, mask, fingerprint))
        except token_files.TokenFileError as e:
            named = str(e).startswith(f"data.mixture.{name}.")  # else say which source
            raise DataError(str(e) if named else f"data.mixture.{name}: {e}") from None
        notes += [warning] if warning else []
        if "format" not in facts:
            foreign.append(name)
        else:
            tokenizer = facts.get("tokenizer_sha256") or facts.get("tokenizer")
            for field, fact in (("tokenizer", tokenizer), ("token dtype", facts.get("dtype"))):
                first = said.setdefault(field, (name, fact))
                if first[1] != fact:
                    raise DataError(
                        f"data.mixture.{name}: its {field} ({fact}) is not "
                        f"data.mixture.{first[0]}'s ({first[1]}): mixed sources share one"
                    )
        if not len(trains[-1]) or not len(helds[-1]):
            split = "train" if not len(trains[-1]) else "eval"
            raise DataError(f"data.mixture.{name}: the {split} split is empty; give more data")
        record = tokenizer_lib.record(facts)
        said.setdefault("record", (name, record))
        _check_shared_files(name, facts, read_by)
    if foreign:
        notes.append(
            f"data.mixture: {', '.join(foreign)} are token files that name no tokenizer: make "
            "sure they hold the same tokenizer's ids as the other sources"
        )
    note, record = "\n".join(notes) or None, said["record"][1]
    order = mixture.Order(stages)
    return (
        MixtureRows(tuple(names), tuple(trains), order, note, record),
        MixtureRows(tuple(names), tuple(helds)),
    )


def _check_shared_files(name: str, facts: dict, read_by: dict[str, tuple[str, tuple]]) -> None:
    """Refuses a source that reads a token file another source reads split otherwise: each
    holds out its own tail (or nanoGPT's val.bin), so one would train on rows the other
    holds out. The same files read the same way (one path under two names) split alike."""
    files = tuple(
        os.path.realpath(os.path.expanduser(f)) if is_local(f) else f
        for f in facts.get("files") or ()
    )
    reading = (facts.get("layout"), files)
    for file in files:
        other, theirs = read_by.setdefault(file, (name, reading))
        if theirs != reading:
            raise DataError(
                f"data.mixture.{name} reads {file}, which data.mixture.{other} reads with "
                "other files or another layout: one would train on rows the other holds out; "
                "give each token file to one source (or the same path to both)"
            )


def _check_tokenizer(config: RunConfig, facts: dict | None, label: str | None = None) -> str | None:
    """Refuses data that model.init_from's model would read as other tokens than it was
    made of (jaxkit/data/tokenizer.py); returns a warning line where the kit cannot tell. `facts`
    is what token files say of themselves, None for the other sources; `label` names a
    mixture's source (`data.mixture.NAME.path=DIR`), else data.path is named."""
    from jaxkit.data import tokenizer as tokenizer_lib
    from jaxkit.hf.load import source_dir

    directory = source_dir(config)
    if directory is None:
        return None
    d = config.data
    try:
        said = f"data.path={d.path}" if label is None else label
        return tokenizer_lib.check_data(directory, d.source, said, facts)
    except tokenizer_lib.TokenizerError as e:
        raise DataError(str(e)) from None


# uint32 ids read as uint16 put each id's high half at every odd position of the files:
# below this for any id below 2**21 (2,097,152, beyond every tokenizer's vocabulary) ...
_HIGH_HALF_BELOW = 32
# ... while some low half, at an even position, is above this, which a stream of real
# uint16 ids that small at every other position (punctuation and digits, say) never is
# over _HALVES_SEEN ids.
_LOW_HALF_ABOVE = 4095
_HALVES_SEEN = 1024


def _halves_of_uint32(ranges: list[Any], vocab: int, train: Any, held_out: Any) -> bool:
    """Whether ids read as uint16 are uint32 ids' halves: each id's high half at every odd
    position of the files, its low half at the even one before. Conclusive where an even
    position holds more than a high half of an id below model.vocab_size could, over 16 ids
    at least; and whatever model.vocab_size says, for the tiny high halves of any
    tokenizer's ids beside large low halves, over enough ids to rule out real uint16 ids."""
    odd_top, even_top = max(r.odd_top for r in ranges), max(r.even_top for r in ranges)
    ids = len(train.tokens) + len(held_out.tokens)
    high = (vocab - 1) // 2**16  # the largest high half of an id below the vocabulary
    if odd_top <= high < even_top and ids >= 16:
        return True
    return odd_top < _HIGH_HALF_BELOW and even_top > _LOW_HALF_ABOVE and ids >= _HALVES_SEEN


def _check_ids(config: RunConfig, train: Any, held_out: Any, facts: dict, label: str) -> None:
    """The ids of token files against model.vocab_size: a prepared directory's vocabulary
    from meta.json, foreign files' by reading their ids once (and their dtype with them)."""
    from jaxkit.data import token_files

    d, vocab = config.data, _vocab_size(config)
    init_from = getattr(config.model, "init_from", None)  # a Llama's key
    if "vocab_size" in facts:  # prepared: its tokenizer's ids are all below this
        if facts["vocab_size"] > vocab:
            said = (
                f"{label} holds ids of a {facts['vocab_size']}-token vocabulary, "
                f"above model.vocab_size={vocab}"
            )
            if init_from is not None:  # the size is config.json's: no override can change it
                raise DataError(
                    f"{said}, model.init_from={init_from}'s: the data was prepared with another "
                    "tokenizer; prepare it with the model's own"
                )
            made_with_bytes = facts.get("tokenizer") == "bytes"
            raise DataError(
                f"{said}: set model.vocab_size=null to take the files' vocabulary (or "
                f"{facts['vocab_size']} or more)"
                + (
                    "; configs/lm_tiny_tokens.py is lm_tiny for such files"
                    if made_with_bytes
                    else ""
                )
            )
        return
    # Foreign files state no vocabulary: read their largest id once.
    ranges = [token_files.token_range(s.tokens) for s in (train, held_out)]
    low, top = min(r.low for r in ranges), max(r.top for r in ranges)
    dtype = d.token_dtype
    flat = any(not f.endswith(".npy") for f in facts["files"])  # a .npy states its dtype
    if dtype == "uint16" and flat and _halves_of_uint32(ranges, vocab, train, held_out):
        odd_top, even_top = max(r.odd_top for r in ranges), max(r.even_top for r in ranges)
        halves = "0" if odd_top == 0 else f"at most {odd_top}"
        raise DataError(
            f"data.token_dtype=uint32 is what {label} needs: read as uint16 "
            f"(the default), every second id is {halves} and the others reach {even_top}, "
            "the high and low halves of uint32 ids"
        )
    if low < 0:
        raise DataError(f"{label} holds token id {low}: ids are ≥ 0")
    if top >= vocab:
        said = f"{label} holds token id {top}, not below model.vocab_size={vocab}"
        # .npy files state their dtype, which data.token_dtype does not change
        check = f"data.token_dtype={dtype!r}" if flat else ""
        if init_from is not None:
            raise DataError(
                f"{said}, model.init_from={init_from}'s: the data was made with another "
                "tokenizer" + (f" (or check {check})" if check else "")
            )
        raise DataError(
            f"{said}: set model.vocab_size={top + 1} (or more)"
            + (f", or check {check}" if check else "")
        )


def _synthetic(config: RunConfig) -> tuple[ArraySource, ArraySource]:
    """Learnable synthetic rows, fixed by the seed: a linear teacher, or counting sequences."""
    d, n = config.data, config.data.num_examples
    assert n is not None  # data.source=synthetic requires data.num_examples
    rng = np.random.default_rng(12345)
    if is_lm(config):
        vocab, seq_len = _vocab_size(config), _seq_len(d)
        start = rng.integers(0, vocab, size=(n, 1))
        stride = rng.integers(1, 4, size=(n, 1))
        window = ((start + stride * np.arange(seq_len + 1)) % vocab).astype(np.int32)
        rows = ArraySource(window[:, :-1], window[:, 1:], seq_len=seq_len)
    else:
        # a classifier's rows: its features, and the classes its model section names
        features, classes = d.num_features, getattr(config.model, "num_classes", None)
        assert features is not None and classes is not None
        x = rng.normal(size=(n, features)).astype(np.float32)
        teacher = rng.normal(size=(features, classes))
        rows = ArraySource(x, np.argmax(x @ teacher, axis=1).astype(np.int32))
    train, held_out = _split_shuffled(n, d.eval_fraction, seed=54321)
    return (
        ArraySource(rows.inputs[train], rows.targets[train], rows.seq_len),
        ArraySource(rows.inputs[held_out], rows.targets[held_out], rows.seq_len),
    )


# The epoch orders last read: the two latest epochs of each (source size, seed), for at
# least the 64 sources last read and for every source of the largest mixture opened (see
# keep_orders_of). A batch reads at most two epochs of a source that holds a batch of rows,
# so each such order is drawn once (a smaller source's may be drawn again within a chunk of
# reads), where one cache of a fixed number of orders for all sources would draw them again
# for every batch of a mixture with more sources than it holds. Orders are kept in int32
# where the rows fit (half the memory) and read-only (they are shared).
_EPOCHS_KEPT = 2
_sources_kept = 64
_permutations: collections.OrderedDict[tuple[int, int], collections.OrderedDict] = (
    collections.OrderedDict()
)
_permutations_lock = threading.Lock()  # the prefetch thread reads rows beside the loop


def keep_orders_of(sources: int) -> None:
    """Keeps the epoch orders of at least `sources` sources (a mixture of that many)."""
    global _sources_kept
    with _permutations_lock:
        _sources_kept = max(_sources_kept, sources)


def _epoch_permutation(num_rows: int, seed: int, epoch: int) -> np.ndarray:
    """Epoch `epoch`'s order of a source's `num_rows` rows under `seed`."""
    key = (num_rows, seed)
    with _permutations_lock:
        epochs = _permutations.get(key)
        if epochs is not None and epoch in epochs:
            _permutations.move_to_end(key)
            epochs.move_to_end(epoch)
            return epochs[epoch]
    order = np.random.default_rng([seed, epoch]).permutation(num_rows)
    if num_rows <= np.iinfo(np.int32).max:
        order = order.astype(np.int32)
    order.flags.writeable = False
    with _permutations_lock:
        epochs = _permutations.setdefault(key, collections.OrderedDict())
        epochs[epoch] = order
        _permutations.move_to_end(key)
        while len(epochs) > _EPOCHS_KEPT:
            epochs.popitem(last=False)
        while len(_permutations) > _sources_kept:
            _permutations.popitem(last=False)
    return order


def rows_of_examples(examples: np.ndarray, num_rows: int, seed: int) -> np.ndarray:
    """Source rows of stream examples `examples` (any order): example e is row
    perm_{e // N}[e % N]."""
    epochs, offsets = np.divmod(np.asarray(examples, dtype=np.int64), num_rows)
    rows = np.empty(len(offsets), dtype=np.int64)
    for epoch in np.unique(epochs):  # one or two epochs for any batch that fits the data
        here = epochs == epoch
        rows[here] = _epoch_permutation(num_rows, seed, int(epoch))[offsets[here]]
    return rows


def stream_rows(first_example: int, count: int, num_rows: int, seed: int) -> np.ndarray:
    """Source rows of stream examples [first_example, first_example + count)."""
    return rows_of_examples(np.arange(first_example, first_example + count), num_rows, seed)


# A mixture's order is worked out 2,048 examples (64 blocks) at a time, and the last few
# such chunks kept: a step's weight, its micro-batches and the noise scale's rows reuse them.
_MIXTURE_CHUNK = 64 * mixture.BLOCK
_MIXTURE_CHUNKS_KEPT = 4


@dataclasses.dataclass
class MixtureRows:
    """Several sources' rows as one Source: ids [offset_s, offset_s + len_s) are source s's.

    With an `order` (the training split) the loader asks `stream_rows` for the ids of
    global examples; without one (held-out splits) each source is evaluated on its own
    (`parts`)."""

    names: tuple[str, ...]
    parts: tuple[Any, ...]  # each a data.Source (token_files.TokenRows)
    order: mixture.Order | None = None
    note: str | None = None
    tokenizer: dict | None = None

    def __post_init__(self) -> None:
        self.offsets = np.cumsum([0] + [len(p) for p in self.parts])
        self._chunks: dict[tuple[int, int], np.ndarray] = {}
        self._lock = threading.Lock()
        self._chunks_kept = _MIXTURE_CHUNKS_KEPT
        keep_orders_of(len(self.parts))
        own = zip(self.names, self.parts, strict=True)
        # Every source's tokens: a resume on other sources is refused naming the one changed.
        self.fingerprint: dict[str, Any] = {
            "mixture": {name: getattr(part, "fingerprint", None) for name, part in own}
        }
        # The ids every source shares, where sample and export look for them.
        for key in ("eod_id", "bos_id"):
            said = {(fp or {}).get(key) for fp in self.fingerprint["mixture"].values()}
            if len(said) == 1 and None not in said:
                self.fingerprint[key] = said.pop()
        # The stages, which a resume compares only up to its position (stage_changes).
        self.stages: list[dict] | None = None
        if self.order is not None:
            self.stages = [
                {
                    "start": stage.start,
                    "weights": dict(zip(self.names, map(str, stage.weights), strict=True)),
                    "typed": stage.typed,  # for a refusal's message: not compared
                }
                for stage in self.order.stages
            ]

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def stream_rows(self, first: int, count: int, seed: int) -> np.ndarray:
        ids = np.empty(count, dtype=np.int64)
        at, end = first, first + count
        # room for every chunk of the largest read asked (a step's whole global batch)
        self._chunks_kept = max(self._chunks_kept, -(-count // _MIXTURE_CHUNK) + 2)
        while at < end:
            chunk, lo = divmod(at, _MIXTURE_CHUNK)
            n = min(end - at, _MIXTURE_CHUNK - lo)
            ids[at - first : at - first + n] = self._chunk_rows(chunk, seed)[lo : lo + n]
            at += n
        return ids

    def _chunk_rows(self, chunk: int, seed: int) -> np.ndarray:
        """Ids of examples [chunk · C, (chunk + 1) · C), C = _MIXTURE_CHUNK: the order's
        Python work (each block's counts and shuffle, each source's stream) paid once for
        the step's weight, its micro-batches and the next steps, not once per read."""
        assert self.order is not None
        with self._lock:  # the prefetch thread reads too, and the order walks as it goes
            kept = self._chunks.get((chunk, seed))
            if kept is not None:
                return kept
            source, k = self.order.examples(chunk * _MIXTURE_CHUNK, _MIXTURE_CHUNK, seed)
            ids = np.empty(_MIXTURE_CHUNK, dtype=np.int64)
            for s, name in enumerate(self.names):
                here = source == s
                if here.any():
                    seed_s = mixture.source_seed(seed, name)
                    ids[here] = self.offsets[s] + rows_of_examples(
                        k[here], len(self.parts[s]), seed_s
                    )
            self._chunks[(chunk, seed)] = ids
            while len(self._chunks) > self._chunks_kept:
                del self._chunks[next(iter(self._chunks))]  # the oldest
            return ids

    def _by_source(self, ids: np.ndarray) -> tuple[np.ndarray, list[tuple[int, np.ndarray]]]:
        """`ids` sorted by source (a stable order), and each source's local rows in it:
        each source is read once, and `_put_back` restores the order of `ids`."""
        source = np.searchsorted(self.offsets, ids, side="right") - 1
        order = np.argsort(source, kind="stable")
        starts = np.searchsorted(source[order], np.arange(len(self.parts) + 1))
        return order, [
            (s, ids[order[lo:hi]] - self.offsets[s])
            for s, (lo, hi) in enumerate(itertools.pairwise(starts))
            if hi > lo
        ]

    @staticmethod
    def _put_back(order: np.ndarray, pieces: list[np.ndarray]) -> np.ndarray:
        """The sources' pieces, concatenated in `order`, put back in the order of the ids."""
        joined = pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
        out = np.empty_like(joined)
        out[order] = joined
        return out

    def __getitem__(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        order, local = self._by_source(np.asarray(ids, dtype=np.int64).reshape(-1))
        pieces = [self.parts[s][rows] for s, rows in local]
        if not pieces:  # no ids: what one source gives for none
            return self.parts[0][np.zeros(0, dtype=np.int64)]
        if any("weights" in rows for rows in pieces):
            for rows in pieces:
                if "weights" not in rows:
                    rows["weights"] = np.ones(rows["targets"].shape, dtype=np.float32)
        return {key: self._put_back(order, [rows[key] for rows in pieces]) for key in pieces[0]}

    def row_weight_sums(self, ids: np.ndarray) -> np.ndarray:
        order, local = self._by_source(np.asarray(ids, dtype=np.int64).reshape(-1))
        sums = [row_weight_sums(self.parts[s], rows) for s, rows in local]
        return self._put_back(order, sums) if sums else np.empty(0, dtype=np.float64)

    def by_source(self, examples: int, seed: int) -> dict[str, dict]:
        """examples_by_source and epochs_by_source after global examples [0, examples)."""
        assert self.order is not None
        with self._lock:
            given = self.order.given(examples, seed)
        return {
            "examples_by_source": {n: int(g) for n, g in zip(self.names, given, strict=True)},
            "epochs_by_source": {
                n: int(g) / len(p) for n, g, p in zip(self.names, given, self.parts, strict=True)
            },
        }


def source_rows(source: Source, first_example: int, count: int, seed: int) -> np.ndarray:
    """The rows of `source` that stream examples [first_example, first_example + count)
    are: a mixture's own order (MixtureRows), else stream_rows over its rows."""
    own = getattr(source, "stream_rows", None)
    if own is not None:
        return np.asarray(own(first_example, count, seed))
    return stream_rows(first_example, count, len(source), seed)


def check_batch_fits(global_batch_size: int, num_rows: int) -> None:
    if global_batch_size > num_rows:
        raise DataError(
            f"global_batch_size={global_batch_size} exceeds the {num_rows} training rows"
        )


def global_batch_rows(step: int, global_batch_size: int, num_rows: int, seed: int) -> np.ndarray:
    """Source rows of optimizer step `step` of a run whose global batch never changed."""
    check_batch_fits(global_batch_size, num_rows)
    return stream_rows(step * global_batch_size, global_batch_size, num_rows, seed)


def micro_batch_rows(
    first_example: int, micro: int, plan: BatchPlan, num_rows: int, seed: int
) -> np.ndarray:
    """Source rows of micro-step `micro` (0 ≤ micro < K) of the step starting at
    `first_example`."""
    m = plan.micro_batch_size
    return stream_rows(first_example + micro * m, m, num_rows, seed)


def process_row_range(sharding: jax.sharding.Sharding, num_rows: int) -> slice | np.ndarray:
    """The rows of a row-sharded array that this process's devices hold: one contiguous
    block as a slice, or, where its devices hold several (fsdp across slices, with data
    over them: mesh.dcn_fsdp with mesh.data > 1), the rows of each block in order, which
    is how make_array_from_process_local_data reads a process's rows."""
    row_slices = [
        slice(None) if idx is None else idx[0]  # None: the device holds every row
        for idx in sharding.addressable_devices_indices_map((num_rows,)).values()
    ]
    blocks = sorted({(s.start or 0, num_rows if s.stop is None else s.stop) for s in row_slices})
    if all(stop == start for (_, stop), (start, _) in itertools.pairwise(blocks)):
        return slice(blocks[0][0], blocks[-1][1])
    return np.concatenate([np.arange(start, stop) for start, stop in blocks])


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


# The last few (source, rows asked for, weight), the whole tuple replaced at once: the
# prefetch thread (a step ahead) and the loop (which asks what the step scores) both ask,
# and with one entry they evicted each other's. Each entry carries its key with its own
# weight, so a race loses an entry, never mixes one. The source itself, not its id, is
# kept: a new source may take a freed one's id. A step's K micro-steps ask K times.
_WEIGHTS_KEPT = 4
_last_weights: list[tuple] = [()]


def step_weight(source: Source, first_example: int, rows: int, seed: int) -> float:
    """Σ weight of stream examples [first_example, first_example + rows): an optimizer
    step's (or a micro-step's) denominator, from per-row sums, the same on every process."""
    key = (first_example, rows, seed)
    kept = _last_weights[0]
    for cached_source, cached_key, cached in kept:
        if cached_source is source and cached_key == key:
            return cached
    weight = float(row_weight_sums(source, source_rows(source, first_example, rows, seed)).sum())
    _last_weights[0] = ((source, key, weight), *kept[: _WEIGHTS_KEPT - 1])
    return weight


def _scale(weight: float, factor: float = 1.0) -> float:
    """`factor / weight`; a batch with no weight at all is scored nowhere (scale 0)."""
    return factor / weight if weight > 0 else 0.0


def _with_loss_weights(rows: Rows, scale: np.ndarray | float) -> Rows:
    """`rows` with "loss_weights" (each target's weight × `scale`) in place of "weights":
    the step's loss is then Σ loss_weights × token loss, with no division on the device."""
    weights = rows.pop("weights", None)
    if weights is None:
        weights = np.ones(rows["targets"].shape, dtype=np.float32)
    scale = np.asarray(scale, dtype=np.float64).reshape(np.shape(scale) + (1,) * (weights.ndim - 1))
    rows["loss_weights"] = (weights * scale).astype(np.float32)
    return rows


def load_micro_batch(
    source: Source,
    first_example: int,
    micro: int,
    plan: BatchPlan,
    seed: int,
    sharding: jax.sharding.Sharding,
    normalisation: str = "exact",
) -> dict[str, jax.Array]:
    """Micro-step `micro` of the optimizer step starting at stream example `first_example`,
    sharded over the batch axes.

    Its "loss_weights" make the mean of the K micro-step losses (MultiSteps' mean) the
    step's Σ weight × loss / Σ weight over the whole global batch ("exact"): each weight
    is scaled by K / (the global batch's weight). "naive" divides by the micro-batch's own
    weight instead, the mean of micro-batch means other kits compute (for comparison).
    """
    m, k = plan.micro_batch_size, plan.grad_accum_steps
    if normalisation == "exact":
        scale = _scale(step_weight(source, first_example, plan.global_batch_size, seed), k)
    else:
        scale = _scale(step_weight(source, first_example + micro * m, m, seed))
    rows = source_rows(source, first_example + micro * m, m, seed)
    local_rows = rows[process_row_range(sharding, len(rows))]
    picked = _with_loss_weights(source[local_rows], scale)
    return to_global_array(picked, sharding, len(rows))


def load_small_batch(
    source: Source, first_example: int, rows: int, seed: int, sharding: jax.sharding.Sharding
) -> dict[str, jax.Array] | None:
    """The first `rows` examples of the optimizer step starting at `first_example`, with
    loss_weights summing to 1 (their own mean loss): the noise scale's small batch, the
    same rows for every split. None when they score no target."""
    picked = source_rows(source, first_example, rows, seed)
    scale = _scale(float(row_weight_sums(source, picked).sum()))
    if scale == 0:
        return None
    local = picked[process_row_range(sharding, rows)]
    return to_global_array(_with_loss_weights(source[local], scale), sharding, rows)


def load_global_batch(
    source: Source,
    first_example: int,
    plan: BatchPlan,
    seed: int,
    sharding: jax.sharding.NamedSharding,
    normalisation: str = "exact",
) -> dict[str, jax.Array]:
    """The whole optimizer step starting at `first_example`, as (K, micro_batch, ...):
    micro-step m is row m.

    `sharding` splits the second axis over the batch axes, so each device holds its slice
    of every micro-batch, exactly the rows load_micro_batch would give it. The fused step
    sums Σ loss_weights × loss over all K: "exact" scales each weight by 1 / (the global
    batch's weight), "naive" by 1 / (K × its micro-batch's weight).
    """
    k, m = plan.grad_accum_steps, plan.micro_batch_size
    if normalisation == "exact":
        scale: np.ndarray | float = _scale(
            step_weight(source, first_example, plan.global_batch_size, seed)
        )
    else:
        scale = np.array(
            [_scale(step_weight(source, first_example + i * m, m, seed), 1 / k) for i in range(k)]
        )
    rows_KxM = source_rows(source, first_example, k * m, seed).reshape(k, m)
    rows_sharding = jax.sharding.NamedSharding(sharding.mesh, P(*sharding.spec[1:]))
    local = process_row_range(rows_sharding, m)
    local_rows = rows_KxM[:, local]
    picked = source[local_rows.reshape(-1)]
    stacked = {key: v.reshape(k, -1, *v.shape[1:]) for key, v in picked.items()}
    stacked = _with_loss_weights(stacked, scale)
    return {
        key: jax.make_array_from_process_local_data(sharding, v, (k, m, *v.shape[2:]))
        for key, v in stacked.items()
    }


def eval_row_count(source: Source, eval_examples: int) -> int:
    """Held-out rows an eval reads: the first `eval_examples` (0 = every row)."""
    return len(source) if eval_examples <= 0 else min(eval_examples, len(source))


def eval_batches(
    source: Source, plan: BatchPlan, eval_examples: int, sharding: jax.sharding.Sharding
) -> Iterator[dict[str, jax.Array]]:
    """The first `eval_examples` held-out rows (0 = all), a micro-batch at a time.

    The last batch is padded to a whole micro-batch with weight-0 copies of row 0, so every
    row is evaluated and each counts once: the same rows for every split, device count and
    process count. Each batch carries `weights`, one per target: the source's (1 where it
    gives none), 0 for padding; the eval loss is Σ weight × loss / Σ weight, as training's.
    """
    n, m = eval_row_count(source, eval_examples), plan.micro_batch_size
    local = process_row_range(sharding, m)
    for start in range(0, n, m):
        rows = np.arange(start, start + m)
        real = rows < n
        batch = source[np.where(real, rows, 0)[local]]
        weights = batch.get("weights", np.ones(batch["targets"].shape, dtype=np.float32))
        real_BxT = real[local].reshape((-1,) + (1,) * (weights.ndim - 1))
        batch["weights"] = (weights * real_BxT).astype(np.float32)
        yield to_global_array(batch, sharding, m)


def checked_sources(config: RunConfig, largest: BatchPlan) -> tuple[Source, Source]:
    """make_sources, then every check of the data that `train` makes before it compiles
    (and `plan` with token files): `largest` is the batch schedule's largest stage."""
    train, held_out = make_sources(config)
    check_sources(train, largest)
    check_eval_weight(held_out, config.train.eval_examples)
    return train, held_out


# The key of data facts that records the token files' tokenizer (jaxkit/data/tokenizer.py's
# record): absolute, so that an export from any directory finds it.
TOKENIZER = "tokenizer"


# The key of data facts that records where the config's input paths lie (input_paths).
PATHS = "paths"
# The key of data facts that records a mixture's stages (mixture.stage_changes).
MIXTURE_STAGES = "mixture_stages"


def input_paths(config: RunConfig) -> dict[str, str]:
    """The config's keys that name an input file or directory (data.path), each as the
    absolute location it names from this working directory (a URL as it is): a resume
    from another directory holds these, not the strings, against the saved run's."""
    data = config.data
    named = {"data.path": data.path}
    for name, fields in (data.mixture or {}).items():
        named[f"data.mixture.{name}.path"] = fields.get("path")
    return {
        key: os.path.abspath(path) if is_local(path) else path
        for key, path in named.items()
        if isinstance(path, str) and path
    }


def data_facts(
    train_source: Source, eval_source: Source, paths: dict[str, str] | None = None
) -> dict:
    """What a checkpoint must be resumed on: the same rows of each split and, for token
    files, the same tokens (their fingerprint; see token_files.fingerprint). Token files
    that name their tokenizer add its record (jaxkit/data/tokenizer.py), which a resume does not
    compare (the fingerprint holds the tokenizer as prepare was given it). `paths`
    (input_paths) is recorded as it is: a resume holds it against the config's strings."""
    facts: dict = {"train_rows": len(train_source), "eval_rows": len(eval_source)}
    if paths:
        facts[PATHS] = paths
    fingerprint = getattr(train_source, "fingerprint", None)
    if fingerprint is not None:
        facts["fingerprint"] = fingerprint
    stages = getattr(train_source, "stages", None)
    if stages is not None:  # a mixture's: compared up to a resume's position
        facts[MIXTURE_STAGES] = stages
    tokenizer = getattr(train_source, "tokenizer", None)
    if tokenizer is not None:  # where its file is, not what the data is: a resume ignores it
        facts[TOKENIZER] = tokenizer
    return facts


def check_sources(train_source: Source, plan: BatchPlan) -> None:
    """Fails before training, not at the first step, when the data cannot serve the plan."""
    check_batch_fits(plan.global_batch_size, len(train_source))
    check_train_weight(train_source)


def _each_source(source: Source, check: Callable[[Source], None]) -> bool:
    """For a mixture (MixtureRows): runs `check` on each of its sources, naming the one it
    refuses, and returns True; False for a single source, which the caller checks itself."""
    parts = getattr(source, "parts", None)
    if parts is None:
        return False
    for name, part in zip(source.names, parts, strict=True):  # type: ignore[attr-defined]
        try:
            check(part)
        except DataError as e:
            raise DataError(f"data.mixture.{name}: {e}") from None
    return True


def check_train_weight(source: Source, chunk_rows: int = 4096) -> None:
    """Fails before training when no training row scores a target (every prompt longer than
    data.seq_len, say): every step's loss would be 0 / 0. Reads rows a chunk at a time and
    stops at the first scored one, so data that scores anything costs one chunk. A
    mixture's sources are each checked, and named: one that scores nothing would take its
    share of every batch and train on none of it."""
    if _each_source(source, lambda part: check_train_weight(part, chunk_rows)):
        return
    n = len(source)
    for start in range(0, n, chunk_rows):
        if row_weight_sums(source, np.arange(start, min(start + chunk_rows, n))).sum() > 0:
            return
    raise DataError(
        f"the {n} training rows score no target (every weight is 0: prompts or padding "
        "only); raise data.seq_len, or give data whose rows score targets"
    )


def check_eval_weight(source: Source, eval_examples: int) -> None:
    """Fails before training when the held-out rows an eval reads score no target at all
    (prompts only, say): their weighted mean loss would be 0 / 0. A mixture's sources are
    each evaluated on their own (MixtureRows.parts), so each is checked, and named."""
    if _each_source(source, lambda part: check_eval_weight(part, eval_examples)):
        return
    rows = np.arange(eval_row_count(source, eval_examples))
    if row_weight_sums(source, rows).sum() <= 0:
        raise DataError(
            f"the {len(rows)} held-out rows an eval reads score no target (every weight is "
            "0: prompts or padding only); raise train.eval_examples or data.seq_len"
        )

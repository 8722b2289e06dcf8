"""`data.source=tokens`: rows from token files, read by memory map, never whole.

`data.path` is a directory `jaxkit data prepare` wrote (its meta.json names the shards of
each split), or foreign flat token files: a file, a directory of `.bin`/`.npy` files, or a
glob, local or a URL (`gs://...`, read in ranges through fsspec). A directory in nanoGPT's
layout (`train.bin` and `val.bin`) trains on `train.bin` and holds out `val.bin`; other
foreign files hold out their stream's tail. The shards of a split form one stream of token
ids. Rows are either

- windows (`data.rows=windows`, packed): row r is stream tokens [r·L, r·L + L + 1),
  across document and shard boundaries, as nanoGPT reads `train.bin`; or
- documents (`data.rows=documents`, padded): row r is document r's first L + 1 tokens,
  padded with the end-of-document id, the padding weighing 0.

A target's weight is its mask byte (1 where a prepared mask scores it, else 1 everywhere).
With `data.document_mask`, windows also carry `segment_ids` and `positions` so attention
stays inside each document and positions restart at each one.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
from typing import Any, NamedTuple

import numpy as np

from jaxkit.data import token_format as fmt

ROWS = ("windows", "documents")
# nanoGPT's prepare.py writes these two into a directory: its train and held-out splits.
NANOGPT_FILES = ("train.bin", "val.bin")
# A prepared directory's files that are not token ids, and a stray json beside foreign files.
SIDE_SUFFIXES = (fmt.MASK_SUFFIX, fmt.DOCS_SUFFIX, ".json")


class TokenFileError(ValueError):
    """Token files that cannot be read as the config says."""


def is_url(path: str) -> bool:
    return "://" in path


class _RangeFile:
    """A remote file of fixed-size items, read in ranges through fsspec (no memory map)."""

    def __init__(self, path: str, dtype: np.dtype, size_bytes: int) -> None:
        import fsspec

        self.path, self.dtype = path, dtype
        self.file = fsspec.open(path, "rb").open()
        self.shape = (size_bytes // dtype.itemsize,)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, span: slice) -> np.ndarray:
        start, stop, _ = span.indices(self.shape[0])
        self.file.seek(start * self.dtype.itemsize)
        data = self.file.read(max(stop - start, 0) * self.dtype.itemsize)
        return np.frombuffer(data, dtype=self.dtype)


def _size(path: str) -> int:
    if is_url(path):
        import fsspec

        fs, inner = fsspec.core.url_to_fs(path)
        return int(fs.size(inner))
    return os.path.getsize(path)


def open_tokens(path: str, dtype: str | None) -> Any:
    """One shard as a 1-D array-like of token ids: a memory map locally, ranged reads for
    a URL. `.npy` files carry their dtype; flat files take `dtype` (little-endian)."""
    try:
        if path.endswith(".npy"):
            if is_url(path):
                raise TokenFileError(f"{path}: .npy shards are read locally; use flat .bin files")
            array = np.load(path, mmap_mode="r")
            if array.ndim != 1 or array.dtype.kind not in "ui":
                raise TokenFileError(
                    f"{path}: a .npy shard holds one flat array of integer token ids, "
                    f"not {array.dtype} of shape {array.shape}"
                )
            return array
        if dtype not in fmt.DTYPES:
            raise TokenFileError(f"{path}: the token dtype {dtype!r} is not one of {fmt.DTYPES}")
        item = np.dtype(dtype).newbyteorder("<")
        size = _size(path)
        if size % item.itemsize:
            raise TokenFileError(
                f"{path}: {size} bytes is not a whole number of {dtype} tokens "
                f"({item.itemsize} bytes each): a truncated file, or the wrong data.token_dtype"
            )
        if is_url(path):
            return _RangeFile(path, item, size)
        return np.memmap(path, dtype=item, mode="r") if size else np.zeros(0, item)
    except (OSError, ValueError) as e:
        if isinstance(e, TokenFileError):
            raise
        raise TokenFileError(f"{path}: cannot be read as token ids ({e})") from None


@dataclasses.dataclass
class Stream:
    """Several shards as one stream of `len(self)` items: [lo, hi) of their concatenation."""

    shards: list[Any]
    lo: int = 0
    hi: int | None = None

    def __post_init__(self) -> None:
        self.starts = np.cumsum([0] + [len(s) for s in self.shards])
        total = int(self.starts[-1])
        self.hi = total if self.hi is None else self.hi

    def __len__(self) -> int:
        assert self.hi is not None
        return self.hi - self.lo

    def read(self, start: int, length: int) -> np.ndarray:
        """Items [start, start + length) of the stream, across shard boundaries."""
        first = self.lo + start
        pieces, at, end = [], first, first + length
        shard = int(np.searchsorted(self.starts, at, side="right")) - 1
        while at < end:
            base = int(self.starts[shard])
            stop = min(end, int(self.starts[shard + 1]))
            pieces.append(np.asarray(self.shards[shard][at - base : stop - base]))
            at, shard = stop, shard + 1
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)


@dataclasses.dataclass
class Split:
    """One split of token files: its tokens, its masks (or None) and its documents."""

    tokens: Stream
    masks: Stream | None
    doc_starts: np.ndarray | None  # stream offset of each document's first token
    eod_id: int | None


def _is_glob(path: str) -> bool:
    return any(ch in path for ch in "*?[")


def _is_token_file(path: str) -> bool:
    """What a glob or a directory reads as token ids: .bin and .npy files, no side file."""
    return path.endswith((".bin", ".npy")) and not path.endswith(SIDE_SUFFIXES)


def _parent(path: str) -> str:
    return path.rsplit("/", 1)[0] if is_url(path) else os.path.dirname(path)


def _is_prepared(directory: str) -> bool:
    """Whether `directory` holds a meta.json, as every directory `data prepare` wrote does."""
    meta_path = directory.rstrip("/") + "/" + fmt.META_NAME
    if is_url(directory):
        import fsspec

        fs, inner = fsspec.core.url_to_fs(meta_path)
        return bool(fs.exists(inner))
    return os.path.isfile(meta_path)


def _expand(path: str, key: str = "data.path") -> list[str]:
    """The foreign token files `path` (given as `key`) names: a file, or a directory's or a
    glob's .bin and .npy files. Files inside a prepared directory are refused: read one by
    one, its held-out shards would be trained on and its masks dropped."""
    named = False  # one file, named as it is
    if is_url(path):
        import fsspec

        fs, _ = fsspec.core.url_to_fs(path)
        protocol = path.split("://", 1)[0]
        if _is_glob(path):
            found = sorted(fs.glob(path))
        elif fs.isdir(path):
            found = sorted(fs.ls(path, detail=False))
        else:
            found, named = ([path] if fs.exists(path) else []), True
        found = [p if "://" in p else f"{protocol}://{p.lstrip('/')}" for p in found]
    else:
        path = os.path.expanduser(path)
        if _is_glob(path):
            found = sorted(glob.glob(path))
        elif os.path.isdir(path):
            names = os.listdir(path)
            if any(n.endswith((fmt.DOCS_SUFFIX, fmt.MASK_SUFFIX)) for n in names):
                raise TokenFileError(
                    f"{key}={path!r} holds a prepared directory's shards but no "
                    f"{fmt.META_NAME}: an unfinished or damaged `jaxkit data prepare`; prepare "
                    "it again"
                )
            found = sorted(os.path.join(path, n) for n in names)
        else:
            found, named = ([path] if os.path.isfile(path) else []), True
    if named and found and path.endswith(SIDE_SUFFIXES):
        raise TokenFileError(
            f"{key}={path!r} is a side file ({', '.join(SIDE_SUFFIXES)}), not token ids: "
            "name the .bin or .npy token files, or the directory that holds them"
        )
    if not named:  # masks, document indexes and a stray json are never token ids
        found = [f for f in found if _is_token_file(f)]
    for parent in sorted({_parent(f) for f in found}):
        if _is_prepared(parent):
            raise TokenFileError(
                f"{key}={path!r} reaches into {parent}, a prepared directory whose "
                f"{fmt.META_NAME} names each split's shards and masks: pass "
                f"{key}={parent} instead"
            )
        if (
            not named
            and _nanogpt_files(parent)
            and any(
                f.rsplit("/", 1)[-1] == NANOGPT_FILES[1] and _parent(f) == parent for f in found
            )
        ):
            # Read as one stream, the tail held out would be val.bin's tail only, and the
            # rest of val.bin would be trained on.
            raise TokenFileError(
                f"{key}={path!r} reaches {parent}'s val.bin, the held-out split of "
                f"nanoGPT's layout: pass {key}={parent} (trains on train.bin, holds out "
                "val.bin), or name train.bin alone"
            )
    return found


def _nanogpt_files(path: str) -> tuple[str, str] | None:
    """(train.bin, val.bin) of a directory in nanoGPT's layout, else None."""
    if _is_glob(path):
        return None
    if is_url(path):
        import fsspec

        fs, _ = fsspec.core.url_to_fs(path)
        if not fs.isdir(path):
            return None
        names = {p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(path, detail=False)}
        base = path.rstrip("/") + "/"
    else:
        base = os.path.expanduser(path)
        if not os.path.isdir(base):
            return None
        names = set(os.listdir(base))
        base = os.path.join(base, "")
    if not set(NANOGPT_FILES) <= names:
        return None
    train, val = NANOGPT_FILES
    return base + train, base + val


def read_meta(path: str) -> dict | None:
    """meta.json of a prepared directory, or None for foreign files."""
    meta_path = path.rstrip("/") + "/" + fmt.META_NAME
    try:
        if is_url(path):
            import fsspec

            fs, inner = fsspec.core.url_to_fs(meta_path)
            if not fs.exists(inner):
                return None
            with fs.open(inner, "rb") as f:
                meta = json.loads(f.read())
        else:
            if not os.path.isfile(os.path.expanduser(meta_path)):
                return None
            with open(os.path.expanduser(meta_path), "rb") as f:
                meta = json.loads(f.read())
    except (OSError, ValueError) as e:
        raise TokenFileError(f"{meta_path}: cannot be read ({e})") from None
    if meta.get("format") != fmt.FORMAT or meta.get("version") != fmt.VERSION:
        raise TokenFileError(
            f"{meta_path}: not a {fmt.FORMAT} version {fmt.VERSION} meta.json "
            f"(format {meta.get('format')!r}, version {meta.get('version')!r})"
        )
    return meta


def _open_mask(path: str) -> Any:
    """A shard's mask bytes: a memory map locally, ranged reads behind a URL."""
    if is_url(path):
        return _RangeFile(path, np.dtype(np.uint8), _size(path))
    return np.memmap(path, dtype=np.uint8, mode="r") if os.path.getsize(path) else np.zeros(0)


def _load_npy(path: str) -> np.ndarray:
    if is_url(path):
        import io

        import fsspec

        with fsspec.open(path, "rb") as f:
            return np.load(io.BytesIO(f.read()))
    return np.load(path)


def _prepared_split(root: str, meta: dict, split: str) -> Split:
    """One split of a prepared directory, its files checked against meta.json: a shard
    cut short, a missing file or a document index past its shard is refused here."""
    try:
        stems = meta["shards"][split]
        expected = int(meta["num_tokens"][split])
        eod_id = int(meta["eod_id"])
        dtype = meta["dtype"]
    except (KeyError, TypeError, ValueError) as e:
        raise TokenFileError(f"{root}/{fmt.META_NAME}: no valid {e} entry") from None
    try:
        return _read_split(root, meta, stems, expected, eod_id, dtype)
    except OSError as e:
        raise TokenFileError(f"{root}: a shard of the {split} split cannot be read ({e})") from None


def _read_split(
    root: str, meta: dict, stems: list[str], expected: int, eod_id: int, dtype: str
) -> Split:
    join = (
        (lambda name: root.rstrip("/") + "/" + name)
        if is_url(root)
        else (lambda name: os.path.join(os.path.expanduser(root), name))
    )
    tokens = [open_tokens(join(s + fmt.TOKEN_SUFFIX), dtype) for s in stems]
    if sum(len(t) for t in tokens) != expected:
        raise TokenFileError(
            f"{root}: {sum(len(t) for t in tokens)} tokens in the shards of "
            f"{', '.join(stems)}, but {fmt.META_NAME} says {expected}: a shard was cut short "
            "or replaced; prepare the data again"
        )
    masks = None
    if meta.get("masked"):
        masks = [_open_mask(join(s + fmt.MASK_SUFFIX)) for s in stems]
        for stem, t, m in zip(stems, tokens, masks, strict=True):
            if len(t) != len(m):
                raise TokenFileError(f"{join(stem)}: {len(t)} tokens but {len(m)} mask bytes")
    starts, offset = [], 0
    for stem, t in zip(stems, tokens, strict=True):
        shard_starts = _load_npy(join(stem + fmt.DOCS_SUFFIX))
        if len(shard_starts) and (
            shard_starts[0] != 0 or shard_starts[-1] >= len(t) or np.any(np.diff(shard_starts) <= 0)
        ):
            raise TokenFileError(
                f"{join(stem + fmt.DOCS_SUFFIX)}: document starts do not lie in order inside "
                f"the shard's {len(t)} tokens"
            )
        starts.append(shard_starts + offset)
        offset += len(t)
    doc_starts = np.concatenate(starts) if starts else np.zeros(0, np.int64)
    return Split(Stream(tokens), Stream(masks) if masks else None, doc_starts, eod_id)


def held_out_by_fraction(path: str) -> bool:
    """Whether open_splits holds out `path`'s last eval_fraction of tokens: files neither
    prepared nor in nanoGPT's layout, which hold out their own split."""
    prepared = not _is_glob(path) and read_meta(path) is not None
    return not prepared and _nanogpt_files(path) is None


def open_splits(
    path: str, token_dtype: str, eval_fraction: float, key: str = "data.path"
) -> tuple[Split, Split, dict]:
    """(train, eval, facts): a prepared directory's two splits, nanoGPT's train.bin and
    val.bin, or other foreign token files whose last `eval_fraction` of tokens is held out.
    `facts` holds meta.json (or what is known without it: dtype, files and counts, and
    "layout": "nanogpt" for nanoGPT's). `key` is the config key that gave `path`, as the
    refusals name it (a mixture's source: data.mixture.NAME.path)."""
    meta = read_meta(path) if not _is_glob(path) else None
    if meta is not None:
        train, held = (_prepared_split(path, meta, split) for split in fmt.SPLITS)
        return train, held, meta
    pair = _nanogpt_files(path)
    if pair is not None:  # held out as nanoGPT holds it out: data.eval_fraction does not apply
        train_tokens, val_tokens = (Stream([open_tokens(f, token_dtype)]) for f in pair)
        facts = {
            "dtype": token_dtype,
            "files": list(pair),
            "num_tokens": len(train_tokens) + len(val_tokens),
            "layout": "nanogpt",
        }
        return (
            Split(train_tokens, None, None, None),
            Split(val_tokens, None, None, None),
            facts,
        )
    files = _expand(path, key)
    if not files:
        raise TokenFileError(
            f"{key}={path!r} matches no token file (.bin or .npy) and is no directory "
            "that `jaxkit data prepare --out` wrote: prepare the data first (each token "
            "config's docstring gives the command)"
        )
    stream = Stream([open_tokens(f, token_dtype) for f in files])
    cut = int(len(stream) * (1 - eval_fraction))
    facts = {"dtype": token_dtype, "files": files, "num_tokens": len(stream)}
    return (
        Split(Stream(stream.shards, 0, cut), None, None, None),
        Split(Stream(stream.shards, cut, len(stream)), None, None, None),
        facts,
    )


def take_vocabulary(config: Any) -> str | None:
    """model.vocab_size=null with token files: the vocabulary their meta.json records (as
    nanoGPT takes meta.pkl's; a mixture's largest), set in `config` before its values are
    checked. Returns the line that says so; None where model.vocab_size is given (or the
    config has none). Files that record no vocabulary (foreign .bin/.npy) are refused."""
    from jaxkit.keys import ConfigError, show

    model, data = config.get("model"), config.get("data")
    if model is None or "vocab_size" not in model or model.vocab_size is not None:
        return None
    source = None if data is None else data.get("source")
    if source != "tokens":
        raise ConfigError(
            "model.vocab_size=null takes the vocabulary of token files (data.source=tokens): "
            f"with data.source={show(source)}, give a number"
            + (" (at least 256: bytes)" if source == "text" else "")
        )
    from jaxkit.batch import mixture

    value = data.get("mixture")
    value = value.to_dict() if hasattr(value, "to_dict") else value
    sources = mixture.sources_of(value) if value else {}  # each source's path, checked
    named = {f"data.mixture.{n}.path": fields["path"] for n, fields in sources.items()}
    sizes = {}
    for key, path in (named or {"data.path": data.get("path")}).items():
        if not isinstance(path, str) or not path.strip():
            raise ConfigError(
                f"model.vocab_size=null takes the vocabulary of the token files {key} names, "
                f"and {key}={show(path)} names none"
            )
        try:
            meta = None if _is_glob(path) else read_meta(path)
            if meta is None:  # foreign files, or none there: said as opening them says it
                open_splits(path, "uint16", 0.5, key)
        except TokenFileError as e:
            raise ConfigError(str(e)) from None
        if meta is None or not isinstance(meta.get("vocab_size"), int):
            raise ConfigError(
                f"model.vocab_size=null takes the vocabulary a prepared directory's "
                f"{fmt.META_NAME} records, and {key}={path!r} names token files without one "
                "(`jaxkit data prepare` writes it): give model.vocab_size"
            )
        sizes[f"{key}={path}"] = meta["vocab_size"]
    vocab = max(sizes.values())
    model.vocab_size = vocab
    return (
        f"model.vocab_size={vocab}: the vocabulary of {', '.join(sizes)} ({fmt.META_NAME}), "
        "as model.vocab_size=null asks"
    )


class IdRange(NamedTuple):
    """The ids of a stream, read once: their extremes, and the largest at even and at odd
    positions of the files (-1 where there is none)."""

    low: int
    top: int
    even_top: int
    odd_top: int


def token_range(stream: Stream, chunk: int = 1 << 24) -> IdRange:
    """The smallest and largest ids in `stream`, read a chunk at a time (foreign files
    state no vocabulary, and a signed .npy may hold negative ids), and the largest at even
    and at odd positions of the files: little-endian uint32 ids read as uint16 put each
    id's low half at an even position and its high half, tiny, at the odd one after it."""
    low, even_top, odd_top = 0, -1, -1
    for start in range(0, len(stream), chunk):
        part = stream.read(start, min(chunk, len(stream) - start))
        low = min(low, int(part.min()))
        first_odd = (stream.lo + start + 1) % 2  # where the files' odd positions start
        odd, even = part[first_odd::2], part[1 - first_odd :: 2]
        odd_top = max(odd_top, int(odd.max())) if len(odd) else odd_top
        even_top = max(even_top, int(even.max())) if len(even) else even_top
    return IdRange(low, max(even_top, odd_top), even_top, odd_top)


# Ids read from each end of a shard for the data's fingerprint: a cut or rewritten shard
# changes its size or its ends, and reading 2 blocks costs the same for any shard size.
FINGERPRINT_BLOCK = 4096
# What meta.json records of how the tokens were made, kept in every checkpoint.
FINGERPRINT_META = (
    "tokenizer",
    "seed",
    "eval_fraction",
    "dtype",
    "vocab_size",
    "eod_id",
    "bos_id",  # `--bos` only
    "masked",
    "num_tokens",
    "num_documents",
)


def fingerprint(train: Split, held_out: Split, facts: dict) -> dict:
    """What a checkpoint records to know token data again: meta.json's record (or, for
    foreign files, their dtype and each split's token count) and `shard_digest`, a digest
    of each split's shard sizes, the first and last FINGERPRINT_BLOCK ids (and mask bytes)
    of each shard and the document index: milliseconds, never a whole shard."""
    digest = hashlib.sha256()
    for split in (train, held_out):
        for stream in (split.tokens, split.masks):
            if stream is None:
                continue
            digest.update(f"{stream.lo}:{stream.hi}:{len(stream.shards)};".encode())
            for shard in stream.shards:
                n = len(shard)
                ends = (shard[: min(n, FINGERPRINT_BLOCK)], shard[max(n - FINGERPRINT_BLOCK, 0) :])
                digest.update(f"{n};".encode())
                for block in ends:
                    digest.update(np.ascontiguousarray(block).astype("<i8").tobytes())
        if split.doc_starts is not None:
            digest.update(np.ascontiguousarray(split.doc_starts).astype("<i8").tobytes())
    if "format" in facts:  # a prepared directory's meta.json
        record = {key: facts[key] for key in FINGERPRINT_META if key in facts}
    else:
        record = {
            "dtype": facts["dtype"],
            "num_tokens": {"train": len(train.tokens), "eval": len(held_out.tokens)},
        }
    return record | {"shard_digest": digest.hexdigest()[:16]}


def segments(inputs_BxL: np.ndarray, eod_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(segment_ids, positions) of packed rows: a document's end-of-document token is its
    last, the token after it starts the next segment at position 0."""
    ends = (inputs_BxL == eod_id).astype(np.int32)
    segment_BxL = np.cumsum(ends, axis=1) - ends  # the eod belongs to the document it ends
    index = np.arange(inputs_BxL.shape[1])
    starts = np.where(np.diff(segment_BxL, axis=1, prepend=-1) != 0, index, 0)
    positions_BxL = index - np.maximum.accumulate(starts, axis=1)
    return segment_BxL.astype(np.int32), positions_BxL.astype(np.int32)


@dataclasses.dataclass
class TokenRows:
    """A split's rows (windows or documents), with weights and, asked for, segments."""

    split: Split
    seq_len: int
    rows: str = "windows"
    document_mask: bool = False
    fingerprint: dict | None = None  # what a checkpoint records of the data (see fingerprint)
    note: str | None = None  # lines a run prints about how the data were read
    tokenizer: dict | None = None  # the tokenizer the ids came from (tokenizer.record)

    def __post_init__(self) -> None:
        if self.rows == "documents" and self.split.doc_starts is None:
            raise TokenFileError(
                "data.rows=documents needs the document index that `jaxkit data prepare` "
                "writes (foreign token files have none); use data.rows=windows"
            )
        if self.document_mask and self.split.eod_id is None:
            raise TokenFileError(
                "data.document_mask needs the end-of-document id from meta.json, which "
                "`jaxkit data prepare` writes; foreign token files have none"
            )
        if self.rows == "documents":
            starts = self.split.doc_starts
            assert starts is not None
            self.doc_ends = np.append(starts[1:], len(self.split.tokens))

    def __len__(self) -> int:
        if self.rows == "documents":
            assert self.split.doc_starts is not None
            return len(self.split.doc_starts)
        return max(len(self.split.tokens) - 1, 0) // self.seq_len

    def _spans(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Stream start and length (≤ L + 1) of each row."""
        rows = np.asarray(rows, dtype=np.int64)
        if self.rows == "windows":
            return rows * self.seq_len, np.full(len(rows), self.seq_len + 1)
        assert self.split.doc_starts is not None
        starts = self.split.doc_starts[rows]
        return starts, np.minimum(self.doc_ends[rows] - starts, self.seq_len + 1)

    def _read(self, stream: Stream, rows: np.ndarray, pad: int) -> np.ndarray:
        starts, lengths = self._spans(rows)
        out = np.full((len(starts), self.seq_len + 1), pad, dtype=np.int64)
        for i, (start, length) in enumerate(zip(starts, lengths, strict=True)):
            out[i, :length] = stream.read(int(start), int(length))
        return out

    def __getitem__(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        pad = self.split.eod_id if self.split.eod_id is not None else 0
        window = self._read(self.split.tokens, rows, pad).astype(np.int32)
        out = {"inputs": window[:, :-1], "targets": window[:, 1:]}
        weights = self._weights(rows)
        if weights is not None:
            out["weights"] = weights
        if self.document_mask:
            assert self.split.eod_id is not None
            out["segment_ids"], out["positions"] = segments(out["inputs"], self.split.eod_id)
        return out

    def _weights(self, rows: np.ndarray) -> np.ndarray | None:
        """One per target: its mask byte, 0 for padding; None when every target weighs 1."""
        if self.split.masks is None and self.rows == "windows":
            return None
        if self.split.masks is not None:
            mask = self._read(self.split.masks, rows, 0)[:, 1:]
        else:
            _, lengths = self._spans(rows)
            mask = np.arange(1, self.seq_len + 1) < lengths[:, None]
        return mask.astype(np.float32)

    def row_weight_sums(self, rows: np.ndarray) -> np.ndarray:
        """Σ weight per row: the row's length without a mask, else its mask bytes (one byte
        a token, never the tokens themselves)."""
        if self.split.masks is None:
            _, lengths = self._spans(rows)
            return (lengths - 1).astype(np.float64)
        return self._read(self.split.masks, rows, 0)[:, 1:].sum(axis=1, dtype=np.float64)

"""`jaxkit data prepare`: text, JSON lines and Parquet files to the token shards that
jaxkit/data/token_format.py lays out.

Inputs are counted first (so the held-out documents can be drawn before any is read),
then read in order and tokenized a chunk at a time in worker processes; each document goes
whole to its split's current shard. Everything is built in DIR.partial-PID beside DIR and
renamed to DIR only once meta.json is written: a failed or interrupted run leaves nothing a
training run could read.
"""

from __future__ import annotations

import codecs
import collections
import contextlib
import functools
import glob
import gzip
import io
import json
import multiprocessing
import os
import shutil
import signal
import sys
import zlib
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, NamedTuple

import numpy as np

from jaxkit.data import token_format
from jaxkit.data import tokenizer as tokenizer_lib

# The end-of-document tokens of common tokenizers (GPT-2, Llama 2, Gemma, Llama 3), in the
# order they are looked for when --eod-token is not given.
EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")
# A Hugging Face Dataset saved to disk holds these beside its .arrow files; a DatasetDict
# holds dataset_dict.json and a Dataset's directory for each split.
DATASET_NAMES = ("state.json", "dataset_info.json")
DATASET_DICT_NAME = "dataset_dict.json"
DEFAULT_SPLIT = "train"
DEFAULT_EVAL_FRACTION = 0.01  # of the documents, held out whole
DEFAULT_SHARD_TOKENS = 2**26  # at most per shard: 128 MiB of uint16 tokens
CHUNK_DOCUMENTS = 512  # documents sent to a worker at once, or fewer once they hold
CHUNK_CHARS = 1 << 20  # this many characters (bytes for a text file read as bytes)
LITTLE_ENDIAN = {"uint16": "<u2", "uint32": "<u4"}  # the file's byte order on any host
WRITE_BUFFER_BYTES = 1 << 20


class PrepareError(ValueError):
    """Inputs, a tokenizer or an output directory that cannot be prepared (exit status 2)."""


@dataclass(frozen=True)
class Document:
    """One document: its text, after a prompt when it is a prompt/completion pair."""

    text: str | bytes  # bytes: a text file for the bytes tokenizer, its UTF-8 as on disk
    prompt: str | None = None  # masked out (0) in the .mask file


@dataclass(frozen=True)
class Fields:
    """The JSON fields, or the Parquet and Arrow columns, a document is read from: a text,
    or a prompt and a completion. None: that kind of document is not read."""

    text: str | None = "text"
    prompt: str | None = "prompt"
    completion: str | None = "completion"

    @classmethod
    def named(
        cls, text: str | None = None, prompt: str | None = None, completion: str | None = None
    ) -> Fields:
        """The fields as --text-field, --prompt-field and --completion-field name them: with
        none named, both kinds under today's names; naming one kind's reads only that kind,
        unless the other's is named too (a pair's unnamed half keeps its own default)."""
        if text is None and prompt is None and completion is None:
            return cls()
        pair = prompt is not None or completion is not None
        fields = cls(
            text,
            (prompt or "prompt") if pair else None,
            (completion or "completion") if pair else None,
        )
        names = [n for n in (fields.text, fields.prompt, fields.completion) if n is not None]
        if "" in names or len(set(names)) != len(names):
            raise PrepareError(
                "--text-field, --prompt-field and --completion-field name different fields, "
                f"none empty: {', '.join(map(repr, names))}"
            )
        return fields

    def described(self) -> str:
        """What a JSON line holds: `a "text" field (or "prompt" and "completion")`."""
        pair = f'"{self.prompt}" and "{self.completion}"'
        if self.text is None:
            return f"{pair} fields"
        return f'a "{self.text}" field' + ("" if self.prompt is None else f" (or {pair})")

    def one_kind(self) -> str:
        """How to read one kind only, where a document holds both: the options, with these
        fields' names (naming one kind's fields reads only that kind)."""
        return (
            f"give --text-field {self.text} alone to read the texts, or --prompt-field "
            f"{self.prompt} --completion-field {self.completion} alone to read the pairs"
        )

    def wanted(self) -> str:
        """What a JSON line lacks, as an error says it: `"text" field (a string), nor
        "prompt" and "completion"`."""
        pair = f'"{self.prompt}" and "{self.completion}"'
        if self.text is None:
            return f"{pair} fields (strings)"
        if self.prompt is None:
            return f'"{self.text}" field (a string)'
        return f'"{self.text}" field (a string), nor {pair}'


DEFAULT_FIELDS = Fields()


class Encoded(NamedTuple):
    """A chunk of documents as tokens, each followed by the end-of-document token."""

    tokens: np.ndarray  # every document's tokens, one after the other, little-endian
    lengths: np.ndarray  # int64, each document's token count, its end-of-document included
    prompt_lengths: np.ndarray  # int64, each document's leading prompt tokens (mask 0)
    has_prompt: np.ndarray  # bool, whether each document is a prompt/completion pair


@dataclass
class Encoder:
    """The bytes tokenizer or a Hugging Face tokenizer.json, with its end-of-document id.

    Pickled to each worker process as its spec; the tokenizer.json is loaded there again.
    """

    spec: str  # "bytes" or a tokenizer.json path
    vocab_size: int
    eod_id: int
    bos_id: int | None = None  # --bos: put before each document (its prompt included)
    sha256: str | None = None  # a tokenizer.json's tokenizer_sha256 (jaxkit/data/tokenizer.py)
    _hf: Any = field(default=None, repr=False, compare=False)

    @classmethod
    def load(cls, spec: str, eod_token: str | None = None, bos: bool = False) -> Encoder:
        if spec == "bytes":
            if eod_token is not None:
                raise PrepareError(
                    "--eod-token applies to a tokenizer.json; the bytes tokenizer's "
                    f"end-of-document id is {token_format.BYTES_EOD_ID}"
                )
            if bos:
                raise PrepareError(
                    "--bos applies to a tokenizer.json: the bytes tokenizer has no "
                    "beginning-of-sequence token"
                )
            return cls(spec, token_format.BYTES_VOCAB_SIZE, token_format.BYTES_EOD_ID)
        hf = _load_tokenizer_json(spec)
        names = EOD_CANDIDATES if eod_token is None else (eod_token,)
        ids = [hf.token_to_id(name) for name in names]
        found = [i for i in ids if i is not None]
        if not found and eod_token is not None:
            raise PrepareError(f"--eod-token {eod_token!r} is not in the vocabulary of {spec}")
        if not found:
            raise PrepareError(
                f"--tokenizer {spec} has none of {', '.join(EOD_CANDIDATES)} in its vocabulary: "
                "name its end-of-document token with --eod-token"
            )
        bos_id = _bos_id(hf, spec) if bos else None
        return cls(spec, hf.get_vocab_size(), found[0], bos_id, tokenizer_lib.sha256_of(hf), hf)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_hf": None}

    @property
    def dtype(self) -> str:
        return token_format.token_dtype_for(self.vocab_size)

    def encode(self, documents: Sequence[Document]) -> Encoded:
        """The prompt and the text are encoded apart, so the mask's boundary is exact."""
        pieces = [
            p
            for d in documents
            for p in ((d.prompt, d.text) if d.prompt is not None else (d.text,))
        ]
        ids = iter(self._encode_pieces(pieces))
        eod = np.array([self.eod_id], np.int64)
        # The beginning-of-sequence token belongs to a prompt (mask 0) where there is one; a
        # plain document scores all its tokens, as a file without masks does.
        bos = np.array([] if self.bos_id is None else [self.bos_id], np.int64)
        parts, lengths, prompt_lengths = [], [], []
        for d in documents:
            prompt = next(ids) if d.prompt is not None else eod[:0]
            text = next(ids)
            parts += [bos, prompt, text, eod]
            lengths.append(len(bos) + len(prompt) + len(text) + 1)
            prompt_lengths.append(len(bos) + len(prompt) if d.prompt is not None else 0)
        tokens = np.concatenate(parts)
        if tokens.max() >= self.vocab_size:  # a file of narrower ids would wrap it silently
            raise PrepareError(
                f"--tokenizer {self.spec} gave id {tokens.max()}, outside its vocabulary of "
                f"{self.vocab_size}"
            )
        return Encoded(
            tokens.astype(LITTLE_ENDIAN[self.dtype]),
            np.array(lengths, np.int64),
            np.array(prompt_lengths, np.int64),
            np.array([d.prompt is not None for d in documents]),
        )

    def _encode_pieces(self, pieces: list[str | bytes]) -> list[np.ndarray]:
        if self.spec == "bytes":
            return [
                np.frombuffer(p.encode() if isinstance(p, str) else p, np.uint8).astype(np.int64)
                for p in pieces
            ]
        if self._hf is None:
            self._hf = _load_tokenizer_json(self.spec)
        assert all(isinstance(p, str) for p in pieces)  # the reader decodes for a tokenizer.json
        # No special tokens: a BOS from the post-processor would start the completion too.
        encodings = self._hf.encode_batch(pieces, add_special_tokens=False)
        return [np.asarray(e.ids, np.int64) for e in encodings]


def _bos_id(hf: Any, spec: str) -> int:
    """The beginning-of-sequence id a tokenizer.json's post-processor puts before a sequence
    (Llama's `<s>`, Llama 3's `<|begin_of_text|>`), as transformers adds it."""
    encoding = hf.encode("a", add_special_tokens=True)
    if not encoding.special_tokens_mask or not encoding.special_tokens_mask[0]:
        raise PrepareError(
            f"--bos: --tokenizer {spec} puts no beginning-of-sequence token before a sequence "
            "(its post-processor adds none): prepare without --bos"
        )
    return int(encoding.ids[0])


def _load_tokenizer_json(path: str) -> Any:
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise PrepareError(
            f"--tokenizer {path} needs the tokenizers library: pip install tokenizers"
        ) from None
    try:
        return Tokenizer.from_file(path)
    except Exception as err:  # the library raises a bare Exception, missing file or bad JSON
        raise PrepareError(f"--tokenizer {path}: not a tokenizer.json that loads: {err}") from None


def expand_inputs(inputs: Sequence[str], split: str | None = None) -> list[Path]:
    """The files named by each input, in the order given, each file once.

    A file is itself; a directory gives its files, recursively and sorted, hidden ones
    (`.git`, `.DS_Store`) and Python's bytecode caches (`__pycache__`) left out; a glob
    (`*`, `?`, `[`, `**` for any depth) gives its sorted matches. Prepared directories
    (a jaxkit meta.json) and half-built ones (`DIR.partial-PID`) are never inputs: a
    directory or glob leaves them out, and naming one or a file inside one is refused.

    A Hugging Face dataset saved to disk (`save_to_disk`'s state.json and
    dataset_info.json) is one input, its directory; a DatasetDict (dataset_dict.json) is its
    `split` (default "train"). A glob leaves out what lies inside one, and naming a file
    inside one is refused: its .arrow files are rows, not text.
    """
    # Asked once per directory and call: a directory prepared since an earlier call counts.
    prepared = functools.cache(_prepared_dir)
    saved = functools.cache(_saved_dataset)
    dicts: list[Path] = []  # the DatasetDicts read, for --split

    def split_of(path: Path, kind: str | None) -> Path:
        dicts.extend([path] if kind == "dict" else [])
        return _dataset_split(path, kind, split or DEFAULT_SPLIT)

    files: dict[str, Path] = {}  # by real path: `a/x`, `./a/x` and a link to it are one file
    for given in inputs:
        if any(c in given for c in "*?["):
            matches = sorted(glob.glob(given, recursive=True))
            matches = [m for m in matches if not _skipped_dir(m) and not _in_cache(m)]
            if not matches:
                raise PrepareError(f"{given}: matched no file")
            matches = [m for m in matches if _prepared_ancestor(m, prepared) is None]
            if not matches:
                raise PrepareError(
                    f"{given}: matched only prepared token directories, which are never inputs"
                )
            matches = [m for m in matches if _dataset_ancestor(m, saved) is None]
            if not matches:
                raise PrepareError(
                    f"{given}: matched only files inside a saved Hugging Face dataset: name "
                    "its directory"
                )
        elif os.path.lexists(given):
            inside = _prepared_ancestor(given, prepared)
            if inside is not None:
                where = "is" if inside == os.path.abspath(given) else "lies in"
                raise PrepareError(
                    f"{given}: {where} {inside}, prepared tokens ({token_format.META_NAME} or a "
                    "DIR.partial-PID): train on it with data.path, or prepare its source text"
                )
            inside = None if saved(os.path.abspath(given)) else _dataset_ancestor(given, saved)
            if inside is not None:
                raise PrepareError(
                    f"{given}: lies in {inside}, a saved Hugging Face dataset: name its directory"
                )
            matches = [given]
        else:
            raise PrepareError(f"{given}: no such file or directory")
        for match in matches:
            if not os.path.isdir(match):
                found = [Path(match)]
            elif saved(os.path.abspath(match)):
                found = [split_of(Path(match), saved(os.path.abspath(match)))]
            else:
                found = _walk(Path(match), prepared, saved, split_of)
            if not found:
                raise PrepareError(f"{match}: a directory with no files")
            for path in found:
                files.setdefault(os.path.realpath(path), path)
    if split is not None and not dicts:
        raise PrepareError(
            f"--split {split}: applies to a DatasetDict saved to disk (its dataset_dict.json), "
            "and no input is one"
        )
    return list(files.values())


def _saved_dataset(directory: str) -> str | None:
    """What `directory` holds: "dict", a DatasetDict saved to disk; "dataset", one Dataset
    (both as `datasets`' save_to_disk writes them); None, neither."""
    if os.path.isfile(os.path.join(directory, DATASET_DICT_NAME)):
        return "dict"
    if all(os.path.isfile(os.path.join(directory, n)) for n in DATASET_NAMES):
        return "dataset"
    return None


def _dataset_split(path: Path, kind: str | None, split: str) -> Path:
    """A saved dataset's directory; a DatasetDict's is that of its `split`."""
    if kind != "dict":
        return path
    where = path / DATASET_DICT_NAME
    try:
        splits = json.loads(where.read_text())["splits"]
    except (OSError, ValueError, TypeError, KeyError):
        splits = None
    if not (isinstance(splits, list) and all(isinstance(s, str) for s in splits)):
        raise PrepareError(f'{where}: not a dataset_dict.json (a "splits" list of names)')
    if split not in splits:
        raise PrepareError(
            f"{path}: a DatasetDict without the split {split!r} (its splits: "
            f"{', '.join(splits) or 'none'}): choose one with --split"
        )
    if _saved_dataset(str(path / split)) != "dataset":
        raise PrepareError(
            f"{path / split}: the split {split!r} has no {' and '.join(DATASET_NAMES)}"
        )
    return path / split


def _dataset_ancestor(path: str, saved: Callable[[str], str | None]) -> str | None:
    """The saved dataset (absolute) that `path` lies in, below its own directory; None if
    none: a DatasetDict's split directory lies in the DatasetDict."""
    candidate = os.path.dirname(os.path.abspath(path))
    while not saved(candidate):
        parent = os.path.dirname(candidate)
        if parent == candidate:
            return None
        candidate = parent
    return candidate


def _prepared_dir(directory: str) -> bool:
    """Whether `directory` holds prepared tokens (its meta.json is jaxkit's) or is a
    prepare's half-built `DIR.partial-PID`: shards, never text to prepare."""
    name = os.path.basename(directory.rstrip(os.sep))
    stem, _, pid = name.rpartition(".partial-")
    if stem and pid.isdigit():
        return True
    try:
        with open(os.path.join(directory, token_format.META_NAME), "rb") as f:
            meta = json.load(f)
    except (OSError, ValueError):  # none, or a meta.json of some other kind (a document)
        return False
    return isinstance(meta, dict) and meta.get("format") == token_format.FORMAT


def _prepared_ancestor(path: str, prepared: Callable[[str], bool]) -> str | None:
    """The prepared directory (absolute) that `path` is or lies in; None if neither."""
    candidate = os.path.abspath(path)
    if not os.path.isdir(candidate):
        candidate = os.path.dirname(candidate)
    while not prepared(candidate):
        parent = os.path.dirname(candidate)
        if parent == candidate:
            return None
        candidate = parent
    return candidate


def _in_cache(path: str) -> bool:
    """A file inside a bytecode cache (`**` reaches into them)."""
    return "__pycache__" in Path(path).parts[:-1]


def _skipped_dir(path: str) -> bool:
    """A hidden directory or a bytecode cache: never text to train on."""
    name = os.path.basename(path.rstrip("/"))
    return os.path.isdir(path) and (name.startswith(".") or name == "__pycache__")


def _walk(
    root: Path,
    prepared: Callable[[str], bool],
    saved: Callable[[str], str | None],
    split_of: Callable[[Path, str | None], Path],
) -> list[Path]:
    """Every file under `root`, through symlinked directories too (a corpus is often linked
    in, and a `**` glob follows them), each real directory once (a link back up would loop).
    A saved dataset below `root` is one input, its directory (see `expand_inputs`)."""
    found, seen = [], {os.path.realpath(root)}
    for parent, dirs, names in os.walk(root, followlinks=True):
        kept = []
        for d in dirs:
            path = os.path.join(parent, d)
            real = os.path.realpath(path)
            if _skipped_dir(path) or prepared(os.path.abspath(path)) or real in seen:
                continue
            seen.add(real)
            kind = saved(os.path.abspath(path))
            if kind:
                found.append(split_of(Path(path), kind))
            else:
                kept.append(d)
        dirs[:] = kept
        found += [Path(parent, n) for n in names if not n.startswith(".")]
    return sorted(found)


def _kind(path: Path) -> str:
    """How `path` is read: "dataset" (a saved dataset's directory), or by its name less a
    final ".gz": ".jsonl", ".parquet" or "text"."""
    if path.is_dir():
        return "dataset"
    suffix = Path(path.name.lower().removesuffix(".gz")).suffix
    return suffix if suffix in (".jsonl", ".parquet") else "text"


def _gzipped(path: Path) -> bool:
    return path.name.lower().endswith(".gz")


def _open(path: Path) -> io.BufferedIOBase:
    """`path`'s bytes, decompressed as they are read when it is a `.gz`."""
    return gzip.open(path, "rb") if _gzipped(path) else open(path, "rb")


@contextlib.contextmanager
def _reading(path: Path) -> Iterator[None]:
    """A failure to read `path` as one line naming it."""
    try:
        if _gzipped(path) and path.stat().st_size == 0:
            # gzip reads an empty file as no data; a download that failed leaves one.
            raise EOFError("an empty file")
        yield
    except (gzip.BadGzipFile, EOFError, zlib.error) as err:  # EOFError: cut short
        if not _gzipped(path):
            raise
        raise PrepareError(
            f"{path}: not a whole gzip file ({err}): give it complete, or uncompressed"
        ) from None
    except OSError as err:
        raise PrepareError(f"{path}: cannot read: {err.strerror or err}") from None


def count_documents(path: Path, fields: Fields = DEFAULT_FIELDS) -> int:
    """How many documents `path` holds, read without tokenizing (a Parquet file's footer, an
    Arrow file's batch headers); a Parquet or Arrow table's columns are checked here, before
    any work."""
    if _kind(path) == "dataset":
        with _reading(path):
            files = _dataset_files(path)
            num_rows = sum(_arrow_rows(f) for f in files)
            if num_rows == 0:  # its columns may have no type at all (null)
                raise PrepareError(f"{path}: a saved dataset of 0 rows")
            for file in files:
                _table_columns(_arrow_reader(file).schema, str(file), fields)
        return num_rows
    if _kind(path) == ".parquet" and _gzipped(path):
        # pyarrow reads a Parquet file by seeking to its footer, which a gzip stream lacks.
        raise PrepareError(
            f"{path}: a gzip-compressed Parquet file: gunzip it (Parquet compresses its own "
            "columns)"
        )
    with _reading(path):
        if _kind(path) == ".parquet":
            parquet = _parquet_file(path)
            _table_columns(parquet.schema_arrow, str(path), fields)
            return parquet.metadata.num_rows
        with _open(path) as f:  # one document too: a broken link is refused before writing
            return sum(1 for line in f if line.strip()) if _kind(path) == ".jsonl" else 1


def read_documents(
    paths: Iterable[Path], as_text: bool, fields: Fields = DEFAULT_FIELDS
) -> Iterator[Document]:
    """Every document of `paths`, in order. `as_text`: text files decoded as UTF-8 (for a
    tokenizer.json); otherwise kept as bytes (for the bytes tokenizer), once checked to be
    UTF-8. `fields`: where a JSON line's, a Parquet or Arrow row's document is."""
    for path in paths:
        with _reading(path):
            if _kind(path) == ".jsonl":
                yield from _jsonl_documents(path, fields)
            elif _kind(path) == ".parquet":
                parquet = _parquet_file(path)
                columns = _table_columns(parquet.schema_arrow, str(path), fields)
                batches = parquet.iter_batches(columns=list(columns))
                yield from _table_documents(batches, columns, str(path))
            elif _kind(path) == "dataset":
                for file in _dataset_files(path):
                    reader = _arrow_reader(file)
                    columns = _table_columns(reader.schema, str(file), fields)
                    batches = (b.select(list(columns)) for b in _arrow_batches(reader))
                    yield from _table_documents(batches, columns, str(file))
            else:
                yield _text_document(path, as_text)


def _text_document(path: Path, as_text: bool) -> Document:
    with _open(path) as f:
        raw = f.read()
    text = _utf8(raw, str(path), _gzipped(path))
    return Document(text if as_text else raw)


def _utf8(raw: bytes, where: str, gzipped: bool, offset: int = 0) -> str:
    """`raw` decoded; bytes that are not UTF-8 are refused, naming the first bad one
    (`offset`: where `raw` starts in its file)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise PrepareError(
            f"{where}: not UTF-8 text (byte {raw[err.start]:#04x} at "
            f"{'decompressed' if gzipped else 'file'} offset {offset + err.start}): convert "
            "it to UTF-8 first (iconv -f LATIN1 -t UTF-8, say)"
        ) from None


def _jsonl_documents(path: Path, fields: Fields) -> Iterator[Document]:
    offset = 0  # of the line in the (decompressed) file
    with _open(path) as f:
        for number, line in enumerate(f, 1):
            start, offset = offset, offset + len(line)
            if not line.strip():
                continue
            where = f"{path}:{number}"
            # json.loads, given bytes, took a byte order mark at the start: it still does.
            if start == 0 and line.startswith(codecs.BOM_UTF8):
                line, start = line[len(codecs.BOM_UTF8) :], len(codecs.BOM_UTF8)
            text = _utf8(line, where, _gzipped(path), start)
            try:
                record = json.loads(text)
            except ValueError as err:
                raise PrepareError(f"{where}: not JSON: {err}") from None
            yield _record_document(record, where, fields)


def _record_document(record: object, where: str, fields: Fields) -> Document:
    """A JSON line's document: its text field, or its prompt and completion fields."""
    if not isinstance(record, dict):
        raise PrepareError(
            f"{where}: the line is {_json_type(record)}, not an object with {fields.described()}"
        )
    pair = fields.prompt is not None and (fields.prompt in record or fields.completion in record)
    if pair:
        if fields.text is not None and fields.text in record:
            raise PrepareError(
                f'{where}: both "{fields.text}" and "{fields.prompt}"/"{fields.completion}": '
                f"which one is the document? {fields.one_kind()}"
            )
        prompt, completion = record.get(fields.prompt), record.get(fields.completion)
        for name, other in ((fields.prompt, fields.completion), (fields.completion, fields.prompt)):
            if name not in record:
                raise PrepareError(f'{where}: no "{name}" field beside "{other}"')
            if not isinstance(record[name], str):
                raise PrepareError(f'{where}: "{name}" is {_json_type(record[name])}, not a string')
        assert isinstance(prompt, str) and isinstance(completion, str)
        return Document(_encodable(completion, where), _encodable(prompt, where))
    text = None if fields.text is None else record.get(fields.text)
    if not isinstance(text, str):
        raise PrepareError(
            f"{where}: no {fields.wanted()}"
            if fields.text not in record
            else f'{where}: "{fields.text}" is {_json_type(text)}, not a string'
        )
    return Document(_encodable(text, where))


def _json_type(value: object) -> str:
    """What a JSON value is, in JSON's words: `null`, `a number (5)`, `an array`."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"a boolean ({str(value).lower()})"
    if isinstance(value, (int, float)):
        return f"a number ({value})"
    if isinstance(value, str):
        return "a string"
    return "an array" if isinstance(value, list) else "an object"


def _encodable(text: str, where: str) -> str:
    """`text`, if it is valid Unicode: JSON can carry a lone surrogate (\\ud800), which no
    UTF-8 byte or tokenizer takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise PrepareError(
            f"{where}: not valid Unicode text ({err.reason} at {err.start})"
        ) from None
    return text


def _parquet_file(path: Path) -> Any:
    """The open Parquet file."""
    pyarrow = _pyarrow(path, "Parquet")
    try:
        return pyarrow.parquet.ParquetFile(path)
    except pyarrow.ArrowException as err:
        raise PrepareError(f"{path}: not a Parquet file: {err}") from None


def _pyarrow(path: Path, what: str) -> Any:
    try:
        import pyarrow
        import pyarrow.ipc
        import pyarrow.parquet
    except ImportError:
        raise PrepareError(f"{path}: reading {what} needs pyarrow: pip install pyarrow") from None
    return pyarrow


def _dataset_files(path: Path) -> list[Path]:
    """A saved dataset's .arrow files, in order, as its state.json lists them."""
    where = path / DATASET_NAMES[0]
    try:
        state = json.loads(where.read_text())
        names = [f["filename"] for f in state["_data_files"]]
    except (ValueError, TypeError, KeyError):
        names = None
    if not (names is not None and all(isinstance(n, str) for n in names)):
        raise PrepareError(
            f'{where}: not a saved dataset\'s state.json (a "_data_files" list of '
            '{"filename": NAME})'
        )
    files = [path / n for n in names]
    for file in files:
        if not file.is_file():
            raise PrepareError(f"{where} lists {file.name}, which is not in {path}")
    return files


def _arrow_reader(path: Path) -> Any:
    """An Arrow IPC stream (what `datasets` writes) or file, memory-mapped."""
    pyarrow = _pyarrow(path, "a saved dataset")
    try:
        return pyarrow.ipc.open_stream(pyarrow.memory_map(str(path)))
    except pyarrow.ArrowInvalid:
        pass
    try:
        return pyarrow.ipc.open_file(pyarrow.memory_map(str(path)))
    except pyarrow.ArrowInvalid as err:
        raise PrepareError(f"{path}: not an Arrow stream or file: {err}") from None


def _arrow_batches(reader: Any) -> Iterator[Any]:
    if hasattr(reader, "get_batch"):  # a file: its batches by index
        return (reader.get_batch(i) for i in range(reader.num_record_batches))
    return iter(reader)


def _arrow_rows(path: Path) -> int:
    """An Arrow file's rows, memory-mapped: no column is copied."""
    reader = _arrow_reader(path)
    pyarrow = _pyarrow(path, "a saved dataset")
    try:
        return sum(batch.num_rows for batch in _arrow_batches(reader))
    except pyarrow.ArrowInvalid as err:  # cut short
        raise PrepareError(f"{path}: not a whole Arrow stream or file: {err}") from None


def _table_columns(schema: Any, where: str, fields: Fields) -> tuple[str, ...]:
    """The columns a table's documents are read from, (text,) or (prompt, completion),
    refused unless they are there, of strings, and one kind only."""
    import pyarrow

    names = schema.names
    pair = [n for n in (fields.prompt, fields.completion) if n is not None and n in names]
    if fields.text is not None and fields.text in names:
        if pair:
            raise PrepareError(
                f'{where}: both a "{fields.text}" column and "{fields.prompt}"/'
                f'"{fields.completion}" columns: which one is the document? {fields.one_kind()}'
            )
        columns: tuple[str, ...] = (fields.text,)
    elif fields.prompt is not None and fields.completion is not None and len(pair) == 2:
        columns = (fields.prompt, fields.completion)
    else:
        found = f"(its columns: {', '.join(names)})"
        if pair:
            other = fields.completion if pair == [fields.prompt] else fields.prompt
            raise PrepareError(f'{where}: no "{other}" column beside "{pair[0]}" {found}')
        if fields.text is None:
            missing = f'"{fields.prompt}" and "{fields.completion}" columns {found}'
        else:
            missing = f'"{fields.text}" column {found}'
            if fields.prompt is not None:
                missing += f', nor "{fields.prompt}" and "{fields.completion}"'
        raise PrepareError(f"{where}: no {missing}")
    for name in columns:
        kind = schema.field(name).type
        value = kind.value_type if pyarrow.types.is_dictionary(kind) else kind
        if not (
            pyarrow.types.is_string(value)
            or pyarrow.types.is_large_string(value)
            or pyarrow.types.is_string_view(value)
        ):
            raise PrepareError(f'{where}: column "{name}" holds {kind}, not strings')
    return columns


def _table_documents(
    batches: Iterable[Any], columns: tuple[str, ...], where: str
) -> Iterator[Document]:
    """A table's rows as documents: a text, or a prompt and a completion (`columns`)."""
    row = 0
    for batch in batches:
        values = [batch.column(i).to_pylist() for i in range(len(columns))]
        for cells in zip(*values, strict=True):
            for name, cell in zip(columns, cells, strict=True):
                if cell is None:
                    raise PrepareError(f'{where}: row {row}: "{name}" is null, not a string')
            row += 1
            yield Document(cells[-1], cells[0] if len(cells) == 2 else None)


def held_out(num_documents: int, eval_fraction: float, seed: int) -> np.ndarray:
    """Which documents go to eval (a bool for each, in input order): the nearest whole
    number to num_documents × eval_fraction of them, drawn with the seeded generator."""
    num_eval = int(num_documents * eval_fraction + 0.5)
    if not 1 <= num_eval < num_documents:
        raise PrepareError(
            f"--eval-fraction {eval_fraction} of {num_documents} document"
            f"{'s' if num_documents != 1 else ''} holds out {num_eval}: train and eval need "
            "at least one document each (give more documents or another --eval-fraction)"
        )
    rng = np.random.default_rng(seed)
    is_eval = np.zeros(num_documents, bool)
    is_eval[rng.choice(num_documents, size=num_eval, replace=False, shuffle=False)] = True
    return is_eval


class _SplitWriter:
    """One split's shards. A document goes whole into the current shard, which is closed
    first when the document would take it past `shard_tokens` (a longer document than that
    fills a shard of its own)."""

    def __init__(self, directory: Path, split: str, shard_tokens: int) -> None:
        self.directory, self.split, self.shard_tokens = directory, split, shard_tokens
        self.shards: list[str] = []
        self.num_tokens = self.num_documents = 0
        self._sizes: list[int] = []  # tokens in each closed shard
        self._with_mask: set[str] = set()  # closed shards that have their .mask
        self._bin: IO[bytes] | None = None
        self._mask: IO[bytes] | None = None
        self._starts: list[int] = []
        self._size = 0

    def add(self, tokens: np.ndarray, prompt_length: int, masked: bool) -> None:
        """`masked`: some document so far had a prompt, so this shard gets a .mask."""
        if self._bin is not None and self._size + len(tokens) > self.shard_tokens:
            self._close_shard()
        if self._bin is None:
            self.shards.append(token_format.shard_stem(self.split, len(self.shards)))
            self._bin = self._open(token_format.TOKEN_SUFFIX)
        if masked and self._mask is None:  # the first prompt: the documents before had none
            self._mask = self._open(token_format.MASK_SUFFIX)
            _write_ones(self._mask, self._size)
        self._starts.append(self._size)
        self._bin.write(tokens.tobytes())
        if self._mask is not None:
            mask = np.ones(len(tokens), np.uint8)
            mask[:prompt_length] = 0
            self._mask.write(mask.tobytes())
        self._size += len(tokens)
        self.num_tokens += len(tokens)
        self.num_documents += 1

    def finish(self, masked: bool) -> None:
        """Closes the last shard; with `masked`, shards closed before the first prompt get
        their all-ones .mask."""
        if self._bin is not None:
            self._close_shard()
        for stem, size in zip(self.shards, self._sizes, strict=True):
            if masked and stem not in self._with_mask:
                with open(self.directory / (stem + token_format.MASK_SUFFIX), "wb") as f:
                    _write_ones(f, size)

    def close(self) -> None:
        """Closes what is open, after a failure (the directory goes anyway)."""
        for f in (self._bin, self._mask):
            if f is not None:
                f.close()

    def _open(self, suffix: str) -> IO[bytes]:
        return open(self.directory / (self.shards[-1] + suffix), "wb", WRITE_BUFFER_BYTES)

    def _close_shard(self) -> None:
        assert self._bin is not None
        stem = self.shards[-1]
        self._bin.close()
        if self._mask is not None:
            self._mask.close()
            self._with_mask.add(stem)
        with open(self.directory / (stem + token_format.DOCS_SUFFIX), "wb") as f:
            np.save(f, np.array(self._starts, np.int64))
        self._sizes.append(self._size)
        self._bin = self._mask = None
        self._starts, self._size = [], 0


def _write_ones(f: IO[bytes], count: int) -> None:
    block = np.ones(min(count, WRITE_BUFFER_BYTES), np.uint8).tobytes()
    for start in range(0, count, len(block) or 1):
        f.write(block[: count - start])


def _chunks(documents: Iterable[Document]) -> Iterator[list[Document]]:
    chunk: list[Document] = []
    chars = 0
    for d in documents:
        chunk.append(d)
        chars += len(d.text) + len(d.prompt or "")
        if len(chunk) >= CHUNK_DOCUMENTS or chars >= CHUNK_CHARS:
            yield chunk
            chunk, chars = [], 0
    if chunk:
        yield chunk


_WORKER_ENCODER: Encoder | None = None  # each worker process's own, set as it starts


def _start_worker(encoder: Encoder) -> None:
    global _WORKER_ENCODER
    _WORKER_ENCODER = encoder
    # Ctrl-C reaches the whole process group: the parent stops the pool and cleans up,
    # the workers should not each print a traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _encode_in_worker(chunk: list[Document]) -> Encoded:
    assert _WORKER_ENCODER is not None
    return _WORKER_ENCODER.encode(chunk)


def encode_chunks(
    encoder: Encoder, chunks: Iterable[list[Document]], workers: int
) -> Generator[Encoded, None, None]:
    """Each chunk encoded, in order, by `workers` processes (1: in this one). At most two
    chunks per worker are in flight, so the inputs are read as fast as they are encoded."""
    if workers == 1:
        yield from map(encoder.encode, chunks)
        return
    # spawn, not fork: a forked copy of a process running JAX's threads can deadlock.
    context = multiprocessing.get_context("spawn")
    pool = ProcessPoolExecutor(
        workers, mp_context=context, initializer=_start_worker, initargs=(encoder,)
    )
    pending: collections.deque[Future[Encoded]] = collections.deque()
    try:
        for chunk in chunks:
            pending.append(pool.submit(_encode_in_worker, chunk))
            if len(pending) >= 2 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def prepare(
    inputs: Sequence[str],
    tokenizer: str,
    out: str | os.PathLike[str],
    *,
    eval_fraction: float = DEFAULT_EVAL_FRACTION,
    seed: int = 0,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    eod_token: str | None = None,
    bos: bool = False,
    workers: int | None = None,
    overwrite: bool = False,
    progress: bool = True,
    fields: Fields = DEFAULT_FIELDS,
    split: str | None = None,
) -> dict[str, Any]:
    """Tokenizes `inputs` into the directory `out` (see token_format) and returns its meta.

    Args:
      inputs: files, directories and globs (see `expand_inputs`); `.jsonl` files hold a
        document per line, `.parquet` files and saved Hugging Face datasets one per row,
        each a text or a prompt and a completion (`fields`); any other file is one
        document; a `.gz` is read decompressed. Text must be UTF-8.
      tokenizer: "bytes" (a token per byte) or a Hugging Face tokenizer.json path.
      eval_fraction: of the documents, held out whole in the eval split, drawn with `seed`.
      shard_tokens: the most tokens a shard holds, unless one document alone has more.
      eod_token: the tokenizer.json's end-of-document token (default: the first of
        EOD_CANDIDATES in its vocabulary).
      bos: put the tokenizer.json's beginning-of-sequence token (the one its post-processor
        adds) before each document, as Llama checkpoints expect; recorded as meta["bos_id"].
      workers: tokenizing processes (default: one per CPU).
      overwrite: replace a prepared directory at `out`, once the new one is complete.
      fields: the JSON fields, or the Parquet and Arrow columns, documents are read from.
      split: a saved DatasetDict's split to read (default "train").
    """
    if not 0 < eval_fraction < 1:
        raise PrepareError(f"--eval-fraction {eval_fraction}: must be between 0 and 1")
    if shard_tokens < 1 or (workers is not None and workers < 1):
        raise PrepareError("--shard-tokens and --workers must be at least 1")
    out = Path(os.path.abspath(out))
    _check_out(out, overwrite)
    encoder = Encoder.load(tokenizer, eod_token, bos)
    # The output (and its half-built siblings) is never an input: a DIR inside an input
    # directory, prepared again with --overwrite, would otherwise read its own shards.
    paths = [p for p in expand_inputs(inputs, split) if not _inside_output(p, out)]
    if not paths:
        raise PrepareError("every input lies inside --out: nothing to prepare")
    num_documents = sum(count_documents(p, fields) for p in paths)
    if num_documents == 0:
        raise PrepareError(f"no documents in {len(paths)} input file(s)")
    as_text = encoder.spec != "bytes"
    try:
        is_eval = held_out(num_documents, eval_fraction, seed)
    except PrepareError:
        # Counting reads no row: a bad one (null, a number for a text) comes first, as it
        # would with more documents. Few enough to split badly are quick to read.
        for _ in read_documents(paths, as_text, fields):
            pass
        raise
    documents = read_documents(paths, as_text, fields)
    workers = workers or os.cpu_count() or 1
    with (
        _building(out) as directory,
        contextlib.closing(encode_chunks(encoder, _chunks(documents), workers)) as chunks,
        _progress_bar(num_documents, progress) as bar,
    ):
        writers, masked = _write_splits(directory, chunks, is_eval, shard_tokens, bar)
        meta = {
            "format": token_format.FORMAT,
            "version": token_format.VERSION,
            "dtype": encoder.dtype,
            "vocab_size": encoder.vocab_size,
            "eod_id": encoder.eod_id,
            # Only with --bos: data prepared before the key, or without it, has no entry,
            # so its fingerprint (and the checkpoints that recorded it) stays as it was.
            **({} if encoder.bos_id is None else {"bos_id": encoder.bos_id}),
            "tokenizer": tokenizer,
            # As typed, "tokenizer" may be relative to where prepare ran; export copies the
            # file from anywhere by this one, which the fingerprint leaves out (so data
            # prepared before it, or from another directory, keeps its fingerprint).
            **({} if tokenizer == "bytes" else {"tokenizer_file": os.path.abspath(tokenizer)}),
            # Which tokenizer it is, wherever its file lies: a pretrained model's run holds it
            # against its own tokenizer.json's. Also left out of the fingerprint.
            **({} if encoder.sha256 is None else {"tokenizer_sha256": encoder.sha256}),
            "masked": masked,
            "eval_fraction": eval_fraction,
            "seed": seed,
            "num_tokens": {s: w.num_tokens for s, w in writers.items()},
            "num_documents": {s: w.num_documents for s, w in writers.items()},
            "shards": {s: w.shards for s, w in writers.items()},
        }
        (directory / token_format.META_NAME).write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def _write_splits(
    directory: Path, chunks: Iterable[Encoded], is_eval: np.ndarray, shard_tokens: int, bar: Any
) -> tuple[dict[str, _SplitWriter], bool]:
    """Each encoded document into its split's shards; whether any had a prompt."""
    writers = {s: _SplitWriter(directory, s, shard_tokens) for s in token_format.SPLITS}
    masked, index = False, 0
    try:
        for encoded in chunks:
            starts = np.cumsum(encoded.lengths) - encoded.lengths
            for start, length, prompt_length, has_prompt in zip(
                starts, encoded.lengths, encoded.prompt_lengths, encoded.has_prompt, strict=True
            ):
                if index == len(is_eval):
                    raise PrepareError("the inputs grew while they were read")
                masked |= bool(has_prompt)
                writer = writers["eval" if is_eval[index] else "train"]
                writer.add(encoded.tokens[start : start + length], int(prompt_length), masked)
                index += 1
            bar.update(len(encoded.lengths))
        if index != len(is_eval):
            raise PrepareError("the inputs shrank while they were read")
        for writer in writers.values():
            writer.finish(masked)
    finally:
        for writer in writers.values():
            writer.close()
    return writers, masked


def _progress_bar(total: int, enabled: bool) -> Any:
    import tqdm

    return tqdm.tqdm(
        total=total, unit="doc", desc="tokenizing", disable=not enabled, file=sys.stderr
    )


def _check_out(out: Path, overwrite: bool) -> None:
    """Refuses an `out` that is a file, or a non-empty directory without --overwrite.

    --overwrite replaces only a prepared directory (one with meta.json): `--out .` must
    not delete a directory of other files.
    """
    if out.is_symlink():
        raise PrepareError(
            f"--out {out} is a symbolic link: give the directory it points to, which is "
            "what would be replaced"
        )
    if out.exists() and not out.is_dir():
        raise PrepareError(f"--out {out}: a file, not a directory")
    if not out.is_dir() or not any(out.iterdir()):
        return
    if not overwrite:
        raise PrepareError(f"--out {out} is not empty: give --overwrite to replace it")
    if not (out / token_format.META_NAME).is_file():
        raise PrepareError(
            f"--out {out} holds files but no {token_format.META_NAME}: --overwrite replaces "
            "only a prepared directory"
        )


@contextlib.contextmanager
def _building(out: Path) -> Iterator[Path]:
    """A new directory beside `out`, renamed to `out` when the block ends without error
    (replacing what was there) and deleted, with the parents it created, on any error or
    interrupt."""
    created = [p for p in out.parents if not p.exists()]
    partial = out.with_name(f"{out.name}.partial-{os.getpid()}")
    try:
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise PrepareError(f"--out {out}: cannot create {out.parent}: {err}") from None
        shutil.rmtree(partial, ignore_errors=True)  # a run with this pid that was killed
        _remove_stale_partials(out)
        partial.mkdir()
        yield partial
        _replace(partial, out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        for parent in created:  # the deepest first
            with contextlib.suppress(OSError):
                parent.rmdir()
        raise


def _inside_output(path: Path, out: Path) -> bool:
    """Whether `path` lies in `out` or in one of its half-built or set-aside siblings."""
    real, target = os.path.realpath(path), os.path.realpath(out)
    return real.startswith((target + os.sep, target + ".partial-", target + ".replaced-"))


def _remove_stale_partials(out: Path) -> None:
    """Half-built directories of prepares that were killed (SIGKILL leaves no chance to
    clean up): `DIR.partial-PID` whose process is gone."""
    for stale in out.parent.glob(f"{glob.escape(out.name)}.partial-*"):
        pid = stale.name.rsplit("-", 1)[-1]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(stale, ignore_errors=True)
        except PermissionError:  # another user's live process
            continue


def _replace(new: Path, out: Path) -> None:
    """Renames `new` to `out`; an `out` already there is moved aside first and deleted."""
    if not out.exists():
        os.replace(new, out)
        return
    old = out.with_name(f"{out.name}.replaced-{os.getpid()}")
    os.replace(out, old)
    try:
        os.replace(new, out)
    except BaseException:
        os.replace(old, out)
        raise
    shutil.rmtree(old)


def summary(meta: dict[str, Any], out: str | os.PathLike[str]) -> str:
    """What was written: documents, tokens and shards of each split, and where."""
    lines = [
        f"{split}: {_count(meta['num_documents'][split], 'document')}, "
        f"{_count(meta['num_tokens'][split], 'token')}, "
        f"{_count(len(meta['shards'][split]), 'shard')}"
        for split in token_format.SPLITS
    ]
    masked = ", with masks" if meta["masked"] else ""
    bos = f", beginning of document {meta['bos_id']}" if "bos_id" in meta else ""
    lines.append(
        f"prepared: {os.path.abspath(out)} ({meta['dtype']} tokens, vocabulary "
        f"{meta['vocab_size']:,}, end of document {meta['eod_id']}{bos}{masked})"
    )
    return "\n".join(lines)


def _count(n: int, noun: str) -> str:
    return f"{n:,} {noun}{'' if n == 1 else 's'}"

"""Which tokenizer a run's token ids belong to: held against a pretrained model's, and
recorded for the run's export (and anything else that turns its ids back into text).

A tokenizer is known by `tokenizer_sha256`, the SHA-256 of its canonical JSON (the
`tokenizers` library's `Tokenizer.to_str()` of the file as loaded): the same tokenizer
saved again, pretty-printed or not, keeps it. `jaxkit data prepare` records it in
meta.json (outside the data's fingerprint, so data prepared before it, and the checkpoints
that recorded that data, keep theirs).

A model started from `model.init_from=hf:DIR` reads ids as DIR's tokenizer made them. Where
DIR holds a tokenizer.json, the data must be token files prepared with it: bytes
(`data.source=text`, token files prepared with `--tokenizer bytes`), synthetic ids and
token files of another tokenizer are refused, and token files that say nothing of their
tokenizer are read with one warning. DIR without any tokenizer file (a byte-level model
jaxkit exported itself) trains on what it is given.

A run records its data's tokenizer in every checkpoint, as `meta["data"]["tokenizer"]`
(`record`): the tokenizer as meta.json names it, its absolute path, and its
`tokenizer_sha256`, so that an export from any directory finds the file and knows it is
the same one.
"""

from __future__ import annotations

import functools
import hashlib
import os
import pathlib
from typing import Any

TOKENIZER_JSON = "tokenizer.json"
# A Hugging Face directory's other tokenizer files: SentencePiece's model, GPT-2's
# vocabulary and merges, and the settings transformers keeps beside any of them.
OTHER_TOKENIZER_FILES = ("tokenizer.model", "vocab.json", "merges.txt", "tokenizer_config.json")
BYTES = "bytes"


class TokenizerError(ValueError):
    """Data that the model being trained cannot read as its tokenizer made it."""


def sha256_of(tokenizer: Any) -> str:
    """`tokenizer_sha256` of a loaded `tokenizers.Tokenizer`: of its canonical JSON."""
    return hashlib.sha256(tokenizer.to_str().encode()).hexdigest()


def file_sha256(path: str | os.PathLike[str]) -> str:
    """`tokenizer_sha256` of a tokenizer.json file; TokenizerError where it does not load."""
    path = os.path.abspath(path)
    stat = os.stat(path)
    return _file_sha256(path, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=8)
def _file_sha256(path: str, mtime_ns: int, size: int) -> str:
    """Cached by the file's time and size: an experiment's runs each check the same one."""
    del mtime_ns, size
    from tokenizers import Tokenizer

    try:
        return sha256_of(Tokenizer.from_file(path))
    except Exception as err:  # the library raises a bare Exception for a file it cannot read
        raise TokenizerError(f"{path}: not a tokenizer.json that loads: {err}") from None


def _prepare_hint(tokenizer_json: pathlib.Path) -> str:
    return f"jaxkit data prepare INPUT --tokenizer {tokenizer_json} --out OUT"


def model_tokenizer(directory: pathlib.Path) -> pathlib.Path | None:
    """DIR's tokenizer.json, or None where DIR holds no tokenizer file at all. DIR with
    tokenizer files but no tokenizer.json is refused: prepare reads only a tokenizer.json."""
    path = directory / TOKENIZER_JSON
    if path.is_file():
        return path
    others = [name for name in OTHER_TOKENIZER_FILES if (directory / name).is_file()]
    if not others:
        return None
    raise TokenizerError(
        f"model.init_from=hf:{directory} has a tokenizer ({', '.join(others)}) but no "
        f"{TOKENIZER_JSON}, which `jaxkit data prepare` needs to prepare data the model can "
        "read: save one beside it (transformers' AutoTokenizer.from_pretrained(DIR)"
        f".save_pretrained(DIR) writes it), then {_prepare_hint(path)}"
    )


def check_data(directory: pathlib.Path, source: str, label: str, facts: dict | None) -> str | None:
    """Refuses data that the model in `directory` (model.init_from's) would read as other
    tokens than it was made of; returns a warning line where the kit cannot tell.

    `source` is data.source, `label` the key that names the token files as the user gave
    it (`data.path=DIR`, or a mixture's `data.mixture.NAME.path=DIR`), and `facts` what the
    token files say of themselves (meta.json for a prepared directory; None for other
    sources)."""
    if not directory.is_dir():
        return None  # a resume, which reads the checkpoint (a fresh start refused it already)
    tokenizer_json = model_tokenizer(directory)
    if tokenizer_json is None:
        return None  # no tokenizer: a byte-level model trains on what it is given
    model = f"model.init_from=hf:{directory}"
    prepare = f"prepare the data with its tokenizer: {_prepare_hint(tokenizer_json)}"
    if source != "tokens":
        what = "bytes (ids 0-255)" if source == "text" else f"{source} ids"
        raise TokenizerError(
            f"data.source={source} gives {model} {what}, which its {TOKENIZER_JSON} reads as "
            f"other tokens; {prepare}, and train with data.source=tokens data.path=OUT"
        )
    assert facts is not None
    if "format" not in facts:  # foreign token files: nothing says how they were made
        return (
            f"warning: {label} holds token files that record no tokenizer: the kit "
            f"cannot check that they were made with {tokenizer_json}"
        )
    made_with = facts.get("tokenizer")
    if made_with == BYTES:
        raise TokenizerError(
            f"{label} was prepared with --tokenizer bytes, whose ids {model} reads as "
            f"other tokens; {prepare}"
        )
    recorded = facts.get("tokenizer_sha256")
    if recorded is None:
        return (
            f"warning: {label} was prepared with {made_with} by a jaxkit that did not "
            f"record its tokenizer_sha256: the kit cannot check that it is {tokenizer_json}"
        )
    expected = file_sha256(tokenizer_json)
    if recorded != expected:
        raise TokenizerError(
            f"{label} was prepared with another tokenizer than {model}'s: its "
            f"tokenizer_sha256 {recorded[:12]}... is not {tokenizer_json}'s {expected[:12]}... "
            f"(ids of one mean other tokens to the other, at any vocabulary size); {prepare}"
        )
    return None


def record(facts: dict) -> dict[str, str | None] | None:
    """What a run records of its token data's tokenizer (None for foreign files, which say
    nothing of theirs):

        tokenizer         "bytes", or the tokenizer.json as `data prepare` was given it
        tokenizer_file    (a tokenizer.json only) its absolute path, or null if unknown
        tokenizer_sha256  (a tokenizer.json only) what meta.json recorded, or null (data
                          prepared before prepare recorded it)
    """
    made_with = facts.get("tokenizer")
    if not isinstance(made_with, str):
        return None
    if made_with == BYTES:
        return {"tokenizer": BYTES}
    found = facts.get("tokenizer_file")  # absolute, as prepare recorded it
    if not isinstance(found, str) and os.path.isfile(made_with):
        found = os.path.abspath(made_with)  # data prepared before prepare recorded the file
    return {
        "tokenizer": made_with,
        "tokenizer_file": found if isinstance(found, str) else None,
        "tokenizer_sha256": facts.get("tokenizer_sha256"),
    }

"""Prepared token directories written by hand (numpy and json only), so the readers and
the training tests do not depend on `jaxkit data prepare`, which has tests of its own."""

import json
import pathlib

import numpy as np

from jaxkit.data import token_format as fmt


def write_prepared(
    out: pathlib.Path,
    splits: dict[str, list[tuple[list[int], list[int]]]],
    *,
    vocab_size: int = fmt.BYTES_VOCAB_SIZE,
    eod_id: int = fmt.BYTES_EOD_ID,
    shard_docs: int = 1_000_000,
    masked: bool = True,
) -> dict:
    """Writes `splits` ({"train": [(prompt_ids, completion_ids), ...], "eval": [...]}) as
    prepared shards of at most `shard_docs` documents; each document is prompt +
    completion + eod, its mask 0 on the prompt and 1 on the rest. Returns the meta."""
    out.mkdir(parents=True, exist_ok=True)
    dtype = fmt.token_dtype_for(vocab_size)
    meta = {
        "format": fmt.FORMAT,
        "version": fmt.VERSION,
        "dtype": dtype,
        "vocab_size": vocab_size,
        "eod_id": eod_id,
        "tokenizer": "bytes",
        "masked": masked,
        "eval_fraction": 0.1,
        "seed": 0,
        "num_tokens": {},
        "num_documents": {},
        "shards": {},
    }
    for split, docs in splits.items():
        stems = []
        for i, first in enumerate(range(0, len(docs), shard_docs)):
            chunk = docs[first : first + shard_docs]
            tokens, mask, starts = [], [], []
            for prompt, completion in chunk:
                starts.append(len(tokens))
                tokens += [*prompt, *completion, eod_id]
                mask += [0] * len(prompt) + [1] * (len(completion) + 1)
            stem = fmt.shard_stem(split, i)
            np.asarray(tokens, dtype=np.dtype(dtype).newbyteorder("<")).tofile(
                out / (stem + fmt.TOKEN_SUFFIX)
            )
            if masked:
                np.asarray(mask, dtype=np.uint8).tofile(out / (stem + fmt.MASK_SUFFIX))
            np.save(out / (stem + fmt.DOCS_SUFFIX), np.asarray(starts, dtype=np.int64))
            stems.append(stem)
        meta["shards"][split] = stems
        meta["num_documents"][split] = len(docs)
        meta["num_tokens"][split] = sum(len(p) + len(c) + 1 for p, c in docs)
    (out / fmt.META_NAME).write_text(json.dumps(meta, indent=1))
    return meta


def prompt_completion_docs(count: int, seed: int, max_len: int = 24) -> list:
    """Byte documents of very unequal lengths: prompts of 1..max_len bytes and completions
    of 1..max_len / 2, so padded rows weigh anywhere from 2 to max_len / 2 + 1 targets."""
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(count):
        prompt = rng.integers(97, 123, size=rng.integers(1, max_len + 1)).tolist()
        # The completion repeats the prompt's start: something a model can learn.
        completion = prompt[: rng.integers(1, max_len // 2 + 1)]
        docs.append((prompt, completion))
    return docs


def padded_prompt_completion(out: pathlib.Path, shard_docs: int = 70) -> list[str]:
    """Writes 300 train and 40 eval prompt/completion documents (rows of 2 to 7 scored
    targets at seq_len 16, in several shards) to `out`; returns the overrides that train
    lm_tiny on them, one padded document per row."""
    write_prepared(
        out,
        {
            "train": prompt_completion_docs(300, seed=1, max_len=12),
            "eval": prompt_completion_docs(40, seed=2, max_len=12),
        },
        shard_docs=shard_docs,
    )
    return ["data.source=tokens", f"data.path={out}", "data.rows=documents", "model.vocab_size=257"]

"""The on-disk layout of prepared token data: what `jaxkit data prepare` writes and
`data.source=tokens` reads.

A prepared directory holds, for each split ("train", "eval"):

    {split}-00000.bin       flat little-endian token ids of meta["dtype"]; every document
                            is followed by meta["eod_id"]; a shard ends at a document end
    {split}-00000.mask      (when meta["masked"]) uint8, one per token: 1 where the token
                            is scored as a target (a completion, an end of document), 0
                            where it is not (a prompt)
    {split}-00000.docs.npy  int64 offsets of each document's first token in the shard

and `meta.json`, written last, which names the shards: a directory without it was never
finished, and training refuses it. Foreign token files (nanoGPT's `train.bin`, a `.npy`)
need no meta.json: the dtype then comes from `data.token_dtype` or the `.npy` header.
"""

from __future__ import annotations

META_NAME = "meta.json"
FORMAT = "jaxkit.tokens"
VERSION = 1
SPLITS = ("train", "eval")
TOKEN_SUFFIX = ".bin"
MASK_SUFFIX = ".mask"
DOCS_SUFFIX = ".docs.npy"
DTYPES = ("uint16", "uint32")  # the smallest that holds the vocabulary is written
BYTES_VOCAB_SIZE = 257  # the 256 byte values and the end-of-document token
BYTES_EOD_ID = 256


def shard_stem(split: str, index: int) -> str:
    """`train-00003`: the shared name of a shard's token, mask and document files."""
    return f"{split}-{index:05d}"


def token_dtype_for(vocab_size: int) -> str:
    """The smallest dtype in DTYPES that holds every id below `vocab_size`."""
    return "uint16" if vocab_size <= 2**16 else "uint32"


# meta.json's keys, as `data prepare` writes them:
#   format, version            FORMAT and VERSION
#   dtype                      one of DTYPES
#   vocab_size, eod_id         the tokenizer's; every id is < vocab_size
#   bos_id                     (only with --bos) the id put before each document
#   tokenizer                  "bytes" or the tokenizer.json path it was given
#   tokenizer_file             (a tokenizer.json only) its absolute path, for `export`
#   tokenizer_sha256           (a tokenizer.json only) SHA-256 of its canonical JSON, which
#                              model.init_from's tokenizer.json must match
#                              (jaxkit/data/tokenizer.py)
#   masked                     whether each shard has a .mask file
#   eval_fraction, seed        how documents were drawn for the held-out split
#   num_tokens, num_documents  {"train": n, "eval": n}
#   shards                     {"train": [stem, ...], "eval": [stem, ...]}

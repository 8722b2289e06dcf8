"""`jaxkit data prepare`: what it writes, read back independently of jaxkit/data/prepare.py."""

import functools
import gzip
import io
import json
import os
import subprocess
import sys

import numpy as np
import pyarrow
import pyarrow.parquet
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from jaxkit import cli
from jaxkit.data import prepare as prepare_lib
from jaxkit.data import token_format
from jaxkit.data.prepare import PrepareError, expand_inputs, prepare

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
META_KEYS = {  # token_format's list
    "format",
    "version",
    "dtype",
    "vocab_size",
    "eod_id",
    "tokenizer",
    "tokenizer_file",  # a tokenizer.json's (the bytes tokenizer has no file)
    "tokenizer_sha256",  # a tokenizer.json's
    "masked",
    "eval_fraction",
    "seed",
    "num_tokens",
    "num_documents",
    "shards",
}
CORPUS = [
    "the quick brown fox jumps over the lazy dog. " * 3,
    "a stitch in time saves nine; the early bird catches the worm. " * 2,
    "Ünïcödé — ½ ≠ 0.5, naïve café, 東京 🚀",
    "the the the then there these those three through",
]


def train_bpe(path, special_tokens):
    """A byte-level BPE (so decoding gives back the text exactly) saved as tokenizer.json."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS * 20, trainer)
    tokenizer.save(str(path))
    return str(path)


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    return train_bpe(tmp_path_factory.mktemp("bpe") / "tokenizer.json", ["<|endoftext|>"])


def read_split(out, split):
    """Each document's tokens (and mask, or None) of `split`, in shard order."""
    meta = json.loads((out / "meta.json").read_text())
    dtype = {"uint16": "<u2", "uint32": "<u4"}[meta["dtype"]]
    docs, masks = [], []
    for stem in meta["shards"][split]:
        tokens = np.fromfile(out / f"{stem}.bin", dtype)
        starts = np.load(out / f"{stem}.docs.npy")
        assert starts.dtype == np.int64 and starts[0] == 0
        mask_path = out / f"{stem}.mask"
        assert mask_path.exists() == meta["masked"]
        mask = np.fromfile(mask_path, np.uint8) if meta["masked"] else None
        assert mask is None or len(mask) == len(tokens)
        ends = [*starts[1:], len(tokens)]
        for start, end in zip(starts, ends, strict=True):
            assert tokens[end - 1] == meta["eod_id"]  # every document ends with it
            assert meta["eod_id"] not in tokens[start : end - 1]
            docs.append(tokens[start:end])
            masks.append(None if mask is None else mask[start:end])
    return docs, masks


def write_texts(directory, texts):
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, text in enumerate(texts):
        path = directory / f"doc{i:03d}.txt"
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
        paths.append(path)
    return paths


def is_subsequence(part, whole):
    it = iter(whole)
    return all(any(p == w for w in it) for p in part)


def as_bytes(tokens):
    return [bytes(t[:-1].astype(np.uint8)) for t in tokens]


def test_bytes_tokens_are_each_documents_bytes_then_256(tmp_path):
    texts = [b"hello", "héllo wörld\n".encode(), b"", "🚀 four bytes".encode(), b"x" * 40]
    texts += [f"document {i}".encode() for i in range(15)]
    write_texts(tmp_path / "in", texts)
    meta = prepare(
        [str(tmp_path / "in")], "bytes", tmp_path / "out", eval_fraction=0.25, progress=False
    )
    out = tmp_path / "out"
    train, train_masks = read_split(out, "train")
    held, _ = read_split(out, "eval")
    assert all(t[-1] == 256 for t in train + held) and all(m is None for m in train_masks)
    assert sorted(as_bytes(train + held)) == sorted(texts)
    assert is_subsequence(as_bytes(train), texts) and is_subsequence(as_bytes(held), texts)
    assert not list(out.glob("*.mask")) and meta["masked"] is False
    assert meta["num_documents"] == {"train": 15, "eval": 5}  # 20 × 0.25 held out
    # Starts are where each document begins: the cumulative lengths, from 0.
    stem = meta["shards"]["train"][0]
    starts = np.load(out / f"{stem}.docs.npy")
    assert list(starts) == list(np.cumsum([0] + [len(t) for t in train])[:-1])
    size = os.path.getsize(out / f"{stem}.bin")
    assert size == 2 * sum(len(t) for t in train) == 2 * meta["num_tokens"]["train"]


def test_a_tokenizer_json_decodes_back_to_each_document(tmp_path, bpe, monkeypatch):
    texts = [*CORPUS, "", "a new sentence the tokenizer never saw: zebra quokka 42"]
    texts += [f"line {i}: the fox and the dog" for i in range(14)]
    write_texts(tmp_path / "in", texts)
    tokenizer = Tokenizer.from_file(bpe)
    eod = tokenizer.token_to_id("<|endoftext|>")
    meta = prepare([str(tmp_path / "in")], bpe, tmp_path / "one", eval_fraction=0.2, workers=1)
    assert (meta["eod_id"], meta["vocab_size"]) == (eod, tokenizer.get_vocab_size())
    assert (meta["dtype"], meta["tokenizer"], meta["masked"]) == ("uint16", bpe, False)
    train, _ = read_split(tmp_path / "one", "train")
    held, _ = read_split(tmp_path / "one", "eval")
    decoded = [tokenizer.decode(t[:-1].tolist(), skip_special_tokens=False) for t in train + held]
    assert sorted(decoded) == sorted(texts) and len(held) == 4
    for t in train + held:  # the tokenizer's own ids, not bytes
        text = tokenizer.decode(t[:-1].tolist())
        assert t[:-1].tolist() == tokenizer.encode(text, add_special_tokens=False).ids
    assert sum(len(t) for t in train) == meta["num_tokens"]["train"]
    # Two worker processes, three documents a chunk: the same files, byte for byte.
    monkeypatch.setattr(prepare_lib, "CHUNK_DOCUMENTS", 3)
    again = prepare(
        [str(tmp_path / "in")], bpe, tmp_path / "two", eval_fraction=0.2, workers=2, progress=False
    )
    assert again == meta
    for name in os.listdir(tmp_path / "one"):
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes()


def test_the_end_of_document_token_is_found_or_named(tmp_path):
    write_texts(tmp_path / "in", ["one", "two", "three", "four"])
    two = train_bpe(tmp_path / "two.json", ["<pad>", "</s>", "<eos>"])
    tokenizer = Tokenizer.from_file(two)
    common = {"eval_fraction": 0.25, "workers": 1, "progress": False}
    meta = prepare([str(tmp_path / "in")], two, tmp_path / "a", **common)
    assert meta["eod_id"] == tokenizer.token_to_id("</s>")  # before <eos> in the search
    meta = prepare([str(tmp_path / "in")], two, tmp_path / "b", eod_token="<pad>", **common)
    assert meta["eod_id"] == tokenizer.token_to_id("<pad>")
    assert read_split(tmp_path / "b", "train")[0][0][-1] == tokenizer.token_to_id("<pad>")


def test_prompt_completion_masks_exactly_the_completion_and_the_end(tmp_path):
    lines = [
        {"text": "plain text, all scored"},
        {"prompt": "Q: 2+2?", "completion": " A: 4"},
        {"prompt": "", "completion": "no prompt tokens"},
        {"prompt": "ünïcode prompt ", "completion": "ç"},
    ] * 3
    path = tmp_path / "in" / "pairs.jsonl"
    path.parent.mkdir()
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")  # a blank line is skipped
    meta = prepare([str(path)], "bytes", tmp_path / "out", eval_fraction=0.25, progress=False)
    assert meta["masked"] is True and sum(meta["num_documents"].values()) == 12
    docs, masks = read_split(tmp_path / "out", "train")
    held, held_masks = read_split(tmp_path / "out", "eval")
    expected = {}
    for x in lines:
        prompt, completion = x.get("prompt", "").encode(), x.get("completion", x.get("text"))
        tokens = [*prompt, *completion.encode(), 256]
        expected[tuple(tokens)] = [0] * len(prompt) + [1] * (len(tokens) - len(prompt))
    for tokens, mask in zip(docs + held, masks + held_masks, strict=True):
        assert mask.tolist() == expected[tuple(tokens.tolist())]


def test_masks_cover_shards_written_before_the_first_prompt(tmp_path, bpe):
    # Plain documents fill several shards before any prompt appears: those shards still get
    # a .mask (all ones), and a prompt's boundary is where the prompt's own encoding ends.
    lines = [{"text": f"plain document number {i}"} for i in range(30)]
    lines += [{"prompt": "the quick brown", "completion": " fox jumps"}] * 10
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    meta = prepare(
        [str(path)], bpe, tmp_path / "out", eval_fraction=0.1, shard_tokens=40, progress=False
    )
    assert meta["masked"] and len(meta["shards"]["train"]) > 3
    tokenizer = Tokenizer.from_file(bpe)
    prompt = tokenizer.encode("the quick brown", add_special_tokens=False).ids
    completion = tokenizer.encode(" fox jumps", add_special_tokens=False).ids
    pair = [*prompt, *completion, meta["eod_id"]]
    for split in token_format.SPLITS:
        for tokens, mask in zip(*read_split(tmp_path / "out", split), strict=True):
            if tokens.tolist() == pair:
                assert mask.tolist() == [0] * len(prompt) + [1] * (len(completion) + 1)
            else:
                assert mask.all()
    assert sum(n for n in meta["num_documents"].values()) == 40


def test_parquet_rows_are_documents(tmp_path):
    texts = [f"row {i} text" for i in range(10)]
    table = pyarrow.table({"id": list(range(10)), "text": texts})
    pyarrow.parquet.write_table(table, tmp_path / "rows.parquet", row_group_size=3)
    meta = prepare(
        [str(tmp_path / "rows.parquet")], "bytes", tmp_path / "o", eval_fraction=0.2, progress=False
    )
    train, _ = read_split(tmp_path / "o", "train")
    held, _ = read_split(tmp_path / "o", "eval")
    assert sorted(as_bytes(train + held)) == sorted(t.encode() for t in texts)
    assert meta["num_documents"] == {"train": 8, "eval": 2}


def test_directories_and_globs_expand_sorted_recursively_and_once(tmp_path):
    root = tmp_path / "corpus"
    for name in ("b.txt", "a.txt", "sub/z.txt", "sub/deeper/y.md", "a2/x.jsonl"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(name if not name.endswith(".jsonl") else '{"text": "x"}\n')
    (root / ".hidden.txt").write_text("left out")
    (root / ".git").mkdir()
    (root / ".git" / "HEAD").write_text("left out")
    (root / "sub" / "__pycache__").mkdir()
    (root / "sub" / "__pycache__" / "z.cpython-311.pyc").write_bytes(b"\x00left out")
    found = expand_inputs([str(root)])
    names = [str(p.relative_to(root)) for p in found]
    assert names == ["a.txt", "a2/x.jsonl", "b.txt", "sub/deeper/y.md", "sub/z.txt"]
    # A glob's matches, sorted, a directory among them expanded; a file named twice is once.
    found = expand_inputs([str(root / "sub" / "*"), str(root / "b.txt"), str(root / "*.txt")])
    names = [str(p.relative_to(root)) for p in found]
    assert names == ["sub/deeper/y.md", "sub/z.txt", "b.txt", "a.txt"]
    meta = prepare([str(root / "**" / "*.txt")], "bytes", tmp_path / "o", eval_fraction=0.34)
    train, _ = read_split(tmp_path / "o", "train")
    held, _ = read_split(tmp_path / "o", "eval")
    assert sorted(as_bytes(train + held)) == [b"a.txt", b"b.txt", b"sub/z.txt"]
    assert meta["num_documents"] == {"train": 2, "eval": 1}


def test_eval_takes_whole_documents_by_the_seed(tmp_path):
    texts = [f"document {i:03d} " * (1 + i % 7) for i in range(100)]
    write_texts(tmp_path / "in", texts)
    inputs = [str(tmp_path / "in")]

    def run(name, **kwargs):
        meta = prepare(inputs, "bytes", tmp_path / name, progress=False, **kwargs)
        train, _ = read_split(tmp_path / name, "train")
        held, _ = read_split(tmp_path / name, "eval")
        return meta, as_bytes(train), as_bytes(held)

    meta, train, held = run("a", eval_fraction=0.1, seed=3)
    encoded = [t.encode() for t in texts]
    assert len(held) == 10 and len(train) == 90 and sorted(train + held) == sorted(encoded)
    assert is_subsequence(train, encoded) and is_subsequence(held, encoded)  # input order
    assert meta["num_tokens"]["eval"] == sum(len(d) + 1 for d in held)
    assert meta["num_tokens"]["train"] == sum(len(d) + 1 for d in train)
    assert (meta["eval_fraction"], meta["seed"]) == (0.1, 3)
    _, train_again, held_again = run("b", eval_fraction=0.1, seed=3)
    assert (train_again, held_again) == (train, held)
    _, _, held_other = run("c", eval_fraction=0.1, seed=4)
    assert held_other != held
    _, _, held_more = run("d", eval_fraction=0.125, seed=3)  # 12.5 rounds half up
    assert len(held_more) == 13


def test_shards_end_at_document_ends_within_the_token_bound(tmp_path):
    lengths = [5, 9, 3, 30, 2, 2, 2, 7, 11, 1, 4, 6]  # + 1 for each end of document
    texts = [bytes([65 + i]) * n for i, n in enumerate(lengths)]
    write_texts(tmp_path / "in", texts)
    meta = prepare(
        [str(tmp_path / "in")],
        "bytes",
        tmp_path / "o",
        eval_fraction=0.1,
        shard_tokens=16,
        progress=False,
    )
    for split in token_format.SPLITS:
        docs, _ = read_split(tmp_path / "o", split)
        sizes = []
        for stem in meta["shards"][split]:
            starts = np.load(tmp_path / "o" / f"{stem}.docs.npy")
            size = os.path.getsize(tmp_path / "o" / f"{stem}.bin") // 2
            sizes.append((size, len(starts)))
        # Greedy: a shard holds ≤ 16 tokens unless it is one longer document, and it was
        # closed only because the next document would not fit.
        lengths_in_order = [len(d) for d in docs]
        i = 0
        for k, (size, count) in enumerate(sizes):
            shard_docs = lengths_in_order[i : i + count]
            assert sum(shard_docs) == size
            assert size <= 16 or count == 1
            if k + 1 < len(sizes):
                assert size + lengths_in_order[i + count] > 16
            i += count
        assert i == len(docs) and meta["num_tokens"][split] == sum(lengths_in_order)
        assert [s for s, _ in sizes] and all(s > 0 for s, _ in sizes)
    train, _ = read_split(tmp_path / "o", "train")
    assert any(len(d) == 31 for d in train + read_split(tmp_path / "o", "eval")[0])


def test_meta_json_has_every_key_token_format_lists(tmp_path, bpe):
    write_texts(tmp_path / "in", ["a b c", "d e f", "g h i"])
    meta = prepare(
        [str(tmp_path / "in")], bpe, tmp_path / "o", eval_fraction=0.34, seed=7, progress=False
    )
    on_disk = json.loads((tmp_path / "o" / token_format.META_NAME).read_text())
    assert on_disk == meta and set(meta) == META_KEYS
    assert (meta["format"], meta["version"]) == (token_format.FORMAT, token_format.VERSION)
    assert (meta["tokenizer"], meta["eval_fraction"], meta["seed"]) == (bpe, 0.34, 7)
    assert meta["num_documents"] == {"train": 2, "eval": 1}
    assert meta["shards"] == {"train": ["train-00000"], "eval": ["eval-00000"]}
    files = sorted(os.listdir(tmp_path / "o"))
    assert files == sorted(
        ["meta.json", *(f"{s}-00000{x}" for s in ("train", "eval") for x in (".bin", ".docs.npy"))]
    )


def refused(argv, tmp_path, capsys, *fragments):
    """`jaxkit data prepare argv`: exit status 2, the reason in one line on stderr (after
    the usage line, for argparse's own refusals), nothing written."""
    before = sorted(os.listdir(tmp_path))
    try:
        code = cli.main(["data", "prepare", *argv, "--no-progress"])
        usage = []
    except SystemExit as exit:  # argparse: a usage line, then the error
        code, usage = exit.code, ["usage: jaxkit data prepare INPUT"]
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert code == 2 and out == "" and len(lines) == 1 + len(usage), err
    assert all(line.startswith(u) for line, u in zip(lines, usage, strict=False))
    assert lines[-1].startswith("jaxkit: error: " if not usage else "jaxkit data: error: ")
    for fragment in fragments:
        assert fragment in lines[-1], (fragment, err)
    assert sorted(os.listdir(tmp_path)) == before  # no DIR, no DIR.partial-PID, no parents


@pytest.fixture
def inputs(tmp_path):
    """in/: 7 good documents (text, JSON lines, Parquet); bad/: an input wrong in each way
    prepare refuses; links/: a link to nowhere."""
    write_texts(tmp_path / "in", ["one", "two", "three"])
    (tmp_path / "in" / "good.jsonl").write_text(
        '{"text": "a"}\n{"prompt": "p", "completion": "c"}\n'
    )
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "broken.jsonl").write_text('{"text": "a"}\n{"text": \n')
    (tmp_path / "bad" / "fieldless.jsonl").write_text('{"text": "a"}\n\n{"body": "b"}\n')
    (tmp_path / "bad" / "pair.jsonl").write_text('{"prompt": "p"}\n')
    (tmp_path / "bad" / "list.jsonl").write_text('{"text": "a"}\n["text"]\n')
    (tmp_path / "bad" / "blank.jsonl").write_text("\n \n")
    (tmp_path / "bad" / "empty").mkdir()
    pyarrow.parquet.write_table(pyarrow.table({"body": ["x"]}), tmp_path / "bad" / "no.parquet")
    pyarrow.parquet.write_table(pyarrow.table({"text": ["x", "y"]}), tmp_path / "in" / "t.parquet")
    (tmp_path / "bad" / "latin1.txt").write_bytes("café".encode("latin-1"))
    (tmp_path / "bad" / "tokenizer.json").write_text('{"not": "a tokenizer"}')
    (tmp_path / "links").mkdir()
    (tmp_path / "links" / "gone.txt").symlink_to(tmp_path / "nowhere")
    return tmp_path


def test_errors_exit_2_with_the_reason_and_write_nothing(inputs, bpe, capsys):
    good, bad = str(inputs / "in"), inputs / "bad"
    out = ["--out", str(inputs / "new" / "dir" / "out")]  # parents made only on success
    plain = [*out, "--tokenizer", "bytes", "--eval-fraction", "0.3"]
    refused([str(inputs / "none*.txt"), *plain], inputs, capsys, "none*.txt: matched no file")
    refused([str(inputs / "missing.txt"), *plain], inputs, capsys, "no such file or directory")
    refused([str(inputs / "links"), *plain], inputs, capsys, "gone.txt: cannot read")
    refused([str(bad / "broken.jsonl"), *plain], inputs, capsys, "broken.jsonl:2: not JSON")
    refused(
        [str(bad / "fieldless.jsonl"), *plain],
        inputs,
        capsys,
        'fieldless.jsonl:3: no "text" field (a string), nor "prompt" and "completion"',
    )
    refused(
        [good, str(bad / "pair.jsonl"), *plain],
        inputs,
        capsys,
        'pair.jsonl:1: no "completion" field beside "prompt"',
    )
    refused(
        [str(bad / "list.jsonl"), *plain], inputs, capsys, "list.jsonl:2: the line is an array, not"
    )
    # A file too small to split at --eval-fraction 0.01: its bad row is still what is said,
    # each value named as JSON names it.
    few = [*out, "--tokenizer", "bytes", "--eval-fraction", "0.01"]
    for line, said in [
        ('{"text": 5}', '"text" is a number (5), not a string'),
        ('{"text": null}', '"text" is null, not a string'),
        ("null", "the line is null, not an object with"),
        ('{"prompt": "p", "completion": true}', '"completion" is a boolean (true), not a string'),
    ]:
        (bad / "few.jsonl").write_text(f'{{"text": "a"}}\n{line}\n{{"text": "c"}}\n')
        refused([str(bad / "few.jsonl"), *few], inputs, capsys, f"few.jsonl:2: {said}")
    (bad / "few.jsonl").write_text('{"text": "a"}\n{"text": "b"}\n')  # fine, but too few
    refused([str(bad / "few.jsonl"), *few], inputs, capsys, "--eval-fraction 0.01 of 2 documents")
    refused([str(bad / "blank.jsonl"), *plain], inputs, capsys, "no documents in 1 input file")
    refused([str(bad / "empty"), *plain], inputs, capsys, "empty: a directory with no files")
    refused([good, str(bad / "no.parquet"), *plain], inputs, capsys, 'no "text" column (its')
    refused(
        [good, *out, "--tokenizer", str(bad / "tokenizer.json")],
        inputs,
        capsys,
        "tokenizer.json: not a tokenizer.json that loads",
    )
    refused(
        [good, *out, "--tokenizer", str(inputs / "nope.json")],
        inputs,
        capsys,
        "nope.json: not a tokenizer.json that loads",
    )
    refused(
        [good, *out, "--tokenizer", bpe, "--eod-token", "<eos>"],
        inputs,
        capsys,
        "--eod-token '<eos>' is not in the vocabulary",
    )
    refused([good, *plain, "--eod-token", "x"], inputs, capsys, "--eod-token applies to a")
    no_eod = train_bpe(inputs / "bad" / "pad_only.json", ["<pad>"])
    refused(
        [good, *out, "--tokenizer", no_eod], inputs, capsys, "name its end-of-document token with"
    )
    refused(
        [str(bad / "latin1.txt"), good, *out, "--tokenizer", bpe, "--eval-fraction", "0.3"],
        inputs,
        capsys,
        "latin1.txt: not UTF-8 text (byte 0xe9 at file offset 3)",
    )
    refused([good, *out, "--tokenizer", "bytes"], inputs, capsys, "of 7 documents holds out 0")
    refused([good, *plain, "--eval-fraction", "0.95"], inputs, capsys, "holds out 7")
    refused([good, *plain, "--eval-fraction", "1"], inputs, capsys, "must be between 0 and 1")
    refused([good, *plain, "--shard-tokens", "0"], inputs, capsys, "must be at least 1")
    refused([good, "--tokenizer", "bytes"], inputs, capsys, "required: --out")
    (inputs / "a_file").write_text("")
    refused([good, "--tokenizer", "bytes", "--out", str(inputs / "a_file")], inputs, capsys, "file")
    with pytest.raises(PrepareError, match="a_file: a file, not a directory"):
        prepare([good], "bytes", inputs / "a_file", eval_fraction=0.3)
    with pytest.raises(PrepareError, match="cannot create"):  # the CLI refuses it earlier
        prepare([good], "bytes", inputs / "a_file" / "out", eval_fraction=0.3)


def test_without_pyarrow_a_parquet_input_is_refused(inputs, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow now fails
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    argv = [str(inputs / "in"), "--tokenizer", "bytes", "--out", str(inputs / "o")]
    refused([*argv, "--eval-fraction", "0.3"], inputs, capsys, "needs pyarrow: pip install")


def test_an_error_after_shards_were_written_leaves_nothing(tmp_path, monkeypatch):
    # Two documents a chunk and shards of 8 tokens: several shards are on disk in the
    # partial directory when line 41 turns out to be bad.
    lines = [json.dumps({"text": f"doc {i}"}) for i in range(40)] + ['{"txt": 1}']
    (tmp_path / "late.jsonl").write_text("\n".join(lines) + "\n")
    monkeypatch.setattr(prepare_lib, "CHUNK_DOCUMENTS", 2)
    written = []
    close_shard = prepare_lib._SplitWriter._close_shard

    def recording(self):
        close_shard(self)
        written.append(sorted(os.listdir(self.directory)))

    monkeypatch.setattr(prepare_lib._SplitWriter, "_close_shard", recording)
    with pytest.raises(PrepareError, match=r"late.jsonl:41: no \"text\" field"):
        prepare(
            [str(tmp_path / "late.jsonl")],
            "bytes",
            tmp_path / "out",
            eval_fraction=0.1,
            shard_tokens=8,
            progress=False,
        )
    assert len(written) > 5 and "train-00004.docs.npy" in written[-1]
    assert sorted(os.listdir(tmp_path)) == ["late.jsonl"]


def test_an_interrupted_prepare_leaves_the_old_directory_as_it_was(tmp_path, monkeypatch):
    write_texts(tmp_path / "in", [f"document {i}" for i in range(20)])
    args = ([str(tmp_path / "in")], "bytes", tmp_path / "out")
    prepare(*args, eval_fraction=0.1, progress=False)
    old = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    calls = []
    add = prepare_lib._SplitWriter.add

    def interrupted(self, *a):
        calls.append(1)
        if len(calls) == 12:
            raise KeyboardInterrupt
        add(self, *a)

    monkeypatch.setattr(prepare_lib._SplitWriter, "add", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prepare(*args, eval_fraction=0.2, shard_tokens=20, overwrite=True, progress=False)
    assert sorted(os.listdir(tmp_path)) == ["in", "out"]
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == old
    calls.clear()
    with pytest.raises(KeyboardInterrupt):
        prepare(*args[:2], tmp_path / "new" / "out", eval_fraction=0.2, progress=False)
    assert sorted(os.listdir(tmp_path)) == ["in", "out"]


def test_overwrite_replaces_only_a_prepared_directory_once_the_new_one_is_done(tmp_path):
    write_texts(tmp_path / "in", [f"document {i}" for i in range(10)])
    inputs, out = [str(tmp_path / "in")], tmp_path / "out"
    out.mkdir()  # empty: nothing to overwrite
    first = prepare(inputs, "bytes", out, eval_fraction=0.1, progress=False)
    with pytest.raises(PrepareError, match="is not empty: give --overwrite"):
        prepare(inputs, "bytes", out, eval_fraction=0.5, progress=False)
    second = prepare(inputs, "bytes", out, eval_fraction=0.5, overwrite=True, progress=False)
    assert first["num_documents"]["eval"] == 1 and second["num_documents"]["eval"] == 5
    assert json.loads((out / "meta.json").read_text()) == second
    assert sorted(os.listdir(tmp_path)) == ["in", "out"]  # the old one moved aside, deleted
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    with pytest.raises(PrepareError, match=r"no meta\.json: --overwrite replaces only a prepared"):
        prepare(inputs, "bytes", tmp_path / "notes", eval_fraction=0.5, overwrite=True)
    assert os.listdir(tmp_path / "notes") == ["todo.txt"]


def jaxkit(*args):
    return subprocess.run(
        [sys.executable, "-m", "jaxkit", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=ROOT),
    )


def test_cli_prepares_with_options_anywhere_and_prints_what_it_wrote(tmp_path, bpe):
    texts = [f"the fox number {i} jumps" for i in range(18)]
    write_texts(tmp_path / "a", texts[:9])
    write_texts(tmp_path / "b", texts[9:])
    (tmp_path / "b" / "pairs.jsonl").write_text('{"prompt": "the", "completion": " dog"}\n' * 2)
    out = tmp_path / "out"
    result = jaxkit(
        "data",
        "prepare",
        "--tokenizer",
        bpe,
        str(tmp_path / "a"),
        "--eval-fraction",
        "0.25",
        str(tmp_path / "b" / "*"),
        "--out",
        str(out),
        "--shard-tokens",
        "64",
        "--workers",
        "2",
    )
    assert result.returncode == 0, result.stderr
    meta = json.loads((out / "meta.json").read_text())
    train, _ = read_split(out, "train")
    held, _ = read_split(out, "eval")
    assert (len(train), len(held)) == (15, 5) and meta["masked"]
    lines = result.stdout.splitlines()
    tokens = (sum(len(t) for t in train), sum(len(t) for t in held))
    shards = len(list(out.glob("train-*.bin"))), len(list(out.glob("eval-*.bin")))
    assert shards[0] > 1
    assert lines[0] == f"train: 15 documents, {tokens[0]} tokens, {shards[0]} shards"
    assert lines[1] == f"eval: 5 documents, {tokens[1]} tokens, {shards[1]} shard" + "s" * (
        shards[1] != 1
    )
    assert lines[2].startswith(f"prepared: {out} (uint16 tokens, vocabulary")
    assert "tokenizing" in result.stderr  # the progress bar


def test_ctrl_c_midway_exits_130_and_leaves_nothing(tmp_path):
    write_texts(tmp_path / "in", [f"document {i} " * 20 for i in range(60)])
    # The process interrupts itself as its second shard closes, workers running. It takes
    # SIGINT as a terminal's Ctrl-C finds it: a parent that ignores SIGINT (a suite started
    # as a background job by a script does) passes that on, and Python then never raises
    # KeyboardInterrupt.
    script = f"""
import os, signal, sys
from jaxkit import cli
from jaxkit.data import prepare
signal.signal(signal.SIGINT, signal.default_int_handler)
close = prepare._SplitWriter._close_shard
def close_then_interrupt(self):
    close(self)
    if len(self.shards) == 2:
        os.kill(os.getpid(), signal.SIGINT)
prepare._SplitWriter._close_shard = close_then_interrupt
prepare.CHUNK_DOCUMENTS = 4
sys.exit(cli.main(["data", "prepare", {str(tmp_path / "in")!r}, "--tokenizer", "bytes",
    "--out", {str(tmp_path / "out")!r}, "--shard-tokens", "300", "--eval-fraction", "0.1",
    "--workers", "2"]))
"""
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=ROOT),
    )
    assert result.returncode == 130, result.stderr
    assert "jaxkit: interrupted" in result.stderr and "Traceback" not in result.stderr
    assert sorted(os.listdir(tmp_path)) == ["in"]


def test_what_users_hand_prepare_by_mistake(tmp_path, monkeypatch):
    """Found by using it: the output inside an input directory is not read back with
    --overwrite; `**` does not reach into bytecode caches; one file spelled two ways is
    one input; a symlinked --out, a lone surrogate and a line with both kinds of fields
    are refused; a killed prepare's half-built directory is cleaned up by the next."""
    corpus = tmp_path / "corp"
    write_texts(corpus, [f"document {i}" for i in range(10)])
    out = corpus / "tokens"
    first = prepare([str(corpus)], "bytes", out, eval_fraction=0.2, progress=False)
    again = prepare([str(corpus)], "bytes", out, eval_fraction=0.2, overwrite=True, progress=False)
    assert again["num_documents"] == first["num_documents"] == {"train": 8, "eval": 2}
    (corpus / "__pycache__").mkdir()
    (corpus / "__pycache__" / "m.cpython-311.pyc").write_bytes(b"\x00\x01")
    names = {p.name for p in expand_inputs([str(corpus / "**")])} - {"meta.json"}
    assert not any(n.endswith(".pyc") for n in names)
    monkeypatch.chdir(tmp_path)
    same = expand_inputs(
        ["corp/doc000.txt", str(corpus / "doc000.txt"), "./corp/../corp/doc000.txt"]
    )
    assert len(same) == 1
    link = tmp_path / "link"
    link.symlink_to(out)
    with pytest.raises(PrepareError, match="is a symbolic link"):
        prepare([str(corpus / "doc000.txt")], "bytes", link, overwrite=True, progress=False)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": "a\\ud800b"}\n')
    with pytest.raises(PrepareError, match=r"bad\.jsonl:2: not valid Unicode"):
        prepare([str(bad)], "bytes", tmp_path / "o1", eval_fraction=0.5, progress=False)
    both = tmp_path / "both.jsonl"
    both.write_text('{"text": "u"}\n{"text": "t", "prompt": "p", "completion": "c"}\n')
    with pytest.raises(PrepareError, match=r"both\.jsonl:2: both \"text\" and"):
        prepare([str(both)], "bytes", tmp_path / "o2", eval_fraction=0.5, progress=False)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a process id that no longer runs
    stale = tmp_path / f"o3.partial-{dead.pid}"
    stale.mkdir()
    (stale / "train-00000.bin").write_bytes(b"\x00" * 10)
    prepare([str(corpus / "doc001.txt"), str(corpus / "doc002.txt")], "bytes", tmp_path / "o3",
            eval_fraction=0.5, progress=False)  # fmt: skip
    assert not stale.exists() and (tmp_path / "o3" / "meta.json").is_file()


def prepare_cli(capsys, *argv):
    """`jaxkit data prepare argv` in this process, one worker: its stdout, after exit 0."""
    code = cli.main(["data", "prepare", *argv, "--no-progress", "--workers", "1"])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


def test_every_prepared_directory_is_left_out_of_the_inputs(tmp_path, capsys):
    # corp/ holds 9 texts and a meta.json of its own kind (a document); what prepare writes
    # into corp/ (and a killed prepare's half-built directory) is never read back.
    corp = tmp_path / "corp"
    texts = [f"document {i}" for i in range(9)]
    write_texts(corp, texts)
    (corp / "notes").mkdir()
    (corp / "notes" / "meta.json").write_text('{"author": "me"}')
    (corp / "tok3.partial-999999").mkdir()
    (corp / "tok3.partial-999999" / "train-00000.bin").write_bytes(b"\x01\x00" * 8)
    expected = sorted([t.encode() for t in texts] + [b'{"author": "me"}'])
    for out in ("tok", "tok2"):
        argv = [str(corp), "--tokenizer", "bytes", "--eval-fraction", "0.2"]
        prepare_cli(capsys, *argv, "--out", str(corp / out))
        train, _ = read_split(corp / out, "train")
        held, _ = read_split(corp / out, "eval")
        assert sorted(as_bytes(train + held)) == expected  # 10, not 15
    names = sorted(os.listdir(corp / "tok"))
    assert names == sorted(os.listdir(corp / "tok2"))
    for name in names:  # the same inputs, so the same files
        assert (corp / "tok" / name).read_bytes() == (corp / "tok2" / name).read_bytes()
    # A glob that reaches into them leaves them out too.
    argv = [str(corp / "**"), "--tokenizer", "bytes", "--eval-fraction", "0.2"]
    prepare_cli(capsys, *argv, "--out", str(tmp_path / "g"))
    train, _ = read_split(tmp_path / "g", "train")
    held, _ = read_split(tmp_path / "g", "eval")
    assert sorted(as_bytes(train + held)) == expected
    # Named outright, one or a file of one is refused, naming the directory.
    tok = corp / "tok"
    plain = ["--tokenizer", "bytes", "--out", str(tmp_path / "x"), "--eval-fraction", "0.5"]
    refused([str(tok), *plain], tmp_path, capsys, f"tok: is {tok}, prepared tokens")
    refused(
        [str(tok / "train-00000.bin"), *plain], tmp_path, capsys, f"bin: lies in {tok}, prepared"
    )
    refused([str(tok / "*"), *plain], tmp_path, capsys, "matched only prepared token directories")


def gzip_file(path, data):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(data))
    return path


def test_gzip_inputs_are_read_as_their_uncompressed_selves(tmp_path, bpe, capsys):
    texts = [*CORPUS, *(f"line {i}: the fox and the dog" for i in range(6))]
    lines = [{"text": t} for t in texts[:5]] + [{"prompt": "Q: 2+2?", "completion": " 4"}] * 3
    jsonl = "".join(json.dumps(x, ensure_ascii=False) + "\n" for x in lines).encode()
    write_texts(tmp_path / "plain", texts[5:])
    (tmp_path / "plain" / "pairs.jsonl").write_bytes(jsonl)
    for i, text in enumerate(texts[5:]):  # the same names, .gz added: the same order
        gzip_file(tmp_path / "gz" / f"doc{i:03d}.txt.gz", text.encode())
    gzip_file(tmp_path / "gz" / "pairs.jsonl.gz", jsonl)
    for tokenizer in ("bytes", bpe):
        common = ["--tokenizer", tokenizer, "--eval-fraction", "0.25", "--shard-tokens", "200"]
        plain, gz = tmp_path / "out" / "plain", tmp_path / "out" / "gz"
        prepare_cli(capsys, str(tmp_path / "plain"), *common, "--out", str(plain), "--overwrite")
        prepare_cli(capsys, str(tmp_path / "gz"), *common, "--out", str(gz), "--overwrite")
        meta = json.loads((gz / "meta.json").read_text())
        assert sum(meta["num_documents"].values()) == len(texts[5:]) + len(lines)
        assert meta == json.loads((plain / "meta.json").read_text()) and meta["masked"]
        assert sorted(os.listdir(plain)) == sorted(os.listdir(gz))
        for name in os.listdir(plain):
            assert (plain / name).read_bytes() == (gz / name).read_bytes(), (tokenizer, name)


def test_a_damaged_gzip_or_a_gzipped_parquet_is_refused(tmp_path, capsys):
    packed = gzip.compress(b'{"text": "a"}\n' * 400)
    (tmp_path / "cut.jsonl.gz").write_bytes(packed[: len(packed) // 2])
    (tmp_path / "plain.txt.gz").write_bytes(b"not compressed at all")
    corrupt = bytearray(gzip.compress(b"some text " * 50))
    corrupt[-8] ^= 0xFF  # the CRC of the uncompressed bytes
    (tmp_path / "crc.txt.gz").write_bytes(bytes(corrupt))
    buffer = io.BytesIO()
    pyarrow.parquet.write_table(pyarrow.table({"text": ["x", "y"]}), buffer)
    gzip_file(tmp_path / "rows.parquet.gz", buffer.getvalue())
    write_texts(tmp_path / "good", ["one", "two", "three"])
    plain = ["--tokenizer", "bytes", "--out", str(tmp_path / "o"), "--eval-fraction", "0.3"]
    good = str(tmp_path / "good")
    (tmp_path / "empty.txt.gz").write_bytes(b"")  # what a failed download leaves
    for name, reason in [
        ("empty.txt.gz", "an empty file"),
        ("cut.jsonl.gz", "end-of-stream marker"),
        ("plain.txt.gz", "Not a gzipped file"),
        ("crc.txt.gz", "CRC check failed"),
    ]:
        refused(
            [good, str(tmp_path / name), *plain],
            tmp_path,
            capsys,
            f"{name}: not a whole gzip file (",
            reason,
        )
    refused(
        [good, str(tmp_path / "rows.parquet.gz"), *plain],
        tmp_path,
        capsys,
        "rows.parquet.gz: a gzip-compressed Parquet file: gunzip it",
    )


def test_text_that_is_not_utf8_is_refused_by_every_tokenizer(tmp_path, bpe, capsys):
    # docs/data.md lists it among the refusals; each names the file, and the line of a .jsonl, and
    # the offset of the first bad byte in the file (decompressed, for a .gz).
    latin1 = "naïve café".encode("latin-1")
    first = latin1.index(b"\xef")  # "ï" is 0xef in Latin-1, not a UTF-8 sequence here
    jsonl = b'{"text": "ok"}\n\n{"text": "' + latin1 + b'"}\n'
    at_jsonl = jsonl.index(b"\xef")
    valid = "utf-8 first: é, ".encode()  # the offset counts bytes, not characters
    write_texts(tmp_path / "good", ["one", "two", "three"])
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "latin1.txt").write_bytes(latin1)
    (tmp_path / "bad" / "latin1.jsonl").write_bytes(jsonl)
    gzip_file(tmp_path / "bad" / "latin1.txt.gz", valid + latin1)
    good = str(tmp_path / "good")
    for tokenizer in ("bytes", bpe):
        plain = ["--tokenizer", tokenizer, "--out", str(tmp_path / "o"), "--eval-fraction", "0.3"]
        bad = tmp_path / "bad"
        refused(
            [good, str(bad / "latin1.txt"), *plain],
            tmp_path,
            capsys,
            f"latin1.txt: not UTF-8 text (byte 0xef at file offset {first})",
        )
        refused(
            [good, str(bad / "latin1.jsonl"), *plain],
            tmp_path,
            capsys,
            f"latin1.jsonl:3: not UTF-8 text (byte 0xef at file offset {at_jsonl})",
        )
        refused(
            [good, str(bad / "latin1.txt.gz"), *plain],
            tmp_path,
            capsys,
            "latin1.txt.gz: not UTF-8 text "
            f"(byte 0xef at decompressed offset {len(valid) + first})",
        )


def test_symlinked_directories_are_read_as_a_glob_reads_them_and_once(tmp_path):
    """A corpus linked into the input directory is part of it (a `**` glob followed the link
    while the directory walk skipped it); a link back up does not loop."""
    write_texts(tmp_path / "extra", ["four", "five"])
    write_texts(tmp_path / "corpus", ["one", "two", "three"])
    (tmp_path / "corpus" / "linked").symlink_to(tmp_path / "extra")
    (tmp_path / "corpus" / "loop").symlink_to(tmp_path / "corpus")
    walked = expand_inputs([str(tmp_path / "corpus")])
    globbed = expand_inputs([str(tmp_path / "corpus" / "linked" / "*")])
    assert len(walked) == 5 and set(globbed) <= set(walked)
    assert sorted(p.read_text() for p in walked) == sorted(["one", "two", "three", "four", "five"])


def test_bos_starts_every_document_before_its_prompt_and_is_recorded(tmp_path, capsys):
    from tokenizers import processors

    from jaxkit.data import token_files

    # Llama's tokenizer.json shape: a post-processor that puts <s> before every sequence.
    path = train_bpe(tmp_path / "plain.json", ["<s>", "</s>"])
    tokenizer = Tokenizer.from_file(path)
    bos, eod = tokenizer.token_to_id("<s>"), tokenizer.token_to_id("</s>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", bos)]
    )
    llama = str(tmp_path / "tokenizer.json")
    tokenizer.save(llama)
    lines = [{"text": "the quick brown fox"}, {"prompt": "Q: dog?", "completion": " A: lazy"}] * 2
    source = tmp_path / "in" / "pairs.jsonl"
    source.parent.mkdir()
    source.write_text("".join(json.dumps(x) + "\n" for x in lines))
    common = ["--eval-fraction", "0.25", "--workers", "1", "--no-progress"]
    argv = ["data", "prepare", str(source), "--tokenizer", llama, *common]
    assert cli.main([*argv, "--bos", "--out", str(tmp_path / "with")]) == 0
    assert f"beginning of document {bos}" in capsys.readouterr().out
    assert prepare_lib.prepare([str(source)], llama, tmp_path / "without", eval_fraction=0.25)
    meta = json.loads((tmp_path / "with" / "meta.json").read_text())
    assert meta["bos_id"] == bos
    assert "bos_id" not in json.loads((tmp_path / "without" / "meta.json").read_text())
    docs, masks = read_split(tmp_path / "with", "train")
    plain, _ = read_split(tmp_path / "without", "train")
    expected = {}  # each document as the tokenizer encodes it apart: <s>, prompt, text, </s>
    for x in lines:
        encode = functools.partial(tokenizer.encode, add_special_tokens=False)
        prompt = encode(x["prompt"]).ids if "prompt" in x else []
        text = encode(x.get("completion", x.get("text"))).ids
        tokens = [bos, *prompt, *text, eod]
        # <s> weighs 0 with a prompt; a plain document scores every token, masks or not.
        scored = 0 if "prompt" in x else 1
        expected[tuple(tokens)] = [scored] * (1 + len(prompt)) + [1] * (len(text) + 1)
    for tokens, mask in zip(docs, masks, strict=True):
        assert mask.tolist() == expected[tuple(tokens.tolist())]
    assert sorted(d[1:].tolist() for d in docs) == sorted(d.tolist() for d in plain)
    # The fingerprint a checkpoint keeps tells the two apart: a resume is not silently mixed.
    prints = [
        token_files.fingerprint(*token_files.open_splits(str(tmp_path / d), "uint16", 0.1))
        for d in ("with", "without")
    ]
    assert prints[0]["bos_id"] == bos and "bos_id" not in prints[1]


def test_bos_is_refused_where_the_tokenizer_has_none(tmp_path, bpe, capsys):
    write_texts(tmp_path / "in", ["one", "two"])
    out = str(tmp_path / "out")
    tmp = tmp_path / "in"
    refused([str(tmp), "--tokenizer", bpe, "--bos", "--out", out], tmp, capsys, "--bos", bpe)
    refused([str(tmp), "--tokenizer", "bytes", "--bos", "--out", out], tmp, capsys, "--bos")


def save_dataset(path, columns, num_shards=1):
    """`columns` as `datasets` saves a Dataset to disk: state.json, dataset_info.json and
    data-*.arrow, Arrow IPC streams."""
    import datasets

    datasets.disable_progress_bars()
    datasets.Dataset.from_dict(columns).save_to_disk(str(path), num_shards=num_shards)
    return str(path)


def save_dataset_dict(path, splits):
    import datasets

    datasets.disable_progress_bars()
    saved = datasets.DatasetDict({s: datasets.Dataset.from_dict(c) for s, c in splits.items()})
    saved.save_to_disk(str(path))
    return str(path)


def files_of(directory):
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


TEXTS = [f"{CORPUS[i % len(CORPUS)][: 10 + i]} row {i}" for i in range(40)]


def test_a_saved_dataset_prepares_to_the_files_its_rows_give_as_json_lines(tmp_path, bpe, capsys):
    # Three .arrow streams (read in state.json's order), the text in a column named by
    # --text-field beside a "text" column of titles that must not be read; an Arrow IPC
    # *file* in the same layout, and the same rows as JSON lines, give the same files.
    columns = {"title": [f"title {i}" for i in range(40)], "id": list(range(40))}
    saved = save_dataset(tmp_path / "ds", {**columns, "body": TEXTS}, num_shards=3)
    assert len(list((tmp_path / "ds").glob("data-*-of-00003.arrow"))) == 3
    by_hand = tmp_path / "by_hand"
    by_hand.mkdir()
    for name in ("state.json", "dataset_info.json"):
        (by_hand / name).write_text((tmp_path / "ds" / name).read_text())
    state = json.loads((by_hand / "state.json").read_text())
    state["_data_files"] = [{"filename": "rows.arrow"}]
    (by_hand / "state.json").write_text(json.dumps(state))
    table = pyarrow.table({"body": TEXTS, "id": list(range(40))})
    with pyarrow.ipc.new_file(str(by_hand / "rows.arrow"), table.schema) as writer:
        writer.write_table(table, max_chunksize=7)
    lines = tmp_path / "rows.jsonl"
    lines.write_text("".join(json.dumps({"body": t, "id": i}) + "\n" for i, t in enumerate(TEXTS)))
    common = ["--tokenizer", bpe, "--eval-fraction", "0.2", "--shard-tokens", "64"]
    for source, out in [(saved, "a"), (saved, "again"), (str(by_hand), "f"), (str(lines), "j")]:
        prepare_cli(capsys, source, *common, "--text-field", "body", "--out", str(tmp_path / out))
    written = files_of(tmp_path / "a")
    assert len(written) > 6  # several shards of each split, and meta.json
    for out in ("again", "f", "j"):  # prepared twice, read as a file, read as JSON lines
        assert files_of(tmp_path / out) == written, out
    # The tokens themselves, from the tokenizer alone: each row's, then the end of document,
    # the held-out rows taken whole and both splits in row order.
    tokenizer = Tokenizer.from_file(bpe)
    eod = tokenizer.token_to_id("<|endoftext|>")
    expected = [[*tokenizer.encode(t, add_special_tokens=False).ids, eod] for t in TEXTS]
    train, _ = read_split(tmp_path / "a", "train")
    held, _ = read_split(tmp_path / "a", "eval")
    assert (len(train), len(held)) == (32, 8)
    train, held = [d.tolist() for d in train], [d.tolist() for d in held]
    assert sorted(train + held) == sorted(expected)
    assert is_subsequence(train, expected) and is_subsequence(held, expected)


def test_prompt_completion_rows_mask_alike_from_a_dataset_parquet_and_json_lines(
    tmp_path, bpe, capsys
):
    # Pairs under other names in a DatasetDict (its train split by default, --split test
    # for the other), a Parquet file and JSON lines: the same tokens and masks.
    prompts = [f"Q{i}: {'' if i % 5 == 0 else CORPUS[i % 4][:i]}" for i in range(24)]
    answers = [f" A: {CORPUS[(i + 1) % 4][: 3 + i]}" for i in range(24)]
    test_pairs = {"question": ["Q: held?", "Q: too?"], "answer": [" A: yes", " A: ✓"]}
    pairs = {"question": prompts, "answer": answers}
    saved = save_dataset_dict(tmp_path / "dd", {"train": pairs, "test": test_pairs})
    pyarrow.parquet.write_table(
        pyarrow.table({"n": list(range(24)), **pairs}), tmp_path / "p.parquet", row_group_size=5
    )
    rows = [{"question": q, "answer": a} for q, a in zip(prompts, answers, strict=True)]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    names = ["--prompt-field", "question", "--completion-field", "answer"]
    common = [*names, "--tokenizer", bpe, "--eval-fraction", "0.25"]
    for source, out in [(saved, "d"), (str(tmp_path / "p.parquet"), "p"), ("p.jsonl", "j")]:
        prepare_cli(capsys, str(tmp_path / source), *common, "--out", str(tmp_path / out))
    assert files_of(tmp_path / "d") == files_of(tmp_path / "p") == files_of(tmp_path / "j")
    tokenizer = Tokenizer.from_file(bpe)
    eod = tokenizer.token_to_id("<|endoftext|>")

    def expected(questions, answers):
        """Each pair's tokens and mask, from the tokenizer alone: the prompt weighs 0."""
        pairs = {}
        for q, a in zip(questions, answers, strict=True):
            prompt = tokenizer.encode(q, add_special_tokens=False).ids
            completion = tokenizer.encode(a, add_special_tokens=False).ids
            tokens = (*prompt, *completion, eod)
            pairs[tokens] = [0] * len(prompt) + [1] * (len(completion) + 1)
        return pairs

    def prepared(out):
        docs, masks = [], []
        for split in token_format.SPLITS:
            d, m = read_split(out, split)
            docs, masks = docs + d, masks + m
        return {tuple(d.tolist()): m.tolist() for d, m in zip(docs, masks, strict=True)}

    assert prepared(tmp_path / "d") == expected(prompts, answers)
    assert any(0 in m for m in expected(prompts, answers).values())  # a prompt has tokens
    prepare_cli(capsys, saved, "--split", "test", *common, "--eval-fraction", "0.5", "--out",
                str(tmp_path / "t"))  # fmt: skip
    assert prepared(tmp_path / "t") == expected(test_pairs["question"], test_pairs["answer"])


def test_a_saved_dataset_the_options_cannot_read_is_one_line_and_writes_nothing(
    tmp_path, bpe, capsys
):
    ds = save_dataset(tmp_path / "ds", {"body": ["one", "two", "three"], "id": [1, 2, 3]})
    dd = save_dataset_dict(
        tmp_path / "dd", {"validation": {"text": ["v"]}, "test": {"text": ["t"]}}
    )
    empty = save_dataset(tmp_path / "empty", {"text": []})
    both = save_dataset(tmp_path / "both", {"text": ["a"], "prompt": ["p"], "completion": ["c"]})
    half = save_dataset(tmp_path / "half", {"prompt": ["p", "q"]})
    null = save_dataset(tmp_path / "null", {"text": ["a", None, "c"]})
    pyarrow.parquet.write_table(pyarrow.table({"q": ["x"], "n": [1]}), tmp_path / "q.parquet")
    torn = save_dataset(tmp_path / "torn", {"text": ["a", "b"]})
    (tmp_path / "torn" / "data-00000-of-00001.arrow").write_bytes(b"not arrow at all")
    plain = ["--tokenizer", "bytes", "--eval-fraction", "0.4", "--out", str(tmp_path / "out")]

    def says(inputs, *fragments):
        refused([*inputs, *plain], tmp_path, capsys, *fragments)

    arrow = "data-00000-of-00001.arrow"
    says([ds], f'{arrow}: no "text" column (its columns: body, id), nor "prompt" and "completion"')
    says([ds, "--text-field", "title"], f'{arrow}: no "title" column (its columns: body, id)')
    says([ds, "--text-field", "id"], f'{arrow}: column "id" holds int64, not strings')
    says([ds, "--prompt-field", "body"], 'no "completion" column beside "body" (its columns')
    says([str(tmp_path / "q.parquet"), "--prompt-field", "q", "--completion-field", "a"],
         'q.parquet: no "a" column beside "q" (its columns: q, n)')  # fmt: skip
    says([ds, "--prompt-field", "x", "--completion-field", "x"], "name different fields")
    # Naming one kind's field reads only that kind: a pair is not taken for a text, nor the
    # reverse, and the line is named.
    (tmp_path / "mixed.jsonl").write_text('{"body": "b"}\n{"prompt": "p", "completion": "c"}\n')
    says([str(tmp_path / "mixed.jsonl"), "--text-field", "body"],
         'mixed.jsonl:2: no "body" field (a string)')  # fmt: skip
    says([str(tmp_path / "mixed.jsonl"), "--completion-field", "completion"],
         'mixed.jsonl:1: no "prompt" and "completion" fields (strings)')  # fmt: skip
    says([dd], f"{dd}: a DatasetDict without the split 'train' (its splits: validation, test)")
    says([dd, "--split", "dev"], "without the split 'dev' (its splits: validation, test)")
    says([ds, "--split", "test"], "--split test: applies to a DatasetDict saved to disk")
    says([empty], f"{empty}: a saved dataset of 0 rows")
    says([both], f'{arrow}: both a "text" column and "prompt"/"completion" columns')
    # Given both kinds' options, the advice is to drop one kind's, not to give them.
    named = ["--text-field", "text", "--prompt-field", "prompt", "--completion-field", "completion"]
    one_kind = (
        "give --text-field text alone to read the texts, or --prompt-field prompt "
        "--completion-field completion alone to read the pairs"
    )
    says([both, *named], f'"prompt"/"completion" columns: which one is the document? {one_kind}')
    (tmp_path / "both.jsonl").write_text('{"b": "x", "q": "y", "a": "z"}\n{"b": "w"}\n')
    fields = ["--text-field", "b", "--prompt-field", "q", "--completion-field", "a"]
    says([str(tmp_path / "both.jsonl"), *fields],
         'both.jsonl:1: both "b" and "q"/"a": which one is the document? give --text-field b '
         "alone to read the texts, or --prompt-field q --completion-field a alone to read the "
         "pairs")  # fmt: skip
    says([half], 'no "completion" column beside "prompt" (its columns: prompt)')
    says([null], f'{arrow}: row 1: "text" is null, not a string')
    says([torn], f"{torn}/{arrow}: not an Arrow stream or file")
    says([f"{ds}/{arrow}"], f"lies in {ds}, a saved Hugging Face dataset: name its directory")
    says([f"{ds}/*"], "matched only files inside a saved Hugging Face dataset")
    # A glob over them all reads each dataset once, a DatasetDict's --split alone.
    found = expand_inputs([str(tmp_path / "**")], split="test")
    assert str(tmp_path / "dd" / "test") in map(str, found) and str(tmp_path / "ds") in map(
        str, found
    )
    assert not any("validation" in str(p) or p.name.endswith((".arrow", ".json")) for p in found)


def test_a_glob_reads_a_saved_dataset_it_matches_beside_other_files(tmp_path):
    """`corpus/*` matches a saved dataset's own directory (no file inside it): the dataset
    is an input beside the corpus's other files, not dropped as though it lay inside
    itself (a `**` glob also matches `corpus/` and walks down to it, which this does not)."""
    corpus = tmp_path / "corpus"
    save_dataset(corpus / "ds", {"text": ["one", "two", "three"]})
    (corpus / "a.txt").write_text("alpha")
    assert expand_inputs([str(corpus / "*")]) == [corpus / "a.txt", corpus / "ds"]
    out = tmp_path / "out"
    meta = prepare([str(corpus / "*")], "bytes", out, eval_fraction=0.25, progress=False)
    assert meta["num_documents"] == {"train": 3, "eval": 1}
    assert meta["num_tokens"]["train"] + meta["num_tokens"]["eval"] == 5 + 3 + 3 + 5 + 4

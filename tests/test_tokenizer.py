"""A pretrained model trains only on token ids its own tokenizer made (jaxkit/data/tokenizer.py),
and a run records that tokenizer so that its export finds it from any directory.

The model directories are small random Llamas (test_hf_io.write_hf) beside byte-level BPE
tokenizers trained here (test_prepare.train_bpe); every refusal is met through the CLI,
before any training.
"""

import functools
import hashlib
import json
import shutil
import types

import pytest
from cli_run import jaxkit
from test_hf_io import small_config, write_hf
from test_prepare import CORPUS, train_bpe
from tokenizers import Tokenizer

from jaxkit.config import run_config
from jaxkit.data.sources import data_facts, make_sources

# The model's sizes (test_hf_io's SMALL, with room for the BPE's ids) and a one-step run of
# one row per device: a run that starts trains for milliseconds.
VOCAB = 320
SMALL = [
    f"model.vocab_size={VOCAB}",
    "model.d_model=32",
    "model.num_layers=2",
    "model.num_heads=4",
    "model.num_kv_heads=2",
    "model.mlp_dim=64",
    "data.seq_len=16",
    "data.max_bytes=60000",
    "train.steps=1",
    "batch.global_batch_size=8",
    "batch.per_device_batch_size=1",
    "train.eval_examples=8",
]


def texts(path, copies=40):
    """A JSON lines file of CORPUS's documents, `copies` times over."""
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in CORPUS * copies))
    return str(path)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A Hugging Face directory with its tokenizer.json, another BPE of the same vocabulary
    size (trained with one more special token), and JSON lines to prepare."""
    tmp = tmp_path_factory.mktemp("tokenizer")
    write_hf(tmp / "hf", small_config(f"model.vocab_size={VOCAB}").model)
    train_bpe(tmp / "hf" / "tokenizer.json", ["<|endoftext|>"])
    (tmp / "other").mkdir()
    train_bpe(tmp / "other" / "tokenizer.json", ["<|endoftext|>", "<pad>"])
    sizes = [
        Tokenizer.from_file(str(tmp / d / "tokenizer.json")).get_vocab_size()
        for d in ("hf", "other")
    ]
    assert sizes[0] == sizes[1] <= VOCAB  # the same size: only the tokenizers tell them apart
    texts(tmp / "docs.jsonl")
    return tmp


def prepared(model, name, tokenizer):
    """`jaxkit data prepare` of the module's documents with `tokenizer`, into `name`."""
    out = model / name
    if not out.exists():
        done = jaxkit(
            "data", "prepare", str(model / "docs.jsonl"), "--tokenizer", tokenizer,
            "--out", str(out), "--workers", "1", "--no-progress", "--eval-fraction", "0.1",
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
    return out


def refused(*args, says, workdir):
    """`jaxkit train llama_tiny ARGS`: exit 2, one line naming the problem, nothing written."""
    done = jaxkit("train", "llama_tiny", *SMALL, *args, "--workdir", str(workdir), "--no-progress")
    err = done.stderr.splitlines()
    assert done.returncode == 2 and len(err) == 1, (done.returncode, done.stderr[-2000:])
    for fragment in says:
        assert fragment in err[0], (fragment, err[0])
    assert not workdir.exists()
    return err[0]


def test_a_model_with_a_tokenizer_json_refuses_ids_it_did_not_make(model, tmp_path):
    """llama_tiny's bytes fed to a BPE model are ids that mean other tokens to it (256 is
    below its vocabulary: the size check passed, and the run trained to exit 0)."""
    init_from = f"model.init_from=hf:{model / 'hf'}"
    command = f"jaxkit data prepare INPUT --tokenizer {model / 'hf' / 'tokenizer.json'} --out OUT"
    run = functools.partial(refused, init_from, workdir=tmp_path / "run")
    run(says=["data.source=text", "bytes", command])
    run("data.source=synthetic", "data.num_examples=64", says=["synthetic", command])
    as_bytes = prepared(model, "bytes", "bytes")
    run("data.source=tokens", f"data.path={as_bytes}", says=["--tokenizer bytes", command])
    # A mixture's source is named as it was given, not as data.path.
    mixture = "data.mixture=" + json.dumps({"web": {"path": str(as_bytes), "weight": 1}})
    line = run("data.source=tokens", mixture, says=[f"data.mixture.web.path={as_bytes} was"])
    assert "data.path" not in line, line
    # Another tokenizer of the same vocabulary size: its ids are in range, and other tokens.
    other = prepared(model, "other-data", str(model / "other" / "tokenizer.json"))
    run("data.source=tokens", f"data.path={other}", says=["another tokenizer", command])


def test_a_model_with_tokenizer_files_but_no_tokenizer_json_is_refused(model, tmp_path):
    """prepare reads a tokenizer.json only: a SentencePiece model or GPT-2's vocabulary and
    merges leave the data nothing to be prepared with."""
    for files in (("tokenizer.model",), ("vocab.json", "merges.txt")):
        directory = tmp_path / files[0]
        shutil.copytree(model / "hf", directory)
        (directory / "tokenizer.json").unlink()
        for name in files:
            (directory / name).write_text("{}")
        data = ["data.source=tokens", f"data.path={prepared(model, 'bytes', 'bytes')}"]
        init_from = f"model.init_from=hf:{directory}"
        line = refused(init_from, *data, says=[*files, "tokenizer.json"], workdir=tmp_path / "run")
        assert f"--tokenizer {directory / 'tokenizer.json'} --out OUT" in line


def test_prepare_records_the_tokenizer_s_canonical_sha256_outside_the_fingerprint(model, tmp_path):
    """tokenizer_sha256 is SHA-256 of Tokenizer.to_str(): the same tokenizer saved again,
    compact instead of pretty, keeps it. The fingerprint, which checkpoints hold to know
    their data again, leaves it out: data prepared before it keeps its fingerprint."""
    tokenizer = Tokenizer.from_file(str(model / "hf" / "tokenizer.json"))
    expected = hashlib.sha256(tokenizer.to_str().encode()).hexdigest()
    tokenizer.save(str(tmp_path / "compact.json"), pretty=False)
    assert (tmp_path / "compact.json").read_bytes() != (
        model / "hf" / "tokenizer.json"
    ).read_bytes()
    compact = prepared(model, "compact", str(tmp_path / "compact.json"))
    meta = json.loads((compact / "meta.json").read_text())
    assert meta["tokenizer_sha256"] == expected
    config = run_config(small_config(*SMALL, "data.source=tokens", f"data.path={compact}"))
    fingerprint = make_sources(config)[0].fingerprint
    del meta["tokenizer_sha256"]
    (compact / "meta.json").write_text(json.dumps(meta))
    assert make_sources(config)[0].fingerprint == fingerprint
    assert "tokenizer_sha256" not in json.dumps(fingerprint)


def without_sha256(prepared_dir):
    """The prepared directory as a jaxkit that did not record tokenizer_sha256 wrote it."""
    meta = json.loads((prepared_dir / "meta.json").read_text())
    meta.pop("tokenizer_sha256")
    (prepared_dir / "meta.json").write_text(json.dumps(meta))


def test_token_files_that_cannot_say_their_tokenizer_are_read_with_one_warning(model, tmp_path):
    """Foreign token files, and data prepared before prepare recorded tokenizer_sha256, may
    be the model's own ids: read, with one line saying the kit cannot check them (a run
    prints it: relative_run's, on data of the second kind)."""
    ours = prepared(model, "ours", str(model / "hf" / "tokenizer.json"))
    init_from = f"model.init_from=hf:{model / 'hf'}"
    config = small_config(*SMALL, init_from, "data.source=tokens", f"data.path={ours}")
    assert make_sources(run_config(config))[0].note is None  # the model's own: nothing to say
    shutil.copytree(ours, tmp_path / "older")
    without_sha256(tmp_path / "older")
    shutil.copy(ours / "train-00000.bin", tmp_path / "train.bin")  # nanoGPT's layout
    shutil.copy(ours / "eval-00000.bin", tmp_path / "val.bin")
    for path, says in ((tmp_path / "older", "tokenizer_sha256"), (tmp_path, "no tokenizer")):
        config = run_config(
            small_config(*SMALL, init_from, "data.source=tokens", f"data.path={path}")
        )
        (warning,) = [n for n in make_sources(config)[0].note.splitlines() if "warning" in n]
        assert warning.startswith("warning: ") and "cannot check" in warning, warning
        assert says in warning and str(model / "hf" / "tokenizer.json") in warning


@pytest.fixture(scope="module")
def relative_run(model):
    """A run started in one directory from relative paths only: data prepared there with
    `--tokenizer hf/tokenizer.json --out data` (by a jaxkit that did not record the
    tokenizer's sha256), trained with model.init_from=hf:hf and data.path=data."""
    here = model / "a"
    here.mkdir()
    shutil.copytree(model / "hf", here / "hf")
    texts(here / "docs.jsonl")
    done = jaxkit(
        "data", "prepare", "docs.jsonl", "--tokenizer", "hf/tokenizer.json", "--out", "data",
        "--workers", "1", "--no-progress", "--eval-fraction", "0.1", cwd=here,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    without_sha256(here / "data")
    args = [*SMALL, "model.init_from=hf:hf", "data.source=tokens", "data.path=data"]
    done = jaxkit("train", "llama_tiny", *args, "--workdir", "run", "--no-progress", cwd=here)
    assert done.returncode == 0, done.stderr[-2000:]
    return types.SimpleNamespace(directory=here, printed=done.stdout)


def test_a_run_on_data_without_tokenizer_sha256_warns_once(relative_run):
    warned = [line for line in relative_run.printed.splitlines() if "warning" in line]
    assert len(warned) == 1 and warned[0].startswith("warning: data.path=data "), warned
    assert "cannot check" in warned[0] and "hf/tokenizer.json" in warned[0]


def test_export_from_another_directory_copies_the_run_s_tokenizer(relative_run, tmp_path):
    """The run recorded its tokenizer at its start, absolute: export finds it from anywhere
    (the checkpoint's data.path and the prepare's --tokenizer are relative paths)."""
    here = relative_run.directory
    elsewhere = tmp_path / "b"
    elsewhere.mkdir()
    done = jaxkit("export", str(here / "run"), "--hf", str(tmp_path / "out"), cwd=elsewhere)
    assert done.returncode == 0, done.stderr
    assert "warning" not in done.stdout and "tokenizer.json" in done.stdout, done.stdout
    original = (here / "hf" / "tokenizer.json").read_bytes()
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == original


def test_export_copies_no_tokenizer_that_changed_since_the_run_started(
    relative_run, model, tmp_path
):
    """The record's tokenizer_sha256 (data prepared today records it) is held against the
    file export would copy: the same path holding another tokenizer is warned of and left
    out."""
    ours = prepared(model, "ours", str(model / "hf" / "tokenizer.json"))
    config = small_config(*SMALL, "data.source=tokens", f"data.path={ours}")
    record = data_facts(*make_sources(run_config(config)))["tokenizer"]
    assert record == {
        "tokenizer": str(model / "hf" / "tokenizer.json"),
        "tokenizer_file": str(model / "hf" / "tokenizer.json"),
        "tokenizer_sha256": json.loads((ours / "meta.json").read_text())["tokenizer_sha256"],
    }
    # relative_run's checkpoint, as a run on that data records it, its file a copy here.
    shutil.copytree(relative_run.directory / "run", tmp_path / "run")
    shutil.copytree(model / "hf", tmp_path / "hf")
    record["tokenizer_file"] = str(tmp_path / "hf" / "tokenizer.json")
    (path,) = (tmp_path / "run" / "checkpoints").glob("step_*/meta/metadata")
    meta = json.loads(path.read_text())
    meta["data"]["tokenizer"] = record
    path.write_text(json.dumps(meta))
    done = jaxkit("export", str(tmp_path / "run"), "--hf", str(tmp_path / "same"))
    assert done.returncode == 0 and "warning" not in done.stdout, (done.stdout, done.stderr)
    assert (tmp_path / "same" / "tokenizer.json").is_file()
    shutil.copy(model / "other" / "tokenizer.json", tmp_path / "hf" / "tokenizer.json")
    done = jaxkit("export", str(tmp_path / "run"), "--hf", str(tmp_path / "changed"))
    assert done.returncode == 0, done.stderr
    (warned,) = [line for line in done.stdout.splitlines() if "warning" in line]
    assert "not the tokenizer the run's data was prepared with" in warned, warned
    assert not (tmp_path / "changed" / "tokenizer.json").exists()


def test_sample_from_another_directory_encodes_and_decodes_with_the_run_s_tokenizer(
    relative_run, tmp_path
):
    """`jaxkit sample` finds the tokenizer.json the run's data was prepared with through the
    checkpoint's record (its paths were relative to the run's directory), from anywhere."""
    here = relative_run.directory
    elsewhere = tmp_path / "c"
    elsewhere.mkdir()
    prompt = CORPUS[0][:20]
    done = jaxkit(
        "sample", str(here / "run"), "--prompt", prompt, "--max-new-tokens", "4",
        "--temperature", "0", "--json", cwd=elsewhere,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    line = json.loads(done.stdout)
    tokenizer = Tokenizer.from_file(str(here / "hf" / "tokenizer.json"))
    # As `data prepare` encoded the documents: no special tokens added.
    assert line["prompt_tokens"] == tokenizer.encode(prompt, add_special_tokens=False).ids
    assert line["text"] == tokenizer.decode(line["tokens"], skip_special_tokens=False)


def test_sample_refuses_a_run_whose_tokenizer_json_was_replaced(relative_run, model, tmp_path):
    """The checkpoint's tokenizer_sha256 is held against the file the record names: the same
    path holding another tokenizer (of the same vocabulary size) would turn the run's ids
    into other text; the unchanged file samples."""
    ours = prepared(model, "ours-sample", str(model / "hf" / "tokenizer.json"))
    sha256 = json.loads((ours / "meta.json").read_text())["tokenizer_sha256"]
    shutil.copytree(relative_run.directory / "run", tmp_path / "run")
    shutil.copytree(model / "hf", tmp_path / "hf")
    (path,) = (tmp_path / "run" / "checkpoints").glob("step_*/meta/metadata")
    meta = json.loads(path.read_text())
    meta["data"]["tokenizer"] = {
        "tokenizer": str(tmp_path / "hf" / "tokenizer.json"),
        "tokenizer_file": str(tmp_path / "hf" / "tokenizer.json"),
        "tokenizer_sha256": sha256,
    }
    path.write_text(json.dumps(meta))
    args = ["sample", str(tmp_path / "run"), "--prompt", CORPUS[0][:20], "--max-new-tokens", "2"]
    done = jaxkit(*args, "--no-progress")
    assert done.returncode == 0, done.stderr
    shutil.copy(model / "other" / "tokenizer.json", tmp_path / "hf" / "tokenizer.json")
    done = jaxkit(*args)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == (
        f"jaxkit: error: {tmp_path / 'hf' / 'tokenizer.json'} is not the tokenizer the run in "
        f"{tmp_path / 'run'}'s data was prepared with (tokenizer_sha256 {sha256[:12]}... "
        f"recorded, {done.stderr.split('recorded, ')[-1][:12]}... now)\n"
    )
    assert done.stderr.split("recorded, ")[-1][:12] != sha256[:12]

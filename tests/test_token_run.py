"""A Llama run from random weights on prepared token data, started in its own directory with
relative paths (`data.path=data --workdir run`), as people start runs: what a resume from
another working directory and an export read of the record it left."""

import json
import shutil
import types

import numpy as np
import pytest
from cli_run import jaxkit
from token_dirs import write_prepared

# A one-layer Llama, one step of 8 rows of 16 tokens on 8 CPU devices, no evaluation.
RUN = [
    "train", "llama_tiny", "model.vocab_size=64", "model.d_model=32", "model.num_layers=1",
    "model.num_heads=4", "model.num_kv_heads=2", "model.mlp_dim=64", "data.seq_len=16",
    "data.source=tokens", "train.steps=1", "train.eval_every=0",
    "batch.global_batch_size=8", "batch.per_device_batch_size=1", "--no-progress",
]  # fmt: skip


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """`jaxkit train ... data.path=data --workdir run` from `a/`: 30 documents of ids below
    64, each a BOS (0) and ending with eod_id 1, as `data prepare --bos` writes them."""
    tmp = tmp_path_factory.mktemp("token_run")
    rng = np.random.default_rng(0)
    docs = [
        ([0, *rng.integers(2, 64, 5).tolist()], rng.integers(2, 64, 4).tolist()) for _ in range(30)
    ]
    meta = write_prepared(
        tmp / "a" / "data", {"train": docs, "eval": docs[:8]}, vocab_size=64, eod_id=1
    )
    meta["bos_id"] = 0
    (tmp / "a" / "data" / "meta.json").write_text(json.dumps(meta))
    done = jaxkit(*RUN, "data.path=data", "--workdir", "run", cwd=tmp / "a")
    assert done.returncode == 0, done.stderr
    return types.SimpleNamespace(tmp=tmp, meta=meta)


def test_a_resume_from_another_directory_naming_the_same_data_resumes(run):
    """From a/'s parent, `data.path=a/data --workdir a/run` is the same data written from
    elsewhere: it was refused as a config change ('data' (saved) -> 'a/data')."""
    done = jaxkit(*RUN, "data.path=a/data", "--workdir", "a/run", cwd=run.tmp)
    assert done.returncode == 0, done.stderr
    assert "holds a finished run of 1 steps" in done.stdout, done.stdout


def test_the_same_relative_path_naming_other_data_is_a_change(run):
    """`data.path=data` from b/, where data/ is a copy of a/data (the same tokens): the
    string is the saved one, the directory another, and the change says both locations."""
    shutil.copytree(run.tmp / "a" / "data", run.tmp / "b" / "data")
    done = jaxkit(*RUN, "data.path=data", "--workdir", "../a/run", cwd=run.tmp / "b")
    assert done.returncode == 2, (done.stdout, done.stderr)
    said = (
        f"data.path: 'data' (saved, {run.tmp / 'a' / 'data'}) -> 'data' ({run.tmp / 'b' / 'data'})"
    )
    assert said in done.stderr, done.stderr


def test_an_export_names_the_datas_token_ids(run, tmp_path):
    """config.json had no bos/eos_token_id, so transformers took Llama's 1 and 2 while the
    data's documents ended with its eod_id: generate() never stopped. Both come from the
    data's meta.json as the run recorded it (bos_id: data prepared with --bos)."""
    done = jaxkit("export", str(run.tmp / "a" / "run"), "--hf", str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    ids = (cfg["eos_token_id"], cfg["bos_token_id"])
    assert ids == (run.meta["eod_id"], run.meta["bos_id"]) == (1, 0)


def test_a_null_vocabulary_is_the_token_files_and_the_plan_says_so(tmp_path):
    """`data prepare --tokenizer bytes` writes 257 ids (the 256 bytes and an end of
    document): lm_tiny's 256 is refused, offering model.vocab_size=null beside
    configs/lm_tiny_tokens.py. With null, the vocabulary is the files' meta.json's (as
    nanoGPT takes meta.pkl's): said before the plan (`plan` too; on stderr beside --json),
    trained and saved as 257, and a resume under null is the same run."""
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": f"document {i} " * 5}) + "\n" for i in range(20)))
    data = tmp_path / "data"
    done = jaxkit("data", "prepare", str(docs), "--tokenizer", "bytes", "--out", str(data),
                  "--eval-fraction", "0.2", "--no-progress")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads((data / "meta.json").read_text())["vocab_size"] == 257
    small = [
        "lm_tiny", "data.source=tokens", f"data.path={data}", "model.d_model=32",
        "model.num_layers=1", "model.num_heads=2", "model.mlp_dim=64", "data.seq_len=16",
        "train.steps=1", "train.eval_every=0", "batch.global_batch_size=8",
        "batch.per_device_batch_size=1",
    ]  # fmt: skip
    run = ["train", *small, "--workdir", str(tmp_path / "run"), "--no-progress"]
    done = jaxkit(*run)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert (
        f"data.path={str(data)!r} holds ids of a 257-token vocabulary, above "
        "model.vocab_size=256: set model.vocab_size=null to take the files' vocabulary (or "
        "257 or more); configs/lm_tiny_tokens.py is lm_tiny for such files"
    ) in done.stderr
    said = f"model.vocab_size=257: the vocabulary of data.path={data} (meta.json), as "
    said += "model.vocab_size=null asks"
    done = jaxkit(*run, "model.vocab_size=null")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == said and any(line.startswith("batch plan") for line in lines[1:])
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["model"]["vocab_size"] == 257
    done = jaxkit(*run, "model.vocab_size=null")  # the saved 257 against the files' again
    assert done.returncode == 0 and "holds a finished run of 1 steps" in done.stdout, done
    done = jaxkit("plan", *small, "model.vocab_size=null")
    assert done.returncode == 0 and done.stdout.splitlines()[0] == said, done
    done = jaxkit("plan", *small, "model.vocab_size=null", "--json")
    assert done.returncode == 0 and done.stderr == said + "\n", done
    assert json.loads(done.stdout)["global_batch_size"] == 8

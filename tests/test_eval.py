"""`jaxkit eval SOURCE` (jaxkit/commands/evaluate.py): the run's own eval outside the run,
on a run's checkpoint and on a Hugging Face directory, and what it refuses."""

import json
import math
import shutil
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_cli
from cli_run import jaxkit
from flax import nnx
from small_configs import SMALL_LM
from test_hf_reference import HF_SHAPE, jaxkit_config, random_tensors, read, write_hf_dir
from token_dirs import padded_prompt_completion
from tokenizers import Tokenizer as WordLevelTokenizer
from tokenizers import models

from jaxkit.commands import evaluate
from jaxkit.data import sources as data_lib
from jaxkit.hf import names
from jaxkit.step.train_step import _abstract_model

# lm_tiny holds out the last 5% of SMALL_LM's 60,000 bytes: rows of 16 bytes and the next.
HELD_OUT_ROWS = (60_000 - int(60_000 * 0.95) - 1) // 16
# Another layout or device count sums the same float32 terms in other orders (rows per
# batch, the matmuls' reductions split over fsdp and tensor): measured at most 2.4e-8
# relative on the loss (1 and 2 devices, 8 with fsdp and tensor axes; 3 gave it exactly).
# 1e-6 is 8 float32 epsilons; the slips it must catch are far larger: one target too many
# or too few in Σ weight moves the loss by 1 in 2,992 (3e-4), a row counted twice by 5e-5
# where its loss is 1% off the mean.
RTOL = 1e-6


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[str, dict]:
    """test_sampling's byte LM (2 steps at SMALL_LM's size; the same programs, compiled
    once per session), which evaluates its final step; and its summary."""
    workdir = tmp_path_factory.mktemp("eval") / "run"
    args = ["train", "lm_tiny", *SMALL_LM, "train.steps=2", "train.eval_every=0"]
    done = jaxkit(*args, "--workdir", str(workdir), "--no-progress")
    assert done.returncode == 0, done.stderr
    return str(workdir), json.loads((workdir / "summary.json").read_text())


def _json(*args: str) -> dict:
    done = jaxkit("eval", *args, "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_eval_gives_the_runs_own_eval_loss_at_its_final_checkpoint(run):
    """Every held-out row once (187 rows: the last of 6 batches of 32 padded), on the mesh
    and micro-batch the run evaluated its final step with: the same number, exactly."""
    workdir, summary = run
    result = _json(workdir)
    # every key, in order, but a mixture's eval_loss_by_source: this run reads one source
    assert list(result) == [key for key in evaluate.KEYS if key != "eval_loss_by_source"]
    assert result["eval_loss"] == summary["eval_loss"]
    assert result["eval_accuracy"] == summary["eval_accuracy"]
    assert result["eval_examples"] == HELD_OUT_ROWS and HELD_OUT_ROWS % 32 != 0
    assert result["eval_targets"] == HELD_OUT_ROWS * 16  # every byte of a row scored
    assert result["eval_perplexity"] == math.exp(result["eval_loss"])
    assert result["eval_bits_per_byte"] == result["eval_loss"] / math.log(2)
    done = jaxkit("eval", workdir)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        f"the run in {workdir}, step 2: {HELD_OUT_ROWS} held-out rows, "
        f"{HELD_OUT_ROWS * 16:,} targets scored",
        f"  eval loss {result['eval_loss']:.4f} nats/byte "
        f"({result['eval_bits_per_byte']:.4f} bits/byte), perplexity "
        f"{result['eval_perplexity']:.4g}, accuracy {result['eval_accuracy']:.2%}",
    ]
    # --examples: the first N rows, as train.eval_examples reads them.
    assert _json(workdir, "--examples", "5")["eval_targets"] == 5 * 16


def test_eval_on_another_layout_and_device_count_is_the_same_within_round_off(run):
    """fsdp 2 × tensor 2 on these 8 devices (batches of 16 rows, not 32), and 3 devices in a
    process of their own, over which the run's global batch of 64 does not split (batches
    of 3 × 4 rows): the same loss to float32 round-off, and the same hits."""
    workdir, summary = run
    three = test_cli.jaxkit("eval", workdir, "--host-devices", "3", "--json")
    assert three.returncode == 0, three.stderr
    for result in (_json(workdir, "mesh.fsdp=2", "mesh.tensor=2"), json.loads(three.stdout)):
        assert result["eval_loss"] == pytest.approx(summary["eval_loss"], rel=RTOL)
        assert result["eval_targets"] == HELD_OUT_ROWS * 16
        # Hits are counted, not summed in float32; a logit tie within round-off could
        # flip one, no more.
        hits = (result["eval_accuracy"] - summary["eval_accuracy"]) * result["eval_targets"]
        assert abs(hits) < 1.5


def test_eval_of_a_file_given_as_data_says_only_its_tail_is_held_out(run, tmp_path):
    """--data FILE (a text file here, nanoGPT's val.bin alike) is split as data.path is: its
    last data.eval_fraction held out, not the whole file a user may expect; stderr says so."""
    workdir, _ = run
    text = tmp_path / "other.txt"
    text.write_bytes(bytes(range(32, 127)) * 40)  # 3,800 bytes: 5% is 190, 11 rows of 16
    done = jaxkit("eval", workdir, "--data", str(text), "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["eval_examples"] == 11
    assert done.stderr.splitlines() == [
        f"data: --data {text} is not read whole: its held-out split, as a run on it holds it "
        "out, is its last data.eval_fraction=0.05 (11 rows; a directory in nanoGPT's layout "
        "holds out val.bin whole)"
    ]


def test_eval_of_a_nanogpt_directory_says_it_evaluates_val_bin(tmp_path):
    """Given nanoGPT's directory, an eval reads val.bin whole and says so (it said
    "training on train.bin", as a run on it is told)."""
    rng = np.random.default_rng(0)
    rng.integers(0, 48, 500).astype(np.uint16).tofile(tmp_path / "train.bin")
    rng.integers(0, 48, 200).astype(np.uint16).tofile(tmp_path / "val.bin")
    path, _ = _hf_dir(tmp_path / "model", 48)
    done = jaxkit("eval", f"hf:{path}", "--data", str(tmp_path), "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["eval_examples"] == (200 - 1) // 64  # rows of its context
    assert done.stderr.splitlines() == [
        f"data: --data {tmp_path} is in nanoGPT's layout: its held-out val.bin is evaluated"
    ]


def _hf_dir(tmp_path, vocab_size: int):
    hf_config = {"model_type": "llama", **HF_SHAPE, "vocab_size": vocab_size}
    path = write_hf_dir(tmp_path / "hf", hf_config, random_tensors(jaxkit_config(hf_config), 4))
    return path, hf_config


@pytest.mark.parametrize("seq_len", [None, 32])
def test_eval_of_an_hf_dir_on_prepared_tokens_is_the_weighted_mean_over_their_targets(
    tmp_path, seq_len
):
    """hf:DIR (no tokenizer of its own: a byte-level model) on prepared byte documents,
    their prompts masked: Σ weight × loss / Σ weight over the held-out windows' scored
    targets, against the model's logits on one device, summed here in float64. The rows
    are the model's context (config.json's max_position_embeddings=64, not llama_tiny's
    data.seq_len=128), or a data.seq_len within it."""
    data = tmp_path / "data"
    padded_prompt_completion(data)
    path, hf_config = _hf_dir(tmp_path, 257)
    override = [] if seq_len is None else [f"data.seq_len={seq_len}"]
    result = _json(f"hf:{path}", f"--data={data}", "mesh.fsdp=2", *override)
    rows_of = seq_len or hf_config["max_position_embeddings"]
    config = jaxkit_config(
        hf_config, f"data.seq_len={rows_of}", "data.source=tokens", f"data.path={data}"
    )
    _, held_out = data_lib.make_sources(config)
    rows = held_out[np.arange(len(held_out))]
    graphdef, _ = _abstract_model(config)
    params = names.from_hf(read(path), config.model)
    forward = jax.jit(lambda p, x: nnx.merge(graphdef, p)(x))
    logits = np.asarray(forward(params, jnp.asarray(rows["inputs"]))).astype(np.float64)
    z = logits - logits.max(-1, keepdims=True)
    log_p = z - np.log(np.exp(z).sum(-1, keepdims=True))
    loss = -np.take_along_axis(log_p, rows["targets"][..., None], -1)[..., 0]
    hits = logits.argmax(-1) == rows["targets"]
    w = rows["weights"].astype(np.float64)
    assert 0 < w.sum() < w.size  # prompts masked: some targets unscored
    assert result["eval_examples"] == len(held_out)
    assert result["eval_targets"] == w.sum()
    # float32 logits on one device against the eval's on fsdp 2 (see RTOL).
    assert result["eval_loss"] == pytest.approx((w * loss).sum() / w.sum(), rel=RTOL)
    assert result["eval_accuracy"] == pytest.approx((w * hits).sum() / w.sum(), abs=1e-9)
    assert "eval_bits_per_byte" not in result  # token ids, not bytes of text


def test_eval_refuses_what_it_cannot_evaluate_in_one_line(run, tmp_path):
    """Each refusal before any work: one line, exit 2, naming what is wrong."""
    workdir, _ = run
    data = tmp_path / "data"
    padded_prompt_completion(data)  # bytes, prepared: ids up to 256 (the end of a document)
    small, _ = _hf_dir(tmp_path / "small", 48)
    no_tokenizer, _ = _hf_dir(tmp_path / "big", 512)
    with_tokenizer, _ = _hf_dir(tmp_path / "tok", 300)
    WordLevelTokenizer(models.WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>")).save(
        str(with_tokenizer / "tokenizer.json")
    )
    # A run whose data is not what it was: its checkpoint's record of the held-out rows
    # edited, as if the corpus had grown since.
    moved = shutil.copytree(workdir, tmp_path / "moved")
    record = moved / "checkpoints" / "step_2" / "meta" / "metadata"
    meta = json.loads(record.read_text())
    meta["data"]["eval_rows"] += 1
    record.write_text(json.dumps(meta))
    cases = {
        (str(moved),): f"eval_rows {HELD_OUT_ROWS + 1!r} (saved) -> {HELD_OUT_ROWS!r}",
        (workdir, "--data", str(tmp_path / "nothing.txt")): (
            f"--data '{tmp_path / 'nothing.txt'}': is not a file"
        ),
        (workdir, "--step", "7"): "--step 7",
        (workdir, "model.d_model=64"): "model.d_model=64",
        (str(tmp_path),): "holds no checkpoint",
        (f"hf:{small}",): "give --data PATH",
        (f"hf:{no_tokenizer}", "--data", str(data)): (
            f"hf:{no_tokenizer} has no tokenizer.json, and its vocabulary of 512 is not bytes "
            "(257 or 256): add the tokenizer.json the model was trained with"
        ),
        (f"hf:{tmp_path / 'none'}", "--data", str(data)): (
            f"error: hf:{tmp_path / 'none'}: no such directory"
        ),
        (f"hf:{data}", "--data", str(data)): f"error: hf:{data}: no config.json: not a Hugging",
        (f"hf:{workdir}", "--data", str(data)): "a jaxkit run's workdir: give it without hf:",
        (f"hf:{small}", "--data", str(data)): "257-token vocabulary, above model.vocab_size=48",
        (f"hf:{with_tokenizer}", "--data", str(data)): f"--data {data} was prepared with "
        "--tokenizer bytes",
        (f"hf:{small}", "--data", str(data), "data.seq_len=65"): (
            f"data.seq_len=65: hf:{small} takes 64 positions (config.json's "
            "max_position_embeddings=64); give data.seq_len=64 or less"
        ),
        (workdir, "data.seq_len=8"): "may override mesh.*, model.attention and model.compute",
        (str(tmp_path / "no_run"),): f"{tmp_path / 'no_run'}: no such directory",
        (str(tmp_path / "moved" / "summary.json"),): "summary.json: a file, not a run's workdir",
    }
    for args, said in cases.items():
        done = jaxkit("eval", *args)
        assert done.returncode == 2 and done.stdout == "", args
        assert len(done.stderr.splitlines()) == 1 and said in done.stderr, done.stderr
        assert "model.init_from" not in done.stderr  # SOURCE is named as typed
    # argparse's usage errors: its usage line, then the error.
    for args, said in (
        ((), "the following arguments are required: SOURCE"),
        ((workdir, "--examples", "0"), "--examples: must be at least 1, got 0"),
        ((workdir, "--examples", "-2"), "--examples: must be at least 1, got -2"),
    ):
        done = jaxkit("eval", *args)
        assert done.returncode == 2 and said in done.stderr.splitlines()[-1], done.stderr


@pytest.mark.parametrize(
    "trained, given, refused",
    [
        ({"tokenizer": "bytes"}, {"tokenizer": "t.json", "tokenizer_sha256": "ab" * 32}, True),
        ({"tokenizer": "t.json", "tokenizer_sha256": "cd" * 32}, {"tokenizer": "bytes"}, True),
        (
            {"tokenizer": "a/t.json", "tokenizer_sha256": "ab" * 32},
            {"tokenizer": "b/t.json", "tokenizer_sha256": "ab" * 32},
            False,  # the same tokenizer, saved elsewhere
        ),
        ({"tokenizer": "t.json", "tokenizer_sha256": None}, {"tokenizer": "bytes"}, True),
        (
            {"tokenizer": "t.json", "tokenizer_sha256": None},
            {"tokenizer": "t.json", "tokenizer_sha256": "ab" * 32},
            False,  # data prepared before sha256 was recorded: the kit cannot tell
        ),
        (None, {"tokenizer": "bytes"}, False),  # foreign token files: nothing to compare
    ],
)
def test_a_runs_eval_refuses_token_data_of_another_tokenizer(trained, given, refused):
    """Only where both records say what they are (tokenizer_sha256, or bytes): ids of one
    tokenizer are other tokens to another at any vocabulary size."""
    source = types.SimpleNamespace(where="the run in r")
    train = types.SimpleNamespace(tokenizer=given)
    if refused:
        with pytest.raises(evaluate.common.UsageError, match="another tokenizer"):
            evaluate._check_tokenizer(source, trained, train, "d")
    else:
        evaluate._check_tokenizer(source, trained, train, "d")

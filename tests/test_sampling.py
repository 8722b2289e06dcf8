"""Sampling (jaxkit/generate/sampling.py, jaxkit/models/kv_cache.py): the cache against a full
forward pass, the distribution each setting defines, and a seed's samples on other device counts."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cli_run import jaxkit
from flax import nnx
from small_configs import SMALL_LM
from test_hf_reference import HF_SHAPE, flax_logits, jaxkit_config, random_tensors, write_hf_dir

from jaxkit import mesh as mesh_lib
from jaxkit.config import apply_overrides, load_config, run_config
from jaxkit.generate import sampling
from jaxkit.models import build_model
from jaxkit.models.common import Decoding

# Tiny shapes: compiling is most of each test's time. Prompts of 3, 5 and 1 tokens pad on
# the left to different lengths in one batch.
TINY = ["model.d_model=32", "model.mlp_dim=64", "model.num_layers=2", "data.seq_len=32"]
PROMPTS = [[5, 6, 7], [10, 11, 12, 13, 14], [1]]
NEW = 8


def _model(name: str, *overrides: str) -> tuple:
    config = load_config(name)
    apply_overrides(config, [*TINY, *overrides])
    with nnx.use_eager_sharding(False):
        model = build_model(run_config(config), nnx.Rngs(1))
    return config, model


def _mesh(config, devices: int) -> jax.sharding.Mesh:
    return mesh_lib.make_mesh(dict(config.mesh), jax.devices()[:devices])


@pytest.mark.parametrize(
    "name, scan, devices, mesh",
    [
        ("lm_tiny", False, 1, []),
        ("lm_tiny", True, 8, ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]),
        ("llama_tiny", True, 1, []),
        ("llama_tiny", False, 8, ["mesh.data=1", "mesh.fsdp=4", "mesh.tensor=2"]),
    ],
)
def test_cached_logits_equal_a_full_forward_pass_at_every_generated_position(
    name, scan, devices, mesh
):
    """Both families, scanned and unrolled, on one device and on 8 with fsdp and tensor
    axes: the logits each new token was drawn from (prefill, then steps over the cache, rows
    padded on the left) are the model's own logits over the whole prefix."""
    if devices == 1:
        mesh = ["mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1"]
    config, model = _model(name, f"model.scan_layers={scan}", *mesh)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    sampler = sampling.Sampler(run_config(config), _mesh(config, devices), params)
    samples, logits = sampler.generate(
        PROMPTS, max_new=NEW, settings=sampling.Settings(temperature=1.0), seed=0, keep_logits=True
    )
    # The full forward on one device, each row padded on the right (causal: unseen).
    rows = [s.prompt_tokens + s.tokens for s in samples]
    width = max(map(len, rows))
    batch = np.array([r + [0] * (width - len(r)) for r in rows], np.int32)
    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda state, t: nnx.merge(graphdef, state)(t))
    full_BxLxV = np.asarray(forward(state, jnp.asarray(batch)))
    for sample, row_logits, full_LxV in zip(samples, logits, full_BxLxV, strict=True):
        assert sample.finish_reason == "length" and len(sample.tokens) == NEW
        first = len(sample.prompt_tokens) - 1  # position whose logits choose new token 0
        # float32 throughout: the cache and the full pass add the same terms in other orders
        # (a masked padding key, one query against a cache), which moves logits of size ~1
        # by ~1e-6; a key or position off by one slot moves them by ~1e-1.
        np.testing.assert_allclose(row_logits, full_LxV[first : first + NEW], atol=1e-4)


def _softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max())
    return e / e.sum()


@pytest.mark.parametrize(
    "settings, expected",
    [
        # Temperature divides the logits.
        (sampling.Settings(temperature=0.5), _softmax(np.array([6.0, 4.0, 2.0, 0.0]))),
        # Top-k keeps the k largest, renormalised.
        (sampling.Settings(top_k=2), np.array([np.e, 1.0, 0.0, 0.0]) / (np.e + 1)),
        # Top-p keeps the fewest whose probability reaches p: 0.644 < 0.7, then 0.881.
        (sampling.Settings(top_p=0.7), np.array([np.e, 1.0, 0.0, 0.0]) / (np.e + 1)),
        (sampling.Settings(top_p=0.6), np.array([1.0, 0.0, 0.0, 0.0])),
        (sampling.Settings(top_p=1.0), _softmax(np.array([3.0, 2.0, 1.0, 0.0]))),
        # Top-k, then top-p on what it kept, at a temperature: softmax([6, 4, 2]) is
        # [0.867, 0.117, 0.016], so p=0.9 keeps two.
        (
            sampling.Settings(temperature=0.5, top_k=3, top_p=0.9),
            np.array([np.exp(6.0), np.exp(4.0), 0.0, 0.0]) / (np.exp(6.0) + np.exp(4.0)),
        ),
    ],
)
def test_temperature_top_k_and_top_p_give_the_distribution_they_define(settings, expected):
    logits_BxV = jnp.array([[3.0, 2.0, 1.0, 0.0], [1.0, 0.0, 3.0, 2.0]])
    p_BxV = np.asarray(sampling.distribution(logits_BxV, settings))
    # float32 softmax of small logits: exact to ~1e-7 of each probability.
    np.testing.assert_allclose(p_BxV[0], expected, atol=1e-6)
    np.testing.assert_allclose(p_BxV[1], expected[[2, 3, 0, 1]], atol=1e-6)  # same, permuted


def test_tokens_are_drawn_from_that_distribution_and_greedy_takes_the_most_probable():
    settings = sampling.Settings(temperature=0.5, top_k=3)
    rows = 20_000
    logits_BxV = jnp.tile(jnp.array([[3.0, 2.0, 1.0, 0.0]]), (rows, 1))
    keys_B = jax.vmap(lambda r: jax.random.fold_in(jax.random.key(0), r))(jnp.arange(rows))
    drawn = np.asarray(
        jax.jit(sampling.next_tokens, static_argnums=2)(logits_BxV, keys_B, settings)
    )
    expected = np.asarray(sampling.distribution(logits_BxV[:1], settings))[0]
    counts = np.bincount(drawn, minlength=4) / rows
    # 20,000 draws: each frequency within 5 standard errors (sqrt(p(1-p)/n) ≤ 0.0036).
    np.testing.assert_allclose(counts, expected, atol=0.018)
    assert counts[3] == 0  # outside the top 3: never drawn
    greedy = sampling.next_tokens(logits_BxV[:2], keys_B[:2], sampling.Settings(temperature=0))
    assert np.asarray(greedy).tolist() == [0, 0]


@pytest.mark.parametrize("temperature", [1e-9, 1e-30, 1e-300])
def test_a_temperature_near_0_draws_what_greedy_takes(temperature):
    """Dividing the logits first overflowed float32 near 1e-9, and draws fell on junk."""
    logits_BxV = jnp.array([[3.0, 2.5, 1.0, 0.0], [1.0, 0.0, 3.0, 2.0]])
    settings = sampling.Settings(temperature=temperature)
    p_BxV = np.asarray(jax.jit(sampling.distribution, static_argnums=1)(logits_BxV, settings))
    np.testing.assert_array_equal(p_BxV, np.eye(4, dtype=np.float32)[[0, 2]])
    keys_B = jax.vmap(lambda r: jax.random.fold_in(jax.random.key(3), r))(jnp.arange(2))
    drawn = jax.jit(sampling.next_tokens, static_argnums=2)(logits_BxV, keys_B, settings)
    assert np.asarray(drawn).tolist() == [0, 2]  # as compiled in the generation program


def test_a_seed_gives_the_same_samples_on_1_and_8_devices():
    """Row r's draw at step t uses fold_in(fold_in(key(seed), r), t): not the device
    count, the batch (5 rows: 8 on 8 devices, padded) or the sharding."""
    config, model = _model("llama_tiny")
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    prompts = [*PROMPTS, [3, 4], [9] * 6]
    settings = sampling.Settings(temperature=0.8, top_k=50, top_p=0.95)
    drawn = []
    for devices, mesh in (
        (1, ["mesh.data=1"]),
        (8, ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]),
    ):
        apply_overrides(config, [*mesh, "mesh.fsdp=1", "mesh.tensor=1"] if devices == 1 else mesh)
        sampler = sampling.Sampler(run_config(config), _mesh(config, devices), params)
        for seed in (0, 1):
            samples, _ = sampler.generate(prompts, max_new=NEW, settings=settings, seed=seed)
            drawn.append([s.tokens for s in samples])
    assert drawn[0] == drawn[2] and drawn[1] == drawn[3]
    assert drawn[0] != drawn[1]  # another seed, other samples
    # A stop id ends each row where it is first drawn, itself left out; rows without it run
    # to the end (the ids are an argument of the same program).
    stop = drawn[2][0][3]
    samples, _ = sampler.generate(prompts, max_new=NEW, settings=settings, eos_ids=[stop, 999])
    for sample, tokens in zip(samples, drawn[2], strict=True):
        cut = tokens.index(stop) if stop in tokens else NEW
        assert sample.tokens == tokens[:cut]
        assert sample.finish_reason == ("eos" if stop in tokens else "length")
    assert samples[0].finish_reason == "eos" and len(samples[0].tokens) <= 3


def test_a_rows_draws_follow_its_place_among_all_rows_not_within_its_batch():
    """66 samples of one prompt run as batches of 64 and 2: row r draws with row r's keys
    (its first token is the independent draw of fold_in(fold_in(key(seed), r), 0) from the
    prompt's distribution), so samples 64 and 65 are not samples 0 and 1 again."""
    config, model = _model("lm_tiny", "mesh.data=1")
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    sampler = sampling.Sampler(run_config(config), _mesh(config, 1), params)
    settings = sampling.Settings(temperature=1.0)
    rows = 66
    samples, _ = sampler.generate([PROMPTS[1]] * rows, max_new=4, settings=settings, seed=5)
    assert sampler.rows_per_batch(rows) == sampling.MAX_BATCH_ROWS < rows
    drawn = [s.tokens for s in samples]
    assert drawn[64:] != drawn[:2]
    graphdef, state = nnx.split(model)
    logits_V = nnx.merge(graphdef, state)(jnp.asarray([PROMPTS[1]]))[0, -1]
    log_p_V = jnp.log(sampling.distribution(logits_V[None], settings)[0])
    for r in (0, 1, 64, 65):
        key = jax.random.fold_in(jax.random.fold_in(jax.random.key(5), r), 0)
        assert drawn[r][0] == int(jax.random.categorical(key, log_p_V)), r


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> str:
    """A byte LM trained for 2 steps at SMALL_LM's size (rows of 16 bytes)."""
    workdir = str(tmp_path_factory.mktemp("sample") / "run")
    args = ["train", "lm_tiny", *SMALL_LM, "train.steps=2", "train.eval_every=0"]
    done = jaxkit(*args, "--workdir", workdir, "--no-progress")
    assert done.returncode == 0, done.stderr
    return workdir


def test_sample_prints_a_json_object_per_sample_from_a_runs_checkpoint(trained_run, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "é"}) + "\n\n" + json.dumps({"prompt": "x"}) + "\n")
    done = jaxkit(
        "sample", trained_run, "mesh.fsdp=2", "--prompt", "def ", "--prompts", str(prompts),
        "--num-samples", "2", "--max-new-tokens", "6", "--temperature", "0", "--json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert [line["prompt"] for line in lines] == ["def ", "def ", "é", "é", "x", "x"]
    for line in lines:
        assert list(line) == ["prompt", "prompt_tokens", "tokens", "text", "finish_reason"]
        assert line["prompt_tokens"] == list(line["prompt"].encode())
        # Byte data has no end-of-document id: every sample runs to --max-new-tokens.
        assert len(line["tokens"]) == 6 and line["finish_reason"] == "length"
        assert line["text"] == bytes(line["tokens"]).decode(errors="replace")
    assert lines[0]["tokens"] == lines[1]["tokens"]  # greedy: one answer
    # Without --json: each sample's prompt and text, a blank line between samples.
    done = jaxkit(
        "sample", trained_run, "mesh.fsdp=2", "--prompt", "def ", "--prompts", str(prompts),
        "--num-samples", "2", "--max-new-tokens", "6", "--temperature", "0",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    expected = "\n".join(line["prompt"] + line["text"] + "\n" for line in lines)
    assert done.stdout == expected


def test_a_prompts_file_is_cut_into_prompts_at_newlines_only(trained_run, tmp_path):
    """A .txt's prompts and a .jsonl's JSON strings may hold a lone carriage return, a form
    feed, U+0085 or U+2028 raw: each line, ended by "\n" or "\r\n", is one prompt (a BOM
    none of its text)."""
    held = ["a\rb", "c\x0cd", "e\x85f", "g\u2028h"]
    (tmp_path / "p.txt").write_bytes(("\ufeff" + "\r\n".join(held) + "\n").encode())
    (tmp_path / "p.jsonl").write_text(
        "".join(json.dumps({"prompt": p}, ensure_ascii=False) + "\n" for p in held),
        encoding="utf-8",
        newline="",
    )
    for name in ("p.txt", "p.jsonl"):
        done = jaxkit(
            "sample", trained_run, "--prompts", str(tmp_path / name),
            "--max-new-tokens", "1", "--temperature", "0", "--json",
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        lines = done.stdout.split("\n")[:-1]  # the JSON strings hold those characters raw
        assert [json.loads(line)["prompt"] for line in lines] == held, name


def test_sample_refuses_what_the_model_cannot_generate_in_one_line(trained_run, tmp_path):
    """The byte LM's learned positions end at data.seq_len=16, prompt included; a sample
    changes no model key."""
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a"}\n{"text": "b"}\n')
    (tmp_path / "p.csv").write_text("a\n")
    (tmp_path / "lone.jsonl").write_text('{"prompt": "a"}\n{"prompt": "b\\udcff"}\n')
    cases = {
        ("--prompts", str(tmp_path / "bad.jsonl")): "line 2 is not a JSON object",
        ("--prompts", str(tmp_path / "p.csv")): "a .jsonl",
        ("--prompt", "é", "--prompt", "\N{SNOWMAN}" * 6): (
            "prompt '☃☃☃☃☃☃' is 18 tokens, longer than the model's context of 16 positions "
            "(its learned positions end at data.seq_len=16), new tokens included: give a "
            "shorter prompt, or --truncate-left to keep its last 8"
        ),
        ("--prompt", "def ", "--max-new-tokens", "13"): "data.seq_len=16",
        ("--prompt", "x", "--max-new-tokens", "16"): "--max-new-tokens 16: the model's context",
        # Bytes that are not UTF-8 on the command line (Python's argv holds them escaped),
        # and a lone surrogate a JSON escape makes.
        ("--prompt", "ab\udcffcd"): (
            "--prompt 'ab\\xffcd' is not UTF-8 text (byte 0xff): give it as UTF-8"
        ),
        ("--prompts", str(tmp_path / "lone.jsonl")): (
            f"--prompts {tmp_path / 'lone.jsonl'}: line 2's prompt is not UTF-8 text (a lone "
            "surrogate \\udcff)"
        ),
        ("model.d_model=64", "--prompt", "x"): "model.d_model=64",
        ("--prompt", "x", "--step", "7"): "--step 7",
        (): "no prompt",
    }
    for args, said in cases.items():
        done = jaxkit("sample", trained_run, *args)
        assert done.returncode == 2 and done.stdout == "", args
        assert len(done.stderr.splitlines()) == 1 and said in done.stderr, done.stderr
    done = jaxkit("sample", str(tmp_path / "no_run"), "--prompt", "x")
    assert done.returncode == 2
    assert done.stderr == f"jaxkit: error: {tmp_path / 'no_run'}: no such directory\n"
    # Values out of range: argparse's usage errors (its usage line, then the error).
    for option, value, said in (
        ("--seed", str(2**32), "--seed: must be below 2**32"),
        ("--temperature", "nan", "--temperature: must be a finite number"),
        ("--top-p", "0", "--top-p: must be in (0, 1]"),
    ):
        done = jaxkit("sample", trained_run, "--prompt", "x", option, value)
        assert done.returncode == 2 and said in done.stderr.splitlines()[-1], done.stderr
    # Without --max-new-tokens: its default of 128, or as many as the positions allow.
    fits = jaxkit("sample", trained_run, "--prompt", "def ", "--json")
    assert fits.returncode == 0, fits.stderr
    assert len(json.loads(fits.stdout)["tokens"]) == 12


def test_truncate_left_keeps_a_prompts_last_tokens_and_generates_from_them(trained_run):
    """A prompt longer than the context (16 bytes) keeps its last 16 - N with
    --truncate-left, and samples as that tail given whole would; stderr says it was cut."""
    prompt = "import os, sys, re\n"  # 19 bytes
    args = ["--max-new-tokens", "6", "--temperature", "0", "--json", "--no-progress"]
    cut = jaxkit("sample", trained_run, "--prompt", prompt, "--truncate-left", *args)
    assert cut.returncode == 0, cut.stderr
    assert cut.stderr == (
        f"note: prompt {prompt!r} is 19 tokens: cut on the left to its last 10, leaving 6 new "
        "tokens in the model's context of 16\n"
    )
    tail = jaxkit("sample", trained_run, "--prompt", prompt[-10:], *args)
    assert tail.returncode == 0, tail.stderr
    line, expected = json.loads(cut.stdout), json.loads(tail.stdout)
    assert line["prompt"] == prompt and line["prompt_tokens"] == list(prompt[-10:].encode())
    assert line["tokens"] == expected["tokens"] and len(line["tokens"]) == 6
    # Without --max-new-tokens: half the context is left to the new tokens.
    halves = jaxkit("sample", trained_run, "--prompt", prompt, "--truncate-left", "--json")
    assert halves.returncode == 0, halves.stderr
    assert len(json.loads(halves.stdout)["prompt_tokens"]) == 8
    assert len(json.loads(halves.stdout)["tokens"]) == 8


def test_a_long_generation_shows_progress_on_stderr_unless_no_progress(trained_run, monkeypatch):
    """The bar shows where generating takes over PROGRESS_DELAY_S (0 here), the program
    then run PROGRESS_STEPS tokens at a time (5 here): the same samples as one call."""
    monkeypatch.setattr(sampling, "PROGRESS_DELAY_S", 0.0)
    monkeypatch.setattr(sampling, "PROGRESS_STEPS", 5)
    args = ["sample", trained_run, "--prompt", "def ", "--max-new-tokens", "12", "--json"]
    shown = jaxkit(*args, "--num-samples", "2")
    assert shown.returncode == 0, shown.stderr
    assert "generating" in shown.stderr and "12/12" in shown.stderr, shown.stderr
    quiet = jaxkit(*args, "--num-samples", "2", "--no-progress")
    assert quiet.returncode == 0 and quiet.stderr == "", quiet.stderr
    assert shown.stdout == quiet.stdout
    assert [len(json.loads(line)["tokens"]) for line in quiet.stdout.splitlines()] == [12, 12]


def test_sample_takes_an_hf_dirs_context_from_max_position_embeddings(tmp_path):
    """A rotary model has no position table to end: its context is config.json's
    max_position_embeddings (64 here), prompt and new tokens together."""
    hf_config = {"model_type": "llama", **HF_SHAPE, "tie_word_embeddings": False}
    path = write_hf_dir(tmp_path / "hf", hf_config, random_tensors(jaxkit_config(hf_config), 3))
    why = "config.json's max_position_embeddings=64"
    long = "!#%&" * 17  # 68 bytes, within the vocabulary of 48
    for args, said in (
        (("--prompt", "!#", "--max-new-tokens", "2000"), f"context is 64 positions ({why})"),
        (("--prompt", "!#", "--max-new-tokens", "63"), "give at most 62 new tokens"),
        (
            ("--prompt", long),
            f"is 68 tokens, longer than the model's context of 64 positions ({why})",
        ),
    ):
        done = jaxkit("sample", f"hf:{path}", *args)
        assert done.returncode == 2 and done.stdout == "", args
        assert len(done.stderr.splitlines()) == 1 and said in done.stderr, done.stderr
    done = jaxkit(
        "sample", f"hf:{path}", "--prompt", long, "--truncate-left", "--max-new-tokens", "4",
        "--temperature", "0", "--json", "--no-progress",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    line = json.loads(done.stdout)
    assert line["prompt_tokens"] == list(long.encode())[-60:] and len(line["tokens"]) == 4
    # config.json without max_position_embeddings: transformers' default of 2048.
    del hf_config["max_position_embeddings"]
    (path / "config.json").write_text(json.dumps(hf_config))
    done = jaxkit("sample", f"hf:{path}", "--prompt", "!#", "--max-new-tokens", "2047")
    assert done.returncode == 2
    assert (
        "context is 2048 positions (transformers' default, as config.json gives no "
        "max_position_embeddings)" in done.stderr
    ), done.stderr


def test_an_hf_source_is_refused_as_typed(trained_run, tmp_path):
    """SOURCE hf:DIR is named as the user typed it (loading it said model.init_from=hf:DIR,
    the key train takes): a file, a run's workdir and an empty --prompts file are said as
    what they are."""
    (tmp_path / "file.txt").write_text("x\n")
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "config.json").write_text("{}")
    (tmp_path / "empty.txt").write_text("\n\n")
    cases = {
        ("hf:",): "SOURCE 'hf:' names no directory: give hf:DIR",
        (f"hf:{tmp_path / 'none'}",): (
            f"hf:{tmp_path / 'none'}: no such directory (nothing is downloaded: fetch it first)"
        ),
        (f"hf:{tmp_path / 'file.txt'}",): f"hf:{tmp_path / 'file.txt'}: a file, not a directory",
        (f"hf:{trained_run}",): f"hf:{trained_run}: a jaxkit run's workdir: give it without hf:",
        (f"hf:{tmp_path / 'bare'}",): f"hf:{tmp_path / 'bare'} holds no *.safetensors weights",
        (trained_run, "--prompts", str(tmp_path / "empty.txt")): (
            f"--prompts {tmp_path / 'empty.txt'} holds no prompt, only blank lines or none"
        ),
    }
    for args, said in cases.items():
        done = jaxkit("sample", *args, *([] if "--prompts" in args else ["--prompt", "x"]))
        assert done.returncode == 2 and done.stdout == "", args
        assert done.stderr.startswith("jaxkit: error: ") and said in done.stderr, done.stderr
        assert len(done.stderr.splitlines()) == 1 and "model.init_from" not in done.stderr


def test_an_hf_dir_without_a_tokenizer_samples_bytes_only(tmp_path):
    """No tokenizer.json: a vocabulary of bytes (257 or fewer) reads prompts as bytes; a
    larger one is refused, its ids being some tokenizer's (printed as U+FFFD before)."""
    hf_config = {"model_type": "llama", **HF_SHAPE, "vocab_size": 512}
    path = write_hf_dir(tmp_path / "hf", hf_config, random_tensors(jaxkit_config(hf_config), 3))
    done = jaxkit("sample", f"hf:{path}", "--prompt", "import", "--max-new-tokens", "2")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == (
        f"jaxkit: error: hf:{path} has no tokenizer.json, and its vocabulary of 512 is not "
        f"bytes (257 or 256): add the tokenizer.json the model was trained with to {path}\n"
    )
    hf_config["vocab_size"] = 257  # the 256 bytes and an end of document: bytes it is
    path = write_hf_dir(tmp_path / "bytes", hf_config, random_tensors(jaxkit_config(hf_config), 3))
    args = ["--prompt", "import", "--max-new-tokens", "2", "--json", "--no-progress"]
    done = jaxkit("sample", f"hf:{path}", *args)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["prompt_tokens"] == list(b"import")


def test_the_usage_line_shows_that_prompt_and_prompts_go_together():
    done = jaxkit("sample", "--help")
    assert done.returncode == 0
    assert "[--prompt TEXT ...] [--prompts FILE]" in " ".join(done.stdout.split())


@pytest.mark.parametrize("tied", [False, True])
def test_greedy_from_an_hf_dir_gives_the_flax_llamas_greedy_tokens(tmp_path, tied):
    """`jaxkit sample hf:DIR` at temperature 0 against transformers' FlaxLlamaForCausalLM
    decoding greedily on the same directory (grouped-query heads: 4 query, 2 key/value),
    32 new tokens on a mesh of fsdp 2 × tensor 2. Each step's top-2 margin is asserted
    above 1e-4, far above float32 round-off, so a near-tie cannot flip a token."""
    hf_config = {"model_type": "llama", **HF_SHAPE, "tie_word_embeddings": tied}
    tensors = random_tensors(jaxkit_config(hf_config), seed=2 if tied else 3)
    if tied:  # the Flax Llama has no tied head: the table as lm_head.weight too
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    path = write_hf_dir(tmp_path / "hf", hf_config, tensors)
    prompt, new = "!#%&", 32  # bytes 33-38: within the vocabulary of 48, as no tokenizer
    done = jaxkit(
        "sample", f"hf:{path}", "mesh.fsdp=2", "mesh.tensor=2", "--prompt", prompt,
        "--temperature", "0", "--max-new-tokens", str(new), "--json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    sampled = json.loads(done.stdout)["tokens"]
    # The Flax Llama's greedy decoding: the whole row each step (right padding is unseen).
    row = np.zeros((1, len(prompt) + new), np.int32)
    row[0, : len(prompt)] = list(prompt.encode())
    for t in range(new):
        logits = flax_logits(path, row)[0, len(prompt) + t - 1]
        top2 = np.sort(logits)[-2:]
        assert top2[1] - top2[0] > 1e-4, f"near-tie at step {t}"
        row[0, len(prompt) + t] = int(np.argmax(logits))
    assert sampled == row[0, len(prompt) :].tolist()


def test_an_hf_dirs_sentencepiece_style_text_reads_on_from_the_prompt(tmp_path):
    """A Metaspace decoder (Llama 2's, Mistral's) reads "▁w5" as "w5" at a text's start and
    " w5" after another word: the text printed after the prompt keeps its space."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    hf_config = {"model_type": "llama", **HF_SHAPE, "tie_word_embeddings": False}
    path = write_hf_dir(tmp_path / "hf", hf_config, random_tensors(jaxkit_config(hf_config), 3))
    words = {f"\N{LOWER ONE EIGHTH BLOCK}w{i}": i for i in range(HF_SHAPE["vocab_size"])}
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="\N{LOWER ONE EIGHTH BLOCK}w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    tokenizer.save(str(path / "tokenizer.json"))
    args = ["sample", f"hf:{path}", "--prompt", "w1 w2", "--max-new-tokens", "3"]
    done = jaxkit(*args, "--temperature", "0", "--json")
    assert done.returncode == 0, done.stderr
    sample = json.loads(done.stdout)
    assert sample["prompt_tokens"] == [1, 2]
    assert sample["text"] == "".join(f" w{token}" for token in sample["tokens"])
    plain = jaxkit(*args, "--temperature", "0")
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout == "w1 w2" + sample["text"] + "\n"


def test_recomputing_the_prefix_gives_the_tokens_the_cache_gives():
    """The path a model of your own takes (no cache: the whole prefix each step, rows padded
    on the right), run on the byte LM, draws what its cache draws. Its rows stay within
    data.seq_len=32 (a bucket of 16 and 20 new tokens would not: learned positions end)."""
    config, model = _model("lm_tiny", "mesh.data=1")
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    cached = sampling.Sampler(run_config(config), _mesh(config, 1), params)
    recomputed = sampling.Sampler(run_config(config), _mesh(config, 1), params)
    recomputed.decoding = Decoding(cache=None, max_positions=32)
    settings = sampling.Settings(temperature=0.7, top_k=40)
    drawn = [
        [s.tokens for s in sampler.generate(PROMPTS, max_new=20, settings=settings)[0]]
        for sampler in (cached, recomputed)
    ]
    assert drawn[0] == drawn[1]


def test_a_classifier_is_refused_in_one_line_as_a_source_of_text():
    """sample and the lm-eval model ask an opened SOURCE for its decoding contract; a
    classifier has none and is refused naming the source and its kind."""
    from jaxkit.config import UsageError, load_config
    from jaxkit.generate.source import Source

    lm = Source(config=load_config("lm_tiny"), where="runs/lm", meta={})
    assert lm.decoding("unused").max_positions == lm.config.data.seq_len
    classifier = Source(config=load_config("mlp_digits"), where="runs/digits", meta={})
    with pytest.raises(UsageError) as refused:
        classifier.decoding("it generates no text")
    assert str(refused.value) == (
        "runs/digits trained model.kind='mlp', a classifier: it generates no text"
    )

"""A damaged or foreign model.init_from=hf:DIR is one line and exit status 2, naming the file,
field or tensor (docs/exit-statuses.md): weight files that are not safetensors, config.json
fields the loader cannot read, dtypes it does not load, and weights that are not finite.
Small random HF directories written here, nothing downloaded."""

import json
import shutil

import jax
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
from test_hf_io import SMALL, loaded_state, refused, small_config, write_hf

from jaxkit.config import ConfigError
from jaxkit.hf import load as hf_load

BF16 = np.dtype(ml_dtypes.bfloat16)


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """A sound directory (bfloat16, untied) to copy and damage; its config.json and tensors."""
    directory = tmp_path_factory.mktemp("hf") / "good"
    tensors = write_hf(directory, small_config().model)
    return directory, json.loads((directory / "config.json").read_text()), tensors


def copy_of(good, tmp_path, name):
    directory = tmp_path / name
    shutil.copytree(good[0], directory)
    return directory


def train_line(tmp_path, directory, *extra):
    """`jaxkit train` from `directory`, as a user starts one; a refusal leaves no workdir."""
    workdir = tmp_path / "run"
    return [
        "train",
        "llama_tiny",
        *SMALL,
        f"model.init_from=hf:{directory}",
        *extra,
        "--workdir",
        str(workdir),
        "--no-progress",
    ]


def test_a_weight_file_that_is_not_safetensors_is_one_line_naming_it(good, tmp_path):
    whole = (good[0] / "model.safetensors").read_bytes()
    damaged = {
        "truncated": whole[: len(whole) - 100],  # a download cut short
        "empty": b"",
        "garbage": b"<html>403 Forbidden</html>\n" * 8,  # a login page saved as the file
    }
    for name, content in damaged.items():
        directory = copy_of(good, tmp_path, name)
        (directory / "model.safetensors").write_bytes(content)
        refused(
            *train_line(tmp_path, directory),
            says=[f"hf:{directory}: model.safetensors is not a readable safetensors file"],
        )
    # Sharded: one shard cut short is named; an index whose weight_map is not a map of names
    # to files is said as such (an AttributeError before).
    sharded = tmp_path / "sharded"
    write_hf(sharded, small_config().model, files=2)
    shard = sharded / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1])
    refused(*train_line(tmp_path, sharded), says=[f"{shard.name} is not a readable safetensors"])
    index = sharded / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": [shard.name]}))
    refused(*train_line(tmp_path, sharded), says=["weight_map is not an object of tensor names"])
    assert not (tmp_path / "run").exists()


# Each config.json field the loader reads, broken as a hand-edited or foreign file breaks it:
# (field, value; None removes it), and what the message must say.
BROKEN_FIELDS = [
    ("intermediate_size", None, "config.json gives no intermediate_size"),
    ("hidden_size", None, "config.json gives no hidden_size"),
    ("num_hidden_layers", None, "config.json gives no num_hidden_layers"),
    ("num_attention_heads", None, "config.json gives no num_attention_heads"),
    ("vocab_size", None, "config.json gives no vocab_size"),
    ("num_attention_heads", "4", 'num_attention_heads="4": must be an integer ≥ 1'),
    ("num_hidden_layers", True, "num_hidden_layers=true: must be an integer ≥ 1"),
    ("hidden_size", 32.0, "hidden_size=32.0: must be an integer ≥ 1"),
    ("vocab_size", 0, "vocab_size=0: must be an integer ≥ 1"),
    ("intermediate_size", -64, "intermediate_size=-64: must be an integer ≥ 1"),
    ("num_key_value_heads", 0, "num_key_value_heads=0: must be an integer ≥ 1"),
    ("num_key_value_heads", 3, "num_attention_heads=4 is not divisible by num_key_value_heads=3"),
    ("head_dim", "8", 'head_dim="8": must be an integer ≥ 1'),
    ("rope_theta", "10000", 'rope_theta="10000": must be a number > 0'),
    ("rope_theta", 0, "rope_theta=0: must be > 0"),
    ("rms_norm_eps", -1e-5, "rms_norm_eps=-1e-05: must be > 0"),
    ("tie_word_embeddings", "false", 'tie_word_embeddings="false": must be true or false'),
    ("attention_bias", "false", 'attention_bias="false": must be true or false'),
    ("hidden_act", 7, "hidden_act=7: must be a string"),
    ("sliding_window", "4096", 'sliding_window="4096": must be an integer ≥ 1'),
    ("rope_scaling", [8.0], "rope_scaling=[8.0] is not a dict"),
    (
        "rope_scaling",
        {
            "rope_type": "llama3",
            "factor": "8",
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
        },
        "config.json rope_scaling=",
    ),
]


def test_each_config_json_field_the_loader_reads_is_one_line_naming_it(good, tmp_path):
    directory = copy_of(good, tmp_path, "hf")
    for field, value, says in BROKEN_FIELDS:
        cfg = {k: v for k, v in good[1].items() if k != field}
        if value is not None:
            cfg[field] = value
        (directory / "config.json").write_text(json.dumps(cfg))
        refused(*train_line(tmp_path, directory), says=[f"hf:{directory}: ", says])
    # hidden_size 30 over 4 heads, with no head_dim to give the width: the tensors' shapes
    # are not known, so it is said as such (not as weights that disagree with config.json).
    cfg = {k: v for k, v in good[1].items() if k != "head_dim"} | {"hidden_size": 30}
    (directory / "config.json").write_text(json.dumps(cfg))
    refused(
        *train_line(tmp_path, directory),
        says=["hidden_size=30 is not divisible by num_attention_heads=4 and there is no head_dim"],
    )
    assert not (tmp_path / "run").exists()


def test_float64_weights_are_refused_as_a_dtype_not_a_disagreement(good, tmp_path):
    directory = copy_of(good, tmp_path, "f64")
    tensors = {name: t.astype(np.float64) for name, t in good[2].items()}
    safetensors.numpy.save_file(tensors, directory / "model.safetensors")
    refused(
        *train_line(tmp_path, directory),
        says=["model.embed_tokens.weight is stored as F64, a dtype jaxkit does not load"],
    )


# test_hf_io's stopped_run's settings: the same step program, which the session's compile
# cache then holds once for both (the check itself runs after the step compiles).
STOPPED_RUN = [
    "train.steps=2",
    "train.log_every=1",
    "checkpoint.every=1",
    "batch.global_batch_size=16",
    "batch.per_device_batch_size=1",
    "train.eval_examples=8",
]


def with_value(good, tmp_path, name, tensor, index, value, *overrides):
    """A copy of the good directory whose `tensor` holds `value` at `index`."""
    directory = copy_of(good, tmp_path, name)
    tensors = dict(good[2])
    damaged = tensors[tensor].copy()
    damaged[index] = value
    tensors[tensor] = damaged
    safetensors.numpy.save_file(tensors, directory / "model.safetensors")
    return directory


def test_a_non_finite_weight_is_refused_before_the_first_step(good, tmp_path):
    # One NaN in one (out, in) entry: in jaxkit's (in, out) kernel it sits in one fsdp row
    # block and one tensor column block, on 2 of the 8 devices.
    directory = with_value(
        good, tmp_path, "nan", "model.layers.1.mlp.up_proj.weight", (5, 3), np.nan
    )
    refused(
        *train_line(tmp_path, directory, *STOPPED_RUN),
        says=[
            f"hf:{directory}: model.layers.1.mlp.up_proj.weight (param blocks/1/up/kernel) "
            "holds NaN or infinite values as loaded"
        ],
    )
    # Refused before the first step: nothing was logged or saved.
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    assert not (tmp_path / "run" / "checkpoints").exists() or not any(
        (tmp_path / "run" / "checkpoints").iterdir()
    )


def test_a_scanned_model_names_the_layer_whose_weight_is_not_finite(good, tmp_path):
    directory = with_value(
        good, tmp_path, "inf", "model.layers.1.self_attn.k_proj.weight", (0, 31), -np.inf
    )
    config = small_config(f"model.init_from=hf:{directory}", "model.scan_layers=true")
    hf_load.apply_init_from(config)
    with pytest.raises(ConfigError, match=r"k_proj\.weight \(param blocks/key/kernel\[1\]\)"):
        loaded_state(config, {"data": 2, "fsdp": 2, "tensor": 2})
    # The same directory, finite again: the check passes and the params are the file's.
    fixed = with_value(good, tmp_path, "fixed", "model.layers.1.self_attn.k_proj.weight", 0, 0)
    config = small_config(f"model.init_from=hf:{fixed}", "model.scan_layers=true")
    hf_load.apply_init_from(config)
    _, state = loaded_state(config, {"data": 2, "fsdp": 2, "tensor": 2})
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state.params))


# Fields transformers reads null as their default: the width from the sizes, no sliding
# window, no rope scaling. Every other field the loader reads is refused null.
NULLABLE = ("head_dim", "sliding_window", "rope_scaling", "num_key_value_heads")
NULL_REFUSED = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "tie_word_embeddings",
    "rope_theta",
    "rms_norm_eps",
    "hidden_act",
    "attention_bias",
    "mlp_bias",
)


def test_a_null_config_json_field_is_refused_unless_transformers_reads_null(good, tmp_path):
    """`"rope_theta": null` was taken as 10000 (a missing field's default) and exported as
    null; null is a wrong value for it, said as the field's rule words it."""
    directory = copy_of(good, tmp_path, "hf")
    for field in NULL_REFUSED:
        (directory / "config.json").write_text(json.dumps(good[1] | {field: None}))
        refused(
            *train_line(tmp_path, directory), says=[f"hf:{directory}: config.json {field}=null"]
        )
    assert not (tmp_path / "run").exists()
    # A missing rope_theta keeps transformers' default, as before.
    cfg = {k: v for k, v in good[1].items() if k != "rope_theta"}
    config = small_config(f"model.init_from=hf:{directory}")
    (directory / "config.json").write_text(json.dumps(cfg))
    hf_load.apply_init_from(config)
    assert config.model.rope_theta == 10000.0
    # null where transformers takes the default: kv heads as many as heads (4 here, as the
    # key/value weights are made for), the width from the sizes, no window, no scaling.
    m = small_config("model.num_kv_heads=4").model
    write_hf(tmp_path / "mha", m)
    cfg = json.loads((tmp_path / "mha" / "config.json").read_text())
    (tmp_path / "mha" / "config.json").write_text(json.dumps(cfg | dict.fromkeys(NULLABLE)))
    config = small_config(f"model.init_from=hf:{tmp_path / 'mha'}")
    hf_load.apply_init_from(config)
    assert (config.model.num_kv_heads, config.model.head_dim) == (4, None)
    assert config.model.rope_scaling is None


def test_sample_and_the_harness_refuse_a_damaged_tokenizer_json_in_one_line(good, tmp_path):
    """`eval --data`, `train` and `data prepare` refused a tokenizer.json that does not load
    in one line; `sample` and `eval --tasks` failed inside the tokenizers library."""
    directory = copy_of(good, tmp_path, "tokenizer")
    (directory / "tokenizer.json").write_text('{"version": "1.0", "model": ')  # cut short
    says = [f"{directory / 'tokenizer.json'}: not a tokenizer.json that loads: "]
    refused("sample", f"hf:{directory}", "--prompt", "x", says=says)
    tasks = ("--tasks", "jaxkit_choice", "--include-path", "tests/data/lm_eval")
    refused("eval", f"hf:{directory}", *tasks, says=says)


def test_sample_refuses_weights_that_are_not_finite_saying_what_it_would_draw(good, tmp_path):
    directory = with_value(good, tmp_path, "nan", "model.layers.0.mlp.up_proj.weight", 0, np.nan)
    refused(
        "sample", f"hf:{directory}", "--prompt", "x",
        says=[
            f"hf:{directory}: model.layers.0.mlp.up_proj.weight (param blocks/0/up/kernel) "
            "holds NaN or infinite values as loaded",
            "; sampling from them draws from NaN logits",
        ],
    )  # fmt: skip

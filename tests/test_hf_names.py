"""jaxkit/hf/names.py: every param of a Llama model has exactly one HF tensor, the map
round-trips bit for bit (unrolled and scanned), and config.json maps to model keys and back,
refusing what the kit cannot run."""

import sys

import numpy as np
import pytest
from flax import nnx

from jaxkit.config import ConfigError, apply_overrides, load_config, run_config
from jaxkit.hf import names
from jaxkit.models import build_model

SMALL = [
    "model.vocab_size=48",
    "model.d_model=16",
    "model.num_heads=4",
    "model.num_kv_heads=2",
    "model.mlp_dim=24",
    "model.num_layers=2",
    "data.seq_len=8",
]


# HF's Llama block kernels, written out here rather than read from names.py: HF's torch
# Linear stores (out, in), jaxkit's kernels are (in, out).
HF_KERNELS = {
    "self_attn.q_proj.weight": "query",
    "self_attn.k_proj.weight": "key",
    "self_attn.v_proj.weight": "value",
    "self_attn.o_proj.weight": "attn_out",
    "mlp.gate_proj.weight": "gate",
    "mlp.up_proj.weight": "up",
    "mlp.down_proj.weight": "down",
}


def small(*overrides):
    config = load_config("llama_tiny")
    apply_overrides(config, SMALL + list(overrides))  # no data is read: vocab < 256 bytes
    return run_config(config, checked=True)  # its model's sections: the data is not read


def pure_params(config):
    with nnx.use_eager_sharding(False):
        model = build_model(config, nnx.Rngs(0))
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def leaves(tree, prefix=()):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from leaves(value, (*prefix, key))
        else:
            yield (*prefix, key), np.asarray(value)


def test_importing_the_names_loads_no_jax():
    # The config and the CLI read the names before JAX starts: run in a fresh interpreter.
    import subprocess

    code = "import sys, jaxkit.hf.names; print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("tied", [False, True])
def test_each_param_is_one_hf_tensor_of_the_same_size(tied):
    config = small(f"model.tie_embeddings={str(tied).lower()}")
    params = dict(leaves(pure_params(config)))
    tensors = names.hf_tensors(config.model)
    # One HF tensor per param, at the model's own paths and with its shapes (transposed).
    assert {t.path for t in tensors} == set(params)
    assert len({t.name for t in tensors}) == len(tensors)
    for t in tensors:
        assert params[t.path].shape == t.param_shape
    assert ("lm_head.weight" in {t.name for t in tensors}) is not tied
    assert {t.layer for t in tensors} == {None, 0, 1}


@pytest.mark.parametrize("scan", [False, True])
def test_to_hf_then_from_hf_gives_the_params_back_bit_for_bit(scan):
    config = small(f"model.scan_layers={str(scan).lower()}")
    params = pure_params(config)
    hf = names.to_hf(params, config.model)
    # HF layout, checked independently of the map: torch Linear weights are (out, in). Every
    # kernel by value, the square ones (q, o) and the others (k, v 16 -> 8; gate, up 16 -> 24;
    # down 24 -> 16), whose shape alone would tell only a transpose left out.
    blocks = params["blocks"]
    for layer in range(2):
        for name, module in HF_KERNELS.items():
            kernel = blocks[module]["kernel"][layer] if scan else blocks[layer][module]["kernel"]
            tensor = hf[f"model.layers.{layer}.{name}"]
            np.testing.assert_array_equal(tensor, np.asarray(kernel).T, err_msg=name)
    back = dict(leaves(names.from_hf(hf, config.model)))
    assert back.keys() == dict(leaves(params)).keys()
    for path, value in leaves(params):
        np.testing.assert_array_equal(back[path], value)


def test_a_scanned_path_names_its_row_of_the_stacked_array():
    config = small("model.scan_layers=true")
    params = pure_params(config)
    name = "model.layers.1.mlp.up_proj.weight"
    t = next(t for t in names.hf_tensors(config.model) if t.name == name)
    assert names.param_path(t, scanned=False) == (("blocks", 1, "up", "kernel"), None)
    path, layer = names.param_path(t, scanned=True)
    assert (path, layer) == (("blocks", "up", "kernel"), 1)
    # The HF tensor is that row.
    hf = names.to_hf(params, config.model)
    np.testing.assert_array_equal(hf[t.name], np.asarray(params["blocks"]["up"]["kernel"][1]).T)


def test_from_hf_refuses_missing_misshapen_and_foreign_tensors():
    config = small()
    hf = names.to_hf(pure_params(config), config.model)
    names.from_hf(hf, config.model)  # complete: loads
    missing = {k: v for k, v in hf.items() if k != "model.norm.weight"}
    with pytest.raises(ConfigError, match=r"'model\.norm\.weight' is missing"):
        names.from_hf(missing, config.model)
    with pytest.raises(ConfigError, match=r"shape \(16, 15\)"):
        wrong = {**hf, "model.layers.0.mlp.down_proj.weight": np.zeros((16, 15))}
        names.from_hf(wrong, config.model)
    with pytest.raises(ConfigError, match=r"q_proj\.bias"):
        names.from_hf({**hf, "model.layers.0.self_attn.q_proj.bias": np.zeros(16)}, config.model)
    # Old checkpoints carry the rotary buffer: not a weight, skipped.
    names.from_hf({**hf, "model.layers.0.self_attn.rotary_emb.inv_freq": np.zeros(2)}, config.model)


def test_a_tied_checkpoint_may_store_its_head_only_as_the_table():
    config = small("model.tie_embeddings=true")
    hf = names.to_hf(pure_params(config), config.model)
    table = hf["model.embed_tokens.weight"]
    names.from_hf({**hf, "lm_head.weight": table.copy()}, config.model)
    with pytest.raises(ConfigError, match=r"model\.tie_embeddings=false"):
        names.from_hf({**hf, "lm_head.weight": table + 1}, config.model)


LLAMA_31 = {  # Llama 3.1 8B's config.json, as Meta published it on the Hub
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 128256,
}


def test_llama_31_config_json_gives_its_model_keys():
    keys = names.model_keys_from_hf_config(LLAMA_31, seq_len=2048)
    assert keys == {
        "model.kind": "llama",
        "model.vocab_size": 128256,
        "model.d_model": 4096,
        "model.num_layers": 32,
        "model.num_heads": 32,
        "model.num_kv_heads": 8,
        "model.mlp_dim": 14336,
        "model.tie_embeddings": False,
        "model.rope_theta": 500000.0,
        "model.norm_eps": 1e-5,
        "model.rope_scaling": {
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "model.head_dim": None,  # 4096 / 32 = 128, the default width
    }


@pytest.mark.parametrize(
    ("change", "names_option"),
    [
        ({"attention_bias": True}, "attention_bias"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling type 'yarn'"),
        ({"model_type": "qwen2"}, "model_type='qwen2'"),
        ({"model_type": "mistral", "sliding_window": 1024}, "sliding_window=1024"),
    ],
)
def test_what_the_kit_cannot_run_is_one_line_naming_the_option(change, names_option):
    with pytest.raises(ConfigError, match=names_option) as error:
        names.model_keys_from_hf_config({**LLAMA_31, **change}, seq_len=2048)
    assert "\n" not in str(error.value)


def test_a_mistral_config_that_fits_is_accepted():
    mistral = {**LLAMA_31, "model_type": "mistral", "sliding_window": 4096, "rope_scaling": None}
    keys = names.model_keys_from_hf_config(mistral, seq_len=4096)
    assert keys["model.rope_scaling"] is None and keys["model.num_kv_heads"] == 8
    # Without data.seq_len the window cannot be checked: refused, not assumed long enough.
    with pytest.raises(ConfigError, match="sliding_window"):
        names.model_keys_from_hf_config(mistral)

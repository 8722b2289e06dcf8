"""jaxkit's Llama against Hugging Face's own, not against itself: weights written as a
Hugging Face directory (config.json, model.safetensors with HF's names) are read by
transformers' Flax Llama (`FlaxLlamaForCausalLM`, transformers 4.x, no torch) and by jaxkit
(`jaxkit.hf.names.from_hf`), and the logits compared; jaxkit's own params go out the other
way (`to_hf`) and come back equal from the Flax Llama.

What the Flax Llama cannot express is checked against its torch Llama through files
tests/data/hf_reference/make.py wrote once (torch is not a test dependency): a rotary base
of 5e5 (the Flax model fixes 10,000), Llama 3.1's rope_scaling and a head width apart from
hidden_size / heads. The Flax Llama has no tied head either: a tied checkpoint is given to it
with lm_head.weight equal to the table, as some tied checkpoints store it (the torch case
head_dim_12 is tied and stores none). Nor has it document masks: a packed row is checked
against the Flax model run on each document alone, which is what the mask must give.

Tolerance: float32 round-off only. The two sides sum the same products in other orders
(einsum against dot_product_attention, another softmax, the norm's mean), a few ulps per
op through two layers. Measured: at most 7.2e-7 on logits up to 2.5 (Flax and torch,
unrolled, scanned and sharded, packed documents). LOGITS_ATOL = 1e-5 keeps a 14x margin and
stays two orders below the smallest modelling slip measured on the same models: RMSNorm's
epsilon at 1e-6 for 1e-5 moves the logits by 1.3e-3, the llama3 frequencies unscaled by
0.038, a rotary base of 1e4 for 5e5 by 0.12.
"""

import functools
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from flax import nnx
from safetensors.numpy import load_file, save_file

from jaxkit import mesh as mesh_lib
from jaxkit.config import apply_overrides, load_config, run_config
from jaxkit.hf import names
from jaxkit.models import build_model
from jaxkit.models.llama_net import inverse_frequencies
from jaxkit.models.llama_shape import head_dim, rope_scaling
from jaxkit.step.train_step import _abstract_model, on_mesh

LOGITS_ATOL = 1e-5  # see the module docstring
REFERENCE = pathlib.Path(__file__).parent / "data" / "hf_reference"
SEQ_LEN = 16
# A Llama shape in HF's words: grouped-query attention (4 query heads, 2 key/value heads),
# Llama 2/3's RMSNorm epsilon.
HF_SHAPE = {
    "vocab_size": 48,
    "hidden_size": 32,
    "intermediate_size": 40,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 64,
}


def _override(key, value):
    """`key=value` as the command line takes it: null, JSON for dicts and bools."""
    if value is None:
        return f"{key}=null"
    text = json.dumps(value) if isinstance(value, (dict, bool)) else value
    return f"{key}={text}"


def jaxkit_config(hf_config, *overrides):
    """llama_tiny with the model keys config.json gives."""
    config = load_config("llama_tiny")
    keys = names.model_keys_from_hf_config(hf_config, seq_len=SEQ_LEN)
    apply_overrides(
        config,
        [_override(k, v) for k, v in keys.items()] + [f"data.seq_len={SEQ_LEN}", *overrides],
    )
    return run_config(config, checked=True)  # its model's sections: no data is read


def random_tensors(config, seed):
    """Every HF tensor of the model drawn at random (norm scales too, so a misplaced tensor
    shows in the logits)."""
    rng = np.random.default_rng(seed)
    return {
        t.name: (
            1 + 0.2 * rng.standard_normal(t.shape)
            if t.name.endswith("norm.weight")
            else 0.08 * rng.standard_normal(t.shape)
        ).astype(np.float32)
        for t in names.hf_tensors(config.model)
    }


def write_hf_dir(path, hf_config, tensors):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf_config))
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def read(path):
    return load_file(str(path / "model.safetensors"))


@functools.cache
def flax_llama(path):
    """Hugging Face's Flax Llama, loaded from the directory as a user would, its forward
    pass jitted (one program per shape, not hundreds of op-by-op ones)."""
    model = transformers.FlaxLlamaForCausalLM.from_pretrained(path, from_pt=True)
    params = model.params
    forward = jax.jit(lambda p, x, pos: model(x, params=p, position_ids=pos).logits)
    return lambda tokens: np.asarray(forward(params, tokens, _positions(tokens)))


def _positions(tokens):
    return np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape)


def flax_logits(path, tokens):
    return flax_llama(path)(tokens)


def jaxkit_logits(config, path, *inputs):
    """jaxkit's Llama with the directory's weights as from_hf maps them, on one device."""
    graphdef, _ = _abstract_model(config)
    params = names.from_hf(read(path), config.model)
    forward = jax.jit(lambda p, *x: nnx.merge(graphdef, p)(*x))
    return np.asarray(forward(params, *(jnp.asarray(x) for x in inputs)))


def sharded_logits(config, path, tokens, shape):
    """jaxkit's logits on a mesh of 8 devices: the loaded params placed as mesh.RULES shard
    them, rows over the batch axes, the activation constraints in force."""
    mesh = mesh_lib.make_mesh(shape)
    graphdef, abstract = _abstract_model(config)
    shardings = mesh_lib.named_shardings(mesh, nnx.to_pure_dict(nnx.get_partition_spec(abstract)))
    params = names.from_hf(read(path), config.model)
    params = jax.device_put(params, shardings)
    kernel = (
        params["blocks"]["query"]["kernel"]
        if config.model.scan_layers
        else params["blocks"][0]["query"]["kernel"]
    )
    assert kernel.sharding.shard_shape(kernel.shape) != kernel.shape  # really sharded
    forward = jax.jit(
        on_mesh(lambda p, x: nnx.merge(graphdef, p)(x), mesh),
        in_shardings=(shardings, mesh_lib.batch_sharding(mesh)),
    )
    return np.asarray(forward(params, jnp.asarray(tokens)))


def tokens_for(rows, vocab, seed=0):
    return np.random.default_rng(seed).integers(0, vocab, (rows, SEQ_LEN)).astype(np.int32)


@pytest.fixture(scope="module", params=["untied", "tied"])
def checkpoint(request, tmp_path_factory):
    """A random HF checkpoint (tied or not) and the Flax Llama's logits for 4 rows."""
    tied = request.param == "tied"
    hf_config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **HF_SHAPE,
        "tie_word_embeddings": tied,
    }
    config = jaxkit_config(hf_config)
    tensors = random_tensors(config, seed=1 if tied else 0)
    if tied:  # the Flax Llama has no tied head: give it the table as lm_head.weight
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    path = write_hf_dir(tmp_path_factory.mktemp(request.param), hf_config, tensors)
    tokens = tokens_for(4, HF_SHAPE["vocab_size"])
    return request.param, hf_config, path, tokens, flax_logits(path, tokens)


# Each checkpoint once unrolled and once scanned, one of the two on 8 devices (fsdp 4 ×
# tensor 2: params cut on both axes, rows over fsdp).
LAYOUTS = {
    ("untied", "unrolled"): None,
    ("untied", "scanned"): {"data": 1, "fsdp": 4, "tensor": 2},
    ("tied", "unrolled"): {"data": 1, "fsdp": 4, "tensor": 2},
    ("tied", "scanned"): None,
}


@pytest.mark.parametrize("layout", ["unrolled", "scanned"])
def test_logits_match_hugging_faces_flax_llama(checkpoint, layout):
    kind, hf_config, path, tokens, reference = checkpoint
    config = jaxkit_config(hf_config, f"model.scan_layers={str(layout == 'scanned').lower()}")
    assert config.model.tie_embeddings == (kind == "tied")
    assert config.model.norm_eps == 1e-5 and config.model.num_kv_heads == 2
    mesh_shape = LAYOUTS[kind, layout]
    if mesh_shape is None:
        logits = jaxkit_logits(config, path, tokens)
    else:
        logits = sharded_logits(config, path, tokens, mesh_shape)
    assert np.abs(reference).max() > 0.5  # logits that mean something, not all near 0
    np.testing.assert_allclose(logits, reference, rtol=0, atol=LOGITS_ATOL)


def test_a_packed_row_with_document_masks_is_each_document_alone(checkpoint):
    """The Flax Llama has no document masks: each document run alone from position 0 is
    what attention kept inside documents, positions restarting, must give."""
    _, hf_config, path, tokens, _ = checkpoint
    config = jaxkit_config(hf_config)
    cut = 6  # documents of 6 and 10 tokens in one row
    segments = np.where(np.arange(SEQ_LEN) < cut, 1, 2)[None].repeat(2, 0).astype(np.int32)
    positions = np.where(np.arange(SEQ_LEN) < cut, np.arange(SEQ_LEN), np.arange(SEQ_LEN) - cut)
    positions = positions[None].repeat(2, 0).astype(np.int32)
    packed = jaxkit_logits(config, path, tokens[:2], segments, positions)
    alone = np.concatenate(
        [flax_logits(path, tokens[:2, :cut]), flax_logits(path, tokens[:2, cut:])], axis=1
    )
    np.testing.assert_allclose(packed, alone, rtol=0, atol=LOGITS_ATOL)


def test_jaxkit_params_exported_load_in_the_flax_llama_with_the_same_logits(tmp_path):
    """The loop closed: jaxkit's own random init -> to_hf -> a directory with
    hf_config_from_model's config.json -> Hugging Face's Flax Llama -> jaxkit's logits."""
    config = load_config("llama_tiny")
    apply_overrides(
        config,
        [
            "model.vocab_size=48",
            "model.d_model=32",
            "model.mlp_dim=40",
            "model.norm_eps=1e-5",
            f"data.seq_len={SEQ_LEN}",
        ],
    )
    typed = run_config(config, checked=True)  # its model alone: no data is read (vocab < 256)
    with nnx.use_eager_sharding(False):
        model = build_model(typed, nnx.Rngs(3))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    path = write_hf_dir(
        tmp_path / "out",
        names.hf_config_from_model(typed.model),
        names.to_hf(params, typed.model),
    )
    tokens = tokens_for(2, 48, seed=4)
    ours = np.asarray(model(jnp.asarray(tokens)))
    np.testing.assert_allclose(flax_logits(path, tokens), ours, rtol=0, atol=LOGITS_ATOL)


# The torch Llama's references (tests/data/hf_reference/make.py wrote them).
TORCH_CASES = ["rope_theta_5e5", "rope_scaling_llama3", "head_dim_12"]


@pytest.mark.parametrize("case", TORCH_CASES)
def test_logits_and_rotary_frequencies_match_hugging_faces_torch_llama(case):
    path = REFERENCE / case
    hf_config = json.loads((path / "config.json").read_text())
    config = jaxkit_config(hf_config, "data.seq_len=24")
    reference = load_file(str(path / "reference.safetensors"))
    m = config.model
    inv_freq = inverse_frequencies(head_dim(m), m.rope_theta, rope_scaling(m))
    # Both raise theta to 2i/K rounded to float32 (HF then inverts): that rounding (6e-8
    # relative) times ln(theta) ≤ 13 allows 8e-7 relative; measured 5.0e-7 (head_dim_12).
    # A wrong base or scaling is off by percents at least.
    np.testing.assert_allclose(inv_freq, reference["inv_freq"], rtol=2e-6, atol=0)
    logits = jaxkit_logits(config, path, reference["input_ids"])
    np.testing.assert_allclose(logits, reference["logits"], rtol=0, atol=LOGITS_ATOL)


def test_the_torch_cases_test_what_they_are_named_for():
    """Each reference pins its feature: without it the frequencies are others."""
    shapes = {
        case: json.loads((REFERENCE / case / "config.json").read_text()) for case in TORCH_CASES
    }
    assert shapes["rope_theta_5e5"]["rope_theta"] == 500000.0
    scaled = load_file(str(REFERENCE / "rope_scaling_llama3" / "reference.safetensors"))
    plain = inverse_frequencies(8, 500000.0)
    # Kept, blended and slowed: one frequency in each of llama3's three bands.
    assert scaled["inv_freq"][0] == pytest.approx(float(plain[0]))
    assert float(plain[1]) / 8 < scaled["inv_freq"][1] < float(plain[1])
    assert scaled["inv_freq"][2:] == pytest.approx(np.asarray(plain[2:]) / 8, rel=1e-6)
    head = shapes["head_dim_12"]
    assert head["head_dim"] * head["num_attention_heads"] != head["hidden_size"]
    assert head["tie_word_embeddings"]
    assert "lm_head.weight" not in read(REFERENCE / "head_dim_12")


def test_splits_and_exact_normalisation_hold_from_a_loaded_checkpoint(monkeypatch, tmp_path):
    """test_normalisation's claim from HF weights: on padded prompt/completion rows, two
    devices x two micro-batches of 8, started with model.init_from=hf:DIR, train what one
    device does on the whole weighted global batch of 32 from the params from_hf reads."""
    import test_equivalence
    from test_equivalence import LOSS_RTOL, assert_adam_params_match, reference_run
    from test_llama import TINY
    from token_dirs import padded_prompt_completion

    padded = padded_prompt_completion(tmp_path / "data")
    monkeypatch.setitem(test_equivalence.SMALL, "llama_tiny", [*TINY, "model.num_layers=2"])
    config = test_equivalence.small_config("llama_tiny", 1, 32)
    apply_overrides(config, [*padded, "model.norm_eps=1e-5"])
    typed = run_config(config)
    path = write_hf_dir(
        tmp_path / "hf", names.hf_config_from_model(typed.model), random_tensors(typed, seed=5)
    )
    # The checkpoint's own config.json gives the model the runs train.
    loaded = jaxkit_config(json.loads((path / "config.json").read_text()))
    assert loaded.model == typed.model

    ref_losses, _, trajectory = reference_run(typed, names.from_hf(read(path), typed.model))
    assert ref_losses[-1] < ref_losses[0]
    overrides = [*padded, "model.norm_eps=1e-5", f"model.init_from=hf:{path}"]
    losses, _, final = test_equivalence.run_splits("llama_tiny", [(2, 8, 2)], overrides)[2, 8, 2]
    # The losses from the first step on: the run did start from the checkpoint.
    np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL)
    assert_adam_params_match(final, trajectory[-1], config)

"""model.kind="llama": the Llama-style decoder (network: llama_net.py)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from jaxkit.keys import (
    POSITIVE,
    REQUIRED,
    ConfigError,
    Key,
    Rule,
    boolean,
    integer,
    number,
    show,
)
from jaxkit.models import lm
from jaxkit.models.common import Decoding
from jaxkit.models.llama_shape import (
    NORM_EPS,
    ROPE_SCALING_FIELDS,
    head_dim,
    norm_eps,
    rope_scaling,
)
from jaxkit.models.lm import (
    DATA_KEYS,
    LM_OPTION_KEYS,
    READS_LM_OPTIONS,
    check_shards,
    facts,
    flops_per_example,
    is_lm,
    kernel_params,
    sizes,
)
from jaxkit.sections import LlamaModel, RunConfig

if TYPE_CHECKING:
    from flax import nnx

    from jaxkit.models.common import Params, Sizes

__all__ = [
    "NORM_EPS",
    "READS_LM_OPTIONS",
    "ROPE_SCALING_FIELDS",
    "build",
    "check_model",
    "check_shards",
    "check_values",
    "decoding",
    "facts",
    "flops_per_example",
    "head_dim",
    "is_lm",
    "keys",
    "matmul_params",
    "norm_eps",
    "rope_scaling",
    "sharded_sizes",
]


def _init_from(value: object) -> str | None:
    if value is None or (isinstance(value, str) and value.startswith("hf:") and value[3:]):
        return None
    return "must be null or hf:DIR, a local Hugging Face model directory"


def _rope_scaling_problem(value: object) -> str | None:
    """None, or what is wrong with a model.rope_scaling value (HF's llama3 checks)."""
    if value is None:
        return None
    fields = ", ".join(ROPE_SCALING_FIELDS)
    if not isinstance(value, Mapping) or set(value) != set(ROPE_SCALING_FIELDS):
        return f"must be null or a dict of exactly {fields}"
    numbers = {field: value[field] for field in ROPE_SCALING_FIELDS}
    if any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in numbers.values()):
        return f"must give numbers for {fields}"
    original = numbers["original_max_position_embeddings"]
    if not isinstance(original, int) or original < 1:
        return "must give original_max_position_embeddings as a positive integer"
    if numbers["factor"] < 1:
        return "must give factor ≥ 1 (the context is stretched, never shrunk)"
    if not 0 < numbers["low_freq_factor"] < numbers["high_freq_factor"]:
        return "must give 0 < low_freq_factor < high_freq_factor"
    return None


# Hugging Face's name of the one scaling model.rope_scaling is ("type" in older files).
ROPE_TYPE = "llama3"


def rope_scaling_fields(value: dict) -> dict:
    """A model.rope_scaling dict as the key holds it: Hugging Face's rope_type ("type" in
    older config.json files) said once, so config.json's dict may be pasted as it is; a
    rope type other than llama3 is refused, naming it."""
    named = [field for field in ("rope_type", "type") if field in value]
    for field in named:
        if value[field] != ROPE_TYPE:
            raise ConfigError(
                f"{field} {show(value[field])} is not supported: jaxkit's Llama scales rotary "
                f"frequencies as Llama 3.1 does ({field} {ROPE_TYPE!r}) or not at all (null)"
            )
    return {field: v for field, v in value.items() if field not in named}


ROPE_SCALING = Rule(
    "null, or a dict: factor ≥ 1, 0 < low_freq_factor < high_freq_factor, "
    "original_max_position_embeddings",
    _rope_scaling_problem,
    "dict[str, Any] | None",
)

# The model's sizes and the data it reads (required), and the options it may leave out.
KEYS: tuple[Key, ...] = (
    *sizes("vocab_size", "d_model", "num_layers", "num_heads"),
    Key(
        "model.num_kv_heads",
        REQUIRED,
        POSITIVE,
        "key/value heads for grouped-query attention (divide num_heads; = num_heads for "
        "plain attention)",
    ),
    *sizes("mlp_dim"),
    Key("model.tie_embeddings", REQUIRED, boolean(), "the embedding table is the head"),
    Key(
        "model.rope_theta",
        REQUIRED,
        number(0, open_low=True, open_high=False),
        "the rotary base period",
    ),
    # Hugging Face checkpoints' shapes (jaxkit/hf/); the defaults are what runs before ran as.
    Key(
        "model.norm_eps",
        NORM_EPS,
        number(0, open_low=True, open_high=False),
        "RMSNorm's epsilon (Hugging Face's rms_norm_eps: Llama 2 and 3 use 1e-5)",
        added=NORM_EPS,
    ),
    Key(
        "model.head_dim",
        None,
        integer(2, nullable=True),
        "each attention head's width, even (null: d_model / num_heads, which must divide)",
        type=int,
        added=None,
    ),
    Key(
        "model.rope_scaling",
        None,
        ROPE_SCALING,
        "null, or Llama 3.1's rotary frequency scaling (Hugging Face's rope_type llama3): "
        "a dict of factor, low_freq_factor, high_freq_factor and "
        "original_max_position_embeddings; on the command line as JSON, where "
        'config.json\'s "rope_type": "llama3" may be repeated',
        type=dict,
        added=None,
        normalise=rope_scaling_fields,
    ),
    # Read before validation (jaxkit/hf/load.py): config.json's architecture replaces the
    # model keys. Only a fresh start reads the weights, so a resume may leave it as it is.
    Key(
        "model.init_from",
        None,
        Rule("null or hf:DIR", _init_from, "str | None"),
        "null (random init) or `hf:DIR`, a local Hugging Face Llama directory (config.json, "
        "*.safetensors): its architecture and weights; read at a fresh start only",
        type=str,
        resumable=True,
        added=None,
    ),
    *DATA_KEYS,
    *LM_OPTION_KEYS,
)


def check_values(flat: Mapping[str, Any]) -> None:
    """The language models' checks, and model.rope_scaling's fields (a dict in the config,
    so `flat` holds them as model.rope_scaling.FIELD)."""
    lm.check_values(flat)
    prefix = "model.rope_scaling."
    fields = {key[len(prefix) :]: v for key, v in flat.items() if key.startswith(prefix)}
    value = fields or flat.get("model.rope_scaling")
    problem = _rope_scaling_problem(value)
    if problem:
        raise ConfigError(f"model.rope_scaling={show(value)}: {problem}")


def llama_model(config: RunConfig) -> LlamaModel:
    """The config's model section, a Llama's: this contract is asked only of its own kind,
    and hf/ reads only a Llama's."""
    assert isinstance(config.model, LlamaModel), type(config.model)
    return config.model


def check_model(config: RunConfig) -> None:
    """model.rope_scaling as the config holds it: an empty dict leaves no dotted key in the
    flattened values check_values sees, so only here is {} told apart from null."""
    value = llama_model(config).rope_scaling
    problem = _rope_scaling_problem(value)
    if problem:
        raise ConfigError(f"model.rope_scaling={show(value)}: {problem}")


def sharded_sizes(config: RunConfig) -> Sizes:
    """As the language models', where heads take d_model / num_heads dimensions each; with
    model.head_dim set, d_model lies on fsdp only, and heads × head_dim (and key/value heads
    × head_dim) are the tensor side of the attention projections."""
    m = llama_model(config)
    if m.head_dim is None:
        return lm.sharded_sizes(config)
    k = head_dim(m)
    return [
        ("model.d_model", m.d_model, ("fsdp",)),
        ("model.num_heads × model.head_dim", m.num_heads * k, ("tensor",)),
        ("model.num_kv_heads × model.head_dim", m.num_kv_heads * k, ("tensor",)),
        ("model.mlp_dim", m.mlp_dim, ("tensor",)),
    ]


def keys(flat: Mapping[str, object]) -> tuple[Key, ...]:
    del flat
    return KEYS


def build(config: RunConfig, rngs: nnx.Rngs) -> nnx.Module:
    from jaxkit.models.llama_net import LlamaLM  # flax loads with the network

    return LlamaLM(llama_model(config), rngs=rngs)


def matmul_params(config: RunConfig, params: Params) -> int:
    """The kernels, and the embedding table where it is tied (it is also the head)."""
    return kernel_params(params, tied_table=llama_model(config).tie_embeddings)


def decoding(config: RunConfig) -> Decoding:
    """A key/value cache of the key/value heads (grouped-query); rotary positions set no
    bound of their own."""
    m = llama_model(config)
    return Decoding(cache=(m.num_layers, m.num_kv_heads, head_dim(m)))

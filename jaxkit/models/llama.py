"""model.kind="llama": the Llama-style decoder (network: llama_net.py)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import ml_collections

from jaxkit.keys import POSITIVE, REQUIRED, Key, boolean, number
from jaxkit.models.lm import (
    DATA_KEYS,
    LM_OPTION_KEYS,
    READS_LM_OPTIONS,
    check_model,
    check_shards,
    check_values,
    facts,
    flops_per_example,
    is_lm,
    kernel_params,
    sharded_sizes,
    sizes,
)

if TYPE_CHECKING:
    from flax import nnx

    from jaxkit.models.common import Params

__all__ = [
    "READS_LM_OPTIONS",
    "build",
    "check_model",
    "check_shards",
    "check_values",
    "facts",
    "flops_per_example",
    "head_dim",
    "is_lm",
    "keys",
    "matmul_params",
    "sharded_sizes",
]

# flax's RMSNorm epsilon: what every run before model.norm_eps ran with.
NORM_EPS = 1e-6
# model.rope_scaling's fields: Llama 3.1's frequency scaling ("rope_type": "llama3" in HF's).
ROPE_SCALING_FIELDS = (
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "original_max_position_embeddings",
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
    *DATA_KEYS,
    *LM_OPTION_KEYS,
)


def head_dim(m: ml_collections.ConfigDict) -> int:
    """Each attention head's width: model.head_dim, or d_model / num_heads where it is null
    (or the config predates it)."""
    width = m.get("head_dim")
    return int(width) if width is not None else int(m.d_model // m.num_heads)


def keys(flat: Mapping[str, object]) -> tuple[Key, ...]:
    del flat
    return KEYS


def build(config: ml_collections.ConfigDict, rngs: nnx.Rngs) -> nnx.Module:
    from jaxkit.models.llama_net import LlamaLM  # flax loads with the network

    return LlamaLM(config.model, rngs=rngs)


def matmul_params(config: ml_collections.ConfigDict, params: Params) -> int:
    """The kernels, and the embedding table where it is tied (it is also the head)."""
    return kernel_params(params, tied_table=bool(config.model.tie_embeddings))

"""model.kind="transformer": the byte Transformer LM (network: transformer_net.py)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from jaxkit.keys import Key
from jaxkit.models.common import Decoding
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
    lm_seq_len,
    sharded_sizes,
    sizes,
)
from jaxkit.sections import RunConfig, TransformerModel

if TYPE_CHECKING:
    from flax import nnx

    from jaxkit.models.common import Params

__all__ = [
    "READS_LM_OPTIONS",
    "build",
    "check_model",
    "check_shards",
    "check_values",
    "decoding",
    "facts",
    "flops_per_example",
    "is_lm",
    "keys",
    "matmul_params",
    "sharded_sizes",
]

# The model's sizes and the data it reads (required), and the options it may leave out.
KEYS: tuple[Key, ...] = (
    *sizes("vocab_size", "d_model", "num_layers", "num_heads", "mlp_dim"),
    *DATA_KEYS,
    *LM_OPTION_KEYS,
)


def keys(flat: Mapping[str, object]) -> tuple[Key, ...]:
    del flat
    return KEYS


def _model(config: RunConfig) -> TransformerModel:
    """The config's model section, a Transformer's: this contract is asked only of its kind."""
    assert isinstance(config.model, TransformerModel), type(config.model)
    return config.model


def build(config: RunConfig, rngs: nnx.Rngs) -> nnx.Module:
    from jaxkit.models.transformer_net import TransformerLM  # flax loads with the network

    return TransformerLM(_model(config), seq_len=lm_seq_len(config), rngs=rngs)


def matmul_params(config: RunConfig, params: Params) -> int:
    del config
    return kernel_params(params)


def decoding(config: RunConfig) -> Decoding:
    """A key/value cache of a head per head; its learned positions end at data.seq_len."""
    m = _model(config)
    heads = (m.num_layers, m.num_heads, m.d_model // m.num_heads)
    return Decoding(cache=heads, max_positions=lm_seq_len(config))

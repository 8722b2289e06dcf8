"""model.kind="transformer": the byte Transformer LM (network: transformer_net.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import ml_collections

from jaxkit.models.lm import (
    READS_LM_OPTIONS,
    check_model,
    check_shards,
    facts,
    flops_per_example,
    is_lm,
    kernel_params,
    sharded_sizes,
)

if TYPE_CHECKING:
    from flax import nnx

    from jaxkit.models.common import Params

__all__ = [
    "READS_LM_OPTIONS",
    "build",
    "check_model",
    "check_shards",
    "facts",
    "flops_per_example",
    "is_lm",
    "matmul_params",
    "sharded_sizes",
]


def build(config: ml_collections.ConfigDict, rngs: nnx.Rngs) -> nnx.Module:
    from jaxkit.models.transformer_net import TransformerLM  # flax loads with the network

    return TransformerLM(config.model, seq_len=config.data.seq_len, rngs=rngs)


def matmul_params(config: ml_collections.ConfigDict, params: Params) -> int:
    del config
    return kernel_params(params)

"""model.kind="llama": the Llama-style decoder (network: llama_net.py)."""

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
    from jaxkit.models.llama_net import LlamaLM  # flax loads with the network

    return LlamaLM(config.model, rngs=rngs)


def matmul_params(config: ml_collections.ConfigDict, params: Params) -> int:
    """The kernels, and the embedding table where it is tied (it is also the head)."""
    return kernel_params(params, tied_table=bool(config.model.tie_embeddings))

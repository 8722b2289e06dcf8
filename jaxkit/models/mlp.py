"""model.kind="mlp": the MLP classifier over rows of features (network: mlp_net.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import ml_collections

if TYPE_CHECKING:
    from flax import nnx

    from jaxkit.models.common import Params, Sizes

READS_LM_OPTIONS = False


def is_lm(config: ml_collections.ConfigDict) -> bool:
    del config
    return False


def build(config: ml_collections.ConfigDict, rngs: nnx.Rngs) -> nnx.Module:
    from jaxkit.models.mlp_net import MLPClassifier  # flax loads with the network

    m = config.model
    return MLPClassifier(
        config.data.num_features, m.hidden_size, m.num_layers, m.num_classes, rngs=rngs
    )


def sharded_sizes(config: ml_collections.ConfigDict) -> Sizes:
    """The first layer's inputs lie on fsdp, and hidden units on both axes."""
    return [
        ("data.num_features", config.data.num_features, ("fsdp",)),
        ("model.hidden_size", config.model.hidden_size, ("fsdp", "tensor")),
    ]


def check_shards(config: ml_collections.ConfigDict, mesh_shape: dict[str, int]) -> None:
    del config, mesh_shape  # no heads: its sharded sizes say all


def check_model(config: ml_collections.ConfigDict) -> None:
    del config  # its values say all: config.check_values checked them


def matmul_params(config: ml_collections.ConfigDict, params: Params) -> int:
    """Every param (PaLM's convention counts a layer's bias with its matmul)."""
    del config
    return sum(size for _, size in params)


def flops_per_example(config: ml_collections.ConfigDict, matmul_params: int) -> float:
    del config
    return 6.0 * matmul_params


def facts(config: ml_collections.ConfigDict) -> dict[str, Any]:
    del config
    return {}

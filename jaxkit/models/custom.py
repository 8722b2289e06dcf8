"""model.kind="package.module:factory": a model of your own, built by its factory
(jaxkit/custom_model.py imports, builds and checks it). A language model or a classifier
by its data; sharded as its params are annotated.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import ml_collections

if TYPE_CHECKING:
    from flax import nnx

    from jaxkit.models.common import Params, Sizes

READS_LM_OPTIONS = False  # its precision, remat and layers are its own


def is_lm(config: ml_collections.ConfigDict) -> bool:
    """Token rows make it a language model; rows of features (digits, or synthetic without
    data.seq_len) a classifier."""
    d = config.data
    source = d.get("source")
    return not (source == "digits" or (source == "synthetic" and d.get("seq_len") is None))


def build(config: ml_collections.ConfigDict, rngs: nnx.Rngs) -> nnx.Module:
    from jaxkit import custom_model

    return custom_model.build(config, rngs)


def sharded_sizes(config: ml_collections.ConfigDict) -> Sizes:
    del config  # sharded as it annotates: see check_shards
    return []


def check_shards(config: ml_collections.ConfigDict, mesh_shape: dict[str, int]) -> None:
    from jaxkit import custom_model

    custom_model.check_shards(config, mesh_shape)


def check_model(config: ml_collections.ConfigDict) -> None:
    """Imports the factory and builds the model from shapes, checking its logits."""
    from jaxkit import custom_model  # flax loads only for a model of your own

    custom_model.check(config)


def matmul_params(config: ml_collections.ConfigDict, params: Params) -> int:
    del config  # its architecture is not known here: every param
    return sum(size for _, size in params)


def flops_per_example(config: ml_collections.ConfigDict, matmul_params: int) -> float:
    """6 × its params per token (its attention unknown), or per example for a classifier."""
    return 6.0 * matmul_params * (config.data.seq_len if is_lm(config) else 1)


def facts(config: ml_collections.ConfigDict) -> dict[str, Any]:
    del config
    return {}

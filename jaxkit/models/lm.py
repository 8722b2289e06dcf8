"""What the built-in language models (transformer, llama) share: the sizes the partition
rules shard, the heads the tensor axis splits, their options (precision, remat, scanned
layers) as facts, and the model FLOPs of a decoder.

Light on purpose, as every contract module: the config reads the contracts before JAX starts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import ml_collections

from jaxkit.keys import ConfigError

if TYPE_CHECKING:
    from jaxkit.models.common import Params, Sizes

READS_LM_OPTIONS = True  # model.remat, the dtypes, scan_layers and the token files' row options


def is_lm(config: ml_collections.ConfigDict) -> bool:
    del config
    return True


def sharded_sizes(config: ml_collections.ConfigDict) -> Sizes:
    """d_model is the fsdp side of every kernel, embedding and head, and, as heads·head_dim,
    the tensor side of the attention projections; mlp_dim is the tensor side of the MLP."""
    m = config.model
    return [
        ("model.d_model", m.d_model, ("fsdp", "tensor")),
        ("model.mlp_dim", m.mlp_dim, ("tensor",)),
    ]


def check_shards(config: ml_collections.ConfigDict, mesh_shape: dict[str, int]) -> None:
    """Fails where the tensor axis would cut an attention head in parts."""
    tensor = mesh_shape["tensor"]
    for key in ("num_heads", "num_kv_heads"):
        heads = config.model.get(key)
        if heads is None or not heads % tensor:
            continue
        # Attention runs head by head: a head split over devices is gathered whole again at
        # every layer (XLA's "involuntary full rematerialization"), the work repeated.
        raise ConfigError(
            f"model.{key}={heads} is not divisible by mesh.tensor={tensor}: attention "
            "heads are split over the tensor axis (jaxkit/mesh.py ACTIVATIONS), and a head "
            f"cut in parts is gathered whole at every layer. Use a multiple of {tensor} "
            "heads, or a smaller mesh.tensor"
        )


def check_model(config: ml_collections.ConfigDict) -> None:
    del config  # its values say all: config.check_values checked them


def kernel_params(params: Params, *, tied_table: bool = False) -> int:
    """Params that take part in a matmul: the kernels, and a tied embedding table (it is the
    head); not biases or norm scales (no matmul), nor tables read by lookup."""
    weights = {"kernel", "embedding"} if tied_table else {"kernel"}
    return sum(size for name, size in params if name in weights)


def flops_per_example(config: ml_collections.ConfigDict, matmul_params: int) -> float:
    """6 × the matmul params per token, plus attention's 12 × layers × d_model × seq_len
    (scores and weighted values, forward and backward, over the whole square)."""
    m, seq_len = config.model, config.data.seq_len
    per_token = 6.0 * matmul_params + 12.0 * m.num_layers * m.d_model * seq_len
    return per_token * seq_len


def facts(config: ml_collections.ConfigDict) -> dict[str, Any]:
    """Its precision, remat and layer layout, as a run's records give them."""
    from jaxkit.layers import LM_DEFAULTS, lm_option

    return {key: lm_option(config.model, key) for key in LM_DEFAULTS}

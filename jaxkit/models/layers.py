"""Pieces the language models share: annotated layers, precision, and the block stack.

The stack runs a model's blocks either unrolled (one traced copy per layer) or scanned
(the blocks' params stacked on a leading layer axis, one traced body run by a scan, so
compile time stays nearly flat in depth), each block optionally rematerialised with a
`jax.checkpoint` policy. The layer axis is never sharded: each device holds every layer of
its own shard.

Precision: params are stored in `model.param_dtype`; matmuls run in `model.compute_dtype`;
norm statistics, attention softmax, the logits' log-sum-exp and the loss run in float32.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxkit.mesh import RULES
from jaxkit.models.kv_cache import Cache
from jaxkit.sections import Model

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# What a rematerialised block keeps for the backward pass; the rest is recomputed.
REMAT_POLICIES: dict[str, Callable | None] = {
    "none": None,  # no jax.checkpoint: every activation is kept
    "full": jax.checkpoint_policies.nothing_saveable,  # only the block's input is kept
    "dots": jax.checkpoint_policies.dots_saveable,  # matmul outputs kept, the rest recomputed
}


def dtypes(model: Model) -> tuple[Any, Any]:
    """(param dtype, compute dtype) of the model section."""
    return DTYPES[model.param_dtype], DTYPES[model.compute_dtype]


def linear(
    d_in: int,
    d_out: int,
    kernel_role: str,
    bias_role: str | None,
    rngs: nnx.Rngs,
    *,
    kernel_init: Callable | None = None,  # default: lecun normal
    dtype: Any = jnp.float32,
    param_dtype: Any = jnp.float32,
) -> nnx.Linear:
    kernel_init = kernel_init or nnx.initializers.lecun_normal()
    bias_axes = RULES[bias_role] if bias_role else (None,)
    return nnx.Linear(
        d_in,
        d_out,
        use_bias=bias_role is not None,
        kernel_init=nnx.with_partitioning(kernel_init, RULES[kernel_role]),
        bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), bias_axes),
        dtype=dtype,
        param_dtype=param_dtype,
        rngs=rngs,
    )


def layer_norm(
    d: int, rngs: nnx.Rngs, *, dtype: Any = jnp.float32, param_dtype: Any = jnp.float32
) -> nnx.LayerNorm:
    """Statistics in float32 whatever `dtype` (flax promotes them), output in `dtype`."""
    return nnx.LayerNorm(
        d,
        scale_init=nnx.with_partitioning(nnx.initializers.ones_init(), RULES["vector"]),
        bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), RULES["vector"]),
        dtype=dtype,
        param_dtype=param_dtype,
        rngs=rngs,
    )


def rms_norm(
    d: int,
    rngs: nnx.Rngs,
    *,
    epsilon: float = 1e-6,  # flax's default
    dtype: Any = jnp.float32,
    param_dtype: Any = jnp.float32,
) -> nnx.RMSNorm:
    """Statistics in float32 whatever `dtype` (flax promotes them), output in `dtype`."""
    return nnx.RMSNorm(
        d,
        epsilon=epsilon,
        scale_init=nnx.with_partitioning(nnx.initializers.ones_init(), RULES["vector"]),
        dtype=dtype,
        param_dtype=param_dtype,
        rngs=rngs,
    )


def make_blocks(
    make_block: Callable[[nnx.Rngs], nnx.Module], num_layers: int, scan: bool, rngs: nnx.Rngs
) -> nnx.Module:
    """`num_layers` blocks: a list, or (scan) one block whose params carry a layer axis."""
    if not scan:
        return nnx.List([make_block(rngs) for _ in range(num_layers)])

    # The partition metadata gains a leading None: the layer axis lies on no mesh axis.
    @nnx.split_rngs(splits=num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: None})
    def stacked(rngs: nnx.Rngs) -> nnx.Module:
        return make_block(rngs)

    return stacked(rngs)


def run_blocks(
    blocks: nnx.Module, x: jax.Array, remat: str, scan: bool, *context: jax.Array | None
) -> jax.Array:
    """`x` through every block in order, rematerialised as `remat` says; `context` (the
    segment ids and positions of packed documents, or None) goes to every block."""

    def apply(block: nnx.Module, x: jax.Array, *context: jax.Array | None) -> jax.Array:
        return block(x, *context)

    if REMAT_POLICIES[remat] is not None:
        apply = nnx.remat(apply, policy=REMAT_POLICIES[remat])
    if not scan:
        for block in blocks:  # type: ignore[attr-defined]  # an nnx.List
            x = apply(block, x, *context)
        return x

    @nnx.scan(in_axes=(0, nnx.Carry, *(None for _ in context)), out_axes=nnx.Carry)
    def layer(block: nnx.Module, x: jax.Array, *context: jax.Array | None) -> jax.Array:
        return apply(block, x, *context)

    return layer(blocks, x, *context)


def run_blocks_cached(
    blocks: nnx.Module, x: jax.Array, positions: jax.Array, cache: Cache
) -> tuple[jax.Array, Cache]:
    """`x` (T new positions) through every block, each reading and writing its layer of the
    key/value cache (kv_cache.py); the cache comes back advanced by T positions."""
    if isinstance(blocks, nnx.List):
        for block in blocks:
            x, cache = block.with_cache(x, positions, cache)
        return x, cache.advanced(x.shape[1])

    @nnx.scan(in_axes=(0, nnx.Carry, None), out_axes=nnx.Carry)
    def layer(
        block: nnx.Module, carry: tuple[jax.Array, Cache], positions: jax.Array
    ) -> tuple[jax.Array, Cache]:
        x, cache = carry
        return block.with_cache(x, positions, cache)  # type: ignore[attr-defined]

    x, cache = layer(blocks, (x, cache), positions)
    return x, cache.advanced(x.shape[1])

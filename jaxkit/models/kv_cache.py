"""The key/value cache the language models decode with (jaxkit/generate/sampling.py drives them).

Every layer's keys and values are stacked in one preallocated buffer of S slots per row,
(N layers, B rows, S slots, G key/value heads, K head dim), laid out as the training mesh
lays out attention (rows over the batch axes, heads over tensor). Prompts are padded on
the left, so every row's prompt ends at the same slot and each step writes one slot for all
rows; `start_B` is each row's first real slot, and slots before it are never attended to.

The prompt goes in once (`prefill`: slots 0..P-1 in one pass, by the run's attention kernel
with padding as its own document), then one position per step by xla attention over the
slots written so far. A block reads and writes its own layer's slice (`layer`), so the
unrolled and the scanned stacks share one buffer, updated in place inside a compiled loop.

Shape legend: N layers, B rows, S slots, T new positions, H query heads, G key/value
heads, K head dim.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxkit.mesh import constrain
from jaxkit.models import attention


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Cache:
    k_NxBxSxGxK: jax.Array
    v_NxBxSxGxK: jax.Array
    start_B: jax.Array  # int32: each row's first real slot (its left padding)
    index: jax.Array  # int32 scalar: the slot the new positions' first one takes
    layer: jax.Array  # int32 scalar: the layer whose slice the next block reads and writes
    # Static: the prompt's pass (attention over the new positions alone, by the run's
    # kernel) rather than a step over the cache.
    prefill: bool = dataclasses.field(default=False, metadata=dict(static=True))

    @classmethod
    def empty(
        cls, layers: int, rows: int, slots: int, kv_heads: int, head_dim: int, dtype: Any
    ) -> Cache:
        shape = (layers, rows, slots, kv_heads, head_dim)
        zeros = constrain(jnp.zeros(shape, dtype), None, "batch", None, "heads", None)
        scalar = jnp.zeros((), jnp.int32)
        return cls(zeros, zeros, jnp.zeros((rows,), jnp.int32), scalar, scalar)

    def attend(
        self, q_BxTxHxK: jax.Array, k_BxTxGxK: jax.Array, v_BxTxGxK: jax.Array, kernel: str
    ) -> tuple[jax.Array, Cache]:
        """Causal attention of the T new positions over the row's real slots up to each,
        their own included; and the cache with their keys and values written, at `layer`."""
        at = (self.layer, 0, self.index, 0, 0)
        k_NxBxSxGxK = jax.lax.dynamic_update_slice(self.k_NxBxSxGxK, k_BxTxGxK[None], at)
        v_NxBxSxGxK = jax.lax.dynamic_update_slice(self.v_NxBxSxGxK, v_BxTxGxK[None], at)
        k_NxBxSxGxK, v_NxBxSxGxK = (
            constrain(t, None, "batch", None, "heads", None) for t in (k_NxBxSxGxK, v_NxBxSxGxK)
        )
        T = q_BxTxHxK.shape[1]
        slots_T = self.index + jnp.arange(T)
        if self.prefill:
            # The padding is a document of its own (segment 0), the prompt another.
            segment_ids_BxT = (slots_T[None] >= self.start_B[:, None]).astype(jnp.int32)
            a_BxTxHxK = attention.attend(q_BxTxHxK, k_BxTxGxK, v_BxTxGxK, segment_ids_BxT, kernel)
        else:
            k_BxSxGxK = jax.lax.dynamic_index_in_dim(k_NxBxSxGxK, self.layer, keepdims=False)
            v_BxSxGxK = jax.lax.dynamic_index_in_dim(v_NxBxSxGxK, self.layer, keepdims=False)
            slots_S = jnp.arange(k_BxSxGxK.shape[1])
            seen_BxTxS = (slots_S[None, None] >= self.start_B[:, None, None]) & (
                slots_S[None, None] <= slots_T[None, :, None]
            )
            a_BxTxHxK = jax.nn.dot_product_attention(
                q_BxTxHxK, k_BxSxGxK, v_BxSxGxK, mask=seen_BxTxS[:, None]
            )
        cache = dataclasses.replace(
            self, k_NxBxSxGxK=k_NxBxSxGxK, v_NxBxSxGxK=v_NxBxSxGxK, layer=self.layer + 1
        )
        return a_BxTxHxK, cache

    def advanced(self, positions: int) -> Cache:
        """After every layer took `positions` new ones: the next step's cache."""
        return dataclasses.replace(self, index=self.index + positions, layer=self.layer * 0)

"""The Llama-style decoder (model.kind="llama") in flax NNX: RMSNorm, rotary positions,
SwiGLU MLP, no biases, grouped-query attention and optional tied embeddings. Params carry
their partitioning (mesh.RULES).

Shape legend: B batch rows, L sequence length, D d_model, H query heads, G key/value heads,
K head dim, F MLP hidden width, V vocabulary.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxkit.mesh import RULES, constrain
from jaxkit.models import attention, layers, llama_shape
from jaxkit.models.kv_cache import Cache
from jaxkit.sections import LlamaModel

INIT_STDDEV = 0.02  # GPT-2's; residual outputs are scaled down further by depth


def inverse_frequencies(
    head_dim: int, theta: float, scaling: dict[str, float] | None = None
) -> jax.Array:
    """The rotary angle per position of each pair of a head's dimensions, float32; with
    `scaling` (model.rope_scaling), Llama 3.1's: long wavelengths slowed by `factor`, short
    ones kept, those between blended, as Hugging Face's `_compute_llama3_parameters`."""
    inv_freq_K2 = theta ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    if scaling is None:
        return inv_freq_K2
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    context = scaling["original_max_position_embeddings"]
    wavelen_K2 = 2 * math.pi / inv_freq_K2
    slowed_K2 = jnp.where(wavelen_K2 > context / low, inv_freq_K2 / factor, inv_freq_K2)
    smooth_K2 = (context / wavelen_K2 - low) / (high - low)
    blended_K2 = (1 - smooth_K2) * slowed_K2 / factor + smooth_K2 * slowed_K2
    medium_K2 = (wavelen_K2 >= context / high) & (wavelen_K2 <= context / low)
    return jnp.where(medium_K2, blended_K2, slowed_K2)


def rotary(
    x_BxLxNxK: jax.Array,
    theta: float,
    positions_BxL: jax.Array | None = None,
    scaling: dict[str, float] | None = None,
) -> jax.Array:
    """Rotary position embedding (rotate-half form), angles computed in float32; positions
    0..L-1 unless given (packed documents restart at 0); `scaling` as inverse_frequencies."""
    L, K = x_BxLxNxK.shape[1], x_BxLxNxK.shape[3]
    inv_freq_K2 = inverse_frequencies(K, theta, scaling)
    pos_BxL = jnp.arange(L)[None] if positions_BxL is None else positions_BxL
    angles_BxLxK2 = pos_BxL.astype(jnp.float32)[..., None] * inv_freq_K2
    cos, sin = jnp.cos(angles_BxLxK2)[:, :, None, :], jnp.sin(angles_BxLxK2)[:, :, None, :]
    x1, x2 = jnp.split(x_BxLxNxK.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BxLxNxK.dtype)


class LlamaBlock(nnx.Module):
    def __init__(self, m: LlamaModel, *, rngs: nnx.Rngs):
        param_dtype, dtype = layers.dtypes(m)
        D, H, G, F = m.d_model, m.num_heads, m.num_kv_heads, m.mlp_dim
        K = llama_shape.head_dim(m)
        self.num_heads, self.num_kv_heads, self.rope_theta = H, G, float(m.rope_theta)
        self.head_dim, self.rope_scaling = K, llama_shape.rope_scaling(m)
        self.attention = m.attention  # the kernel (jaxkit/models/attention.py)
        eps = llama_shape.norm_eps(m)
        init = nnx.initializers.normal(INIT_STDDEV)
        # Each block adds two outputs to the residual stream: scaled so its variance stays
        # put with depth (GPT-2's 1/sqrt(2 × layers)).
        out_init = nnx.initializers.normal(INIT_STDDEV / math.sqrt(2 * m.num_layers))
        kw: dict[str, Any] = dict(dtype=dtype, param_dtype=param_dtype)
        self.attn_norm = layers.rms_norm(D, rngs, epsilon=eps, **kw)
        self.query = layers.linear(D, H * K, "in_proj", None, rngs, kernel_init=init, **kw)
        self.key = layers.linear(D, G * K, "in_proj", None, rngs, kernel_init=init, **kw)
        self.value = layers.linear(D, G * K, "in_proj", None, rngs, kernel_init=init, **kw)
        self.attn_out = layers.linear(H * K, D, "out_proj", None, rngs, kernel_init=out_init, **kw)
        self.mlp_norm = layers.rms_norm(D, rngs, epsilon=eps, **kw)
        self.gate = layers.linear(D, F, "in_proj", None, rngs, kernel_init=init, **kw)
        self.up = layers.linear(D, F, "in_proj", None, rngs, kernel_init=init, **kw)
        self.down = layers.linear(F, D, "out_proj", None, rngs, kernel_init=out_init, **kw)

    def __call__(
        self,
        x_BxLxD: jax.Array,
        segment_ids_BxL: jax.Array | None = None,
        positions_BxL: jax.Array | None = None,
    ) -> jax.Array:
        q_BxLxHxK, k_BxLxGxK, v_BxLxGxK = self._project(x_BxLxD, positions_BxL)
        # Each group of H / G query heads shares one key/value head; softmax in float32.
        a_BxLxHxK = attention.attend(
            q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, segment_ids_BxL, self.attention
        )
        return self._rest(x_BxLxD, a_BxLxHxK)

    def with_cache(
        self, x_BxTxD: jax.Array, positions_BxT: jax.Array, cache: Cache
    ) -> tuple[jax.Array, Cache]:
        """The block on T new positions whose keys and values join `cache` (kv_cache.py)."""
        q_BxTxHxK, k_BxTxGxK, v_BxTxGxK = self._project(x_BxTxD, positions_BxT)
        a_BxTxHxK, cache = cache.attend(q_BxTxHxK, k_BxTxGxK, v_BxTxGxK, self.attention)
        return self._rest(x_BxTxD, a_BxTxHxK), cache

    def _project(
        self, x_BxLxD: jax.Array, positions_BxL: jax.Array | None
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        B, L = x_BxLxD.shape[:2]
        H, G, K = self.num_heads, self.num_kv_heads, self.head_dim
        h_BxLxD = self.attn_norm(x_BxLxD)
        rope = (self.rope_theta, positions_BxL, self.rope_scaling)
        q_BxLxHxK = rotary(self.query(h_BxLxD).reshape(B, L, H, K), *rope)
        k_BxLxGxK = rotary(self.key(h_BxLxD).reshape(B, L, G, K), *rope)
        v_BxLxGxK = self.value(h_BxLxD).reshape(B, L, G, K)
        q_BxLxHxK, k_BxLxGxK, v_BxLxGxK = (
            constrain(t, "batch", None, "heads", None) for t in (q_BxLxHxK, k_BxLxGxK, v_BxLxGxK)
        )
        return q_BxLxHxK, k_BxLxGxK, v_BxLxGxK

    def _rest(self, x_BxLxD: jax.Array, a_BxLxHxK: jax.Array) -> jax.Array:
        """The attention's output projected into the residual stream, then the MLP."""
        B, L = x_BxLxD.shape[:2]
        a_BxLxHxK = constrain(a_BxLxHxK, "batch", None, "heads", None)
        x_BxLxD = constrain(
            x_BxLxD + self.attn_out(a_BxLxHxK.reshape(B, L, -1)), "batch", None, None
        )
        h_BxLxD = self.mlp_norm(x_BxLxD)
        h_BxLxF = constrain(
            jax.nn.silu(self.gate(h_BxLxD)) * self.up(h_BxLxD), "batch", None, "mlp"
        )
        return constrain(x_BxLxD + self.down(h_BxLxF), "batch", None, None)


class LlamaLM(nnx.Module):
    def __init__(self, m: LlamaModel, *, rngs: nnx.Rngs):
        param_dtype, self.dtype = layers.dtypes(m)
        self.remat, self.scan = m.remat, m.scan_layers
        self.tie_embeddings = m.tie_embeddings
        self.loss_chunk_tokens = m.loss_chunk_tokens  # models/loss.py
        self.head_name = "embed" if m.tie_embeddings else "head"
        self.embed = nnx.Embed(
            m.vocab_size,
            m.d_model,
            embedding_init=nnx.with_partitioning(
                nnx.initializers.normal(INIT_STDDEV), RULES["embed"]
            ),
            dtype=self.dtype,
            param_dtype=param_dtype,
            rngs=rngs,
        )
        self.blocks = layers.make_blocks(
            lambda r: LlamaBlock(m, rngs=r), m.num_layers, self.scan, rngs
        )
        self.final_norm = layers.rms_norm(
            m.d_model,
            rngs,
            epsilon=llama_shape.norm_eps(m),
            dtype=self.dtype,
            param_dtype=param_dtype,
        )
        if not self.tie_embeddings:
            self.head = layers.linear(
                m.d_model,
                m.vocab_size,
                "logits",
                None,
                rngs,
                kernel_init=nnx.initializers.normal(INIT_STDDEV),
                dtype=self.dtype,
                param_dtype=param_dtype,
            )

    def __call__(
        self,
        tokens_BxL: jax.Array,
        segment_ids_BxL: jax.Array | None = None,
        positions_BxL: jax.Array | None = None,
    ) -> jax.Array:
        """Logits; with segment ids and positions, as models.TransformerLM."""
        return self.logits(self.head_input(tokens_BxL, segment_ids_BxL, positions_BxL))

    def logits(self, h_BxLxD: jax.Array) -> jax.Array:
        """The head (the embedding table where tied), on every position or on a chunk."""
        logits_BxLxV = self.embed.attend(h_BxLxD) if self.tie_embeddings else self.head(h_BxLxD)
        return constrain(logits_BxLxV, "batch", None, None)

    def head_input(
        self,
        tokens_BxL: jax.Array,
        segment_ids_BxL: jax.Array | None = None,
        positions_BxL: jax.Array | None = None,
    ) -> jax.Array:
        """The final norm's output, which the head reads; arguments as for the logits."""
        # The table whole before the lookup, as in models.TransformerLM.
        table_VxD = constrain(self.embed.embedding[...], None, None)
        x_BxLxD = jnp.take(table_VxD, tokens_BxL, axis=0).astype(self.dtype)
        x_BxLxD = constrain(x_BxLxD, "batch", None, None)
        x_BxLxD = layers.run_blocks(
            self.blocks, x_BxLxD, self.remat, self.scan, segment_ids_BxL, positions_BxL
        )
        return self.final_norm(x_BxLxD)

    def with_cache(
        self, tokens_BxT: jax.Array, positions_BxT: jax.Array, cache: Cache
    ) -> tuple[jax.Array, Cache]:
        """Logits of T new tokens at `positions_BxT`, their keys and values written into
        `cache` (kv_cache.py)."""
        table_VxD = constrain(self.embed.embedding[...], None, None)
        x_BxTxD = jnp.take(table_VxD, tokens_BxT, axis=0).astype(self.dtype)
        x_BxTxD = constrain(x_BxTxD, "batch", None, None)
        x_BxTxD, cache = layers.run_blocks_cached(self.blocks, x_BxTxD, positions_BxT, cache)
        return self.logits(self.final_norm(x_BxTxD)), cache


def parameter_count(m: LlamaModel) -> dict[str, int]:
    """Params by kind, in closed form: the embedding table, the output head (0 when tied),
    and the blocks and final norm."""
    D, H, G, F, V = m.d_model, m.num_heads, m.num_kv_heads, m.mlp_dim, m.vocab_size
    K = llama_shape.head_dim(m)
    attention = D * H * K + 2 * D * G * K + H * K * D
    block = attention + 3 * D * F + 2 * D  # SwiGLU's three matrices; two RMSNorm scales
    return {
        "embedding": V * D,
        "head": 0 if m.tie_embeddings else D * V,
        "blocks": m.num_layers * block + D,
    }

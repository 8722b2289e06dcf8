"""The byte Transformer LM (model.kind="transformer") in flax NNX: pre-norm blocks of causal
self-attention and a GELU MLP, learned positions. Params carry their partitioning
(mesh.RULES).

Shape legend: B batch rows, L sequence length, D d_model, H heads, K head dim,
F MLP hidden width, V vocabulary.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxkit.keys import ConfigError
from jaxkit.mesh import RULES, constrain
from jaxkit.models import attention, layers
from jaxkit.models.kv_cache import Cache
from jaxkit.sections import TransformerModel

_linear = layers.linear


class Block(nnx.Module):
    """Pre-norm Transformer block: causal self-attention, then a GELU MLP."""

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        mlp_dim: int,
        *,
        rngs: nnx.Rngs,
        dtype: Any = jnp.float32,
        param_dtype: Any = jnp.float32,
        attention: str = "auto",  # the kernel (jaxkit/models/attention.py)
    ):
        self.num_heads, self.attention = num_heads, attention
        kw: dict[str, Any] = dict(dtype=dtype, param_dtype=param_dtype)
        self.ln_attn = layers.layer_norm(d_model, rngs, **kw)
        self.query = _linear(d_model, d_model, "in_proj", "hidden_bias", rngs, **kw)
        # No key bias: it adds q·b to every logit of a query, which softmax cancels, so its
        # gradient is zero up to round-off and Adam would turn that noise into steps.
        self.key = _linear(d_model, d_model, "in_proj", None, rngs, **kw)
        self.value = _linear(d_model, d_model, "in_proj", "hidden_bias", rngs, **kw)
        self.attn_out = _linear(d_model, d_model, "out_proj", "vector", rngs, **kw)
        self.ln_mlp = layers.layer_norm(d_model, rngs, **kw)
        self.mlp_in = _linear(d_model, mlp_dim, "in_proj", "hidden_bias", rngs, **kw)
        self.mlp_out = _linear(mlp_dim, d_model, "out_proj", "vector", rngs, **kw)

    def __call__(
        self, x_BxLxD: jax.Array, segment_ids_BxL: jax.Array | None = None, *_: jax.Array | None
    ) -> jax.Array:
        q_BxLxHxK, k_BxLxHxK, v_BxLxHxK = self._project(x_BxLxD)
        a_BxLxHxK = attention.attend(
            q_BxLxHxK, k_BxLxHxK, v_BxLxHxK, segment_ids_BxL, self.attention
        )
        return self._rest(x_BxLxD, a_BxLxHxK)

    def with_cache(self, x_BxTxD: jax.Array, _: jax.Array, cache: Cache) -> tuple[jax.Array, Cache]:
        """The block on T new positions whose keys and values join `cache` (kv_cache.py);
        positions are the embedding's, so the block needs none."""
        q_BxTxHxK, k_BxTxHxK, v_BxTxHxK = self._project(x_BxTxD)
        a_BxTxHxK, cache = cache.attend(q_BxTxHxK, k_BxTxHxK, v_BxTxHxK, self.attention)
        return self._rest(x_BxTxD, a_BxTxHxK), cache

    def _project(self, x_BxLxD: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        B, L, D = x_BxLxD.shape
        H = self.num_heads
        h_BxLxD = self.ln_attn(x_BxLxD)
        q_BxLxHxK, k_BxLxHxK, v_BxLxHxK = (
            constrain(proj(h_BxLxD).reshape(B, L, H, D // H), "batch", None, "heads", None)
            for proj in (self.query, self.key, self.value)
        )
        return q_BxLxHxK, k_BxLxHxK, v_BxLxHxK

    def _rest(self, x_BxLxD: jax.Array, a_BxLxHxK: jax.Array) -> jax.Array:
        """The attention's output projected into the residual stream, then the MLP."""
        B, L, D = x_BxLxD.shape
        a_BxLxHxK = constrain(a_BxLxHxK, "batch", None, "heads", None)
        x_BxLxD = constrain(
            x_BxLxD + self.attn_out(a_BxLxHxK.reshape(B, L, D)), "batch", None, None
        )
        h_BxLxF = constrain(jax.nn.gelu(self.mlp_in(self.ln_mlp(x_BxLxD))), "batch", None, "mlp")
        return constrain(x_BxLxD + self.mlp_out(h_BxLxF), "batch", None, None)


class TransformerLM(nnx.Module):
    """Decoder-only byte LM with learned positions."""

    def __init__(self, m: TransformerModel, *, seq_len: int, rngs: nnx.Rngs):
        """From the config's model section, as LlamaLM; `seq_len` (data.seq_len) is the
        length of the learned position table."""
        vocab_size, d_model, num_heads = m.vocab_size, m.d_model, m.num_heads
        if d_model % num_heads:
            raise ConfigError(f"model.d_model={d_model} is not divisible by num_heads={num_heads}")
        param_dtype, self.dtype = layers.dtypes(m)
        self.remat, self.scan = m.remat, m.scan_layers
        self.loss_chunk_tokens = m.loss_chunk_tokens  # models/loss.py
        self.head_name = "head"
        kw: dict[str, Any] = dict(dtype=self.dtype, param_dtype=param_dtype)
        embed_init = nnx.initializers.normal(stddev=0.02)
        self.embed = nnx.Embed(
            vocab_size,
            d_model,
            embedding_init=nnx.with_partitioning(embed_init, RULES["embed"]),
            rngs=rngs,
            **kw,
        )
        self.pos_embed = nnx.Param(
            nnx.with_partitioning(embed_init, RULES["pos_embed"])(
                rngs.params(), (seq_len, d_model), kw["param_dtype"]
            )
        )
        self.blocks = layers.make_blocks(
            lambda r: Block(
                d_model,
                num_heads,
                m.mlp_dim,
                rngs=r,
                attention=m.attention,
                **kw,
            ),
            m.num_layers,
            self.scan,
            rngs,
        )
        self.ln_final = layers.layer_norm(d_model, rngs, **kw)
        self.head = _linear(d_model, vocab_size, "logits", "vector", rngs, **kw)

    def __call__(
        self,
        tokens_BxL: jax.Array,
        segment_ids_BxL: jax.Array | None = None,
        positions_BxL: jax.Array | None = None,
    ) -> jax.Array:
        """Logits; with segment ids and positions (packed documents, data.document_mask),
        attention stays inside each document and positions restart at each."""
        return self.logits(self.head_input(tokens_BxL, segment_ids_BxL, positions_BxL))

    def logits(self, h_BxLxD: jax.Array) -> jax.Array:
        """The head, on every position or on a chunk of them (models/loss.py)."""
        return constrain(self.head(h_BxLxD), "batch", None, None)  # logits_BxLxV

    def head_input(
        self,
        tokens_BxL: jax.Array,
        segment_ids_BxL: jax.Array | None = None,
        positions_BxL: jax.Array | None = None,
    ) -> jax.Array:
        """The final norm's output, which the head reads; arguments as for the logits."""
        x_BxLxD = self._embed(tokens_BxL, positions_BxL)
        x_BxLxD = layers.run_blocks(self.blocks, x_BxLxD, self.remat, self.scan, segment_ids_BxL)
        return self.ln_final(x_BxLxD)

    def with_cache(
        self, tokens_BxT: jax.Array, positions_BxT: jax.Array, cache: Cache
    ) -> tuple[jax.Array, Cache]:
        """Logits of T new tokens at `positions_BxT` (< data.seq_len: the learned table's
        length), their keys and values written into `cache` (kv_cache.py)."""
        x_BxTxD = self._embed(tokens_BxT, positions_BxT)
        x_BxTxD, cache = layers.run_blocks_cached(self.blocks, x_BxTxD, positions_BxT, cache)
        return self.logits(self.ln_final(x_BxTxD)), cache

    def _embed(self, tokens_BxL: jax.Array, positions_BxL: jax.Array | None) -> jax.Array:
        L = tokens_BxL.shape[1]
        # The table whole before the lookup (FSDP gathers every param for its layer anyway):
        # a gather from a table sharded on d_model cannot make rows sharded by batch.
        table_VxD = constrain(self.embed.embedding[...], None, None)
        if positions_BxL is None:
            pos_xLxD = self.pos_embed[:L]
        else:  # a gather of rows as the token lookup is: from the table whole
            pos_xLxD = jnp.take(constrain(self.pos_embed[...], None, None), positions_BxL, axis=0)
        x_BxLxD = jnp.take(table_VxD, tokens_BxL, axis=0) + pos_xLxD
        return constrain(x_BxLxD.astype(self.dtype), "batch", None, None)

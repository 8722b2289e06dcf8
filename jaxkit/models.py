"""Models in flax NNX whose parameters carry their partitioning (see mesh.RULES).

Shape legend: B batch rows, L sequence length, D d_model, H heads, K head dim,
F MLP hidden width, V vocabulary, C classes, I input features.
"""

from __future__ import annotations

import itertools
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from jaxkit import custom_model, layers
from jaxkit.config import LM_KINDS, ConfigError, is_custom
from jaxkit.llama import LlamaLM
from jaxkit.mesh import RULES, constrain

_linear = layers.linear


class MLPClassifier(nnx.Module):
    def __init__(
        self,
        num_features: int,
        hidden_size: int,
        num_layers: int,
        num_classes: int,
        *,
        rngs: nnx.Rngs,
    ):
        widths = [num_features] + [hidden_size] * num_layers
        # Alternate in/out roles so consecutive kernels shard compatibly on the tensor axis.
        roles = [("in_proj", "hidden_bias"), ("out_proj", "vector")]
        self.hidden = nnx.List(
            [
                _linear(d_in, d_out, *roles[i % 2], rngs=rngs)
                for i, (d_in, d_out) in enumerate(itertools.pairwise(widths))
            ]
        )
        self.head = _linear(hidden_size, num_classes, "logits", "vector", rngs=rngs)

    def __call__(self, x_BxI: jax.Array) -> jax.Array:
        h = constrain(x_BxI, "batch", None)
        for i, layer in enumerate(self.hidden):
            # Alternate in/out roles: in_proj outputs are hidden units (tensor-sharded).
            h = constrain(jax.nn.relu(layer(h)), "batch", "mlp" if i % 2 == 0 else None)
        return constrain(self.head(h), "batch", None)  # logits_BxC


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
    ):
        self.num_heads = num_heads
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
        self, x_BxLxD: jax.Array, mask_Bx1xLxL: jax.Array | None = None, *_: jax.Array | None
    ) -> jax.Array:
        B, L, D = x_BxLxD.shape
        H = self.num_heads
        h_BxLxD = self.ln_attn(x_BxLxD)
        q_BxLxHxK, k_BxLxHxK, v_BxLxHxK = (
            constrain(proj(h_BxLxD).reshape(B, L, H, D // H), "batch", None, "heads", None)
            for proj in (self.query, self.key, self.value)
        )
        a_BxLxHxK = jax.nn.dot_product_attention(
            q_BxLxHxK, k_BxLxHxK, v_BxLxHxK, mask=mask_Bx1xLxL, is_causal=True
        )
        a_BxLxHxK = constrain(a_BxLxHxK, "batch", None, "heads", None)
        x_BxLxD = constrain(
            x_BxLxD + self.attn_out(a_BxLxHxK.reshape(B, L, D)), "batch", None, None
        )
        h_BxLxF = constrain(jax.nn.gelu(self.mlp_in(self.ln_mlp(x_BxLxD))), "batch", None, "mlp")
        return constrain(x_BxLxD + self.mlp_out(h_BxLxF), "batch", None, None)


class TransformerLM(nnx.Module):
    """Decoder-only byte LM with learned positions."""

    def __init__(
        self,
        vocab_size: int,
        seq_len: int,
        d_model: int,
        num_layers: int,
        num_heads: int,
        mlp_dim: int,
        *,
        rngs: nnx.Rngs,
        param_dtype: str = "float32",
        compute_dtype: str = "float32",
        remat: str = "none",
        scan_layers: bool = False,
    ):
        if d_model % num_heads:
            raise ConfigError(f"model.d_model={d_model} is not divisible by num_heads={num_heads}")
        self.dtype = layers.DTYPES[compute_dtype]
        self.remat, self.scan = remat, scan_layers
        kw: dict[str, Any] = dict(dtype=self.dtype, param_dtype=layers.DTYPES[param_dtype])
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
            lambda r: Block(d_model, num_heads, mlp_dim, rngs=r, **kw),
            num_layers,
            scan_layers,
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
        L = tokens_BxL.shape[1]
        # The table whole before the lookup (FSDP gathers every param for its layer anyway):
        # a gather from a table sharded on d_model cannot make rows sharded by batch.
        table_VxD = constrain(self.embed.embedding[...], None, None)
        pos_xLxD = self.pos_embed[:L] if positions_BxL is None else self.pos_embed[positions_BxL]
        x_BxLxD = jnp.take(table_VxD, tokens_BxL, axis=0) + pos_xLxD
        x_BxLxD = constrain(x_BxLxD.astype(self.dtype), "batch", None, None)
        mask = layers.document_mask(segment_ids_BxL)
        x_BxLxD = layers.run_blocks(self.blocks, x_BxLxD, self.remat, self.scan, mask)
        return constrain(self.head(self.ln_final(x_BxLxD)), "batch", None, None)  # logits_BxLxV


def build_model(config: ml_collections.ConfigDict, rngs: nnx.Rngs) -> nnx.Module:
    m, d = config.model, config.data
    if is_custom(m.kind):
        return custom_model.build(config, rngs)
    if m.kind == "transformer":
        options: dict[str, Any] = {key: layers.lm_option(m, key) for key in layers.LM_DEFAULTS}
        return TransformerLM(
            m.vocab_size,
            d.seq_len,
            m.d_model,
            m.num_layers,
            m.num_heads,
            m.mlp_dim,
            rngs=rngs,
            **options,
        )
    if m.kind == "llama":
        return LlamaLM(m, rngs=rngs)
    if m.kind == "mlp":
        return MLPClassifier(d.num_features, m.hidden_size, m.num_layers, m.num_classes, rngs=rngs)
    raise ConfigError(
        f"model.kind={m.kind!r} is not one of transformer, llama, mlp, package.module:factory"
    )


def sharded_sizes(config: ml_collections.ConfigDict) -> list[tuple[str, int, tuple[str, ...]]]:
    """(config key, size, mesh axes) for every parameter dimension mesh.RULES shard.

    Transformer: d_model is the fsdp side of every kernel, embedding and head, and, as
    heads·head_dim, the tensor side of the attention projections; mlp_dim is the tensor side
    of the MLP. MLP: the first layer's inputs lie on fsdp, and hidden units on both axes.
    tests/test_validate.py checks this list against the partition specs of the models.
    """
    m, d = config.model, config.data
    if is_custom(m.kind):  # sharded as it annotates: see custom_model.check_shards
        return []
    if m.kind in LM_KINDS:
        return [
            ("model.d_model", m.d_model, ("fsdp", "tensor")),
            ("model.mlp_dim", m.mlp_dim, ("tensor",)),
        ]
    return [
        ("data.num_features", d.num_features, ("fsdp",)),
        ("model.hidden_size", m.hidden_size, ("fsdp", "tensor")),
    ]


def check_mesh_divides(config: ml_collections.ConfigDict, mesh_shape: dict[str, int]) -> None:
    """Fails, naming the key, when a sharded dimension does not divide over its mesh axis.

    JAX refuses uneven shards (IndivisibleError when the state is laid out, after the data
    is loaded and the step is traced), so this runs as soon as the mesh shape is known.
    """
    if is_custom(config.model.kind):
        custom_model.check_shards(config, mesh_shape)
    for key, size, axes in sharded_sizes(config):
        for axis in axes:
            if size % mesh_shape[axis]:
                raise ConfigError(
                    f"{key}={size} is not divisible by mesh.{axis}={mesh_shape[axis]}: the "
                    f"partition rules (jaxkit/mesh.py RULES) split it over the {axis} axis, "
                    f"and shards must be even. Make {key} a multiple of {mesh_shape[axis]}, "
                    f"or change mesh.{axis}"
                )
    if config.model.kind not in LM_KINDS:
        return
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


def token_cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Cross-entropy in nats of every label (rows, or rows × positions), in float32."""
    logits = logits.astype(jnp.float32)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    label_logit = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
    return log_z - label_logit


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Mean cross-entropy in nats over every label (rows, or rows × positions)."""
    return jnp.mean(token_cross_entropy(logits, labels))


def logits_of(model: nnx.Module, batch: dict[str, jax.Array]) -> jax.Array:
    """The model's logits for a batch; packed documents' segments go to the model."""
    if "segment_ids" in batch:
        return model(batch["inputs"], batch["segment_ids"], batch["positions"])
    return model(batch["inputs"])


def weighted_loss(logits: jax.Array, batch: dict[str, jax.Array]) -> jax.Array:
    """Σ loss_weights × cross-entropy over the batch's labels. The loader has divided the
    weights by the step's normaliser (data.load_micro_batch), so no division happens here,
    and a micro-batch's share of its optimizer step's loss needs no count of its own."""
    return jnp.sum(batch["loss_weights"] * token_cross_entropy(logits, batch["targets"]))

"""The loss every model kind trains on: cross-entropy of its logits, weighted per label."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


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

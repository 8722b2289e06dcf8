# ruff: noqa: N803, N806  (shape-suffixed tensor names, STYLE.md §7, as in the *_net.py)
"""The loss every model kind trains on: cross-entropy of its logits, weighted per label.

A language model whose head reads its final hidden states (the built-in kinds) may have
its loss taken in chunks of positions (`model.loss_chunk_tokens`): each chunk's head
matmul and cross-entropy run in one body of a `lax.map`, under `jax.checkpoint`, so the
(B × L × V) float32 logits are never held whole, forward or backward (the backward
recomputes each chunk's logits). The sums are the same but for their order.

Shape legend: B batch rows, L sequence length, C positions per chunk, N chunks, D the
head's input width, V vocabulary.
"""

from __future__ import annotations

import functools
import math
from typing import Protocol, runtime_checkable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxkit.mesh import BATCH_AXES, constrain


@runtime_checkable
class ChunkedHead(Protocol):
    """A language model whose logits are its head applied to its final hidden states."""

    loss_chunk_tokens: int  # positions per loss chunk; 0: the loss takes the whole logits
    head_name: str  # the attribute holding the head's params (the embedding where tied)

    def head_input(
        self,
        tokens_BxL: jax.Array,
        segment_ids_BxL: jax.Array | None = None,
        positions_BxL: jax.Array | None = None,
    ) -> jax.Array:
        """h_BxLxD: what the head reads."""
        ...

    def logits(self, h_BxLxD: jax.Array) -> jax.Array:
        """The head on all positions or a chunk of them."""
        ...


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


def model_loss(model: nnx.Module, batch: dict[str, jax.Array]) -> jax.Array:
    """weighted_loss of the model's logits on the batch, in chunks where the model says so:
    what the train steps and the noise scale's gradient take."""
    return _weighted_sums(model, batch, batch["loss_weights"], hits=False)["loss_sum"]


def eval_sums(model: nnx.Module, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Σ weight × loss and Σ weight × hit over the batch's targets (padding rows weigh 0),
    and Σ weight: the caller divides once at the end, as a training step's loss does."""
    w = batch["weights"]
    return {**_weighted_sums(model, batch, w, hits=True), "weight": jnp.sum(w)}


def row_sums(model: nnx.Module, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """eval_sums of each row apart, (B,) each: a row's Σ weight × loss is minus the log-
    probability of its weighted targets (weights 0 or 1), and its Σ weight × hit equals its
    Σ weight where each of them is its position's most probable token (lm-evaluation-
    harness's log-likelihood and is_greedy, jaxkit/generate/lm_eval_model.py)."""
    w = batch["weights"]
    return {**_weighted_sums(model, batch, w, hits=True, rows=True), "weight": jnp.sum(w, -1)}


def _sums(
    logits: jax.Array, targets: jax.Array, weights: jax.Array, hits: bool, rows: bool = False
) -> dict[str, jax.Array]:
    """The sums over every label, or over each row's (`rows`: the leading axis kept)."""
    axes = tuple(range(1, targets.ndim)) if rows else None
    sums = {"loss_sum": jnp.sum(weights * token_cross_entropy(logits, targets), axes)}
    if hits:
        hit = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
        sums["accuracy_sum"] = jnp.sum(weights * hit, axes)
    return sums


def chunking(length: int, chunk_tokens: int) -> tuple[int, int]:
    """(chunks N, positions per chunk C) for rows of `length`: the fewest chunks of at most
    `chunk_tokens`, evened out, so N × C - length < N positions are padding (at weight 0)."""
    if chunk_tokens <= 0 or chunk_tokens >= length:
        return 1, length
    n = -(-length // chunk_tokens)
    return n, -(-length // n)


def _weighted_sums(
    model: nnx.Module,
    batch: dict[str, jax.Array],
    weights: jax.Array,
    hits: bool,
    rows: bool = False,
) -> dict[str, jax.Array]:
    targets = batch["targets"]
    chunk_tokens = model.loss_chunk_tokens if isinstance(model, ChunkedHead) else 0
    n, c = chunking(targets.shape[-1], chunk_tokens if targets.ndim == 2 else 0)
    if n == 1:
        return _sums(logits_of(model, batch), targets, weights, hits, rows)
    assert isinstance(model, ChunkedHead)
    extra = (batch["segment_ids"], batch["positions"]) if "segment_ids" in batch else ()
    h_BxLxD = model.head_input(batch["inputs"], *extra)
    B, L = targets.shape
    pad = n * c - L

    def cut(x_BxL: jax.Array) -> jax.Array:
        """(B, L, ...) -> (N, B, C, ...): the chunk axis leads, rows stay sharded."""
        x_BxL = jnp.pad(x_BxL, [(0, 0), (0, pad)] + [(0, 0)] * (x_BxL.ndim - 2))
        return jnp.swapaxes(x_BxL.reshape(B, n, c, *x_BxL.shape[2:]), 0, 1)

    xs = (cut(h_BxLxD), cut(targets), cut(weights))
    axes = _row_axes(B)
    if not axes:
        return _chunk_sums(model, xs, hits, rows)
    # Under the compiler's sharding the head's gradient, summed over the chunks in the loop's
    # carry, would be reduced across the batch axes once per chunk (checked in the compiled
    # program: N all-reduces of the head against one unchunked). Each device therefore sums
    # its own rows' chunks with its own copy of the head, and the gradient is reduced once,
    # where that copy is made (the transpose of the pcast, outside the loop).
    graphdef, *states = nnx.split(model, nnx.PathContains(model.head_name), ...)
    head, rest = states

    def per_shard(
        head: nnx.State, xs: tuple[jax.Array, jax.Array, jax.Array]
    ) -> dict[str, jax.Array]:
        head = jax.tree.map(lambda p: jax.lax.pcast(p, axes, to="varying"), head)
        sums = _chunk_sums(nnx.merge(graphdef, head, rest), xs, hits, rows)
        return sums if rows else jax.lax.psum(sums, axes)

    chunks = P(None, axes)  # (N, B, C, ...): rows over the batch axes, as the batch is
    return jax.shard_map(
        per_shard,
        in_specs=(P(), (chunks, chunks, chunks)),
        out_specs=P(axes) if rows else P(),  # each row's sums stay with its device
        axis_names=set(axes),
    )(head, xs)


def _row_axes(rows: int) -> tuple[str, ...]:
    """The batch axes (of more than one device) of the mesh being traced, where the rows
    divide over them; () outside a mesh, where they do not (the noise scale's one row), and
    inside a shard_map already (the fused step's, manual over "data": a second one, manual
    over "fsdp" inside it, fails Shardy's verifier under AD in jax 0.10.2)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.manual_axes:
        return ()
    axes = tuple(a for a in BATCH_AXES if mesh.shape[a] > 1)
    return axes if axes and rows % math.prod(mesh.shape[a] for a in axes) == 0 else ()


def _chunk_sums(
    model: ChunkedHead, xs: tuple[jax.Array, ...], hits: bool, rows: bool = False
) -> dict[str, jax.Array]:
    """The sums over every chunk of `xs` (h, targets, weights; chunk axis first), one chunk's
    logits at a time; each row's apart where `rows`."""

    # Only the chunk's input is kept for the backward pass, which recomputes its logits
    # (prevent_cse guards against nothing inside a loop body, and would block fusions).
    @functools.partial(jax.checkpoint, prevent_cse=False)
    def chunk(xs: tuple[jax.Array, jax.Array, jax.Array]) -> dict[str, jax.Array]:
        h_BxCxD, targets_BxC, weights_BxC = xs
        logits_BxCxV = model.logits(constrain(h_BxCxD, "batch", None, None))
        return _sums(logits_BxCxV, targets_BxC, weights_BxC, hits, rows)

    per_chunk = jax.lax.map(chunk, xs)  # (N,) each, or (N, B) where `rows`
    return {name: jnp.sum(s_N, axis=0) for name, s_N in per_chunk.items()}

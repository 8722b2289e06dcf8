"""Text from a trained language model: the prompt once, then one token per step, all inside
one compiled program (`jaxkit sample`, jaxkit/commands/sample.py).

How a model generates is its contract's word (`decoding`, jaxkit/models/): the built-in
language models keep a key/value cache (jaxkit/models/kv_cache.py): the prompts, padded on the
left to a length bucket, run once through the run's attention kernel (prefill), then each
step runs the one new token of every row against the cache, by xla attention, inside a
`lax.while_loop` that ends when every row has stopped. A model of your own has no cache the
kit knows, so each step runs it on the whole prefix (padded on the right).

The program runs on the training mesh: params laid out as trained (fsdp and tensor
included), rows over the batch axes. It is compiled once per batch and length bucket: rows
come in batches of a multiple of the batch axes' size (the last one padded), prompts are
padded to a power of two, and the cache holds the bucket's prompt plus `max_new` slots.

Sampling (`distribution`): temperature 0 takes the most probable token; else the logits
are divided by the temperature, top-k keeps the k most probable tokens (and any tied with
the k-th), top-p the fewest most probable tokens whose probability reaches p (and any tied
with the least of them), and the rest is renormalised. Row r's token at step t is drawn
with the key fold_in(fold_in(key(seed), r), t), so a seed gives the same samples whatever
the device count, the batch or the padding.

Shape legend: B rows, P prompt bucket, N new tokens, S slots (P + N), V vocabulary.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxkit import mesh as mesh_lib
from jaxkit.models import build_model, contract, layers
from jaxkit.models.common import Decoding
from jaxkit.models.kv_cache import Cache
from jaxkit.sections import RunConfig
from jaxkit.step.train_step import on_mesh, with_kernel

MAX_BATCH_ROWS = 64  # rows per compiled batch (rounded up to the batch axes' size)
MIN_PROMPT_BUCKET = 16
SPLASH_BLOCK = 128  # a splash prefill's length is a multiple of its block
PROGRESS_STEPS = 64  # tokens a call generates where a bar shows progress
PROGRESS_DELAY_S = 2.0  # a generation shorter than this shows no bar


@dataclasses.dataclass(frozen=True)
class Settings:
    """How each token is chosen: temperature 0 is greedy (top-k and top-p then change
    nothing); top_k / top_p None keep every token."""

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None


@dataclasses.dataclass(frozen=True)
class Sample:
    prompt_tokens: list[int]
    tokens: list[int]  # generated, the stop token left out
    finish_reason: str  # "eos" or "length"


def distribution(logits_BxV: jax.Array, settings: Settings) -> jax.Array:
    """The probabilities a token is drawn from (temperature > 0), float32."""
    # The logits less their row's largest, then divided: a small temperature sends the others
    # to -inf, never the largest to +inf (dividing first overflowed near 1e-9 and drew junk);
    # the largest stays 0, also where the temperature rounds to 0 in float32.
    x_BxV = logits_BxV.astype(jnp.float32)
    shifted_BxV = x_BxV - jnp.max(x_BxV, axis=-1, keepdims=True)
    z_BxV = jnp.where(shifted_BxV == 0, 0.0, shifted_BxV / settings.temperature)
    if settings.top_k is not None and settings.top_k < z_BxV.shape[-1]:
        kth_Bx1 = jax.lax.top_k(z_BxV, settings.top_k)[0][:, -1:]
        z_BxV = jnp.where(z_BxV >= kth_Bx1, z_BxV, -jnp.inf)
    p_BxV = jax.nn.softmax(z_BxV, axis=-1)
    if settings.top_p is not None:
        sorted_BxV = -jnp.sort(-p_BxV, axis=-1)
        before_BxV = jnp.cumsum(sorted_BxV, axis=-1) - sorted_BxV
        # The least probability kept: that of the last token whose predecessors fall short.
        least_Bx1 = jnp.min(
            jnp.where(before_BxV < settings.top_p, sorted_BxV, jnp.inf), axis=-1, keepdims=True
        )
        p_BxV = jnp.where(p_BxV >= least_Bx1, p_BxV, 0.0)
        p_BxV = p_BxV / jnp.sum(p_BxV, axis=-1, keepdims=True)
    return p_BxV


def next_tokens(logits_BxV: jax.Array, keys_B: jax.Array, settings: Settings) -> jax.Array:
    """Each row's token: the most probable at temperature 0, else drawn with its key."""
    if settings.temperature == 0:
        return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
    log_p_BxV = jnp.log(distribution(logits_BxV, settings))
    return jax.vmap(jax.random.categorical)(keys_B, log_p_BxV).astype(jnp.int32)


def _row_keys(seed: jax.Array, rows_B: jax.Array, step: jax.Array) -> jax.Array:
    key = jax.random.key(seed)
    rows_B = jnp.maximum(rows_B, 0)  # padding rows (-1) draw as row 0, unread
    return jax.vmap(lambda r: jax.random.fold_in(jax.random.fold_in(key, r), step))(rows_B)


def _stopped(tokens_B: jax.Array, eos_E: jax.Array) -> jax.Array:
    return jnp.isin(tokens_B, eos_E)


def _cached_start(
    params: Any,
    prompts_BxP: jax.Array,
    start_B: jax.Array,
    rows_B: jax.Array,
    *,
    graphdef: nnx.GraphDef,
    cache_shape: tuple[int, int, int],
    dtype: Any,
    new: int,
    keep_logits: bool,
) -> tuple:
    """The prompts' pass through the model (prefill): the state `_cached_advance` goes on
    from, (step, logits_BxV the next token is chosen from, cache, tokens_BxN, done_B,
    logits_BxNxV each token was chosen from or None)."""
    model: Any = nnx.merge(graphdef, params)
    B, P = prompts_BxP.shape
    layers_, kv_heads, head_dim = cache_shape
    cache = Cache.empty(layers_, B, P + new, kv_heads, head_dim, dtype)
    cache = dataclasses.replace(cache, start_B=start_B, prefill=True)
    positions_BxP = jnp.maximum(jnp.arange(P)[None] - start_B[:, None], 0)
    logits_BxPxV, cache = model.with_cache(prompts_BxP, positions_BxP, cache)
    cache = dataclasses.replace(cache, prefill=False)
    logits_BxV = logits_BxPxV[:, -1].astype(jnp.float32)
    tokens_BxN = jnp.zeros((B, new), jnp.int32)
    kept = jnp.zeros((B, new, logits_BxV.shape[-1]), jnp.float32) if keep_logits else None
    return jnp.zeros((), jnp.int32), logits_BxV, cache, tokens_BxN, rows_B < 0, kept


def _cached_advance(
    params: Any,
    state: tuple,
    start_B: jax.Array,
    rows_B: jax.Array,
    seed: jax.Array,
    eos_E: jax.Array,
    until: jax.Array,
    *,
    graphdef: nnx.GraphDef,
    settings: Settings,
) -> tuple:
    """`state` with its tokens chosen up to step `until` (or until every row stopped), one
    step per token over the cache."""
    new = state[3].shape[1]
    P = state[2].k_NxBxSxGxK.shape[2] - new  # the prompt bucket: the cache holds it and new

    def step(state: tuple) -> tuple:
        t, logits_BxV, cache, tokens_BxN, done_B, kept = state
        chosen_B = next_tokens(logits_BxV, _row_keys(seed, rows_B, t), settings)
        tokens_BxN = tokens_BxN.at[:, t].set(chosen_B)
        if kept is not None:
            kept = kept.at[:, t].set(logits_BxV)
        positions_Bx1 = (P + t - start_B)[:, None]
        # Merged in the loop's own trace: nnx refuses modules from an outer one (scan).
        model: Any = nnx.merge(graphdef, params)
        logits_Bx1xV, cache = model.with_cache(chosen_B[:, None], positions_Bx1, cache)
        done_B = done_B | _stopped(chosen_B, eos_E)
        return t + 1, logits_Bx1xV[:, 0].astype(jnp.float32), cache, tokens_BxN, done_B, kept

    def going(state: tuple) -> jax.Array:
        return (state[0] < jnp.minimum(until, new)) & ~jnp.all(state[4])

    return jax.lax.while_loop(going, step, state)


def _recomputed_start(
    params: Any,
    prompts_BxS: jax.Array,
    lengths_B: jax.Array,
    rows_B: jax.Array,
    *,
    graphdef: nnx.GraphDef,
    new: int,
    keep_logits: bool,
) -> tuple:
    """As _cached_start, for a model without a cache: (step, the buffer of prompts padded
    on the right, tokens_BxN, done_B, kept logits or None)."""
    B, _ = prompts_BxS.shape
    tokens_BxN = jnp.zeros((B, new), jnp.int32)
    vocab = jax.eval_shape(nnx.merge(graphdef, params), prompts_BxS).shape[-1]
    kept = jnp.zeros((B, new, vocab), jnp.float32) if keep_logits else None
    return jnp.zeros((), jnp.int32), prompts_BxS, tokens_BxN, rows_B < 0, kept


def _recomputed_advance(
    params: Any,
    state: tuple,
    lengths_B: jax.Array,
    rows_B: jax.Array,
    seed: jax.Array,
    eos_E: jax.Array,
    until: jax.Array,
    *,
    graphdef: nnx.GraphDef,
    settings: Settings,
) -> tuple:
    """As _cached_advance, for a model without a cache: the whole buffer through the model
    at every step, each row read at its last token."""
    B, S = state[1].shape
    new = state[2].shape[1]
    rows = jnp.arange(B)

    def step(state: tuple) -> tuple:
        t, buffer_BxS, tokens_BxN, done_B, kept = state
        logits_BxSxV = nnx.merge(graphdef, params)(buffer_BxS)
        logits_BxV = logits_BxSxV[rows, lengths_B + t - 1].astype(jnp.float32)
        chosen_B = next_tokens(logits_BxV, _row_keys(seed, rows_B, t), settings)
        tokens_BxN = tokens_BxN.at[:, t].set(chosen_B)
        if kept is not None:
            kept = kept.at[:, t].set(logits_BxV)
        buffer_BxS = buffer_BxS.at[rows, jnp.minimum(lengths_B + t, S - 1)].set(chosen_B)
        return t + 1, buffer_BxS, tokens_BxN, done_B | _stopped(chosen_B, eos_E), kept

    def going(state: tuple) -> jax.Array:
        return (state[0] < jnp.minimum(until, new)) & ~jnp.all(state[3])

    return jax.lax.while_loop(going, step, state)


def param_layout(config: RunConfig, mesh: Mesh) -> tuple[RunConfig, nnx.GraphDef, Any, Any]:
    """(config with its attention kernel resolved for the mesh's devices, the model's
    graphdef, its abstract params, their shardings on `mesh` as the run trains them)."""
    config = with_kernel(config, list(mesh.devices.flat), warn=lambda _: None)
    with nnx.use_eager_sharding(False):
        graphdef, state = nnx.split(nnx.eval_shape(lambda: build_model(config, nnx.Rngs(0))))
    specs = nnx.to_pure_dict(nnx.get_partition_spec(state))
    shardings = mesh_lib.named_shardings(mesh, specs)
    return config, graphdef, nnx.to_pure_dict(state), shardings


class Sampler:
    """A model's params on a mesh, and its generation programs, one per bucket."""

    def __init__(self, config: RunConfig, mesh: Mesh, params: Any):
        """`params` as `param_layout` lays them out (placed there if they are not)."""
        decoding = contract(config).decoding(config)
        if decoding is None:
            raise ValueError(f"model.kind={config.model.kind!r} is no language model")
        self.decoding: Decoding = decoding
        self.config, self.graphdef, _, shardings = param_layout(config, mesh)
        self.mesh = mesh
        self.params = jax.device_put(params, shardings)
        self.shardings = shardings
        self.batch_size = int(np.prod([mesh.shape[a] for a in mesh_lib.BATCH_AXES]))
        self._programs: dict[tuple, Any] = {}

    def rows_per_batch(self, rows: int) -> int:
        """The batch bucket: up to MAX_BATCH_ROWS rows, a multiple of the batch axes' size."""
        wanted = min(rows, MAX_BATCH_ROWS)
        return -(-wanted // self.batch_size) * self.batch_size

    def prompt_bucket(self, longest: int) -> int:
        bucket = max(MIN_PROMPT_BUCKET, 1 << (max(longest, 1) - 1).bit_length())
        if self.config.model.attention == "splash":
            bucket = -(-bucket // SPLASH_BLOCK) * SPLASH_BLOCK
        return bucket

    def _program(
        self, rows: int, bucket: int, new: int, settings: Settings, stops: int, keep_logits: bool
    ) -> list[Any]:
        """[the jitted start, the jitted advance or None until the start's state is known]
        of generating `new` tokens for `rows` prompts of `bucket` tokens with `stops` stop
        ids, each compiled on its first call."""
        key = (rows, bucket, new, settings, stops, keep_logits)
        if key in self._programs:
            return self._programs[key]
        if self.decoding.cache is not None:
            start = functools.partial(
                _cached_start,
                graphdef=self.graphdef,
                cache_shape=self.decoding.cache,
                dtype=layers.dtypes(self.config.model)[1],
                new=new,
                keep_logits=keep_logits,
            )
        else:
            start = functools.partial(
                _recomputed_start, graphdef=self.graphdef, new=new, keep_logits=keep_logits
            )
        rows_ = NamedSharding(self.mesh, P(mesh_lib.BATCH_AXES))
        program = jax.jit(
            on_mesh(start, self.mesh),
            in_shardings=(self.shardings, rows_, rows_, rows_),
        )
        self._programs[key] = [program, None]
        return self._programs[key]

    def _advance(self, programs: list[Any], state: tuple, settings: Settings) -> Any:
        """The jitted advance, its state laid out as the start left it, in and out (one
        program for every call), the state donated."""
        if programs[1] is None:
            fn = _cached_advance if self.decoding.cache is not None else _recomputed_advance
            fn = functools.partial(fn, graphdef=self.graphdef, settings=settings)
            rows_ = NamedSharding(self.mesh, P(mesh_lib.BATCH_AXES))
            replicated = mesh_lib.replicated(self.mesh)
            laid_out = jax.tree.map(lambda x: x.sharding, state)
            programs[1] = jax.jit(
                on_mesh(fn, self.mesh),
                in_shardings=(
                    self.shardings,
                    laid_out,
                    rows_,
                    rows_,
                    replicated,
                    replicated,
                    replicated,
                ),
                out_shardings=laid_out,
                donate_argnums=1,
            )
        return programs[1]

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_new: int,
        settings: Settings,
        seed: int = 0,
        eos_ids: Sequence[int] = (),
        keep_logits: bool = False,
        progress: bool = False,
    ) -> tuple[list[Sample], list[np.ndarray]]:
        """A sample of up to `max_new` tokens for each prompt (prompt i is row i of the
        seed's draws), and, with `keep_logits`, the logits each token was chosen from.
        `progress`: a bar on stderr where generating takes over PROGRESS_DELAY_S, the
        program then called for PROGRESS_STEPS tokens at a time."""
        import tqdm

        limit = self.decoding.max_positions
        longest = max(len(p) for p in prompts)
        if limit is not None and longest + max_new > limit:
            raise ValueError(f"{longest} + {max_new} positions is more than the model's {limit}")
        if min(len(p) for p in prompts) == 0:
            raise ValueError("an empty prompt: the model needs a token to start from")
        B, bucket = self.rows_per_batch(len(prompts)), self.prompt_bucket(longest)
        eos = tuple(sorted(set(int(i) for i in eos_ids)))
        # The stop ids are an argument (-1 never drawn pads them): one program for any.
        eos_E = np.full((-(-max(len(eos), 1) // 8) * 8,), -1, np.int32)
        eos_E[: len(eos)] = eos
        programs = self._program(B, bucket, max_new, settings, len(eos_E), keep_logits)
        samples: list[Sample] = []
        logits: list[np.ndarray] = []
        batches = range(0, len(prompts), B)
        chunk = PROGRESS_STEPS if progress else max_new
        with tqdm.tqdm(
            total=len(batches) * max_new,
            unit="step",
            desc="generating",
            disable=not progress,
            delay=PROGRESS_DELAY_S,
            file=sys.stderr,
            dynamic_ncols=True,
        ) as bar:
            for first in batches:
                rows = list(prompts[first : first + B])
                tokens, where, rows_B = self._batch(rows, B, bucket, first, max_new, longest)
                state = programs[0](self.params, tokens, where, rows_B)
                advance = self._advance(programs, state, settings)
                done = 0
                while done < max_new:
                    until = min(done + chunk, max_new)
                    state = advance(
                        self.params, state, where, rows_B, np.uint32(seed), eos_E, np.int32(until)
                    )
                    # the steps taken, and every row stopped: a batch may end before max_new
                    t, stopped = jax.device_get((state[0], state[-2]))
                    bar.update((max_new if stopped.all() else int(t)) - done)
                    done = max_new if stopped.all() else int(t)
                tokens_BxN = np.asarray(state[-3])
                kept = state[-1]
                for i, prompt in enumerate(rows):
                    samples.append(_cut(list(prompt), tokens_BxN[i].tolist(), eos))
                    if kept is not None:
                        logits.append(np.asarray(kept[i]))
        return samples, logits

    def _batch(
        self,
        chunk: list[Sequence[int]],
        B: int,
        bucket: int,
        first: int,
        max_new: int,
        longest: int,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The rows' tokens, where each starts (cache: left padding) or its length
        (recomputed: right padding), and their rows' ids; rows past the prompts are padding.
        A recomputed row holds the bucket and the new tokens, but no more than the run's
        data.seq_len where the samples fit in it: a model may take no longer rows."""
        cached = self.decoding.cache is not None
        width = bucket if cached else bucket + max_new
        seq_len = self.config.data.seq_len
        if not cached and seq_len and longest + max_new <= seq_len:
            width = min(width, int(seq_len))
        tokens = np.zeros((B, width), np.int32)
        where = np.full((B,), bucket - 1 if cached else 1, np.int32)
        for i, prompt in enumerate(chunk):
            if cached:
                tokens[i, bucket - len(prompt) :] = prompt
                where[i] = bucket - len(prompt)
            else:
                tokens[i, : len(prompt)] = prompt
                where[i] = len(prompt)
        rows = np.arange(first, first + B, dtype=np.int32)
        rows[len(chunk) :] = -1  # done from the start: the loop waits for real rows only
        return tokens, where, rows


def _cut(prompt: list[int], tokens: list[int], eos: tuple[int, ...]) -> Sample:
    for i, token in enumerate(tokens):
        if token in eos:
            return Sample(prompt, tokens[:i], "eos")
    return Sample(prompt, tokens, "length")

"""A run's checkpoint or a Hugging Face directory as lm-evaluation-harness drives it
(`jaxkit eval SOURCE --tasks T`, jaxkit/commands/evaluate.py; the `eval` extra).

    from jaxkit.generate.lm_eval_model import JaxkitLM
    import lm_eval

    lm = JaxkitLM("runs/first")  # or JaxkitLM("hf:DIR"), with mesh.* overrides after it
    results = lm_eval.simple_evaluate(model=lm, tasks=["hellaswag"], limit=100)

SOURCE is opened as `jaxkit sample` and `jaxkit eval` open it (jaxkit/generate/source.py):
the params laid out on the run's mesh as trained, the run's tokenizer (bytes, or the
tokenizer.json its data was prepared with) or DIR's.

- `loglikelihood`: the continuation's tokens are the targets of weight 1 of a row that
  holds the context before them, scored by the run's own loss code (models/loss.py
  `row_sums`, eval_sums per row): Σ log p of each continuation token given everything
  before it, in float32, and is_greedy where each is its position's most probable token.
  Rows go in batches over the batch axes, padded on the right to a length bucket.
- `loglikelihood_rolling`: the harness's disjoint windows of `max_length` tokens, the first
  after the prefix token, each scored as above.
- `generate_until`: `jaxkit sample`'s generation (jaxkit/generate/sampling.py), greedy unless the
  task samples, `max_gen_toks` tokens at most, stopped at the model's end-of-text ids and
  cut before the first of the task's `until` strings.

A context longer than the model takes is cut on the left, as the harness's own Hugging
Face model does: `max_length` tokens for a score (the continuation kept whole), `max_length
- max_gen_toks` before a generation. `max_length` is the model's context as `jaxkit sample`
takes it (jaxkit/generate/source.py `Source.context`): the learned positions' end
(data.seq_len) for the byte LM, config.json's `max_position_embeddings` for hf:DIR, the
larger of that of the directory it started from and data.seq_len for a run fine-tuned from
one, else the run's data.seq_len.
"""

from __future__ import annotations

import argparse
import functools
import json
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import (
    handle_stop_sequences,
    normalize_gen_kwargs,
    postprocess_generated_text,
)

from jaxkit import mesh as mesh_lib
from jaxkit.config import UsageError
from jaxkit.generate import sampling
from jaxkit.generate import source as source_lib
from jaxkit.models.loss import row_sums
from jaxkit.step.train_step import on_mesh

DEVICE_TOKENS = 8192  # a scoring batch's tokens per device (its rows × its length bucket)
MAX_GEN_TOKS = 256  # new tokens where a task does not say (the harness's own default)

Request = tuple[Any, list[int], list[int]]  # (the strings, context ids, continuation ids)


class HarnessError(UsageError):
    """A request the model cannot answer as asked (one line, exit status 2)."""


def _score(params: Any, batch: dict[str, jax.Array], *, graphdef: Any) -> dict[str, jax.Array]:
    from flax import nnx

    return row_sums(nnx.merge(graphdef, params), batch)


class JaxkitLM(TemplateLM):
    """SOURCE (a run's workdir, or hf:DIR) with `overrides` (mesh.*, model.attention,
    model.compute_dtype), at checkpoint `step` (default: the latest), on the devices JAX
    has; `max_length` replaces the context the model takes (see the module's word)."""

    def __init__(
        self,
        source: str,
        *overrides: str,
        step: int | None = None,
        max_length: int | None = None,
    ):
        super().__init__()
        source_lib.check_overrides(overrides, "an eval")
        opts = argparse.Namespace(source=source, overrides=list(overrides), step=step)
        opened = source_lib.open_source(opts, source_lib.load_config, ["data.source=synthetic"])
        config = opened.sections()
        decoding = opened.decoding("lm-evaluation-harness scores and generates text")
        self.opened = opened
        self.text, self.eos_ids = source_lib.source_tokenizer(opened)
        vocab = getattr(config.model, "vocab_size", None)  # a model that decodes has one
        assert vocab is not None
        self.vocab = int(vocab)
        self._max_length = max_length or opened.context(decoding)[0]
        if decoding.max_positions is not None and self._max_length > decoding.max_positions:
            raise UsageError(
                f"max_length {self._max_length}: the model's learned positions end at "
                f"data.seq_len={decoding.max_positions}"
            )
        mesh = source_lib.make_mesh(opened.config, overrides)
        _, _, abstract, shardings = sampling.param_layout(config, mesh)
        params = source_lib.load_params(
            opened, abstract, shardings, "their scores and generations would be NaN"
        )
        self.sampler = sampling.Sampler(config, mesh, params)
        self.mesh = mesh
        self._scorers: dict[tuple[int, int], Any] = {}

    # What the harness reads of a model.
    @property
    def eot_token_id(self) -> int:
        return self.eos_ids[0] if self.eos_ids else self.prefix_token_id

    @property
    def prefix_token_id(self) -> int:
        """What the first token of a text without context is predicted from: the data's (or
        DIR's) beginning of sequence, else its end of text, else (byte text has neither) a
        newline."""
        hf = self.opened.hf_config()
        for found in (self.text.bos_id, hf.get("bos_token_id"), *self.eos_ids):
            if isinstance(found, int) and not isinstance(found, bool):
                return found
        return (self.text.encode("\n", start=False) or [0])[0]

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return MAX_GEN_TOKS

    @property
    def tokenizer_name(self) -> str:
        return self.text.name

    def tok_encode(
        self, string: str, add_special_tokens: bool | None = None, **kwargs: Any
    ) -> list[int]:
        """`string`'s ids, with the beginning-of-sequence id the data (or DIR's tokenizer)
        puts first unless `add_special_tokens` is False."""
        return self.text.encode(string, start=add_special_tokens is not False)

    def tok_decode(self, tokens: Sequence[int]) -> str:
        return self.text.decode(tokens)

    # Scores.
    def _loglikelihood_tokens(
        self, requests: list[Request], disable_tqdm: bool = False, **kwargs: Any
    ) -> list[tuple[float, bool]]:
        rows = [self._row(context, continuation) for _, context, continuation in requests]
        results = self.score_rows(rows)
        for (strings, _, _), result in zip(requests, results, strict=True):
            if strings is not None:
                self.cache_hook.add_partial("loglikelihood", strings, result)
        return results

    def _row(self, context: list[int], continuation: list[int]) -> tuple[list[int], int]:
        """(the row's tokens, how many at its end are scored): the context cut on the left
        to what the model takes, the continuation whole."""
        if not continuation:
            raise HarnessError("a request with an empty continuation: nothing to score")
        if len(continuation) > self.max_length:
            raise HarnessError(
                f"a continuation of {len(continuation)} tokens: the model takes "
                f"{self.max_length} (max_length)"
            )
        whole = (context + continuation)[-(self.max_length + 1) :]
        if len(whole) < 2:
            raise HarnessError("a request of one token: nothing predicts it")
        return whole, len(continuation)

    def score_rows(self, rows: Sequence[tuple[list[int], int]]) -> list[tuple[float, bool]]:
        """For each (tokens, n): Σ log p of the last n tokens, each given those before it,
        and whether each is its position's most probable token."""
        for tokens, _ in rows:
            self._check_ids(tokens)
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
        results: list[tuple[float, bool]] = [(0.0, False)] * len(rows)
        first = 0
        while first < len(order):
            length = self.sampler.prompt_bucket(len(rows[order[first]][0]) - 1)
            batch_rows = self._rows_per_batch(length)
            chunk = order[first : first + batch_rows]
            batch = np.zeros((3, batch_rows, length), np.float32)
            for b, i in enumerate(chunk):
                tokens, scored = rows[i]
                n = len(tokens) - 1
                batch[0, b, :n], batch[1, b, :n] = tokens[:-1], tokens[1:]
                batch[2, b, n - scored : n] = 1.0
            program = self._scorer(batch_rows, length)
            sums = jax.device_get(
                program(
                    self.sampler.params,
                    {
                        "inputs": batch[0].astype(np.int32),
                        "targets": batch[1].astype(np.int32),
                        "weights": batch[2],
                    },
                )
            )
            for b, i in enumerate(chunk):
                greedy = bool(sums["accuracy_sum"][b] == sums["weight"][b])
                results[i] = (-float(sums["loss_sum"][b]), greedy)
            first += len(chunk)
        return results

    def _check_ids(self, tokens: Sequence[int]) -> None:
        if tokens and max(tokens) >= self.vocab:
            raise HarnessError(
                f"text encodes to id {max(tokens)} ({self.text.name}), beyond the model's "
                f"vocabulary of {self.vocab}"
            )

    def _rows_per_batch(self, length: int) -> int:
        per_device = max(1, DEVICE_TOKENS // length)
        rows = min(per_device * self.sampler.batch_size, sampling.MAX_BATCH_ROWS)
        return -(-rows // self.sampler.batch_size) * self.sampler.batch_size

    def _scorer(self, rows: int, length: int) -> Any:
        """The jitted scoring of `rows` rows of `length` tokens, on the run's mesh."""
        key = (rows, length)
        if key not in self._scorers:
            batch = mesh_lib.batch_sharding(self.mesh)
            self._scorers[key] = jax.jit(
                on_mesh(functools.partial(_score, graphdef=self.sampler.graphdef), self.mesh),
                in_shardings=(self.sampler.shardings, batch),
                out_shardings=NamedSharding(self.mesh, P(mesh_lib.BATCH_AXES)),
            )
        return self._scorers[key]

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        windows: list[tuple[int, tuple[list[int], int]]] = []
        for index, (string,) in enumerate(req.args for req in requests):
            for context, continuation in map(
                lm_utils.make_disjoint_window,
                lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string, add_special_tokens=False),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                ),
            ):
                windows.append((index, self._row(list(context), list(continuation))))
        scores = self.score_rows([row for _, row in windows])
        totals = [0.0] * len(requests)
        for (index, _), (logprob, _) in zip(windows, scores, strict=True):
            totals[index] += logprob
        for req, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # Generation.
    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        """Each request's text, one call of `jaxkit sample`'s generation per set of
        generation arguments and prompt length bucket."""
        texts: list[str] = [""] * len(requests)
        groups: dict[str, list[int]] = {}
        for index, req in enumerate(requests):
            groups.setdefault(json.dumps(req.args[1], sort_keys=True, default=str), []).append(
                index
            )
        eos_text = self.text.decode(self.eos_ids[:1]) if self.eos_ids else None
        for indices in groups.values():
            kwargs = normalize_gen_kwargs(dict(requests[indices[0]].args[1]), self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos_text)
            new = int(kwargs.pop("max_gen_toks"))
            room = self.max_length - new
            if room < 1:
                raise HarnessError(
                    f"a task asks for {new} new tokens (max_gen_toks): the model takes "
                    f"{self.max_length} (max_length), context included"
                )
            settings = sampling.Settings(
                temperature=float(kwargs.get("temperature") or 0.0)
                if kwargs.get("do_sample")
                else 0.0,
                top_k=kwargs.get("top_k"),
                top_p=kwargs.get("top_p"),
            )
            prompts = {i: self._prompt(requests[i].args[0], room) for i in indices}
            buckets: dict[int, list[int]] = {}
            for i, ids in prompts.items():
                buckets.setdefault(self.sampler.prompt_bucket(len(ids)), []).append(i)
            for members in buckets.values():
                samples, _ = self.sampler.generate(
                    [prompts[i] for i in members],
                    max_new=new,
                    settings=settings,
                    eos_ids=self.eos_ids,
                )
                for i, sample in zip(members, samples, strict=True):
                    text = postprocess_generated_text(
                        self.tok_decode(sample.tokens), stop=until, think_end_token=None
                    )
                    texts[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return texts

    def _prompt(self, context: str, room: int) -> list[int]:
        """The context's ids, its last `room`; the prefix token where it has none."""
        ids = self.tok_encode(context)[-room:] or [self.prefix_token_id]
        self._check_ids(ids)
        return ids

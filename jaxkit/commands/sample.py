"""`jaxkit sample SOURCE`: text from a run's checkpoint or a Hugging Face directory
(jaxkit/generate/sampling.py generates it; the tokenizer is the run's or the directory's)."""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from jaxkit.commands import common
from jaxkit.generate import source as source_lib

if TYPE_CHECKING:
    import ml_collections

DEFAULT_NEW_TOKENS = 128


def _temperature(text: str) -> float:
    value = common.number(text)
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number ≥ 0, got {text}")
    return value


def _top_p(text: str) -> float:
    value = common.number(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def _seed(text: str) -> int:
    value = common.int_at_least(0)(text)
    if value >= 2**32:
        raise argparse.ArgumentTypeError(f"must be below 2**32 (a 32-bit key), got {value}")
    return value


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    sample = sub.add_parser(
        "sample",
        help="generate text from a run's checkpoint or a Hugging Face directory",
        usage="%(prog)s SOURCE [key=value ...] [--prompt TEXT ...] [--prompts FILE] [options]",
        description="Give one --prompt or more, a --prompts FILE, or both.",
    )
    common.add_source(sample)
    sample.add_argument(
        "--prompt", action="append", default=[], metavar="TEXT", help="a prompt (repeatable)"
    )
    sample.add_argument(
        "--prompts",
        metavar="FILE",
        help='a .jsonl of {"prompt": ...} objects, or a .txt of one prompt a line',
    )
    sample.add_argument(
        "--max-new-tokens",
        type=common.int_at_least(1),
        metavar="N",
        help=f"tokens generated per sample at most (default {DEFAULT_NEW_TOKENS}, or fewer "
        "where the model's context ends sooner, prompt included)",
    )
    sample.add_argument(
        "--truncate-left",
        action="store_true",
        help="cut a prompt that leaves no room for the new tokens in the model's context on "
        "the left (as lm-evaluation-harness does), instead of refusing it",
    )
    sample.add_argument(
        "--temperature",
        type=_temperature,
        default=1.0,
        metavar="T",
        help="divides the logits (default 1.0); 0 takes the most probable token",
    )
    sample.add_argument(
        "--top-k",
        type=common.int_at_least(1),
        metavar="K",
        help="draw from the K most probable tokens only",
    )
    sample.add_argument(
        "--top-p",
        type=_top_p,
        metavar="P",
        help="draw from the fewest most probable tokens whose probability reaches P",
    )
    sample.add_argument(
        "--num-samples",
        type=common.int_at_least(1),
        default=1,
        metavar="M",
        help="samples per prompt (default 1)",
    )
    sample.add_argument(
        "--seed",
        type=_seed,
        default=0,
        metavar="S",
        help="the draws' seed (default 0): the same samples on any device count",
    )
    sample.add_argument(
        "--json",
        action="store_true",
        help="one JSON object a sample: prompt, prompt_tokens, tokens, text, finish_reason",
    )
    sample.add_argument("--no-progress", action="store_true", help="no progress bar")
    common.add_options(sample)
    return sample


def read_prompts(opts: argparse.Namespace) -> list[str]:
    """--prompt's, then --prompts FILE's, in order; UsageError where there are none."""
    prompts = list(opts.prompt)
    for prompt in prompts:
        _check_text(prompt, f"--prompt {_typed(prompt)}")
    if opts.prompts is not None:
        path = pathlib.Path(opts.prompts)
        try:
            text = path.read_bytes().decode("utf-8-sig")  # a BOM is no prompt's text
        except (OSError, UnicodeDecodeError) as err:
            raise common.UsageError(f"--prompts {path}: cannot be read ({err})") from None
        # Lines end at "\n" (or "\r\n") only: str.splitlines and text mode's newlines
        # would also cut a prompt at a lone "\r", a form feed, U+0085 or U+2028, which a .txt
        # prompt or a JSON string may hold raw.
        lines = [line.removesuffix("\r") for line in text.split("\n")]
        if path.suffix == ".jsonl":
            for number, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                try:
                    prompt = json.loads(line).get("prompt")
                except (json.JSONDecodeError, AttributeError):
                    prompt = None
                if not isinstance(prompt, str):
                    raise common.UsageError(
                        f'--prompts {path}: line {number} is not a JSON object {{"prompt": TEXT}}'
                    )
                _check_text(prompt, f"--prompts {path}: line {number}'s prompt")
                prompts.append(prompt)
        elif path.suffix == ".txt":
            prompts += [line for line in lines if line]
        else:
            raise common.UsageError(
                f'--prompts {path}: a .jsonl of {{"prompt": ...}} or a .txt of one prompt a line'
            )
    if not prompts and opts.prompts is not None:
        raise common.UsageError(
            f"--prompts {opts.prompts} holds no prompt, only blank lines or none: give one a "
            "line, or --prompt TEXT"
        )
    if not prompts:
        raise common.UsageError("no prompt: give --prompt TEXT or --prompts FILE")
    return prompts


def _typed(prompt: str) -> str:
    """A prompt from the command line as the user typed it: bytes that are not UTF-8 as
    Python's argv holds them (surrogate escapes) shown as the bytes they were."""
    try:
        return repr(prompt.encode("utf-8", "surrogateescape"))[1:]
    except UnicodeEncodeError:
        return repr(prompt)


def _check_text(prompt: str, where: str) -> None:
    """Refuses a prompt that is no UTF-8 text: bytes that do not decode (from the command
    line), or a lone surrogate (a JSON escape such as "\\udcff"), which no tokenizer reads."""
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as err:
        code = ord(prompt[err.start])
        what = (
            f"byte 0x{code - 0xDC00:02x}"
            if 0xDC80 <= code <= 0xDCFF and where.startswith("--prompt ")
            else f"a lone surrogate \\u{code:04x}"
        )
        raise common.UsageError(f"{where} is not UTF-8 text ({what}): give it as UTF-8") from None


def run(
    opts: argparse.Namespace,
    load_config: Callable[[list[str]], ml_collections.ConfigDict],
    start_jax: Callable[[int | None, bool, bool], None],
) -> int:
    """`load_config` and `start_jax` are the CLI's (jaxkit/cli.py)."""
    from jaxkit.config import ConfigError
    from jaxkit.data.tokenizer import TokenizerError
    from jaxkit.mesh import MeshError
    from jaxkit.train.checkpoint import CheckpointError

    try:
        source_lib.check_overrides(opts.overrides, "a sample")
        prompts = read_prompts(opts)
        # Before anything reads a checkpoint: the device count is fixed when JAX starts.
        start_jax(opts.host_devices, False, not opts.no_compile_cache)
        # No data is read: synthetic ids hold no vocabulary to a floor (bytes would).
        source = source_lib.open_source(opts, load_config, ["data.source=synthetic"])
        tokenizer, eos_ids = source_lib.source_tokenizer(source)
        ids = [tokenizer.encode(p) for p in prompts]
        opts.max_new_tokens, ids = _check_prompts(
            prompts, ids, source, tokenizer, opts.max_new_tokens, opts.truncate_left
        )
        samples = _generate(source, ids, opts, eos_ids)
    except (
        common.UsageError,
        CheckpointError,
        ConfigError,
        MeshError,
        TokenizerError,
    ) as err:
        return common.error(common.UsageError(source_lib.as_typed(str(err), opts.source)))
    for i, sample in enumerate(samples):
        prompt = prompts[i // opts.num_samples]
        text = tokenizer.decode(sample.tokens, after=sample.prompt_tokens)
        if opts.json:
            record = {
                "prompt": prompt,
                "prompt_tokens": sample.prompt_tokens,
                "tokens": sample.tokens,
                "text": text,
                "finish_reason": sample.finish_reason,
            }
            print(json.dumps(record, ensure_ascii=False))
        else:
            print(("\n" if i else "") + prompt + text)
    return 0


def _said(prompt: str, most: int = 40) -> str:
    """A prompt as a refusal names it: its start, where it is long."""
    return repr(prompt if len(prompt) <= most else prompt[:most] + "...")


def _check_prompts(
    prompts: list[str],
    ids: list[list[int]],
    source: source_lib.Source,
    tokenizer: source_lib.Tokenizer,
    asked: int | None,
    truncate_left: bool,
) -> tuple[int, list[list[int]]]:
    """Refuses, before any work, what the model cannot generate from; returns the new
    tokens to generate and the prompts' ids as the model reads them.

    The new tokens are those asked, else the default where the model's context leaves
    room for it after the longest prompt, else as many as it leaves (with `truncate_left`,
    at least half the context). A prompt that leaves them no room is refused, or with
    `truncate_left` keeps its last tokens."""
    config = source.config
    decoding = source.decoding("it generates no text")
    context, why = source.context(decoding)
    vocab = int(config.model.vocab_size)
    longest = max(map(len, ids))
    # What --truncate-left generates: a refusal offers it where it would generate that many.
    cut_new = asked or min(DEFAULT_NEW_TOKENS, max(context - longest, context // 2))
    new = cut_new if asked or truncate_left else max(1, min(DEFAULT_NEW_TOKENS, context - longest))
    if new >= context:
        raise common.UsageError(
            f"--max-new-tokens {new}: the model's context is {context} positions ({why}), "
            f"prompt included; give at most {context - 1}"
        )
    read: list[list[int]] = []
    for prompt, tokens in zip(prompts, ids, strict=True):
        if not tokens:
            raise common.UsageError(f"prompt {_said(prompt)} encodes to no token: give some text")
        if max(tokens) >= vocab:
            raise common.UsageError(
                f"prompt {_said(prompt)} encodes to id {max(tokens)} ({tokenizer.name}), "
                f"beyond the model's vocabulary of {vocab}"
            )
        room = context - len(tokens)
        if new > room and truncate_left:
            print(
                f"note: prompt {_said(prompt)} is {len(tokens)} tokens: cut on the left to its "
                f"last {context - new}, leaving {new} new tokens in the model's context of "
                f"{context}",
                file=sys.stderr,
            )
            tokens = tokens[len(tokens) - (context - new) :]
        elif room < 1:
            longer = "longer than" if room < 0 else "as long as"
            raise common.UsageError(
                f"prompt {_said(prompt)} is {len(tokens)} tokens, {longer} the model's context "
                f"of {context} positions ({why}), new tokens included: give a shorter prompt, "
                f"or --truncate-left to keep its last {context - cut_new}"
            )
        elif new > room:
            asking = f" and --max-new-tokens {new}" if asked is not None else ""
            raise common.UsageError(
                f"prompt {_said(prompt)} is {len(tokens)} tokens{asking}: the model's context "
                f"is {context} positions ({why}), prompt included; give at most {room} new "
                "tokens, or --truncate-left"
            )
        read.append(tokens)
    if decoding.cache is None:
        print(
            f"note: {config.model.kind} is a model of your own with no key/value cache the "
            "kit knows: each new token recomputes the whole prefix",
            file=sys.stderr,
        )
    return new, read


def _generate(
    source: source_lib.Source, ids: list[list[int]], opts: argparse.Namespace, eos_ids: list[int]
) -> list[Any]:
    from jaxkit.generate import sampling

    config = source.sections()
    mesh = source_lib.make_mesh(source.config, opts.overrides)
    _, _, abstract, shardings = sampling.param_layout(config, mesh)
    params = source_lib.load_params(
        source, abstract, shardings, "sampling from them draws from NaN logits"
    )
    sampler = sampling.Sampler(config, mesh, params)
    rows = [tokens for tokens in ids for _ in range(opts.num_samples)]
    settings = sampling.Settings(opts.temperature, opts.top_k, opts.top_p)
    samples, _ = sampler.generate(
        rows,
        max_new=opts.max_new_tokens,
        settings=settings,
        seed=opts.seed,
        eos_ids=eos_ids,
        progress=not opts.no_progress,
    )
    return samples

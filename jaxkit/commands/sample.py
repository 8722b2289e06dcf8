"""`jaxkit sample SOURCE`: text from a run's checkpoint or a Hugging Face directory
(jaxkit/sampling.py generates it; the tokenizer is the run's or the directory's)."""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from jaxkit.commands import common

if TYPE_CHECKING:
    import ml_collections

# What a sample may change of the run's config: where and how it runs, never the model.
OVERRIDABLE = ("mesh.", "model.attention", "model.compute_dtype")
HF_PREFIX = "hf:"
HF_CONFIG = "llama_tiny"  # an hf:DIR runs under it, its shape from config.json
REPLACEMENT = "\N{REPLACEMENT CHARACTER}".encode()
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
        usage="%(prog)s SOURCE [key=value ...] (--prompt TEXT ... | --prompts FILE) [options]",
    )
    sample.add_argument(
        "source",
        type=common.directory,
        metavar="SOURCE",
        help="a run's workdir (its latest checkpoint, or --step N), or hf:DIR, a local "
        f"Hugging Face Llama directory (run under {HF_CONFIG}'s config, its shape from "
        "config.json)",
    )
    sample.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="mesh.*, model.attention or model.compute_dtype only",
    )
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
        "where a model's learned positions end sooner: data.seq_len, prompt included)",
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
        "--step",
        type=common.int_at_least(0),
        metavar="N",
        help="a workdir's checkpoint of optimizer step N (default: the latest)",
    )
    sample.add_argument(
        "--json",
        action="store_true",
        help="one JSON object a sample: prompt, prompt_tokens, tokens, text, finish_reason",
    )
    sample.add_argument(
        "--host-devices",
        type=common.host_devices,
        metavar="N",
        help=f"simulate N devices on the CPU and run there (default: "
        f"{common.DEFAULT_HOST_DEVICES} CPU devices, used when JAX finds no accelerator)",
    )
    sample.add_argument(
        "--no-compile-cache",
        action="store_true",
        help="compile every program afresh: do not read or write the persistent compilation cache",
    )
    return sample


def read_prompts(opts: argparse.Namespace) -> list[str]:
    """--prompt's, then --prompts FILE's, in order; UsageError where there are none."""
    prompts = list(opts.prompt)
    if opts.prompts is not None:
        path = pathlib.Path(opts.prompts)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise common.UsageError(f"--prompts {path}: cannot be read ({err})") from None
        if path.suffix == ".jsonl":
            for number, line in enumerate(text.splitlines(), 1):
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
                prompts.append(prompt)
        elif path.suffix == ".txt":
            prompts += [line for line in text.splitlines() if line]
        else:
            raise common.UsageError(
                f'--prompts {path}: a .jsonl of {{"prompt": ...}} or a .txt of one prompt a line'
            )
    if not prompts:
        raise common.UsageError("no prompt: give --prompt TEXT or --prompts FILE")
    return prompts


def check_overrides(overrides: Sequence[str]) -> None:
    for item in overrides:
        key = item.split("=", 1)[0]
        if "=" not in item or not (key.startswith("mesh.") or key in OVERRIDABLE):
            raise common.UsageError(
                f"{item!r}: a sample may override mesh.*, model.attention and "
                "model.compute_dtype only (key=value)"
            )


class Tokenizer:
    """Bytes, or a tokenizer.json; `bos_id` starts every prompt where the data's did."""

    def __init__(self, path: pathlib.Path | None, bos_id: int | None = None, special: bool = False):
        self.path, self.bos_id, self.special = path, bos_id, special
        self._hf: Any = None
        if path is not None:
            from tokenizers import Tokenizer as HfTokenizer

            self._hf = HfTokenizer.from_file(str(path))

    @property
    def name(self) -> str:
        return "bytes" if self.path is None else str(self.path)

    def encode(self, text: str) -> list[int]:
        if self._hf is None:
            ids = list(text.encode("utf-8"))
        else:
            ids = list(self._hf.encode(text, add_special_tokens=self.special).ids)
        return ([self.bos_id] if self.bos_id is not None else []) + ids

    def decode(self, ids: Sequence[int]) -> str:
        if self._hf is None:
            raw = b"".join(bytes([i]) if i < 256 else REPLACEMENT for i in ids)
            return raw.decode("utf-8", errors="replace")
        return str(self._hf.decode(list(ids), skip_special_tokens=False))


def _eos_list(value: object) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _run_tokenizer(meta: dict, config: ml_collections.ConfigDict, where: str) -> Tokenizer:
    """The run's tokenizer, from the record its checkpoint holds (jaxkit/tokenizer.py)."""
    from jaxkit import tokenizer as tokenizer_lib

    data = meta.get("data") or {}
    source = config.data.get("source")
    record = data.get("tokenizer")
    fingerprint = data.get("fingerprint") or {}
    bos = fingerprint.get("bos_id")
    if source == "text" or (isinstance(record, dict) and record.get("tokenizer") == "bytes"):
        return Tokenizer(None, bos)
    if source != "tokens":
        raise common.UsageError(
            f"{where} trained on data.source={source} ids, which no tokenizer turns into text"
        )
    if not isinstance(record, dict) or not record.get("tokenizer_file"):
        raise common.UsageError(
            f"{where} records no tokenizer file for its token data (data.tokenizer in its "
            "checkpoint): its ids cannot be turned into text"
        )
    path = pathlib.Path(record["tokenizer_file"])
    if not path.is_file():
        raise common.UsageError(
            f"{where}'s data was prepared with {path}, which is not there now: put it back"
        )
    expected = record.get("tokenizer_sha256")
    if expected is not None:
        try:
            found = tokenizer_lib.file_sha256(path)
        except tokenizer_lib.TokenizerError as err:
            raise common.UsageError(str(err)) from None
        if found != expected:
            raise common.UsageError(
                f"{path} is not the tokenizer {where}'s data was prepared with "
                f"(tokenizer_sha256 {expected[:12]}... recorded, {found[:12]}... now)"
            )
    return Tokenizer(path, bos)


def _read_meta(checkpoints: Any, step: int) -> dict:
    from jaxkit.checkpoint import CheckpointError

    path = checkpoints / f"step_{step}" / "meta" / "metadata"
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path}: the checkpoint's record cannot be read ({err})") from None


def run(
    opts: argparse.Namespace,
    load_config: Callable[[list[str]], ml_collections.ConfigDict],
    start_jax: Callable[[int | None, bool, bool], None],
) -> int:
    """`load_config` and `start_jax` are the CLI's (jaxkit/cli.py)."""
    from jaxkit.checkpoint import CheckpointError
    from jaxkit.config import ConfigError, apply_overrides
    from jaxkit.mesh import MeshError
    from jaxkit.tokenizer import TokenizerError

    try:
        check_overrides(opts.overrides)
        prompts = read_prompts(opts)
        # Before anything reads a checkpoint: the device count is fixed when JAX starts.
        start_jax(opts.host_devices, False, not opts.no_compile_cache)
        source = _open_source(opts, load_config, apply_overrides)
        ids = [source.tokenizer.encode(p) for p in prompts]
        opts.max_new_tokens = _check_prompts(prompts, ids, source, opts.max_new_tokens)
        samples = _generate(source, ids, opts)
    except (
        common.UsageError,
        CheckpointError,
        ConfigError,
        MeshError,
        TokenizerError,
    ) as err:
        return common.error(err)
    for i, sample in enumerate(samples):
        prompt = prompts[i // opts.num_samples]
        text = source.tokenizer.decode(sample.tokens)
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


class _Source:
    """A SOURCE opened: its config (overrides applied), tokenizer, stop ids, and where its
    params come from."""

    def __init__(
        self,
        config: ml_collections.ConfigDict,
        tokenizer: Tokenizer,
        eos_ids: list[int],
        where: str,
        step: int | None = None,
        checkpoints: Any = None,
        hf_dir: pathlib.Path | None = None,
    ):
        self.config, self.tokenizer, self.eos_ids, self.where = config, tokenizer, eos_ids, where
        self.step, self.checkpoints, self.hf_dir = step, checkpoints, hf_dir


def _open_source(
    opts: argparse.Namespace,
    load_config: Callable[[list[str]], ml_collections.ConfigDict],
    apply_overrides: Callable[..., None],
) -> _Source:
    from jaxkit import tokenizer as tokenizer_lib
    from jaxkit.checkpoint import CheckpointError, saved_steps
    from jaxkit.hf.load import read_hf_config
    from jaxkit.validate import validate
    from jaxkit.workdir import as_path

    if opts.source.startswith(HF_PREFIX):
        if opts.step is not None:
            raise common.UsageError("--step applies to a run's workdir, not to hf:DIR")
        directory = pathlib.Path(opts.source[len(HF_PREFIX) :])
        # No data is read: synthetic ids hold no vocabulary to a floor (bytes would).
        head = [HF_CONFIG, f"model.init_from={opts.source}", "data.source=synthetic"]
        config = load_config([*head, *opts.overrides])
        hf_config = read_hf_config(directory)
        tokenizer_json = tokenizer_lib.model_tokenizer(directory)
        # The directory's own convention: its tokenizer adds what it adds (a BOS).
        tokenizer = Tokenizer(tokenizer_json, special=True)
        eos = _eos_list(hf_config.get("eos_token_id"))
        return _Source(config, tokenizer, eos, f"hf:{directory}", hf_dir=directory)
    checkpoints = as_path(opts.source) / "checkpoints"
    steps = saved_steps(checkpoints)
    if not steps:
        raise CheckpointError(f"{opts.source} holds no checkpoint (checkpoints/step_N) to sample")
    step = steps[-1] if opts.step is None else opts.step
    if step not in steps:
        raise CheckpointError(
            f"--step {step}: {opts.source} has checkpoints at steps {', '.join(map(str, steps))}"
        )
    meta = _read_meta(checkpoints, step)
    config = _saved_config(meta["config"])
    apply_overrides(config, list(opts.overrides))
    validate(config)
    where = f"the run in {opts.source}"
    tokenizer = _run_tokenizer(meta, config, where)
    data = meta.get("data") or {}
    eos = _eos_list((data.get("fingerprint") or {}).get("eod_id"))
    hf_source = meta.get("hf_source") or {}
    eos += _eos_list((hf_source.get("config") or {}).get("eos_token_id"))
    return _Source(config, tokenizer, eos, where, step=step, checkpoints=checkpoints)


def _saved_config(saved: dict) -> ml_collections.ConfigDict:
    """A checkpoint's config, with the keys added since it was saved at the values the run
    ran as (config.py's `added`)."""
    import ml_collections

    from jaxkit.config import BASE_KEYS, SOURCE_KEYS, flatten
    from jaxkit.keys import ALWAYS
    from jaxkit.models import contract

    config = ml_collections.ConfigDict(saved)
    flat = flatten(config)
    source = SOURCE_KEYS.get(str(flat.get("data.source")), ())
    for key in (*BASE_KEYS, *contract(config).keys(flat), *source):
        if key.added is ALWAYS or key.name in flat:
            continue
        section, leaf = key.name.split(".", 1)
        if section not in config:
            config[section] = ml_collections.ConfigDict()
        config[section][leaf] = key.added
    return config


def _said(prompt: str, most: int = 40) -> str:
    """A prompt as a refusal names it: its start, where it is long."""
    return repr(prompt if len(prompt) <= most else prompt[:most] + "...")


def _check_prompts(
    prompts: list[str], ids: list[list[int]], source: _Source, asked: int | None
) -> int:
    """Refuses, before any work, what the model cannot generate from; returns the new
    tokens to generate: those asked, or the default where the model's positions allow it
    (else as many as they allow the longest prompt)."""
    from jaxkit.models import contract

    config = source.config
    decoding = contract(config).decoding(config)
    if decoding is None:
        raise common.UsageError(
            f"{source.where} trained model.kind={config.model.kind!r}, a classifier: it "
            "generates no text"
        )
    vocab = int(config.model.vocab_size)
    limit = decoding.max_positions
    new = asked or DEFAULT_NEW_TOKENS
    if asked is None and limit is not None:
        new = max(1, min(new, limit - max(map(len, ids))))
    for prompt, tokens in zip(prompts, ids, strict=True):
        if not tokens:
            raise common.UsageError(f"prompt {_said(prompt)} encodes to no token: give some text")
        if max(tokens) >= vocab:
            raise common.UsageError(
                f"prompt {_said(prompt)} encodes to id {max(tokens)} ({source.tokenizer.name}), "
                f"beyond the model's vocabulary of {vocab}"
            )
        if limit is not None and len(tokens) + new > limit:
            room = limit - len(tokens)
            asking = f" and --max-new-tokens {new}" if asked is not None else ""
            raise common.UsageError(
                f"prompt {_said(prompt)} is {len(tokens)} tokens{asking}: the model's learned "
                f"positions end at data.seq_len={limit}, prompt included; "
                + (f"give at most {room} new tokens" if room > 0 else "give a shorter prompt")
            )
    if decoding.cache is None:
        print(
            f"note: {config.model.kind} is a model of your own with no key/value cache the "
            "kit knows: each new token recomputes the whole prefix",
            file=sys.stderr,
        )
    return new


def _generate(source: _Source, ids: list[list[int]], opts: argparse.Namespace) -> list[Any]:
    import jax

    from jaxkit import mesh as mesh_lib
    from jaxkit import sampling
    from jaxkit.checkpoint import restore_params
    from jaxkit.models import check_mesh_divides

    config = source.config
    devices = jax.devices()
    sizes = config.mesh.to_dict()
    given = any(item.startswith("mesh.") for item in opts.overrides)
    if not given and abs(math.prod(sizes.values())) != len(devices):
        # The run's mesh on another device count: its fsdp and tensor axes kept, data
        # takes the rest (as a resume elsewhere would give it).
        sizes["data"] = -1
    try:
        shape = mesh_lib.resolve_mesh_shape(sizes, len(devices))
    except mesh_lib.MeshError as err:
        raise mesh_lib.MeshError(f"{err} (set mesh.* after SOURCE)") from None
    check_mesh_divides(config, shape)
    mesh = mesh_lib.make_mesh(shape, devices)
    _, _, abstract, shardings = sampling.param_layout(config, mesh)
    if source.hf_dir is not None:
        from jaxkit.hf.load import check_finite, load_params

        params = load_params(source.hf_dir, config.model, abstract, shardings)
        check_finite(source.hf_dir, config.model, params)
    else:
        assert source.step is not None  # a workdir's source has its step
        params, _ = restore_params(source.checkpoints, source.step, shardings)
    sampler = sampling.Sampler(config, mesh, params)
    rows = [tokens for tokens in ids for _ in range(opts.num_samples)]
    settings = sampling.Settings(opts.temperature, opts.top_k, opts.top_p)
    samples, _ = sampler.generate(
        rows,
        max_new=opts.max_new_tokens,
        settings=settings,
        seed=opts.seed,
        eos_ids=source.eos_ids,
    )
    return samples

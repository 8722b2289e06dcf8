"""SOURCE as `jaxkit sample` and `jaxkit eval` take it: a run's workdir (its latest
checkpoint, or --step N) or hf:DIR, then overrides that change where and how the model
runs, never the model. Opened here to its config, its mesh on these devices and its params,
laid out as the run trained them."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from jaxkit.commands import common

if TYPE_CHECKING:
    import jax
    import ml_collections

# What a command on a SOURCE may change of the run's config: where and how it runs.
OVERRIDABLE = ("mesh.", "model.attention", "model.compute_dtype")
HF_PREFIX = "hf:"
HF_CONFIG = "llama_tiny"  # an hf:DIR runs under it, its shape from config.json
HF_CONTEXT = 2048  # transformers' max_position_embeddings where config.json gives none


def add_source(parser: argparse.ArgumentParser, hf_note: str = "", hf_keys: str = "") -> None:
    """SOURCE and its overrides, the command's positionals; `hf_keys` says what else an
    hf:DIR's overrides may set."""
    parser.add_argument(
        "source",
        type=common.directory,
        metavar="SOURCE",
        help="a run's workdir (its latest checkpoint, or --step N), or hf:DIR, a local "
        f"Hugging Face Llama directory (run under {HF_CONFIG}'s config, its shape from "
        f"config.json{hf_note})",
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help=f"mesh.*, model.attention or model.compute_dtype only{hf_keys}",
    )


def add_options(parser: argparse.ArgumentParser) -> None:
    """--step, and the options of every command that starts JAX."""
    parser.add_argument(
        "--step",
        type=common.int_at_least(0),
        metavar="N",
        help="a workdir's checkpoint of optimizer step N (default: the latest)",
    )
    parser.add_argument(
        "--host-devices",
        type=common.host_devices,
        metavar="N",
        help=f"simulate N devices on the CPU and run there (default: "
        f"{common.DEFAULT_HOST_DEVICES} CPU devices, used when JAX finds no accelerator)",
    )
    parser.add_argument(
        "--no-compile-cache",
        action="store_true",
        help="compile every program afresh: do not read or write the persistent compilation cache",
    )


def check_overrides(overrides: Sequence[str], who: str, also: Sequence[str] = ()) -> None:
    """`who` ("a sample") names the command in the refusal; `also`, keys it may override
    besides OVERRIDABLE's."""
    allowed = (*OVERRIDABLE, *also)
    for item in overrides:
        key = item.split("=", 1)[0]
        if "=" not in item or not (key.startswith("mesh.") or key in allowed):
            keys = ["mesh.*", *allowed[1:]]
            raise common.UsageError(
                f"{item!r}: {who} may override {', '.join(keys[:-1])} and {keys[-1]} only "
                "(key=value)"
            )


@dataclasses.dataclass
class Source:
    """A SOURCE opened: its config (overrides applied, checked) and where its params are."""

    config: ml_collections.ConfigDict
    where: str  # as a refusal names it
    meta: dict  # the checkpoint's record; {} for hf:DIR
    step: int | None = None
    checkpoints: Any = None  # WORKDIR/checkpoints
    hf_dir: pathlib.Path | None = None

    def decoding(self, refusal: str) -> Any:
        """The model kind's decoding contract; a classifier, which has none, is refused in
        one line ending with `refusal` (what the command would have done with text)."""
        from jaxkit.models import contract

        decoding = contract(self.config).decoding(self.config)
        if decoding is None:
            raise common.UsageError(
                f"{self.where} trained model.kind={self.config.model.kind!r}, a classifier: "
                + refusal
            )
        return decoding

    def hf_tokenizer(self) -> pathlib.Path | None:
        """hf:DIR's tokenizer.json, or None for a byte-level model (a vocabulary of 257 or
        fewer) without one. A larger vocabulary without one is refused: its ids are not
        bytes, and no file says what text they are."""
        from jaxkit import tokenizer as tokenizer_lib
        from jaxkit.token_format import BYTES_VOCAB_SIZE

        assert self.hf_dir is not None  # a workdir's tokenizer is its data's
        path = tokenizer_lib.model_tokenizer(self.hf_dir)
        vocab = int(self.config.model.vocab_size)
        if path is None and vocab > BYTES_VOCAB_SIZE:
            raise common.UsageError(
                f"{self.where} has no {tokenizer_lib.TOKENIZER_JSON}, and its vocabulary of "
                f"{vocab} is not bytes (257 or 256): add the {tokenizer_lib.TOKENIZER_JSON} the "
                f"model was trained with to {self.hf_dir}"
            )
        return path

    def hf_config(self) -> dict:
        """config.json of hf:DIR, or of the directory a run was fine-tuned from ({} for a
        run of its own)."""
        if self.hf_dir is not None:
            from jaxkit.hf.load import read_hf_config

            return dict(read_hf_config(self.hf_dir))
        return dict((self.meta.get("hf_source") or {}).get("config") or {})

    def context(self, decoding: Any) -> tuple[int, str]:
        """The most positions the model takes, its input included (`decoding`'s contract),
        and what sets it, as a refusal says it: learned positions end at data.seq_len;
        hf:DIR takes config.json's max_position_embeddings; a run, `run_context`'s."""
        if decoding.max_positions is not None:
            n = decoding.max_positions
            return n, f"its learned positions end at data.seq_len={n}"
        if self.hf_dir is not None:
            return hf_context(self.hf_config(), self.where)
        return run_context(int(self.config.data.seq_len), self.hf_config(), self.where)


def run_context(seq_len: int, started_from: dict, where: str) -> tuple[int, str]:
    """A run's context with a rotary model (no position table to end) and what sets it:
    the rows it trained on (data.seq_len), or, where longer, the max_position_embeddings
    of the config.json it was fine-tuned from (`started_from`; {} for a run of its own).
    `sample`, `eval` and the lm-eval model take this one, and `export` writes it as a
    fine-tuned run's max_position_embeddings."""
    if not started_from:
        return seq_len, f"the run's data.seq_len={seq_len}"
    n, _ = hf_context(started_from, f"{where}'s model.init_from")
    if started_from.get("max_position_embeddings") is None:
        started = (
            f"transformers' default of {n} (the config.json it was fine-tuned from gives none)"
        )
    else:
        started = f"the max_position_embeddings={n} of the config.json it was fine-tuned from"
    if n >= seq_len:
        return n, started
    return seq_len, f"the run's data.seq_len={seq_len}, longer than {started}"


def hf_context(hf_config: dict, where: str) -> tuple[int, str]:
    """(config.json's max_position_embeddings, what it is), HF_CONTEXT where it gives
    none; `where` names the directory in the refusal of a value that is no length."""
    n = hf_config.get("max_position_embeddings")
    if n is None:
        return HF_CONTEXT, "transformers' default, as config.json gives no max_position_embeddings"
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise common.UsageError(
            f"{where}: config.json max_position_embeddings={json.dumps(n)}: must be an integer ≥ 1"
        )
    return n, f"config.json's max_position_embeddings={n}"


def hf_directory(typed: str) -> pathlib.Path:
    """hf:DIR's directory; refused, named as typed, where it is none: nothing after hf:,
    nothing there, a file, or a jaxkit run's workdir (given as hf:DIR by mistake)."""
    text = typed[len(HF_PREFIX) :]
    if not text:
        raise common.UsageError(
            f"SOURCE {typed!r} names no directory: give hf:DIR, a local Hugging Face model "
            "directory (config.json and *.safetensors), or a run's workdir"
        )
    directory = pathlib.Path(text).expanduser()
    if not directory.exists():
        raise common.UsageError(
            f"{typed}: no such directory (nothing is downloaded: fetch it first)"
        )
    if not directory.is_dir():
        raise common.UsageError(f"{typed}: a file, not a directory")
    if (directory / "checkpoints").is_dir() and not any(directory.glob("*.safetensors")):
        raise common.UsageError(f"{typed}: a jaxkit run's workdir: give it without hf:")
    return directory


def as_typed(message: str, typed: str) -> str:
    """A refusal of hf:DIR as the user typed SOURCE: loading it names it
    model.init_from=hf:DIR, the key `jaxkit train` takes it as."""
    if not typed.startswith(HF_PREFIX):
        return message
    directory = pathlib.Path(typed[len(HF_PREFIX) :]).expanduser()
    return message.replace(f"model.init_from=hf:{directory}", typed)


def open_source(
    opts: argparse.Namespace,
    load_config: Callable[[list[str]], ml_collections.ConfigDict],
    hf_head: Sequence[str],
) -> Source:
    """`opts.source` at `opts.step` with `opts.overrides`; `load_config` is the CLI's, which
    loads hf:DIR's config with `hf_head` (data keys) before the overrides."""
    from jaxkit.checkpoint import CheckpointError, saved_steps
    from jaxkit.config import apply_overrides
    from jaxkit.validate import validate
    from jaxkit.workdir import as_path

    if opts.source.startswith(HF_PREFIX):
        if opts.step is not None:
            raise common.UsageError("--step applies to a run's workdir, not to hf:DIR")
        directory = hf_directory(opts.source)
        head = [HF_CONFIG, f"model.init_from={opts.source}", *hf_head]
        config = load_config([*head, *opts.overrides])
        return Source(config, opts.source, {}, hf_dir=directory)
    if not as_path(opts.source).is_dir():
        what = (
            "a file, not a run's workdir" if as_path(opts.source).exists() else "no such directory"
        )
        raise CheckpointError(f"{opts.source}: {what}")
    checkpoints = as_path(opts.source) / "checkpoints"
    steps = saved_steps(checkpoints)
    if not steps:
        raise CheckpointError(f"{opts.source} holds no checkpoint (checkpoints/step_N)")
    step = steps[-1] if opts.step is None else opts.step
    if step not in steps:
        raise CheckpointError(
            f"--step {step}: {opts.source} has checkpoints at steps {', '.join(map(str, steps))}"
        )
    meta = _read_meta(checkpoints, step)
    config = _saved_config(meta["config"])
    apply_overrides(config, list(opts.overrides))
    validate(config)
    return Source(config, f"the run in {opts.source}", meta, step, checkpoints)


def _read_meta(checkpoints: Any, step: int) -> dict:
    from jaxkit.checkpoint import CheckpointError

    path = checkpoints / f"step_{step}" / "meta" / "metadata"
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path}: the checkpoint's record cannot be read ({err})") from None


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
        # a dict-valued key (data.mixture) flattens to its fields: it was saved all the same
        given = key.name in flat or any(k.startswith(key.name + ".") for k in flat)
        if key.added is ALWAYS or given:
            continue
        section, leaf = key.name.split(".", 1)
        if section not in config:
            config[section] = ml_collections.ConfigDict()
        config[section][leaf] = key.added
    return config


def make_mesh(config: ml_collections.ConfigDict, overrides: Sequence[str]) -> jax.sharding.Mesh:
    """The run's mesh on every device here: on another device count its fsdp and tensor
    axes kept and data taking the rest (as a resume elsewhere would), unless the overrides
    set mesh.*."""
    import jax

    from jaxkit import mesh as mesh_lib
    from jaxkit.models import check_mesh_divides

    devices = jax.devices()
    sizes = config.mesh.to_dict()
    given = any(item.startswith("mesh.") for item in overrides)
    if not given and abs(math.prod(sizes.values())) != len(devices):
        sizes["data"] = -1
    try:
        shape = mesh_lib.resolve_mesh_shape(sizes, len(devices))
    except mesh_lib.MeshError as err:
        raise mesh_lib.MeshError(f"{err} (set mesh.* after SOURCE)") from None
    check_mesh_divides(config, shape)
    return mesh_lib.make_mesh(shape, devices)


def load_params(source: Source, abstract: Any, shardings: Any, outcome: str) -> Any:
    """The source's params placed as `shardings` says (a tree like `abstract`, the abstract
    params): each device reads its own slices. hf:DIR's weights that are not finite are
    refused, `outcome` saying what the command would have made of them."""
    from jaxkit.checkpoint import restore_params

    if source.hf_dir is not None:
        from jaxkit.hf.load import check_finite
        from jaxkit.hf.load import load_params as load_hf

        params = load_hf(source.hf_dir, source.config.model, abstract, shardings)
        check_finite(source.hf_dir, source.config.model, params, source.where, outcome)
        return params
    assert source.step is not None  # a workdir's source has its step
    return restore_params(source.checkpoints, source.step, shardings)[0]

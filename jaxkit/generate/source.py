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

from jaxkit.config import UsageError

if TYPE_CHECKING:
    import jax
    import ml_collections

    from jaxkit.sections import RunConfig

# What a command on a SOURCE may change of the run's config: where and how it runs.
OVERRIDABLE = ("mesh.", "model.attention", "model.compute_dtype")
HF_PREFIX = "hf:"
HF_CONFIG = "llama_tiny"  # an hf:DIR runs under it, its shape from config.json
HF_CONTEXT = 2048  # transformers' max_position_embeddings where config.json gives none


def check_overrides(overrides: Sequence[str], who: str, also: Sequence[str] = ()) -> None:
    """`who` ("a sample") names the command in the refusal; `also`, keys it may override
    besides OVERRIDABLE's."""
    allowed = (*OVERRIDABLE, *also)
    for item in overrides:
        key = item.split("=", 1)[0]
        if "=" not in item or not (key.startswith("mesh.") or key in allowed):
            keys = ["mesh.*", *allowed[1:]]
            raise UsageError(
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

    def sections(self) -> RunConfig:
        """The config's typed sections, as the code below the commands reads it (made
        afresh: a command may have changed the config since it opened the source)."""
        from jaxkit.config import run_config

        return run_config(self.config)

    def decoding(self, refusal: str) -> Any:
        """The model kind's decoding contract; a classifier, which has none, is refused in
        one line ending with `refusal` (what the command would have done with text)."""
        from jaxkit.models import contract

        typed = self.sections()
        decoding = contract(typed).decoding(typed)
        if decoding is None:
            raise UsageError(
                f"{self.where} trained model.kind={self.config.model.kind!r}, a classifier: "
                + refusal
            )
        return decoding

    def hf_tokenizer(self) -> pathlib.Path | None:
        """hf:DIR's tokenizer.json, or None for a byte-level model (a vocabulary of 257 or
        fewer) without one. A larger vocabulary without one is refused: its ids are not
        bytes, and no file says what text they are."""
        from jaxkit.data import tokenizer as tokenizer_lib
        from jaxkit.data.token_format import BYTES_VOCAB_SIZE

        assert self.hf_dir is not None  # a workdir's tokenizer is its data's
        path = tokenizer_lib.model_tokenizer(self.hf_dir)
        vocab = int(self.config.model.vocab_size)
        if path is None and vocab > BYTES_VOCAB_SIZE:
            raise UsageError(
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
        raise UsageError(
            f"{where}: config.json max_position_embeddings={json.dumps(n)}: must be an integer ≥ 1"
        )
    return n, f"config.json's max_position_embeddings={n}"


def hf_directory(typed: str) -> pathlib.Path:
    """hf:DIR's directory; refused, named as typed, where it is none: nothing after hf:,
    nothing there, a file, or a jaxkit run's workdir (given as hf:DIR by mistake)."""
    text = typed[len(HF_PREFIX) :]
    if not text:
        raise UsageError(
            f"SOURCE {typed!r} names no directory: give hf:DIR, a local Hugging Face model "
            "directory (config.json and *.safetensors), or a run's workdir"
        )
    directory = pathlib.Path(text).expanduser()
    if not directory.exists():
        raise UsageError(f"{typed}: no such directory (nothing is downloaded: fetch it first)")
    if not directory.is_dir():
        raise UsageError(f"{typed}: a file, not a directory")
    if (directory / "checkpoints").is_dir() and not any(directory.glob("*.safetensors")):
        raise UsageError(f"{typed}: a jaxkit run's workdir: give it without hf:")
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
    from jaxkit.config import apply_overrides, saved_config, validate
    from jaxkit.train.checkpoint import CheckpointError, saved_steps
    from jaxkit.workdir import as_path

    if opts.source.startswith(HF_PREFIX):
        if opts.step is not None:
            raise UsageError("--step applies to a run's workdir, not to hf:DIR")
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
    config = saved_config(meta["config"])
    apply_overrides(config, list(opts.overrides))
    validate(config)
    return Source(config, f"the run in {opts.source}", meta, step, checkpoints)


def _read_meta(checkpoints: Any, step: int) -> dict:
    from jaxkit.train.checkpoint import CheckpointError

    path = checkpoints / f"step_{step}" / "meta" / "metadata"
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path}: the checkpoint's record cannot be read ({err})") from None


def make_mesh(config: ml_collections.ConfigDict, overrides: Sequence[str]) -> jax.sharding.Mesh:
    """The run's mesh on every device here: on other slices the data axis spanning these
    (mesh.dcn_data), on another device count its fsdp and tensor axes kept and data taking
    the rest (as a resume elsewhere would; an axis the run set to -1 takes it instead),
    unless the overrides set mesh.*."""
    import jax

    from jaxkit import mesh as mesh_lib
    from jaxkit.config import run_config
    from jaxkit.models import check_mesh_divides

    devices = jax.devices()
    sizes = config.mesh.to_dict()
    given = any(item.startswith("mesh.") for item in overrides)
    try:
        if not given:
            try:
                mesh_lib.check_slices(sizes, devices)
            except mesh_lib.MeshError:
                sizes |= {"dcn_data": len(mesh_lib.device_slices(devices)), "dcn_fsdp": 1}
            taking_the_rest = any(sizes[axis] == -1 for axis in mesh_lib.AXES)
            if not taking_the_rest and math.prod(sizes.values()) != len(devices):
                sizes["data"] = -1
        shape = mesh_lib.resolve_mesh_shape(sizes, len(devices))
        mesh_lib.check_slices(sizes, devices)
    except mesh_lib.MeshError as err:
        raise mesh_lib.MeshError(f"{err} (set mesh.* after SOURCE)") from None
    check_mesh_divides(run_config(config), shape)
    return mesh_lib.make_mesh(sizes, devices)


def load_params(source: Source, abstract: Any, shardings: Any, outcome: str) -> Any:
    """The source's params placed as `shardings` says (a tree like `abstract`, the abstract
    params): each device reads its own slices. hf:DIR's weights that are not finite are
    refused, `outcome` saying what the command would have made of them."""
    from jaxkit.train.checkpoint import restore_params

    if source.hf_dir is not None:
        from jaxkit.hf.load import check_finite
        from jaxkit.hf.load import load_params as load_hf
        from jaxkit.models.llama import llama_model

        model = llama_model(source.sections())  # an hf:DIR runs as a Llama
        params = load_hf(source.hf_dir, model, abstract, shardings)
        check_finite(source.hf_dir, model, params, source.where, outcome)
        return params
    assert source.step is not None  # a workdir's source has its step
    return restore_params(source.checkpoints, source.step, shardings)[0]


REPLACEMENT = "\N{REPLACEMENT CHARACTER}".encode()


class Tokenizer:
    """Bytes, or a tokenizer.json; `bos_id` starts every prompt where the data's did."""

    def __init__(self, path: pathlib.Path | None, bos_id: int | None = None, special: bool = False):
        self.path, self.bos_id, self.special = path, bos_id, special
        self._hf: Any = None
        if path is not None:
            from tokenizers import Tokenizer as HfTokenizer

            from jaxkit.data.tokenizer import TokenizerError

            try:
                self._hf = HfTokenizer.from_file(str(path))
            except Exception as err:  # the library raises a bare Exception for a bad file
                said = " ".join(str(err).split())
                raise TokenizerError(f"{path}: not a tokenizer.json that loads: {said}") from None

    @property
    def name(self) -> str:
        return "bytes" if self.path is None else str(self.path)

    def encode(self, text: str, start: bool = True) -> list[int]:
        """`text`'s ids; where it `start`s a sequence, with what the tokenizer or the data put
        first (a beginning-of-sequence id), else the text's own ids only."""
        if self._hf is None:
            ids = list(text.encode("utf-8"))
        else:
            ids = list(self._hf.encode(text, add_special_tokens=self.special and start).ids)
        return ([self.bos_id] if self.bos_id is not None and start else []) + ids

    def decode(self, ids: Sequence[int], after: Sequence[int] = ()) -> str:
        """`ids`' text, as it reads after the ids `after` (a prompt's). A tokenizer.json's
        decoder may read a token otherwise at a text's start than within it (a
        SentencePiece-style "▁Paris" is "Paris" first, " Paris" after "is"): the text is
        what decoding `after` + `ids` adds to `after`'s text, where it only adds."""
        if self._hf is None:
            raw = b"".join(bytes([i]) if i < 256 else REPLACEMENT for i in ids)
            return raw.decode("utf-8", errors="replace")
        alone = str(self._hf.decode(list(ids), skip_special_tokens=False))
        if not after:
            return alone
        before = str(self._hf.decode(list(after), skip_special_tokens=False))
        whole = str(self._hf.decode([*after, *ids], skip_special_tokens=False))
        return whole[len(before) :] if whole.startswith(before) else alone


def _eos_list(value: object) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _run_tokenizer(meta: dict, config: ml_collections.ConfigDict, where: str) -> Tokenizer:
    """The run's tokenizer, from the record its checkpoint holds (jaxkit/data/tokenizer.py)."""
    from jaxkit.data import tokenizer as tokenizer_lib

    data = meta.get("data") or {}
    source = config.data.get("source")
    record = data.get("tokenizer")
    fingerprint = data.get("fingerprint") or {}
    bos = fingerprint.get("bos_id")
    if source == "text" or (isinstance(record, dict) and record.get("tokenizer") == "bytes"):
        return Tokenizer(None, bos)
    if source != "tokens":
        raise UsageError(
            f"{where} trained on data.source={source} ids, which no tokenizer turns into text"
        )
    if not isinstance(record, dict) or not record.get("tokenizer_file"):
        raise UsageError(
            f"{where} records no tokenizer file for its token data (data.tokenizer in its "
            "checkpoint): its ids cannot be turned into text"
        )
    path = pathlib.Path(record["tokenizer_file"])
    if not path.is_file():
        raise UsageError(
            f"{where}'s data was prepared with {path}, which is not there now: put it back"
        )
    expected = record.get("tokenizer_sha256")
    if expected is not None:
        try:
            found = tokenizer_lib.file_sha256(path)
        except tokenizer_lib.TokenizerError as err:
            raise UsageError(str(err)) from None
        if found != expected:
            raise UsageError(
                f"{path} is not the tokenizer {where}'s data was prepared with "
                f"(tokenizer_sha256 {expected[:12]}... recorded, {found[:12]}... now)"
            )
    return Tokenizer(path, bos)


def source_tokenizer(source: Source) -> tuple[Tokenizer, list[int]]:
    """The source's tokenizer, and the ids that end a sample."""
    from jaxkit.hf.load import read_hf_config

    if source.hf_dir is not None:
        hf_config = read_hf_config(source.hf_dir)
        tokenizer_json = source.hf_tokenizer()
        # The directory's own convention: its tokenizer adds what it adds (a BOS).
        return Tokenizer(tokenizer_json, special=True), _eos_list(hf_config.get("eos_token_id"))
    meta = source.meta
    tokenizer = _run_tokenizer(meta, source.config, source.where)
    data = meta.get("data") or {}
    eos = _eos_list((data.get("fingerprint") or {}).get("eod_id"))
    hf_source = meta.get("hf_source") or {}
    eos += _eos_list((hf_source.get("config") or {}).get("eos_token_id"))
    return tokenizer, eos


def split_args(args: list[str]) -> tuple[str, list[str]]:
    """[CONFIG] [key=value ...]: the config's name (the default where none is given) and
    the overrides."""
    from jaxkit.config import DEFAULT_CONFIG

    if args and "=" not in args[0]:
        return args[0], args[1:]
    return DEFAULT_CONFIG, args


def load_config(
    args: list[str], workdir: str | None = None, notes: list[str] | None = None
) -> ml_collections.ConfigDict:
    """CONFIG with its overrides applied and every value checked (before JAX starts).
    `workdir`: train's, where a checkpoint there makes this a resume. `notes` gets a line
    for each value taken from elsewhere (model.vocab_size=null: the token files')."""
    from jaxkit.config import apply_overrides, validate
    from jaxkit.config import load_config as load_named
    from jaxkit.data.token_files import take_vocabulary
    from jaxkit.hf.load import apply_init_from

    name, overrides = split_args(args)
    config = load_named(name)
    held: list[str] = []  # fields of a dict the config leaves null (model.rope_scaling.factor)
    apply_overrides(config, overrides, held=held)
    # model.init_from=hf:DIR: its architecture, or at a resume the checkpoint's, held against
    # every override, a field of a dict against the same field of config.json's value
    apply_init_from(config, overrides, workdir)
    apply_overrides(config, held)  # on the dict config.json gave; still null: refused
    taken = take_vocabulary(config)  # model.vocab_size=null: the token files' vocabulary
    if taken is not None and notes is not None:
        notes.append(taken)
    validate(config)
    return config

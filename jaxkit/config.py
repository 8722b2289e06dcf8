"""Config files and command-line overrides.

A config is a Python file with `get_config()` returning an `ml_collections.ConfigDict`.
Overrides are `dotted.key=value` strings; `key=null` unsets a value. Unknown keys and
ill-typed values are errors that name the key and suggest the closest valid one, and
`check_values` checks every value (`jaxkit.validate` adds a model of your own's checks).
"""

from __future__ import annotations

import difflib
import importlib.util
import math
import pathlib
from collections.abc import Callable
from typing import Any

import ml_collections
from ml_collections import config_dict

from jaxkit.batch_plan import LR_SCALINGS

# A checkout's configs/, or the copy a wheel installs as jaxkit/configs.
_CHECKOUT_CONFIGS = pathlib.Path(__file__).resolve().parent.parent / "configs"
CONFIG_DIR = (
    _CHECKOUT_CONFIGS
    if (_CHECKOUT_CONFIGS / "lm_tiny.py").is_file()
    else pathlib.Path(__file__).resolve().parent / "configs"
)
DEFAULT_CONFIG = "lm_tiny"
# Only this word unsets a value: "none" is a value of some string fields (lr_scaling=none).
NULL_WORD = "null"
# Keys that were renamed, with what replaced them, so an old override gets a pointer.
RENAMED = {
    "train.eval_batches": "train.eval_examples (held-out rows per eval, 0 = every row; "
    "not micro-batches)",
}


# Keys added after runs were saved: a saved config without one ran as this value says.
ADDED_DEFAULTS: dict[str, object] = {
    "train.loss_normalisation": "exact",  # unweighted rows: exact and naive are one loss
    "data.rows": "windows",
    "data.document_mask": False,
    "data.token_dtype": "uint16",
}


class ConfigError(ValueError):
    """A config name, key or value that cannot be used."""


def base_config() -> ml_collections.ConfigDict:
    """The sections every job shares; a config file adds `model` and `data` and overrides."""
    c = ml_collections.ConfigDict()

    # Give two of the three; the third is derived from the live mesh:
    # global_batch_size = (mesh.data × mesh.fsdp) × per_device_batch_size × grad_accum_steps
    c.batch = ml_collections.ConfigDict()
    c.batch.global_batch_size = config_dict.placeholder(int)  # rows per optimizer step
    c.batch.per_device_batch_size = config_dict.placeholder(int)  # rows per rank per micro-step
    c.batch.grad_accum_steps = config_dict.placeholder(int)  # micro-steps per optimizer step
    # A global batch that grows (batch_schedule.py): "" = fixed; "EXAMPLES:GLOBAL,..." stages
    # (e.g. "0:64,200000:128"; a t suffix counts tokens: "25Mt:128"); "auto" doubles K when
    # the smoothed noise scale B_simple stays above the global batch. Only K changes.
    c.batch.schedule = ""
    c.batch.max_global_batch_size = config_dict.placeholder(int)  # auto: the largest, rows
    c.batch.auto_patience = 3  # auto: log windows in a row with B_simple above the batch

    # Mesh axis sizes; one may be -1 to take the remaining devices.
    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = -1  # pure data parallel: replicas that each see part of the batch
    c.mesh.fsdp = 1  # also splits the batch, and shards params and optimizer state
    c.mesh.tensor = 1  # shards heads and hidden units; does not split the batch

    c.optimizer = ml_collections.ConfigDict()
    c.optimizer.name = "adamw"  # adamw | sgd
    c.optimizer.learning_rate = 1e-3  # peak, before batch scaling
    c.optimizer.lr_scaling = "none"  # none | linear | sqrt, by global / reference batch size
    c.optimizer.reference_batch_size = config_dict.placeholder(int)  # batch the LR was tuned at
    c.optimizer.warmup_steps = 10  # optimizer steps of linear warmup
    c.optimizer.final_lr_fraction = 0.1  # cosine decay ends at this fraction of the peak
    c.optimizer.weight_decay = 0.0  # decoupled (adamw) or L2 (sgd), on matrices only
    c.optimizer.b1 = 0.9  # adamw
    c.optimizer.b2 = 0.999  # adamw
    c.optimizer.momentum = 0.9  # sgd; 0 = plain sgd
    c.optimizer.grad_clip_norm = 0.0  # clip the accumulated gradient's global norm; 0 = off

    c.train = ml_collections.ConfigDict()
    c.train.steps = 100  # optimizer steps; or null and train.examples
    c.train.examples = config_dict.placeholder(int)  # examples to train on, instead of steps
    c.train.seed = 0  # model init and data order
    c.train.log_every = 10  # optimizer steps between metrics records
    c.train.eval_every = 0  # optimizer steps between evals; 0 = only at the end
    # Held-out rows per eval, the first N in a fixed order (the same rows for every split);
    # 0 = every held-out row.
    c.train.eval_examples = 0
    c.train.max_nonfinite_in_row = 10  # stop after this many non-finite micro-batches in a row
    # multisteps: optax.MultiSteps, one call per micro-batch (K gradient all-reduces per
    # optimizer step). fused: one call per optimizer step, a local scan over the K
    # micro-batches and one all-reduce; params are gathered whole inside the step.
    c.train.accumulation = "multisteps"  # multisteps | fused
    # exact: a step's loss is Σ weight × token loss / Σ weight over its whole global batch,
    # for every split. naive: the mean of micro-batch means, as other kits compute it; it
    # differs wherever rows weigh differently (padding, prompts): for comparison only.
    c.train.loss_normalisation = "exact"  # exact | naive
    # Batches loaded ahead by a background thread while the devices compute; 0 = each
    # batch is loaded in the step's path.
    c.train.prefetch = 2
    # Smoothing of the gradient noise scale estimate, per optimizer step (see noise_scale.py).
    c.train.noise_scale_decay = 0.95
    c.train.profile_steps = ""  # "START:END": trace optimizer steps START..END-1; "" = off

    # With a workdir, a run also checkpoints on SIGTERM/SIGINT and at the end.
    c.checkpoint = ml_collections.ConfigDict()
    c.checkpoint.every = 100  # optimizer steps between asynchronous saves; 0 = only those two
    c.checkpoint.keep = 3  # newest checkpoints kept
    return c


def _config_candidates(name: str) -> list[pathlib.Path]:
    path = pathlib.Path(name)
    if path.suffix == ".py" or path.parent != pathlib.Path("."):
        return [path]
    return [pathlib.Path("configs") / f"{name}.py", CONFIG_DIR / f"{name}.py"]


def available_configs() -> list[str]:
    return sorted(p.stem for p in CONFIG_DIR.glob("*.py") if not p.stem.startswith("_"))


def load_config(name: str = DEFAULT_CONFIG) -> ml_collections.ConfigDict:
    """Loads `configs/NAME.py` (or any path to a config file) and calls its get_config()."""
    for path in _config_candidates(name):
        if path.is_file():
            break
    else:
        hint = difflib.get_close_matches(pathlib.Path(name).stem, available_configs(), n=1)
        raise ConfigError(
            f"no config {name!r}; available: {', '.join(available_configs())}"
            + (f" (did you mean {hint[0]!r}?)" if hint else "")
        )
    spec = importlib.util.spec_from_file_location(f"jaxkit_config_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"{path} cannot be loaded as a Python module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "get_config"):
        raise ConfigError(f"{path} has no get_config() function")
    config = module.get_config()
    config.name = path.stem
    return config


def flatten(tree: dict | ml_collections.ConfigDict, prefix: str = "") -> dict[str, object]:
    """{"dotted.key": value} for a config, or for a config saved as nested dicts."""
    flat: dict[str, object] = {}
    for key, value in tree.items():
        if isinstance(value, (dict, ml_collections.ConfigDict)):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def flat_keys(config: ml_collections.ConfigDict) -> list[str]:
    return list(flatten(config))


def parse_value(text: str) -> bool | int | float | str | None:
    """Parses an override value: null, bool, int, float, else the string itself."""
    if text == NULL_WORD:
        return None
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def _suggest(key: str, keys: list[str]) -> str:
    leaf = key.rsplit(".", 1)[-1]
    same_leaf = [k for k in keys if k.rsplit(".", 1)[-1] == leaf]  # right name, wrong section
    close = same_leaf + difflib.get_close_matches(key, keys, n=2, cutoff=0.5)
    close = list(dict.fromkeys(close))[:2]
    return f" (did you mean {' or '.join(repr(k) for k in close)}?)" if close else ""


def apply_overrides(config: ml_collections.ConfigDict, overrides: list[str]) -> None:
    """Applies `dotted.key=value` overrides in place, keeping each field's type."""
    keys = flat_keys(config)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form dotted.key=value")
        key, text = item.split("=", 1)
        if key in RENAMED and key not in keys:
            raise ConfigError(f"{key} was replaced by {RENAMED[key]}")
        if key not in keys:
            raise ConfigError(f"unknown config key {key!r}{_suggest(key, keys)}")
        *parents, leaf = key.split(".")
        node = config
        for part in parents:
            node = node[part]
        value = parse_value(text)
        current = node[leaf]
        expected = node.get_type(leaf) if hasattr(node, "get_type") else type(current)
        if text.lower() == "none" and expected not in (str, type(None)):
            raise ConfigError(
                f"{key}={text}: {text!r} is not a value of this {expected.__name__} field; "
                f"write {key}=null to unset it"
            )
        if value is not None and expected is not type(None):
            if expected is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(text)  # a float's own reading: 1e400 digits give inf, not an error
            elif expected is str and not isinstance(value, str):
                value = text
            if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
                raise ConfigError(
                    f"{key}={text!r}: expected {expected.__name__}, got {type(value).__name__}"
                    f" (current value {current!r})"
                )
        node[leaf] = value
    return None


def config_to_json(config: ml_collections.ConfigDict) -> dict:
    return config.to_dict()


# Validation: every value is checked before any work, so a bad one is a message that names
# its key and constraint, never a traceback (or a silent NaN) after minutes of compiling.

Rule = Callable[[object], str | None]  # None when the value is fine, else what it must be


def _show(value: object) -> str:
    return NULL_WORD if value is None else repr(value) if isinstance(value, str) else str(value)


def _integer(low: int, high: int | None = None, *, nullable: bool = False) -> Rule:
    """An int (not a bool) in [low, high), or null where `nullable`."""
    want = f"an integer ≥ {low}" if high is None else f"an integer in [{low}, {high})"
    want = f"null or {want}" if nullable else want

    def check(value: object) -> str | None:
        if value is None and nullable:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            return f"must be {want}"
        return None if value >= low and (high is None or value < high) else f"must be {want}"

    return check


def _number(low: float, high: float | None = None, *, open_low: bool, open_high: bool) -> Rule:
    """A finite real (int or float, not a bool) between `low` and `high`."""
    if high is None:
        want = f"{'>' if open_low else '≥'} {low:g}"
    else:
        want = f"in {'(' if open_low else '['}{low:g}, {high:g}{')' if open_high else ']'}"

    def check(value: object) -> str | None:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"must be a number {want}"
        if not math.isfinite(value):
            return f"must be a finite number {want}"
        above = value > low if open_low else value >= low
        below = high is None or (value < high if open_high else value <= high)
        return None if above and below else f"must be {want}"

    return check


def _one_of(*choices: str) -> Rule:
    return lambda value: None if value in choices else f"must be one of {', '.join(choices)}"


def _text(*, nullable: bool) -> Rule:
    def check(value: object) -> str | None:
        if isinstance(value, str) or (nullable and value is None):
            return None
        return "must be null or a string" if nullable else "must be a string"

    return check


def _token_path(value: object) -> str | None:
    if isinstance(value, str) and value.strip():
        return None
    return (
        "must name token files: a directory `jaxkit data prepare` wrote, a file, a directory "
        "of .bin/.npy files or a glob (local or gs://)"
    )


def _text_file(value: object) -> str | None:
    """null (the default corpus), or a readable, non-empty local file."""
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        return "must be null (the default corpus) or the path of a text file"
    path = pathlib.Path(value).expanduser()
    if not path.is_file():
        return "is not a file"
    if path.stat().st_size == 0:
        return "is an empty file"
    return None


def _null(why: str) -> Rule:
    return lambda value: None if value is None else f"must be null: {why}"


def _mesh_axis(value: object) -> str | None:
    if isinstance(value, bool) or not isinstance(value, int) or not (value >= 1 or value == -1):
        return "must be a positive axis size, or -1 to take the remaining devices"
    return None


CUSTOM_KIND = "package.module:factory"  # model.kind of a model of your own


def is_custom(kind: object) -> bool:
    """Whether `kind` names a model of your own, "package.module:factory"."""
    return isinstance(kind, str) and ":" in kind


def _model_kind(value: object) -> str | None:
    if is_custom(value) or (isinstance(value, str) and value in MODEL_RULES):
        return None
    built_in = ", ".join(kind for kind in MODEL_RULES if not is_custom(kind))
    return f"must be one of {built_in}, or {CUSTOM_KIND} for a model of your own"


_POSITIVE = _integer(1)
_COUNT = _integer(0)  # 0 has a documented meaning (off, or every row)
# Optimizer step counts are int32 in optax (and the schedules read them): 2**31 overflows.
_FRACTION_OPEN = _number(0, 1, open_low=False, open_high=True)  # [0, 1)

# Every key of base_config(), and its constraint.
BASE_RULES: dict[str, Rule] = {
    "batch.global_batch_size": _integer(1, nullable=True),
    "batch.per_device_batch_size": _integer(1, nullable=True),
    "batch.grad_accum_steps": _integer(1, nullable=True),
    "batch.schedule": _text(nullable=False),
    "batch.max_global_batch_size": _integer(1, nullable=True),
    "batch.auto_patience": _POSITIVE,
    "mesh.data": _mesh_axis,
    "mesh.fsdp": _mesh_axis,
    "mesh.tensor": _mesh_axis,
    "optimizer.name": _one_of("adamw", "sgd"),
    "optimizer.learning_rate": _number(0, open_low=True, open_high=False),
    "optimizer.lr_scaling": _one_of(*LR_SCALINGS),
    "optimizer.reference_batch_size": _integer(1, nullable=True),
    "optimizer.warmup_steps": _integer(0, 2**31),
    "optimizer.final_lr_fraction": _number(0, 1, open_low=False, open_high=False),
    "optimizer.weight_decay": _number(0, open_low=False, open_high=False),
    "optimizer.b1": _FRACTION_OPEN,
    "optimizer.b2": _FRACTION_OPEN,
    "optimizer.momentum": _FRACTION_OPEN,
    "optimizer.grad_clip_norm": _number(0, open_low=False, open_high=False),
    "train.steps": _integer(1, 2**31, nullable=True),
    "train.examples": _integer(1, nullable=True),
    # jax.random.key keeps 32 bits: seed 2**32 would initialize exactly as seed 0.
    "train.seed": _integer(0, 2**32),
    "train.log_every": _POSITIVE,
    "train.eval_every": _COUNT,
    "train.eval_examples": _COUNT,
    "train.max_nonfinite_in_row": _POSITIVE,
    "train.accumulation": _one_of("multisteps", "fused"),
    "train.loss_normalisation": _one_of("exact", "naive"),
    "train.prefetch": _COUNT,
    "train.noise_scale_decay": _FRACTION_OPEN,  # 1 divides by its bias correction, 1 − 1**n
    "train.profile_steps": _text(nullable=False),
    "checkpoint.every": _COUNT,
    "checkpoint.keep": _POSITIVE,
    "model.kind": _model_kind,
}
LM_KINDS = ("transformer", "llama")  # token rows in, logits per position out


def _boolean(value: object) -> str | None:
    return None if isinstance(value, bool) else "must be true or false"


_LM_DATA: dict[str, Rule] = {
    "data.source": _one_of("text", "synthetic", "tokens"),
    "data.seq_len": _POSITIVE,
    "data.eval_fraction": _number(0, 1, open_low=True, open_high=True),
}
# Precision, rematerialisation and scanned layers (layers.py): optional, with defaults.
_LM_OPTIONS: dict[str, Rule] = {
    "model.param_dtype": _one_of("float32", "bfloat16"),
    "model.compute_dtype": _one_of("float32", "bfloat16"),
    "model.remat": _one_of("none", "full", "dots"),
    "model.scan_layers": _boolean,
    # Token files (token_files.py): read where data.source=tokens, checked wherever present.
    "data.rows": _one_of("windows", "documents"),
    "data.document_mask": _boolean,
    "data.token_dtype": _one_of("uint16", "uint32"),
}

# Each model kind's keys: the model's sizes, and the data it reads.
MODEL_RULES: dict[str, dict[str, Rule]] = {
    "transformer": {
        "model.vocab_size": _POSITIVE,
        "model.d_model": _POSITIVE,
        "model.num_layers": _POSITIVE,
        "model.num_heads": _POSITIVE,
        "model.mlp_dim": _POSITIVE,
        **_LM_DATA,
    },
    "llama": {
        "model.vocab_size": _POSITIVE,
        "model.d_model": _POSITIVE,
        "model.num_layers": _POSITIVE,
        "model.num_heads": _POSITIVE,
        "model.num_kv_heads": _POSITIVE,  # grouped-query attention; = num_heads for MHA
        "model.mlp_dim": _POSITIVE,
        "model.tie_embeddings": _boolean,
        "model.rope_theta": _number(0, open_low=True, open_high=False),
        **_LM_DATA,
    },
    "mlp": {
        "model.hidden_size": _POSITIVE,
        "model.num_layers": _POSITIVE,
        "model.num_classes": _POSITIVE,
        "data.source": _one_of("digits", "synthetic"),
        "data.num_features": _POSITIVE,
        "data.eval_fraction": _number(0, 1, open_low=True, open_high=True),
    },
}

# Keys a model kind may leave out, checked where present.
OPTIONAL_RULES: dict[str, dict[str, Rule]] = {
    "transformer": _LM_OPTIONS,
    "llama": _LM_OPTIONS,
    "mlp": {"data.seq_len": _null("the mlp reads rows, not sequences")},
}
# Keys only one data source reads: required with that source, checked wherever present.
SOURCE_RULES: dict[str, dict[str, Rule]] = {
    "text": {"data.path": _text_file, "data.max_bytes": _POSITIVE},
    "synthetic": {"data.num_examples": _POSITIVE},
    "digits": {},
    "tokens": {"data.path": _token_path},
}
BYTES = 256  # the text source's token ids are bytes
DIGITS_FEATURES, DIGITS_CLASSES = 64, 10  # scikit-learn's 8×8 digits, labels 0..9

# A model of your own (jaxkit/custom_model.py) takes the data its config names, and every
# other size is its own: a language model over the transformer's data (the vocabulary and
# the rows are the data's), or a classifier over the MLP's (rows of features; the classes
# are the data's: digits' 10, or the model.num_classes that synthetic rows are labelled in).
MODEL_RULES[CUSTOM_KIND] = {
    key: rule
    for key, rule in MODEL_RULES["transformer"].items()
    if key.startswith("data.") or key == "model.vocab_size"
}
OPTIONAL_RULES[CUSTOM_KIND] = {}
CUSTOM_CLASSIFIER = f"{CUSTOM_KIND} (classifier)"  # the key of its rules, not a kind
MODEL_RULES[CUSTOM_CLASSIFIER] = {
    key: rule for key, rule in MODEL_RULES["mlp"].items() if key.startswith("data.")
}
OPTIONAL_RULES[CUSTOM_CLASSIFIER] = {
    "data.seq_len": _null("a classifier reads rows of features, not sequences")
}


def _rules_key(kind: str, source: object, seq_len: object) -> str:
    """The rules of `kind`; a model of your own's follow its data: rows of features (digits,
    or synthetic without data.seq_len) make it a classifier, token rows a language model."""
    if not is_custom(kind):
        return kind
    features = source == "digits" or (source == "synthetic" and seq_len is None)
    return CUSTOM_CLASSIFIER if features else CUSTOM_KIND


def is_lm(config: ml_collections.ConfigDict) -> bool:
    """Whether `config` trains a language model ((B, L) tokens in, (B, L, V) logits out):
    the kinds whose rules require data.seq_len, a model of your own on token rows among
    them."""
    d = config.data
    key = _rules_key(str(config.model.kind), d.get("source"), d.get("seq_len"))
    return "data.seq_len" in MODEL_RULES.get(key, {})


def _check(flat: dict[str, object], rules: dict[str, Rule], needed_by: str | None) -> None:
    """Each present key against its rule; a missing one is an error where `needed_by` says
    what needs it (None: keys read only elsewhere, checked where present)."""
    for key, rule in rules.items():
        if key not in flat:
            if needed_by is not None:
                raise ConfigError(f"the config has no {key}, which {needed_by} needs")
            continue
        problem = rule(flat[key])
        if problem:
            raise ConfigError(f"{key}={_show(flat[key])}: {problem}")


def check_values(config: ml_collections.ConfigDict) -> None:
    """Checks every value of `config` (base keys and its model kind's); a ConfigError names
    the first bad key and its constraint. `jaxkit.validate.validate` also builds a model of
    your own."""
    flat = flatten(config)
    for old in RENAMED:
        if old in flat:
            raise ConfigError(f"{old} was replaced by {RENAMED[old]}")
    _check(flat, BASE_RULES, "every job")
    kind, source = str(flat["model.kind"]), flat.get("data.source")
    model_rules = _rules_key(kind, source, flat.get("data.seq_len"))
    _check(flat, MODEL_RULES[model_rules], f"model.kind={kind!r}")
    _check(flat, OPTIONAL_RULES[model_rules], None)
    own = SOURCE_RULES.get(str(source), {})
    _check(flat, own, f"data.source={source!r}")
    for rules in SOURCE_RULES.values():  # other sources' keys, where this one reads none
        _check(flat, {k: r for k, r in rules.items() if k not in own}, None)
    _check_relations(flat, kind)


def _check_relations(flat: dict[str, Any], kind: str) -> None:
    """Constraints between keys, once each key holds a value of the right kind."""
    if flat["optimizer.lr_scaling"] != "none" and flat["optimizer.reference_batch_size"] is None:
        raise ConfigError(
            f"optimizer.lr_scaling={flat['optimizer.lr_scaling']!r} scales the learning rate by "
            "global_batch_size / reference_batch_size: give optimizer.reference_batch_size"
        )
    free = [f"mesh.{axis}" for axis in ("data", "fsdp", "tensor") if flat[f"mesh.{axis}"] == -1]
    if len(free) > 1:
        raise ConfigError(f"{', '.join(free)} are -1: at most one mesh axis may take the rest")
    if (flat["train.steps"] is None) == (flat["train.examples"] is None):
        both = flat["train.steps"] is not None
        raise ConfigError(
            "give one of train.steps (optimizer steps) and train.examples (examples to train "
            f"on), not {'both' if both else 'neither'}"
            + ("; set train.steps=null to run by examples" if both else "")
        )
    if flat["train.profile_steps"]:
        parse_profile_steps(flat["train.profile_steps"], flat["train.steps"])
    if flat.get("data.document_mask") and kind not in LM_KINDS:
        raise ConfigError(
            f"data.document_mask=true: model.kind={kind!r} takes no segment ids; the built-in "
            f"language models ({', '.join(LM_KINDS)}) do"
        )
    if kind in LM_KINDS:
        _check_transformer(flat)
    elif kind == "mlp":
        _check_mlp(flat)
    elif _rules_key(kind, flat["data.source"], flat.get("data.seq_len")) == CUSTOM_CLASSIFIER:
        _check_digits_features(flat)
        if flat["data.source"] == "synthetic":  # its rows are labelled in that many classes
            _check(flat, {"model.num_classes": _POSITIVE}, "data.source='synthetic'")


def _check_transformer(flat: dict[str, Any]) -> None:
    d_model, heads = flat["model.d_model"], flat["model.num_heads"]
    if d_model % heads:
        raise ConfigError(
            f"model.d_model={d_model} is not divisible by model.num_heads={heads}: each head "
            "takes d_model / num_heads dimensions"
        )
    kv_heads = flat.get("model.num_kv_heads")
    if kv_heads is not None and heads % kv_heads:
        raise ConfigError(
            f"model.num_heads={heads} is not divisible by model.num_kv_heads={kv_heads}: each "
            "key/value head serves an equal group of query heads"
        )
    if kv_heads is not None and (d_model // heads) % 2:
        raise ConfigError(
            f"model.d_model / model.num_heads = {d_model // heads} is odd: rotary positions "
            "rotate pairs of a head's dimensions"
        )
    if flat["data.source"] != "tokens":
        for key, off in (("data.document_mask", False), ("data.rows", "windows")):
            if flat.get(key, off) != off:
                raise ConfigError(
                    f"{key}={_show(flat[key])} reads document ends from token files that "
                    "`jaxkit data prepare` wrote: set data.source=tokens"
                )
    if flat["data.source"] == "text" and flat["model.vocab_size"] < BYTES:
        raise ConfigError(
            f"model.vocab_size={flat['model.vocab_size']}: data.source='text' feeds bytes, "
            f"so it must be at least {BYTES}"
        )


def _check_digits_features(flat: dict[str, Any]) -> None:
    if flat["data.source"] == "digits" and flat["data.num_features"] != DIGITS_FEATURES:
        raise ConfigError(
            f"data.num_features={flat['data.num_features']}: data.source='digits' gives "
            f"{DIGITS_FEATURES} features (8×8 pixels)"
        )


def _check_mlp(flat: dict[str, Any]) -> None:
    _check_digits_features(flat)
    if flat["data.source"] != "digits":
        return
    if flat["model.num_classes"] < DIGITS_CLASSES:
        raise ConfigError(
            f"model.num_classes={flat['model.num_classes']}: data.source='digits' has labels "
            f"0..{DIGITS_CLASSES - 1}, so it must be at least {DIGITS_CLASSES}"
        )


def parse_profile_steps(text: str, steps: int | None) -> tuple[int, int] | None:
    """`train.profile_steps="START:END"`: optimizer steps START..END-1 (0-based); "" = off."""
    if not text:
        return None
    try:
        start, end = (int(part) for part in text.split(":"))
    except ValueError:
        raise ConfigError(
            f"train.profile_steps={text!r} is not START:END (e.g. 10:12 traces steps 10 and 11)"
        ) from None
    if not 0 <= start < end or (steps is not None and end > steps):
        bound = f" <= train.steps={steps}" if steps is not None else ""
        raise ConfigError(f"train.profile_steps={text!r} needs 0 <= START < END{bound}")
    return start, end

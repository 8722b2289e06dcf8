"""Config files and command-line overrides.

A config is a Python file with `get_config()` returning an `ml_collections.ConfigDict`.
Overrides are `dotted.key=value` strings; `key=null` unsets a value. Unknown keys and
ill-typed values are errors that name the key and suggest the closest valid one, and
`check_values` checks every value (`jaxkit.config` adds a model of your own's checks).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import importlib.util
import json
import pathlib
from collections.abc import Iterable, Sequence
from typing import Any

import ml_collections
from ml_collections import config_dict

from jaxkit import sections
from jaxkit.batch.plan import LR_SCALINGS, Accumulation
from jaxkit.keys import (
    ALWAYS,
    COUNT,
    FRACTION_OPEN,
    MESH_AXIS,
    NULL_WORD,
    POSITIVE,
    REQUIRED,
    TEXT_FILE,
    TOKEN_PATH,
    Key,
    Rule,
    integer,
    number,
    one_of,
    rules,
)
from jaxkit.keys import (
    ConfigError as ConfigError,  # raised here; models/ import it from keys
)
from jaxkit.keys import show as _show
from jaxkit.keys import (
    text as text_rule,
)
from jaxkit.models import CUSTOM_KIND, KINDS, Contract, contract, kind_of, kind_problem
from jaxkit.models import is_lm as is_lm  # asked of a config: the contract answers

# A checkout's configs/, or the copy a wheel installs as jaxkit/configs.
_CHECKOUT_CONFIGS = pathlib.Path(__file__).resolve().parent.parent / "configs"
CONFIG_DIR = (
    _CHECKOUT_CONFIGS
    if (_CHECKOUT_CONFIGS / "lm_tiny.py").is_file()
    else pathlib.Path(__file__).resolve().parent / "configs"
)
DEFAULT_CONFIG = "lm_tiny"
# Keys that were renamed, with what replaced them, so an old override gets a pointer.
RENAMED = {
    "train.eval_batches": "train.eval_examples (held-out rows per eval, 0 = every row; "
    "not micro-batches)",
}


def _key(name: str, default: object, rule: Rule, doc: str, **more: Any) -> Key:
    return Key(name, default, rule, doc, **more)


_RESUMABLE = {"resumable": True}
# A Weights & Biases project, entity or run name: an empty one would quietly mean W&B's default.
_W_AND_B_NAME = Rule(
    "null or a non-empty string",
    lambda value: (
        None
        if value is None or (isinstance(value, str) and value.strip())
        else "must be null or a non-empty string"
    ),
    "str | None",
)
# Optimizer step counts are int32 in optax (and the schedules read them): 2**31 overflows.
_STEP_COUNT = 2**31

# The keys every job shares; a config file adds `model` and `data` and overrides. Each is
# declared once: base_config(), BASE_RULES, the keys a resume may change and the config
# reference all come from this table.
BASE_KEYS: tuple[Key, ...] = (
    # Give two of the three; the third is derived from the live mesh:
    # global_batch_size = (mesh.dcn_data × mesh.dcn_fsdp × mesh.data × mesh.fsdp)
    #                     × per_device_batch_size × grad_accum_steps
    _key(
        "batch.global_batch_size",
        None,
        integer(1, nullable=True),
        "rows per optimizer step",
        type=int,
        **_RESUMABLE,
    ),
    _key(
        "batch.per_device_batch_size",
        None,
        integer(1, nullable=True),
        "rows per data-parallel rank per micro-step",
        type=int,
        **_RESUMABLE,
    ),
    _key(
        "batch.grad_accum_steps",
        None,
        integer(1, nullable=True),
        "micro-steps per optimizer step (give two of these three)",
        type=int,
        **_RESUMABLE,
    ),
    _key(
        "batch.schedule",
        "",
        text_rule(nullable=False),
        'a global batch that grows: `""` (fixed), stages `"EXAMPLES:GLOBAL,..."` (a `t` '
        'suffix counts tokens: `"25Mt:128"`) or `auto` (K doubles while the smoothed noise '
        "scale B_simple stays above the global batch); only K changes",
        **_RESUMABLE,
    ),
    _key(
        "batch.max_global_batch_size",
        None,
        integer(1, nullable=True),
        "`auto`: the largest global batch, the first doubled n times",
        type=int,
        **_RESUMABLE,
    ),
    _key(
        "batch.auto_patience",
        3,
        POSITIVE,
        "`auto`: noise-scale samples in a row with B_simple above the batch before K doubles",
        **_RESUMABLE,
    ),
    # The sizes within a slice; the dcn keys below multiply the batch axes over slices.
    _key(
        "mesh.data",
        -1,
        MESH_AXIS,
        "pure data parallel: replicas that each see part of the batch (-1: the remaining "
        "devices of a slice)",
        **_RESUMABLE,
    ),
    _key(
        "mesh.fsdp",
        1,
        MESH_AXIS,
        "also splits the batch, and shards params and optimizer state",
        **_RESUMABLE,
    ),
    _key(
        "mesh.tensor",
        1,
        MESH_AXIS,
        "shards heads and hidden units; does not split the batch",
        **_RESUMABLE,
    ),
    # Several slices (multi-slice): their product is the number of slices; the mesh's data
    # axis is mesh.dcn_data × mesh.data long (fsdp likewise). Runs saved before ran on one.
    _key(
        "mesh.dcn_data",
        1,
        POSITIVE,
        "slices the data axis spans, over the data-centre network (each slice's devices "
        "are `mesh.data × mesh.fsdp × mesh.tensor`)",
        added=1,
        **_RESUMABLE,
    ),
    _key(
        "mesh.dcn_fsdp",
        1,
        POSITIVE,
        "slices the fsdp axis spans, over the data-centre network",
        added=1,
        **_RESUMABLE,
    ),
    _key(
        "optimizer.name",
        "adamw",
        one_of("adamw", "sgd"),
        "`adamw` or `sgd` (inside `optax.MultiSteps`)",
    ),
    _key(
        "optimizer.learning_rate",
        1e-3,
        number(0, open_low=True, open_high=False),
        "peak learning rate, before batch scaling",
    ),
    _key(
        "optimizer.lr_scaling",
        "none",
        one_of(*LR_SCALINGS),
        "`none`, `linear` or `sqrt` in global_batch_size / reference_batch_size",
    ),
    _key(
        "optimizer.reference_batch_size",
        None,
        integer(1, nullable=True),
        "the global batch the learning rate was tuned at",
        type=int,
    ),
    _key(
        "optimizer.warmup_steps",
        10,
        integer(0, _STEP_COUNT),
        "linear warmup, in optimizer steps (of the first stage: warmup and decay are laid "
        "over examples), then cosine decay",
    ),
    _key(
        "optimizer.final_lr_fraction",
        0.1,
        number(0, 1, open_low=False, open_high=False),
        "where the cosine decay ends, as a fraction of the peak",
    ),
    _key(
        "optimizer.weight_decay",
        0.0,
        number(0, open_low=False, open_high=False),
        "decoupled (adamw) or L2 (sgd), on matrices only",
    ),
    _key("optimizer.b1", 0.9, FRACTION_OPEN, "adamw's first moment decay"),
    _key("optimizer.b2", 0.999, FRACTION_OPEN, "adamw's second moment decay"),
    _key("optimizer.momentum", 0.9, FRACTION_OPEN, "sgd momentum (0 = plain sgd)"),
    _key(
        "optimizer.grad_clip_norm",
        0.0,
        number(0, open_low=False, open_high=False),
        "clip the accumulated gradient's global norm (0 = off)",
    ),
    # train.steps (or train.examples) may only grow at a resume, when asked (--allow-longer):
    # checked on its own.
    _key(
        "train.steps",
        100,
        integer(1, _STEP_COUNT, nullable=True),
        "optimizer steps (or null, with `train.examples`)",
        type=int,
        **_RESUMABLE,
    ),
    _key(
        "train.examples",
        None,
        integer(1, nullable=True),
        "examples to train on, instead of `train.steps` (give one)",
        type=int,
        **_RESUMABLE,
    ),
    # jax.random.key keeps 32 bits: seed 2**32 would initialize exactly as seed 0.
    _key("train.seed", 0, integer(0, 2**32), "model init and data order"),
    _key("train.log_every", 10, POSITIVE, "optimizer steps between metrics records", **_RESUMABLE),
    _key(
        "train.eval_every",
        0,
        COUNT,
        "optimizer steps between evals (0 = at the end only)",
        **_RESUMABLE,
    ),
    _key(
        "train.eval_examples",
        0,
        COUNT,
        "held-out rows per eval, the first N in a fixed order, the same for every split "
        "(0 = every held-out row); replaces `eval_batches`",
        **_RESUMABLE,
    ),
    _key(
        "train.max_nonfinite_in_row",
        10,
        POSITIVE,
        "stop after this many non-finite micro-batches (MultiSteps) or skipped steps (fused) "
        "in a row",
        **_RESUMABLE,
    ),
    # Both modes keep MultiSteps' state layout, so a resume may switch.
    _key(
        "train.accumulation",
        Accumulation.MULTISTEPS.value,
        one_of(*(mode.value for mode in Accumulation)),
        "`multisteps` (one call per micro-batch, `optax.MultiSteps`, K gradient all-reduces "
        "per optimizer step) or `fused` (one call per optimizer step: a local scan over the K "
        "micro-batches and one all-reduce)",
        **_RESUMABLE,
    ),
    # Unweighted rows (every run saved before the key): exact and naive are one loss.
    _key(
        "train.loss_normalisation",
        "exact",
        one_of("exact", "naive"),
        "`exact` (Σ weight × loss / Σ weight over the global batch, every split alike) or "
        "`naive` (the mean of micro-batch means, as other kits compute it, for comparison)",
        added="exact",
    ),
    # When batches load, not which.
    _key(
        "train.prefetch",
        2,
        COUNT,
        "micro-batches loaded ahead by a background thread (0 = in the step's path)",
        **_RESUMABLE,
    ),
    # Smooths a logged estimate; only the auto ramp reads it (from the resume on).
    _key(
        "train.noise_scale_decay",
        0.95,
        FRACTION_OPEN,  # 1 divides by 1 − 1**n
        "smoothing of the gradient noise-scale estimates, per sample (one every "
        "`train.noise_scale_every` steps)",
        **_RESUMABLE,
    ),
    # The sample's extra one-row gradient costs a whole step's collectives on a sharded
    # layout: taken every 10th step it stays under 2% of lm_tiny's (docs/benchmarks.md).
    _key(
        "train.noise_scale_every",
        10,
        COUNT,
        "optimizer steps numbered N with N % every = 0 sample the gradient noise scale (an "
        "extra one-row gradient; 0 = off): the same steps on every split",
        added=1,  # runs saved before it sampled every step
        **_RESUMABLE,
    ),
    _key(
        "train.profile_steps",
        "",
        text_rule(nullable=False),
        "`START:END` traces optimizer steps START..END−1 into `WORKDIR/profile/`; empty = off",
        **_RESUMABLE,
    ),
    # With a workdir, a run also checkpoints on SIGTERM/SIGINT and at the end.
    _key(
        "checkpoint.every",
        100,
        COUNT,
        "optimizer steps between asynchronous checkpoints (0 = only on SIGTERM/SIGINT and at "
        "the end)",
        **_RESUMABLE,
    ),
    _key("checkpoint.keep", 3, POSITIVE, "newest checkpoints kept (at least 1)", **_RESUMABLE),
    # Where the run is also followed (jaxkit/records/wandb_log.py); runs saved before ran
    # without it.
    _key(
        "wandb.project",
        None,
        _W_AND_B_NAME,
        "the Weights & Biases project that process 0 also logs to, with a workdir: the "
        "config, the batch plan, TensorBoard's scalars and the summary (null = off; needs "
        "`pip install 'jaxkit[wandb]'`)",
        type=str,
        added=None,
        **_RESUMABLE,
    ),
    _key(
        "wandb.entity",
        None,
        _W_AND_B_NAME,
        "the W&B user or team the project belongs to (null = W&B's default entity)",
        type=str,
        added=None,
        **_RESUMABLE,
    ),
    _key(
        "wandb.run_name",
        None,
        _W_AND_B_NAME,
        "the W&B run's display name (null = the workdir's name)",
        type=str,
        added=None,
        **_RESUMABLE,
    ),
)


def base_config() -> ml_collections.ConfigDict:
    """The sections every job shares (BASE_KEYS, at their defaults); a config file adds
    `model` and `data` and overrides."""
    c = ml_collections.ConfigDict()
    for key in BASE_KEYS:
        section = c.get(key.section)
        if section is None:
            section = c[key.section] = ml_collections.ConfigDict()
        default = key.default
        section[key.leaf] = config_dict.placeholder(key.type) if default is None else default
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


def _once_each(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys are each given once: json.loads keeps the last of two, so
    `{"web": ..., "web": ...}` would drop the first without a word."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ConfigError(f"the JSON object gives {key!r} twice: give each key once")
        out[key] = value
    return out


def parse_value(text: str) -> bool | int | float | str | dict | None:
    """Parses an override value: null, bool, int, float, a JSON object (a dict-valued key such
    as model.rope_scaling), else the string itself."""
    if text == NULL_WORD:
        return None
    if text.lstrip().startswith("{"):
        try:
            value = json.loads(text, object_pairs_hook=_once_each)
        except json.JSONDecodeError as err:
            where = f"{err.msg} at character {err.pos}"
            raise ConfigError(f"{text!r} is not valid JSON: {where}") from None
        if isinstance(value, dict):
            return value
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


def _optional_keys(config: ml_collections.ConfigDict) -> dict[str, Key]:
    """The keys the config's model kind declares with a default (its options), by name."""
    kind = config.get("model", {}).get("kind")
    if not isinstance(kind, str) or kind_problem(kind):
        return {}
    keys = kind_of(kind).keys(flatten(config))
    return {key.name: key for key in keys if key.default is not REQUIRED}


def _add_field(config: ml_collections.ConfigDict, key: Key) -> None:
    """Adds a declared key at its default (typed, where the default is null)."""
    *parents, leaf = key.name.split(".")
    node = config
    for part in parents:
        if part not in node:
            node[part] = ml_collections.ConfigDict()
        node = node[part]
    kind = key.type or type(key.default)
    node[leaf] = config_dict.placeholder(kind) if key.default is None else key.default


def _known_keys(config: ml_collections.ConfigDict) -> list[str]:
    """Every key an override may name: each leaf, and each dict-valued key
    (model.rope_scaling), which is set whole, as JSON or null, like a leaf."""
    keys = flat_keys(config)
    # every dict level below a section: data.mixture as well as data.mixture.web
    dict_keys = {
        ".".join(parts[:i]) for parts in (k.split(".") for k in keys) for i in range(2, len(parts))
    }
    return keys + sorted(dict_keys - set(keys))


def _null_dict(config: ml_collections.ConfigDict, key: str) -> bool:
    """Whether `key` is a dict-valued key of the config's model kind (model.rope_scaling)
    that is null, or absent, here."""
    declared = _optional_keys(config).get(key)
    if declared is None or declared.type is not dict:
        return False
    node: Any = config
    for part in key.split("."):
        if not isinstance(node, ml_collections.ConfigDict) or part not in node:
            return True  # left out: its default, null
        node = node[part]
    return node is None


def apply_overrides(
    config: ml_collections.ConfigDict, overrides: list[str], *, held: list[str] | None = None
) -> None:
    """Applies `dotted.key=value` overrides in place, in order, keeping each field's type.

    A field of a dict-valued key (model.rope_scaling.factor=16.0) sets that field of the
    value the key holds by then: the config file's, or one set whole earlier on the line.
    Where that value is null, the field is refused, or, given `held`, appended to it and
    left for later: model.init_from's config.json may give the value (cli._load_config
    applies `held` again once apply_init_from has read it)."""
    keys = _known_keys(config)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form dotted.key=value")
        key, text = item.split("=", 1)
        if key in RENAMED and key not in keys:
            raise ConfigError(f"{key} was replaced by {RENAMED[key]}")
        if key not in keys and (optional := _optional_keys(config).get(key)) is not None:
            _add_field(config, optional)  # declared for this kind; its config left it out
            keys.append(key)
        parent = key.rpartition(".")[0]
        if key not in keys and _null_dict(config, parent):
            if held is not None:
                held.append(item)
                continue
            raise ConfigError(
                f"{parent} is null: set it whole as JSON first ({parent}='{{...}}'), "
                f"then {key}={text} sets one field"
            )
        if key not in keys:
            raise ConfigError(f"unknown config key {key!r}{_suggest(key, keys)}")
        *parents, leaf = key.split(".")
        node = config
        for part in parents:
            node = node[part]
        text_field = node.get_type(leaf) is str  # takes any text, "{" and all
        try:
            value = text if text_field and text != NULL_WORD else parse_value(text)
        except ConfigError as err:
            raise ConfigError(f"{key}={err}") from None
        current = node[leaf]
        if isinstance(value, dict) or isinstance(current, ml_collections.ConfigDict):
            kind = node.get_type(leaf)
            if value is not None and not isinstance(value, dict):
                raise ConfigError(f"{key}={text!r}: expected a JSON object {{...}} or null")
            if kind not in (type(None), dict, ml_collections.ConfigDict):
                raise ConfigError(f"{key}={text!r}: expected {kind.__name__}, got a JSON object")
            early = [f for f in held or () if f.startswith(f"{key}.")]
            if early:
                raise ConfigError(
                    f"{early[0]} comes before {key} on the line, which sets it whole: give "
                    "a field after the whole value"
                )
            declared = _optional_keys(config).get(key)
            if value is not None and declared is not None and declared.normalise is not None:
                try:
                    value = declared.normalise(value)
                except ConfigError as err:
                    raise ConfigError(f"{key}: {err}") from None
            # a field typed dict or null would not take a ConfigDict, nor one holding a
            # ConfigDict null (a config file's data.mixture unset on the line)
            del node[leaf]
            node[leaf] = value  # a dict becomes a ConfigDict: its fields can be set one by one
            keys = _known_keys(config)  # its fields, from here on the line (none for null)
            continue
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
            elif expected is int and type(value) is float and key.count(".") >= 2:
                # a field of a JSON object's value (data.mixture.web.weight): a number, the
                # field typed only by the value it held (1 before 0.3)
                del node[leaf]
                expected = float
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

MODEL_KIND = _key(
    "model.kind",
    REQUIRED,
    Rule(f"{', '.join(KINDS)}, or {CUSTOM_KIND}", kind_problem, "str"),
    f"{', '.join(f'`{name}`' for name in KINDS)}, or `{CUSTOM_KIND}` for your own model",
)
# Every key of base_config(), and model.kind, with its constraint.
BASE_RULES: dict[str, Rule] = rules((*BASE_KEYS, MODEL_KIND))
# Each model kind's keys, as its contract declares them (jaxkit/models/): the model's sizes
# and the data it reads (REQUIRED), and the keys it may leave out (their default applies),
# checked where present.
KIND_KEYS: dict[str, tuple[Key, ...]] = {name: kind.keys({}) for name, kind in KINDS.items()}
# Keys only one data source reads: required with that source, checked wherever present.
SOURCE_KEYS: dict[str, tuple[Key, ...]] = {
    "text": (
        _key(
            "data.path",
            REQUIRED,
            TEXT_FILE,
            "a text file (null = the standard library's `.py` files in sorted order)",
        ),
        _key("data.max_bytes", REQUIRED, POSITIVE, "corpus bytes read"),
    ),
    "synthetic": (_key("data.num_examples", REQUIRED, POSITIVE, "rows of synthetic data"),),
    "digits": (),
    "tokens": (
        _key(
            "data.path",
            REQUIRED,
            TOKEN_PATH,
            "a prepared directory, token files, a directory of them or a glob, local or `gs://`",
        ),
    ),
}
MODEL_RULES: dict[str, dict[str, Rule]] = {
    kind: rules(k for k in keys if k.default is REQUIRED) for kind, keys in KIND_KEYS.items()
}
OPTIONAL_RULES: dict[str, dict[str, Rule]] = {
    kind: rules(k for k in keys if k.default is not REQUIRED) for kind, keys in KIND_KEYS.items()
}
SOURCE_RULES: dict[str, dict[str, Rule]] = {
    source: rules(keys) for source, keys in SOURCE_KEYS.items()
}


def all_keys() -> list[Key]:
    """Every declared key: the shared ones, each model kind's, each data source's."""
    kinds = [key for keys in KIND_KEYS.values() for key in keys]
    sources = [key for keys in SOURCE_KEYS.values() for key in keys]
    return [*BASE_KEYS, MODEL_KIND, *kinds, *sources]


# Keys added after runs were saved: a saved config without one ran as this value says.
ADDED_DEFAULTS: dict[str, object] = {k.name: k.added for k in all_keys() if k.added is not ALWAYS}
# Keys that may differ between a run and its resumption (see Key.resumable); `name` is the
# config file's, and train.eval_batches an older run's eval_examples.
RESUMABLE_KEYS: frozenset[str] = frozenset(
    {"name", "train.eval_batches"} | {k.name for k in all_keys() if k.resumable}
)
# Sections whose every key may change at a resume (keys older runs saved there too).
RESUMABLE_SECTIONS: frozenset[str] = frozenset(
    k.section for k in BASE_KEYS if all(o.resumable for o in BASE_KEYS if o.section == k.section)
)


def resumable(name: str) -> bool:
    """Whether a resume may change the config key `name`. A mixture's weights
    (data.mixture.NAME.weight), like data.mixture_stages, are checked as the stages draw
    rows instead (normalised, up to the saved position: mixture.stage_changes): `7` and
    `0.7`, or a weight left out beside data.mixture_stages, may draw the same rows."""
    if name.startswith("data.mixture.") and name.endswith(".weight"):
        return True
    return name in RESUMABLE_KEYS or name.split(".", 1)[0] in RESUMABLE_SECTIONS


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
    the first bad key and its constraint. `jaxkit.config.validate` also builds a model of
    your own."""
    flat = flatten(config)
    for old in RENAMED:
        if old in flat:
            raise ConfigError(f"{old} was replaced by {RENAMED[old]}")
    _check(flat, BASE_RULES, "every job")
    kind, source = str(flat["model.kind"]), flat.get("data.source")
    model = kind_of(kind)
    keys = model.keys(flat)
    _check(flat, rules(k for k in keys if k.default is REQUIRED), f"model.kind={kind!r}")
    _check(flat, rules(k for k in keys if k.default is not REQUIRED), None)
    own = SOURCE_RULES.get(str(source), {})
    mixture = config.get("data", {}).get("mixture")
    if mixture is not None and not len(mixture):  # flattens to nothing: said here
        raise ConfigError(
            "data.mixture={} names no source: give NAME: {path, weight} for each, or "
            "data.mixture=null and data.path"
        )
    if any(k.startswith("data.mixture.") for k in flat) and flat.get("data.path") is None:
        own = {k: r for k, r in own.items() if k != "data.path"}  # each source names its own
    _check(flat, own, f"data.source={source!r}")
    for others in SOURCE_RULES.values():  # other sources' keys, where this one reads none
        # null there is unset (lm_tiny's data.path=null, the stdlib, with data.source=synthetic)
        unread = {k: r for k, r in others.items() if k not in own and flat.get(k) is not None}
        _check(flat, unread, None)
    _check_relations(flat, kind, model)


def _check_relations(flat: dict[str, Any], kind: str, model: Contract) -> None:
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
    if flat.get("data.document_mask") and not model.READS_LM_OPTIONS:
        segments = ", ".join(name for name, k in KINDS.items() if k.READS_LM_OPTIONS)
        raise ConfigError(
            f"data.document_mask=true: model.kind={kind!r} takes no segment ids; the built-in "
            f"language models ({segments}) do"
        )
    model.check_values(flat)


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


class UsageError(ValueError):
    """A command line that cannot be run as given (exit status 2)."""


def validate(config: ml_collections.ConfigDict) -> None:
    """Checks every value of `config` (base keys and its model kind's); a ConfigError names
    the first bad key and its constraint. A model of your own is imported and built from
    shapes alone, its logits checked against the data."""
    check_values(config)
    # Flax loads only for a model of your own (its contract builds it from shapes), as the
    # CLI checks every config before JAX starts.
    typed = run_config(config, checked=True)
    contract(typed).check_model(typed)


# Typed sections: after validation, `run_config` turns the ConfigDict into a frozen RunConfig
# whose sections are the dataclasses of jaxkit/sections.py, generated from the declarations
# above by `sections_module()` (`python docs/generate.py` writes it; tests/test_sections.py
# fails when the committed module drifts from them).

SHARED_SECTIONS = ("batch", "mesh", "optimizer", "train", "checkpoint", "wandb")


def _class_name(name: str) -> str:
    return "".join(part.capitalize() for part in name.split("_"))


def _literal(value: object) -> str:
    """A default as the generated module writes it (double-quoted strings, as ruff formats)."""
    return json.dumps(value, ensure_ascii=False) if isinstance(value, str) else repr(value)


def _union(first: str, second: str) -> str:
    """Two annotations as one: `int` and `None` is `int | None`; two Literals, one."""
    parts = first.split(" | ") + [p for p in second.split(" | ") if p not in first.split(" | ")]
    literals = [p for p in parts if p.startswith("Literal[")]
    if len(literals) > 1:
        choices = [c for p in literals for c in p[len("Literal[") : -1].split(", ")]
        merged = f"Literal[{', '.join(dict.fromkeys(choices))}]"
        parts = [merged if p == literals[0] else p for p in parts if p not in literals[1:]]
    return " | ".join([p for p in parts if p != "None"] + (["None"] if "None" in parts else []))


def _section_source(
    name: str,
    doc: str,
    variants: list[list[Key]],
    head: list[str],
    nullable: Sequence[Key] = (),
    shared: Sequence[Key] = (),
) -> str:
    """A frozen dataclass of the keys of `variants` (the key sets a section may hold): a key
    every variant requires keeps its type; one with a default keeps it; one that only some
    variants declare, and each of `nullable` (a data source's own keys), is None where this
    config's kind or source has none; each of `shared` (an option other kinds declare) holds
    its default, as code that serves every kind reads it."""
    fields: dict[str, tuple[str, str | None]] = {}
    optional: dict[str, str] = {}
    for keys in variants:
        for key in keys:
            default = None if key.default is REQUIRED else _literal(key.default)
            annotation, first_default = fields.get(key.leaf, (key.rule.annotation, default))
            fields[key.leaf] = (_union(annotation, key.rule.annotation), first_default or default)
    for key in shared:
        if key.leaf not in fields:
            fields[key.leaf] = (key.rule.annotation, _literal(key.default))
    for key in nullable:
        if key.leaf not in fields:
            known = optional.get(key.leaf, key.rule.annotation)
            optional[key.leaf] = _union(_union(known, key.rule.annotation), "None")
    lines = [
        "@dataclasses.dataclass(frozen=True, kw_only=True)",
        f"class {name}:",
        f'    """{doc}"""',
        "",
        *head,
    ]
    for leaf, (annotation, default) in fields.items():
        everywhere = all(any(k.leaf == leaf for k in keys) for keys in variants)
        if default is None and not everywhere:
            if "None" not in annotation.split(" | "):
                annotation = f"{annotation} | None"
            default = "None"
        lines.append(f"    {leaf}: {annotation}" + (f" = {default}" if default else ""))
    lines += [f"    {leaf}: {annotation} = None" for leaf, annotation in optional.items()]
    return "\n".join(lines)


def _of(keys: Iterable[Key], section: str) -> list[Key]:
    return [key for key in keys if key.section == section and key.name.count(".") == 1]


def sections_module() -> str:
    """The source of jaxkit/sections.py: a dataclass per config section, and RunConfig of
    them all. The model and data sections are one per model kind: a kind's own keys, typed
    as it declares them; the options other kinds share (the LM options) at their defaults,
    as code that serves every kind reads them; and in `data`, every source's keys and every
    other kind's, null where the config's source or kind has none."""
    from jaxkit.models import CUSTOM

    sources = [key for keys in SOURCE_KEYS.values() for key in keys]
    parts = [
        '"""The typed config a run reads: `jaxkit.config.run_config(config)` turns a checked\n'
        "ConfigDict into a frozen RunConfig of these sections.\n\n"
        "Generated from the keys' declarations (jaxkit/config.py and each model kind's) by\n"
        "`python docs/generate.py`: do not edit by hand.\n"
        '"""\n\n'
        "from __future__ import annotations\n\nimport dataclasses\nfrom typing import Any, Literal",
    ]
    for section in SHARED_SECTIONS:
        parts.append(
            _section_source(
                _class_name(section), f"The `{section}.*` keys.", [_of(BASE_KEYS, section)], []
            )
        )
    kinds: dict[str, list[tuple[Key, ...]]] = {k: [keys] for k, keys in KIND_KEYS.items()}
    kinds[CUSTOM_KIND] = [CUSTOM.keys({}), CUSTOM.keys({"data.source": "digits"})]
    # Options two or more kinds declare (the LM options): every kind's section holds them.
    declaring: dict[str, list[Key]] = {}
    for variants in kinds.values():
        options = {k.name: k for keys in variants for k in keys if k.default is not REQUIRED}
        for name, key in options.items():
            declaring.setdefault(name, []).append(key)
    shared_options = [keys[0] for keys in declaring.values() if len(keys) > 1]
    every_data_key = [
        k for variants in kinds.values() for keys in variants for k in _of(keys, "data")
    ]
    for kind, variants in kinds.items():
        name = "Custom" if kind == CUSTOM_KIND else _class_name(kind)
        literal = "str" if kind == CUSTOM_KIND else f'Literal["{kind}"]'
        what = "a model of your own" if kind == CUSTOM_KIND else f"model.kind={kind!r}"
        parts.append(
            _section_source(
                f"{name}Model",
                f"The `model.*` keys of {what}.",
                [_of(keys, "model") for keys in variants],
                [f"    kind: {literal}"],
                shared=_of(shared_options, "model"),
            )
        )
        parts.append(
            _section_source(
                f"{name}Data",
                f"The `data.*` keys of {what}; other sources' and kinds' are null.",
                [_of(keys, "data") for keys in variants],
                [],
                [*sources, *every_data_key],
                shared=_of(shared_options, "data"),
            )
        )
    names = ["Custom" if k == CUSTOM_KIND else _class_name(k) for k in kinds]
    model = " | ".join(f"{n}Model" for n in names)
    data = " | ".join(f"{n}Data" for n in names)
    shared = "\n".join(f"    {s}: {_class_name(s)}" for s in SHARED_SECTIONS)
    parts.append(
        "@dataclasses.dataclass(frozen=True, kw_only=True)\n"
        "class RunConfig:\n"
        '    """A checked config, section by section; `name` is the config file\'s (None for one\n'
        "    built in code). `config` is the ConfigDict it was made from: only a model of your\n"
        "    own is handed it (whole, as docs/training.md says), and code that reads the sections\n"
        '    never looks at it."""\n\n'
        f"    name: str | None\n{shared}\n    model: {model}\n    data: {data}\n"
        "    config: Any = dataclasses.field(default=None, compare=False, repr=False)"
    )
    parts.append(
        "# Any kind's model and data sections, as a function that serves every kind takes them.\n"
        f"Model = {model}\nData = {data}"
    )
    by_kind = "".join(
        f'    "{"custom" if k == CUSTOM_KIND else k}": ({n}Model, {n}Data),\n'
        for k, n in zip(kinds, names, strict=True)
    )
    parts.append(
        "# The model and data sections of each built-in kind, and of a model of your own.\n"
        f"KINDS: dict[str, tuple[type, type]] = {{\n{by_kind}}}"
    )
    return "\n\n\n".join(parts) + "\n"


def _section(cls: type, values: dict[str, Any]) -> Any:
    """The section `cls` of a config section's values: its declared keys (a key left out at
    its default), others (a model of your own's) left to the ConfigDict."""
    names = {field.name for field in dataclasses.fields(cls)}
    return cls(**{name: value for name, value in values.items() if name in names})


def _kind_sections(kind: str) -> tuple[type, type]:
    """The model and data sections of `kind`: a checked kind not built in is a model of
    your own."""
    return sections.KINDS.get(kind, sections.KINDS["custom"])


def run_config(config: ml_collections.ConfigDict, *, checked: bool = False) -> sections.RunConfig:
    """`config` as typed, frozen sections, its values checked first (`check_values`; a
    ConfigError names the first bad key) unless `checked` says they were: each section's
    declared keys, a key the config leaves out at its default (None where the config's kind
    or data source has no such key). Keys no declaration names (a model of your own's) stay
    in the ConfigDict only, which RunConfig.config holds for it."""
    if not checked:
        check_values(config)
    values = {
        name: config.get(name, ml_collections.ConfigDict()).to_dict()
        for name in (*SHARED_SECTIONS, "model", "data")
    }
    model_cls, data_cls = _kind_sections(values["model"]["kind"])
    shared = {
        name: _section(getattr(sections, _class_name(name)), values[name])
        for name in SHARED_SECTIONS
    }
    return sections.RunConfig(
        name=config.get("name"),
        model=_section(model_cls, values["model"]),
        data=_section(data_cls, values["data"]),
        config=copy.deepcopy(config),  # frozen as the sections are: later edits stay out
        **shared,
    )


def model_section(config: ml_collections.ConfigDict) -> sections.Model:
    """The config's model section alone, typed (`run_config`'s, unchecked): for code that
    reads the model before the rest of the config is complete (hf/: model.init_from's
    architecture, taken from its config.json)."""
    return _section(_kind_sections(config.model.kind)[0], config.model.to_dict())


def saved_config(saved: dict) -> ml_collections.ConfigDict:
    """A checkpoint's config, with the keys added since it was saved at the values the run
    ran as (config.py's `added`)."""
    config = ml_collections.ConfigDict(saved)
    flat = flatten(config)
    source = SOURCE_KEYS.get(str(flat.get("data.source")), ())
    for key in (*BASE_KEYS, *kind_of(str(flat["model.kind"])).keys(flat), *source):
        # a dict-valued key (data.mixture) flattens to its fields: it was saved all the same
        given = key.name in flat or any(k.startswith(key.name + ".") for k in flat)
        if key.added is ALWAYS or given:
            continue
        section, leaf = key.name.split(".", 1)
        if section not in config:
            config[section] = ml_collections.ConfigDict()
        config[section][leaf] = key.added
    return config


def saved_run_config(saved: dict[str, Any]) -> sections.RunConfig:
    """The sections of a config saved with a run (its config.json, a checkpoint's record):
    checked when it ran, so not again here (its data may have moved since)."""
    return run_config(saved_config(saved), checked=True)

"""Config files and command-line overrides.

A config is a Python file with `get_config()` returning an `ml_collections.ConfigDict`.
Overrides are `dotted.key=value` strings; `key=null` unsets a value. Unknown keys and
ill-typed values are errors that name the key and suggest the closest valid one.
"""

from __future__ import annotations

import difflib
import importlib.util
import pathlib

import ml_collections
from ml_collections import config_dict

# A checkout's configs/, or the copy a wheel installs as jaxkit/configs.
_CHECKOUT_CONFIGS = pathlib.Path(__file__).resolve().parent.parent / "configs"
CONFIG_DIR = (
    _CHECKOUT_CONFIGS
    if (_CHECKOUT_CONFIGS / "lm_tiny.py").is_file()
    else pathlib.Path(__file__).resolve().parent / "configs"
)
DEFAULT_CONFIG = "lm_tiny"
NULL_WORDS = ("null", "none", "None")


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
    c.train.steps = 100  # optimizer steps
    c.train.seed = 0  # model init and data order
    c.train.log_every = 10  # optimizer steps between metrics records
    c.train.eval_every = 0  # optimizer steps between evals; 0 = only at the end
    c.train.eval_batches = 0  # micro-batches of held-out data per eval; 0 = all of it
    c.train.max_nonfinite_in_row = 10  # stop after this many non-finite micro-batches in a row
    # multisteps: optax.MultiSteps, one call per micro-batch (K gradient all-reduces per
    # optimizer step). fused: one call per optimizer step, a local scan over the K
    # micro-batches and one all-reduce; params are gathered whole inside the step.
    c.train.accumulation = "multisteps"  # multisteps | fused
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
    if text in NULL_WORDS:
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
        if key not in keys:
            raise ConfigError(f"unknown config key {key!r}{_suggest(key, keys)}")
        *parents, leaf = key.split(".")
        node = config
        for part in parents:
            node = node[part]
        value = parse_value(text)
        current = node[leaf]
        expected = node.get_type(leaf) if hasattr(node, "get_type") else type(current)
        if value is not None and expected is not type(None):
            if expected is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
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

"""model.kind="mlp": the MLP classifier over rows of features (network: mlp_net.py)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from jaxkit.keys import POSITIVE, REQUIRED, ConfigError, Key, null, one_of
from jaxkit.models.common import DIGITS_CLASSES, DIGITS_FEATURES, EVAL_FRACTION
from jaxkit.sections import MlpModel, RunConfig

if TYPE_CHECKING:
    from flax import nnx

    from jaxkit.models.common import Params, Sizes

READS_LM_OPTIONS = False

# The model's sizes and the data it reads (required), and the keys it may leave out.
KEYS: tuple[Key, ...] = (
    Key("model.hidden_size", REQUIRED, POSITIVE, "hidden units per layer"),
    Key("model.num_layers", REQUIRED, POSITIVE, "hidden layers"),
    Key("model.num_classes", REQUIRED, POSITIVE, "output classes (≥ 10 for digits)"),
    Key(
        "data.source",
        REQUIRED,
        one_of("digits", "synthetic"),
        "`digits` (scikit-learn's 8×8 digits) or `synthetic`",
    ),
    Key("data.num_features", REQUIRED, POSITIVE, "input features (64 for 8×8 digits)"),
    EVAL_FRACTION,
    Key(
        "data.seq_len",
        None,
        null("the mlp reads rows, not sequences"),
        "null: the MLP reads rows, not sequences",
    ),
)


def keys(flat: Mapping[str, object]) -> tuple[Key, ...]:
    del flat
    return KEYS


def check_digits_features(flat: Mapping[str, Any]) -> None:
    if flat["data.source"] == "digits" and flat["data.num_features"] != DIGITS_FEATURES:
        raise ConfigError(
            f"data.num_features={flat['data.num_features']}: data.source='digits' gives "
            f"{DIGITS_FEATURES} features (8×8 pixels)"
        )


def check_values(flat: Mapping[str, Any]) -> None:
    """Constraints between its keys, once each holds a value of its kind."""
    check_digits_features(flat)
    if flat["data.source"] != "digits":
        return
    if flat["model.num_classes"] < DIGITS_CLASSES:
        raise ConfigError(
            f"model.num_classes={flat['model.num_classes']}: data.source='digits' has labels "
            f"0..{DIGITS_CLASSES - 1}, so it must be at least {DIGITS_CLASSES}"
        )


def is_lm(config: RunConfig) -> bool:
    del config
    return False


def _model(config: RunConfig) -> MlpModel:
    """The config's model section, an MLP's: this contract is asked only of its kind."""
    assert isinstance(config.model, MlpModel), type(config.model)
    return config.model


def _num_features(config: RunConfig) -> int:
    """data.num_features, which every MLP config gives (config.check_values)."""
    assert config.data.num_features is not None
    return config.data.num_features


def build(config: RunConfig, rngs: nnx.Rngs) -> nnx.Module:
    from jaxkit.models.mlp_net import MLPClassifier  # flax loads with the network

    m = _model(config)
    return MLPClassifier(
        _num_features(config), m.hidden_size, m.num_layers, m.num_classes, rngs=rngs
    )


def sharded_sizes(config: RunConfig) -> Sizes:
    """The first layer's inputs lie on fsdp, and hidden units on both axes."""
    return [
        ("data.num_features", _num_features(config), ("fsdp",)),
        ("model.hidden_size", _model(config).hidden_size, ("fsdp", "tensor")),
    ]


def check_shards(config: RunConfig, mesh_shape: dict[str, int]) -> None:
    del config, mesh_shape  # no heads: its sharded sizes say all


def check_model(config: RunConfig) -> None:
    del config  # its values say all: config.check_values checked them


def matmul_params(config: RunConfig, params: Params) -> int:
    """Every param (PaLM's convention counts a layer's bias with its matmul)."""
    del config
    return sum(size for _, size in params)


def flops_per_example(config: RunConfig, matmul_params: int) -> float:
    del config
    return 6.0 * matmul_params


def decoding(config: RunConfig) -> None:
    del config  # a classifier: it generates nothing
    return None


def facts(config: RunConfig) -> dict[str, Any]:
    del config
    return {}

"""model.kind="package.module:factory": a model of your own, built by its factory
(jaxkit/models/custom_model.py imports, builds and checks it). A language model or a classifier
by its data; sharded as its params are annotated.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from jaxkit.keys import POSITIVE, REQUIRED, ConfigError, Key, integer, null, show
from jaxkit.models import lm, mlp
from jaxkit.models.common import Decoding, rows_of_features
from jaxkit.sections import RunConfig

if TYPE_CHECKING:
    from flax import nnx

    from jaxkit.models.common import Params, Sizes

READS_LM_OPTIONS = False  # its precision, remat and layers are its own

# It takes the data its config names, and every other size is its own: a language model over
# the transformer's data (the vocabulary and the rows are the data's), or a classifier over
# the MLP's (rows of features; the classes are the data's: digits' 10, or the
# model.num_classes that synthetic rows are labelled in).
LM_KEYS: tuple[Key, ...] = (*lm.sizes("vocab_size"), *lm.DATA_KEYS)
CLASSIFIER_KEYS: tuple[Key, ...] = (
    *(key for key in mlp.KEYS if key.section == "data" and key.default is REQUIRED),
    Key(
        "data.seq_len",
        None,
        null("a classifier reads rows of features, not sequences"),
        "null: a classifier reads rows of features, not sequences",
    ),
    # Required with synthetic rows (check_values); digits' classes are the data's.
    Key(
        "model.num_classes",
        None,
        integer(1, nullable=True),
        "the classes synthetic rows are labelled in (required with data.source=synthetic)",
        type=int,
    ),
)


def is_lm(config: RunConfig) -> bool:
    """Token rows make it a language model; rows of features (digits, or synthetic without
    data.seq_len) a classifier."""
    return not rows_of_features(config.data.source, config.data.seq_len)


def keys(flat: Mapping[str, object]) -> tuple[Key, ...]:
    """The keys of its data: a language model's or a classifier's."""
    features = rows_of_features(flat.get("data.source"), flat.get("data.seq_len"))
    return CLASSIFIER_KEYS if features else LM_KEYS


def check_values(flat: Mapping[str, Any]) -> None:
    """A classifier's rows are the data's: digits' 64 features, and synthetic rows labelled
    in model.num_classes, which it must give."""
    if not rows_of_features(flat["data.source"], flat.get("data.seq_len")):
        return
    mlp.check_digits_features(flat)
    if flat["data.source"] != "synthetic":
        return
    if "model.num_classes" not in flat:
        raise ConfigError(
            "the config has no model.num_classes, which data.source='synthetic' needs"
        )
    problem = POSITIVE(flat["model.num_classes"])
    if problem:
        raise ConfigError(f"model.num_classes={show(flat['model.num_classes'])}: {problem}")


def build(config: RunConfig, rngs: nnx.Rngs) -> nnx.Module:
    from jaxkit.models import custom_model

    return custom_model.build(config.config, rngs)  # a model of your own: the whole ConfigDict


def sharded_sizes(config: RunConfig) -> Sizes:
    del config  # sharded as it annotates: see check_shards
    return []


def check_shards(config: RunConfig, mesh_shape: dict[str, int]) -> None:
    from jaxkit.models import custom_model

    custom_model.check_shards(config.config, mesh_shape)


def check_model(config: RunConfig) -> None:
    """Imports the factory and builds the model from shapes, checking its logits."""
    from jaxkit.models import custom_model  # flax loads only for a model of your own

    custom_model.check(config.config)


def matmul_params(config: RunConfig, params: Params) -> int:
    del config  # its architecture is not known here: every param
    return sum(size for _, size in params)


def flops_per_example(config: RunConfig, matmul_params: int) -> float:
    """6 × its params per token (its attention unknown), or per example for a classifier."""
    if not is_lm(config):
        return 6.0 * matmul_params
    assert config.data.seq_len is not None  # token rows: a language model's
    return 6.0 * matmul_params * config.data.seq_len


def decoding(config: RunConfig) -> Decoding | None:
    """A language model of your own has no cache the kit knows: each new token recomputes
    the whole prefix. A classifier generates nothing."""
    return Decoding(cache=None) if is_lm(config) else None


def facts(config: RunConfig) -> dict[str, Any]:
    del config
    return {}

"""What the model kinds' contracts share, below all of them (the package's __init__ holds
the contract and imports every kind): the data's fixed sizes, the form of a model of your
own's name, and the key every kind's data has."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jaxkit.keys import REQUIRED, Key, number

# (config key, size, mesh axes) of each parameter dimension the partition rules shard.
Sizes = list[tuple[str, int, tuple[str, ...]]]
# Each param as (the last key of its path, its size): "kernel", "bias", "embedding", ...
Params = Sequence[tuple[str, int]]

BYTES = 256  # the text source's token ids are bytes
DIGITS_FEATURES, DIGITS_CLASSES = 64, 10  # scikit-learn's 8×8 digits, labels 0..9

CUSTOM_KIND = "package.module:factory"  # model.kind of a model of your own


def is_custom(kind: object) -> bool:
    """Whether `kind` names a model of your own, "package.module:factory"."""
    return isinstance(kind, str) and ":" in kind


def rows_of_features(source: object, seq_len: object) -> bool:
    """Whether the data's rows are features (digits, or synthetic without data.seq_len),
    not tokens: what makes a model of your own a classifier rather than a language model."""
    return source == "digits" or (source == "synthetic" and seq_len is None)


EVAL_FRACTION = Key(
    "data.eval_fraction",
    REQUIRED,
    number(0, 1, open_low=True, open_high=True),
    "held-out share: the corpus tail for text, a fixed shuffle otherwise",
)


@dataclasses.dataclass(frozen=True)
class Decoding:
    """How a language model generates (jaxkit/generate/sampling.py): by its own key/value cache
    (`cache`: its layers, key/value heads and head width, which the cache is shaped by),
    or, where it has none (a model of your own), by recomputing the whole prefix for each
    new token; and the most positions it takes, prompt included (None: no bound of its own)."""

    cache: tuple[int, int, int] | None
    max_positions: int | None = None

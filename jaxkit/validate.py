"""A config checked whole before any work: every value, and a model of your own's factory.

It sits above `config` and the model kinds' contracts (jaxkit/models/): a model of your
own's check needs the config's rules and errors, so the config cannot ask for it itself.
"""

from __future__ import annotations

import ml_collections

from jaxkit.config import check_values
from jaxkit.models import contract


def validate(config: ml_collections.ConfigDict) -> None:
    """Checks every value of `config` (base keys and its model kind's); a ConfigError names
    the first bad key and its constraint. A model of your own is imported and built from
    shapes alone, its logits checked against the data."""
    check_values(config)
    # Flax loads only for a model of your own (its contract builds it from shapes), as the
    # CLI checks every config before JAX starts.
    contract(config).check_model(config)

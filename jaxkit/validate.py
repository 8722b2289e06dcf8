"""A config checked whole before any work: every value, and a model of your own's factory.

It sits above `config` and `custom_model`: the model's check needs the config's rules and
errors, so the config cannot ask for the model's check itself.
"""

from __future__ import annotations

import ml_collections

from jaxkit.config import check_values, is_custom


def validate(config: ml_collections.ConfigDict) -> None:
    """Checks every value of `config` (base keys and its model kind's); a ConfigError names
    the first bad key and its constraint. A model of your own is imported and built from
    shapes alone, its logits checked against the data."""
    check_values(config)
    if is_custom(str(config.model.kind)):
        # Here, not at the top: flax loads only for a model of your own, as the CLI checks
        # every config before JAX starts.
        from jaxkit import custom_model

        custom_model.check(config)

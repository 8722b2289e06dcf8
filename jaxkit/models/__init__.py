"""Each model kind is one contract, and code elsewhere asks the contract, never the kind's
name. A kind's module (transformer.py, llama.py, mlp.py, custom.py for a model of your
own) declares its config keys and the checks between them, says how to build it, which of
its sizes the partition rules (mesh.RULES) shard, what else a mesh must divide, its
analytic FLOPs, which params are matmuls, whether it is a language model and whether it
reads the LM options, and the facts a run records of it.

The contracts load no JAX: the config reads them before JAX starts. The networks
(`*_net.py`) and the loss (loss.py) load with flax, on first use of their names here.
Beside them: the layers the LMs share, attention kernels, the key/value cache.

May import: batch, keys, mesh, workdir.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from jaxkit.keys import ConfigError, Key
from jaxkit.models import custom, llama, mlp, transformer
from jaxkit.models.common import CUSTOM_KIND, Decoding, Params, Sizes, is_custom
from jaxkit.sections import RunConfig

if TYPE_CHECKING:
    from flax import nnx

    from jaxkit.models.loss import (
        cross_entropy,
        eval_sums,
        logits_of,
        model_loss,
        token_cross_entropy,
        weighted_loss,
    )
    from jaxkit.models.mlp_net import MLPClassifier
    from jaxkit.models.transformer_net import TransformerLM


class Contract(Protocol):
    """What a model kind provides; each kind's module is one (mypy checks KINDS)."""

    # The LM options apply: model.param_dtype, compute_dtype, remat, scan_layers, and the
    # token files' data.rows, document_mask (segment ids) and token_dtype.
    READS_LM_OPTIONS: bool

    def keys(self, flat: Mapping[str, object]) -> tuple[Key, ...]:
        """Its config keys: required (default REQUIRED) and optional, checked where present;
        `flat` (the config's dotted keys) matters to a model of your own only."""
        ...

    def check_values(self, flat: Mapping[str, Any]) -> None:
        """Constraints between its keys, once each holds a value of the right kind."""
        ...

    def is_lm(self, config: RunConfig) -> bool:
        """(B, L) tokens in, (B, L, V) logits out; else (B, I) features to (B, C) logits."""
        ...

    def build(self, config: RunConfig, rngs: nnx.Rngs) -> nnx.Module: ...

    def sharded_sizes(self, config: RunConfig) -> Sizes:
        """(config key, size, mesh axes) for every parameter dimension mesh.RULES shard."""
        ...

    def check_shards(self, config: RunConfig, mesh_shape: dict[str, int]) -> None:
        """What else the mesh must divide (attention heads; a model of your own's params)."""
        ...

    def check_model(self, config: RunConfig) -> None:
        """Checks beyond the config's values, before any work (a model of your own is
        built from shapes)."""
        ...

    def matmul_params(self, config: RunConfig, params: Params) -> int:
        """How many of the params take part in a matmul (the basis of model FLOPs)."""
        ...

    def flops_per_example(self, config: RunConfig, matmul_params: int) -> float:
        """Training FLOPs (forward and backward) of one example (jaxkit/plan/flops.py)."""
        ...

    def decoding(self, config: RunConfig) -> Decoding | None:
        """How it generates text (jaxkit/generate/sampling.py); None: it cannot (a classifier)."""
        ...

    def facts(self, config: RunConfig) -> dict[str, Any]:
        """What a run's records say of the model, beside its param count."""
        ...


# The built-in kinds by model.kind; a model of your own is any "package.module:factory".
KINDS: dict[str, Contract] = {"transformer": transformer, "llama": llama, "mlp": mlp}
CUSTOM: Contract = custom


def kind_problem(value: object) -> str | None:
    """What is wrong with `value` as a model.kind (config.MODEL_KIND's rule), or None."""
    if is_custom(value) or (isinstance(value, str) and value in KINDS):
        return None
    return f"must be one of {', '.join(KINDS)}, or {CUSTOM_KIND} for a model of your own"


def kind_of(kind: str) -> Contract:
    """The contract of `model.kind=kind`."""
    if is_custom(kind):
        return CUSTOM
    if kind not in KINDS:
        raise ConfigError(f"model.kind={kind!r} is not one of {', '.join(KINDS)}, {CUSTOM_KIND}")
    return KINDS[kind]


def contract(config: RunConfig) -> Contract:
    """The contract of the config's model kind."""
    return kind_of(str(config.model.kind))


def is_lm(config: RunConfig) -> bool:
    """Whether `config` trains a language model ((B, L) tokens in, (B, L, V) logits out)."""
    return contract(config).is_lm(config)


def build_model(config: RunConfig, rngs: nnx.Rngs) -> nnx.Module:
    return contract(config).build(config, rngs)


def sharded_sizes(config: RunConfig) -> Sizes:
    """(config key, size, mesh axes) for every parameter dimension mesh.RULES shard.
    tests/test_validate.py checks this list against the partition specs of the models."""
    return contract(config).sharded_sizes(config)


def check_mesh_divides(config: RunConfig, mesh_shape: dict[str, int]) -> None:
    """Fails, naming the key, when a sharded dimension does not divide over its mesh axis.

    JAX refuses uneven shards (IndivisibleError when the state is laid out, after the data
    is loaded and the step is traced), so this runs as soon as the mesh shape is known.
    """
    kind = contract(config)
    for key, size, axes in kind.sharded_sizes(config):
        for axis in axes:
            if size % mesh_shape[axis]:
                raise ConfigError(
                    f"{key}={size} is not divisible by mesh.{axis}={mesh_shape[axis]}: the "
                    f"partition rules (jaxkit/mesh.py RULES) split it over the {axis} axis, "
                    f"and shards must be even. Make {key} a multiple of {mesh_shape[axis]}, "
                    f"or change mesh.{axis}"
                )
    kind.check_shards(config, mesh_shape)


# The networks and the loss, by the names code imported from jaxkit.models before it was a
# package; they load flax, so only when asked for.
_LAZY = {
    "TransformerLM": "transformer_net",
    "MLPClassifier": "mlp_net",
    "token_cross_entropy": "loss",
    "cross_entropy": "loss",
    "logits_of": "loss",
    "weighted_loss": "loss",
    "model_loss": "loss",
    "eval_sums": "loss",
}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        return getattr(importlib.import_module(f"jaxkit.models.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CUSTOM_KIND",
    "KINDS",
    "Contract",
    "Decoding",
    "MLPClassifier",
    "TransformerLM",
    "build_model",
    "check_mesh_divides",
    "contract",
    "cross_entropy",
    "eval_sums",
    "is_custom",
    "is_lm",
    "kind_of",
    "kind_problem",
    "logits_of",
    "model_loss",
    "sharded_sizes",
    "token_cross_entropy",
    "weighted_loss",
]

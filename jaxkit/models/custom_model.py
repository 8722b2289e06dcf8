"""A model of your own: `model.kind="package.module:factory"`.

`factory(config, rngs)` returns an `nnx.Module` for the data the config names:
- a language model over the transformer's data (`data.source` text, tokens or synthetic
  with `data.seq_len`): `inputs` (B, L) int32 tokens to logits (B, L, V), V = model.vocab_size;
- a classifier over the MLP's (`data.source` digits, or synthetic without `data.seq_len`):
  `inputs` (B, I) float32 features to logits (B, C), I = data.num_features and C the data's
  classes (digits' 10; synthetic rows are labelled in model.num_classes).
Params annotated with `nnx.with_partitioning` are laid out as annotated (axes of
mesh.AXES); the others are replicated on every device, with one warning that names them.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import math
import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from jaxkit.keys import ConfigError
from jaxkit.models.common import BYTES, CUSTOM_KIND, DIGITS_CLASSES, rows_of_features

_WARNED: set[str] = set()  # warnings given in this process


def load_factory(kind: str) -> Callable[..., object]:
    """The factory `kind` names ("package.module:factory"), imported from sys.path."""
    module_name, _, attr = kind.partition(":")
    if not (all(p.isidentifier() for p in module_name.split(".")) and attr.isidentifier()):
        raise ConfigError(
            f"model.kind={kind!r} is not {CUSTOM_KIND}: a module's dotted name, a colon, "
            "and the name of a function in it (e.g. mymodel:make for make() in ./mymodel.py)"
        )
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name is not None and (module_name + ".").startswith(err.name + "."):
            raise ConfigError(
                f"model.kind={kind!r}: no module named {err.name!r} on the Python path; run "
                "from the directory that holds it, or add that directory to PYTHONPATH"
            ) from None
        # The module exists but imports one that does not: its own problem, said as such.
        raise ConfigError(f"model.kind={kind!r}: importing {module_name} failed: {err}") from None
    if not hasattr(module, attr):
        names = [n for n in dir(module) if not n.startswith("_")]
        close = difflib.get_close_matches(attr, names, n=1)
        raise ConfigError(
            f"model.kind={kind!r}: module {module_name} ({module.__file__}) has no attribute "
            f"{attr!r}" + (f" (did you mean {close[0]!r}?)" if close else "")
        )
    factory = getattr(module, attr)
    if not callable(factory):
        raise ConfigError(
            f"model.kind={kind!r}: {module_name}.{attr} is not callable (of type "
            f"{type(factory).__name__}); it must be a function called as factory(config, rngs)"
        )
    return factory


def build(config: ml_collections.ConfigDict, rngs: nnx.Rngs) -> nnx.Module:
    """The module the configured factory returns for `config` and `rngs`."""
    kind = config.model.kind
    factory = load_factory(kind)
    try:
        inspect.signature(factory).bind(config, rngs)
    except TypeError as err:
        raise ConfigError(
            f"model.kind={kind!r}: the factory cannot be called as factory(config, rngs): {err}"
        ) from None
    except ValueError:  # no signature to read (some builtins): the call will tell
        pass
    model = factory(config, rngs)
    if not isinstance(model, nnx.Module):
        raise ConfigError(
            f"model.kind={kind!r}: factory(config, rngs) returned a "
            f"{type(model).__module__}.{type(model).__qualname__}, not an nnx.Module"
        )
    return model


def _path(keys: tuple) -> str:
    return ".".join(str(k) for k in keys)


def unannotated_params(model: nnx.Module) -> list[str]:
    """Paths of the params without partitioning metadata, which nnx lays out as P()."""
    return [
        _path(keys)
        for keys, var in nnx.to_flat_state(nnx.state(model, nnx.Param))
        if not var.get_metadata().get("out_sharding")
    ]


def _abstract(config: ml_collections.ConfigDict) -> nnx.Module:
    """The model with shapes for arrays: nothing allocated, no backend started."""
    with nnx.use_eager_sharding(False):
        return nnx.eval_shape(lambda: build(config, nnx.Rngs(0)))


def data_classes(config: ml_collections.ConfigDict) -> int:
    """The classes a classifier's data are labelled in: digits' 10, synthetic's
    model.num_classes (its rows' labels are the argmax of that many teacher outputs)."""
    return DIGITS_CLASSES if config.data.source == "digits" else int(config.model.num_classes)


def _is_lm(config: ml_collections.ConfigDict) -> bool:
    """Token rows make it a language model, rows of features a classifier."""
    return not rows_of_features(config.data.get("source"), config.data.get("seq_len"))


def _contract(config: ml_collections.ConfigDict) -> tuple[jax.ShapeDtypeStruct, tuple, str, str]:
    """(one row of inputs, the logits' shape for it, what each means) for the config's data."""
    d = config.data
    if _is_lm(config):
        vocab = config.model.vocab_size
        return (
            jax.ShapeDtypeStruct((1, d.seq_len), jnp.int32),
            (1, d.seq_len, vocab),
            "(rows, data.seq_len)",
            "(rows, data.seq_len, model.vocab_size)",
        )
    classes = data_classes(config)
    of = (
        "model.num_classes, the classes synthetic rows are labelled in"
        if d.source == "synthetic"
        else f"the {classes} classes of data.source='digits'"
    )
    return (
        jax.ShapeDtypeStruct((1, d.num_features), jnp.float32),
        (1, classes),
        "(rows, data.num_features)",
        f"(rows, {of})",
    )


def check(config: ml_collections.ConfigDict) -> None:
    """Imports the factory, builds the model from shapes alone and checks its logits; warns
    once of the params it leaves replicated."""
    kind, d = config.model.kind, config.data
    if _is_lm(config) and d.source == "text" and config.model.vocab_size < BYTES:
        raise ConfigError(
            f"model.vocab_size={config.model.vocab_size}: data.source='text' feeds bytes, so "
            f"it must be at least {BYTES}"
        )
    model = _abstract(config)
    # The train state is every variable of the module, and the optimizer updates all of it.
    other = nnx.to_flat_state(nnx.state(model, nnx.Not(nnx.Param)))
    if other:
        raise ConfigError(
            f"model.kind={kind!r}: the model holds variables other than nnx.Param ("
            + ", ".join(f"{_path(keys)}: {type(var).__name__}" for keys, var in other)
            + "), which the optimizer would update as params: keep only params (no "
            "stored rngs, as nnx.Dropout keeps, and no batch statistics)"
        )
    graphdef, state = nnx.split(model)
    inputs, want, inputs_are, logits_are = _contract(config)
    logits = jax.eval_shape(lambda s, x: nnx.merge(graphdef, s)(x), state, inputs)
    got = getattr(logits, "shape", None)
    if got != want:
        raise ConfigError(
            f"model.kind={kind!r}: for inputs of shape {inputs.shape} {inputs_are} the model "
            f"returns {f'logits of shape {got}' if got else type(logits).__name__}; "
            f"expected {want} {logits_are}"
        )
    replicated = unannotated_params(model)
    message = (
        f"model.kind={kind!r}: replicated on every device for want of a partitioning "
        "annotation (nnx.with_partitioning): " + ", ".join(replicated)
    )
    # Once per process, though the CLI and the loop both validate: the warnings module's
    # own once-per-place registry is reset whenever a library changes the filters.
    if replicated and message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, stacklevel=2)


def check_shards(config: ml_collections.ConfigDict, mesh_shape: dict[str, int]) -> None:
    """Fails, naming the param, where an annotation names an axis the mesh lacks or splits a
    dimension unevenly (JAX refuses uneven shards, but only once the step is traced)."""
    kind = config.model.kind
    params = nnx.state(_abstract(config), nnx.Param)
    specs = nnx.to_flat_state(nnx.get_partition_spec(params))
    for (keys, var), (_, spec) in zip(nnx.to_flat_state(params), specs, strict=True):
        for dim, (size, names) in enumerate(zip(var.shape, spec.get_value(), strict=False)):
            axes = () if names is None else (names,) if isinstance(names, str) else tuple(names)
            unknown = [axis for axis in axes if axis not in mesh_shape]
            if unknown:
                raise ConfigError(
                    f"model.kind={kind!r}: param {_path(keys)} is annotated with mesh axis "
                    f"{unknown[0]!r}, not one of {', '.join(mesh_shape)}"
                )
            if size % math.prod(mesh_shape[axis] for axis in axes):
                over = " × ".join(f"mesh.{axis}={mesh_shape[axis]}" for axis in axes)
                raise ConfigError(
                    f"model.kind={kind!r}: param {_path(keys)} of shape {tuple(var.shape)} "
                    f"splits dimension {dim} ({size}) over {over}, which does not divide "
                    "it: shards must be even"
                )

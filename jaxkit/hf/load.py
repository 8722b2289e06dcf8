"""model.init_from="hf:DIR": a local Hugging Face Llama directory (config.json and
*.safetensors, sharded with model.safetensors.index.json or not) as a run's first params.

Two moments. Before validation (before JAX starts), `apply_init_from` reads config.json:
its architecture replaces the config file's model keys, a command-line override that
contradicts it is refused, and the weight files' headers are checked (every tensor there,
with its shape; nothing the model would not read; never a pickle). At a resume the
checkpoint's saved config gives the architecture instead, and the directory is not read
at all (`saved_config`). At a fresh start,
`train.resume.initial_state` reads the weights: each process reads, from memory-mapped safetensors,
only the slices its own devices hold (`jax.make_array_from_callback` with the train
state's shardings), so beyond the devices' buffers host memory stays near one tensor's
slice. The optimizer state starts fresh, and the run records what an export needs of the
directory (`source_record`) in its checkpoints. Nothing is ever downloaded.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import json
import os
import pathlib
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import ml_collections
import numpy as np

from jaxkit.config import ADDED_DEFAULTS, ConfigError, model_section, parse_value
from jaxkit.hf import names
from jaxkit.models import llama
from jaxkit.sections import LlamaModel, RunConfig

if TYPE_CHECKING:
    import jax


PREFIX = "hf:"
INDEX_NAME = "model.safetensors.index.json"
# Files of pickled weights (torch.save): loading one runs whatever code it holds.
PICKLES = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")
FLOAT_DTYPES = ("F32", "BF16", "F16")
_DTYPE_NAMES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
# A checkpoint's directory under WORKDIR/checkpoints, as checkpoint.py numbers them.
_CHECKPOINT_NAME = re.compile(r"(step_)?[0-9]+")
_COMPARE_ROWS = 1024  # a tied head is compared with the table this many rows at a time


def source_dir(config: ml_collections.ConfigDict | RunConfig) -> pathlib.Path | None:
    """The directory model.init_from names, or None where it is null (or the kind has none)."""
    if isinstance(config, RunConfig):
        value = getattr(config.model, "init_from", None)  # a Llama's key
    else:
        model = config.get("model")
        value = model.get("init_from") if model is not None else None
    if value is None:
        return None
    if not isinstance(value, str) or not value.startswith(PREFIX) or not value[len(PREFIX) :]:
        raise ConfigError(
            f"model.init_from={value!r}: give hf:DIR, a local Hugging Face model directory "
            "(config.json and *.safetensors), or null"
        )
    return pathlib.Path(value[len(PREFIX) :]).expanduser()


def read_hf_config(directory: pathlib.Path) -> dict[str, Any]:
    """config.json of `directory`, once the directory is checked to hold safetensors."""
    where = f"model.init_from=hf:{directory}"
    if not directory.is_dir():
        raise ConfigError(f"{where}: no such directory (nothing is downloaded: fetch it first)")
    path = directory / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{where}: no config.json: not a Hugging Face model directory") from None
    except (OSError, ValueError) as err:
        raise ConfigError(f"{where}: config.json does not read as JSON ({err})") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{where}: config.json is not a JSON object")
    weight_files(directory)  # refuses a directory of pickles before anything else
    return cfg


def weight_files(directory: pathlib.Path) -> dict[str, pathlib.Path]:
    """Each tensor's safetensors file: from model.safetensors.index.json's weight_map where
    there is one, else from the headers of every *.safetensors in `directory`."""
    where = f"model.init_from=hf:{directory}"
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for pattern in PICKLES for p in directory.glob(pattern))
        if pickles:
            raise ConfigError(
                f"{where} holds pickled weights only ({', '.join(pickles[:3])}), which jaxkit "
                "never loads (unpickling runs code): save them as safetensors "
                "(transformers' save_pretrained(safe_serialization=True))"
            )
        raise ConfigError(f"{where} holds no *.safetensors weights")
    index = directory / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise ConfigError(f"{where}: {INDEX_NAME} has no readable weight_map ({err})") from None
        if not isinstance(weight_map, dict) or not all(
            isinstance(file, str) and file for file in weight_map.values()
        ):
            raise ConfigError(
                f"{where}: {INDEX_NAME}'s weight_map is not an object of tensor names to file names"
            )
        found = {name: directory / file for name, file in weight_map.items()}
        missing = sorted({p.name for p in found.values() if not p.is_file()})
        if missing:
            raise ConfigError(f"{where}: {INDEX_NAME} names missing files: {', '.join(missing)}")
        # The headers only: a tensor the index puts in a file without it would otherwise
        # surface as safetensors' own error at the first read.
        for path in sorted(set(found.values())):
            held = _tensor_names(path)
            absent = [name for name, p in found.items() if p == path and name not in held]
            if absent:
                raise ConfigError(
                    f"{where}: {INDEX_NAME} puts {absent[0]!r} in {path.name}, which does not "
                    "hold it: the index and the weight files disagree"
                )
        return found
    found = {}
    for path in files:
        for name in _tensor_names(path):
            if name in found:
                # Without an index no file is the one to read (transformers reads
                # model.safetensors alone): taking either could load the wrong weights.
                raise ConfigError(
                    f"{where}: tensor {name!r} is in both {found[name].name} and {path.name} "
                    f"and there is no {INDEX_NAME} to say which to read: remove the stray file"
                )
            found[name] = path
    return found


def _tensor_names(path: pathlib.Path) -> set[str]:
    """The tensors a safetensors file's header names."""
    with _safe_open(path) as f:
        return set(f.keys())


def _safe_open(path: pathlib.Path) -> Any:
    """safetensors' reader of `path` (memory-mapped), or a ConfigError naming the file where
    it is not one: empty, truncated (its header names bytes past the end) or not safetensors
    at all. Opening reads and checks the whole header, so this is where a damaged file
    shows, before any tensor is read."""
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(str(path), framework="numpy")
    except (SafetensorError, OSError) as err:
        raise ConfigError(
            f"model.init_from=hf:{path.parent}: {path.name} is not a readable safetensors file "
            f"({err}): it is damaged or was not fully downloaded; fetch it again"
        ) from None


def apply_init_from(
    config: ml_collections.ConfigDict,
    overrides: Sequence[str] = (),
    workdir: str | os.PathLike[str] | None = None,
) -> None:
    """Where model.init_from names a directory, its config.json's architecture replaces
    the config's model keys, in place. `overrides` (`key=value`, as given on the command
    line) may repeat a value of config.json, not contradict it. The weight files are checked
    against that architecture here, before any work.

    Where `workdir` holds a checkpoint, the run resumes from it and the checkpoint wins: the
    architecture is the one its record saved and the directory is not touched (it may have
    been moved or deleted since the run started). An override is then left as given, for
    the resume to hold it against the saved config as it holds any other."""
    directory = source_dir(config)
    if directory is None:
        return
    saved = saved_config(workdir) if workdir is not None else None
    if saved is not None:
        _take_saved_architecture(config, saved, overrides)
        return
    cfg = read_hf_config(directory)
    seq_len = config.get("data", {}).get("seq_len")
    keys = _model_keys(directory, cfg, seq_len)
    given = dict(item.split("=", 1) for item in overrides if "=" in item)
    differing = [
        f"{name}={text} (config.json: {said})"
        for name, text in given.items()
        if (said := _contradicted(name, parse_value(text), keys, cfg)) is not None
    ]
    if differing:
        raise ConfigError(
            f"model.init_from=hf:{directory} sets the architecture, and the command line "
            f"contradicts it: {', '.join(differing)}; leave those overrides out"
        )
    with config.unlocked() if config.is_locked else contextlib.nullcontext():
        for key, value in keys.items():
            section, leaf = key.split(".", 1)
            if leaf in config[section]:
                del config[section][leaf]  # its type may differ from the file's (an int theta)
            config[section][leaf] = value
    model = model_section(config)
    assert isinstance(model, LlamaModel)  # model.init_from is a Llama's key
    check_weights(directory, model)


def _model_keys(
    directory: pathlib.Path, cfg: Mapping[str, Any], seq_len: int | None
) -> dict[str, object]:
    """names.model_keys_from_hf_config, its refusals naming the directory."""
    try:
        return names.model_keys_from_hf_config(cfg, seq_len=seq_len)
    except ConfigError as err:
        raise ConfigError(f"model.init_from=hf:{directory}: {err}") from None


def _contradicted(
    name: str, value: object, keys: Mapping[str, object], cfg: Mapping[str, Any]
) -> str | None:
    """config.json's value where the override `name`=`value` contradicts it, else None.
    A field of a model key (model.rope_scaling.factor) overrides that key: it is compared
    with the same field of config.json's value. A head width is compared as the width the
    model gets, so model.head_dim=8 agrees with a config.json whose width is 8 by default."""
    key, _, field = name.rpartition(".") if name not in keys else (name, "", "")
    if key not in keys:
        return None
    expected = keys[key]
    if field:
        if isinstance(expected, Mapping) and field in expected:
            return None if value == expected[field] else repr(expected[field])
        return repr(expected)  # no such field there: config.json says otherwise
    if key == "model.rope_scaling" and isinstance(value, dict):
        value = llama.rope_scaling_fields(value)  # config.json's rope_type, said once
    if key == "model.head_dim" and expected is None:
        expected = cfg["hidden_size"] // cfg["num_attention_heads"]
        return None if value in (None, expected) else f"None, a width of {expected}"
    return None if value == expected else str(expected)


def saved_config(workdir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The config the newest readable checkpoint record in `workdir` saved, or None where
    it holds none. Read as the JSON file orbax's JsonCheckpointHandler wrote
    (checkpoints/step_N/meta/metadata; checkpoints/N/ in workdirs numbered by micro-step),
    without orbax: this runs before JAX starts, and orbax would start it. A directory orbax
    is still writing carries a suffix (step_N.orbax-checkpoint-tmp-...) and is skipped."""
    from etils import epath

    checkpoints = epath.Path(workdir) / "checkpoints"
    try:
        found = [p for p in checkpoints.iterdir() if _CHECKPOINT_NAME.fullmatch(p.name)]
    except OSError:  # no checkpoints/ (a new workdir), or not readable here
        return None
    # Optimizer-step numbering first, newest first; then the older micro-step numbering.
    found.sort(key=lambda p: (p.name.startswith("step_"), int(p.name.rsplit("_", 1)[-1])))
    for path in reversed(found):
        try:
            meta = json.loads((path / "meta" / "metadata").read_text())
        except (OSError, ValueError):
            continue
        if isinstance(meta, dict) and isinstance(meta.get("config"), dict):
            return dict(meta["config"])
    return None


def _take_saved_architecture(
    config: ml_collections.ConfigDict, saved: Mapping[str, Any], overrides: Sequence[str]
) -> None:
    """The model keys config.json would set, as the checkpoint's saved config has them,
    except those the command line gives (the resume compares those with the saved ones)."""
    model = saved.get("model") or {}
    if model.get("kind") != names.KIND:
        return  # another model: the resume names every key that differs
    given = {item.split("=", 1)[0] for item in overrides if "=" in item}
    with config.unlocked() if config.is_locked else contextlib.nullcontext():
        for key in names.MODEL_KEYS:
            section, leaf = key.split(".", 1)
            if key in given:
                continue
            # A run saved before a key existed ran with its default (its Key's `added`).
            value = model[leaf] if leaf in model else ADDED_DEFAULTS.get(key)
            if leaf in config[section]:
                del config[section][leaf]  # its type may differ from the saved one's
            config[section][leaf] = value


def source_record(directory: pathlib.Path, m: LlamaModel) -> dict[str, Any]:
    """What an export needs of the source, kept in the run's checkpoints so that the
    directory may go: its config.json, and the dtype the tensors of the model section `m`
    are stored in (`dtype`, most of them; `other_dtypes`, by name, any stored otherwise)."""
    with _opened(directory) as slice_of:  # the headers only: no tensor is read
        stored = {name: _DTYPE_NAMES[slice_of(name).get_dtype()] for name in _expected(m)}
    counts = collections.Counter(stored.values())
    dtype = counts.most_common(1)[0][0]
    return {
        "init_from": f"{PREFIX}{directory}",
        "config": read_hf_config(directory),
        "dtype": dtype,
        "other_dtypes": {name: d for name, d in stored.items() if d != dtype},
    }


def _expected(m: LlamaModel) -> dict[str, names.HfTensor]:
    return {t.name: t for t in names.hf_tensors(m)}


@contextlib.contextmanager
def _opened(
    directory: pathlib.Path, files: Mapping[str, pathlib.Path] | None = None
) -> Iterator[Callable[[str], Any]]:
    """A function from a tensor's name to its safetensors slice (memory-mapped: reading a
    slice reads its bytes only), each file opened once, when first asked for, and closed on
    leaving: the pages read stay mapped (and count in the process's resident memory) only
    while it is open."""
    files = weight_files(directory) if files is None else files
    with contextlib.ExitStack() as stack:
        handles: dict[pathlib.Path, Any] = {}

        def slice_of(name: str) -> Any:
            path = files[name]
            if path not in handles:
                handles[path] = stack.enter_context(_safe_open(path))
            return handles[path].get_slice(name)

        yield slice_of


def check_weights(directory: pathlib.Path, m: LlamaModel) -> None:
    """Every tensor the model section `m` needs is in the files, with its shape and a float
    dtype; none is there that it would not read (a tied head must be the table)."""
    where = f"model.init_from=hf:{directory}"
    files = weight_files(directory)
    expected = _expected(m)
    missing = [name for name in expected if name not in files]
    if missing:
        raise ConfigError(
            f"{where}: the weights lack {len(missing)} tensor(s) config.json implies, "
            f"e.g. {missing[0]!r}"
        )
    extra = [n for n in files if n not in expected and not n.endswith(names._IGNORED_SUFFIX)]
    with _opened(directory) as slice_of:
        for name, t in expected.items():
            s = slice_of(name)
            shape, dtype = tuple(s.get_shape()), s.get_dtype()
            if dtype not in FLOAT_DTYPES:
                raise ConfigError(
                    f"{where}: {name} is stored as {dtype}, a dtype jaxkit does not load: "
                    f"it reads {', '.join(FLOAT_DTYPES)} (float32, bfloat16, float16); save "
                    "the weights in one of those"
                )
            if shape != t.shape:
                raise ConfigError(
                    f"{where}: {name} has shape {shape}, config.json implies {t.shape}: the "
                    "weights and config.json disagree"
                )
        for name in extra:
            if name == "lm_head.weight" and m.tie_embeddings:
                _check_tied_head(slice_of, where)
                continue
            raise ConfigError(
                f"{where}: tensor {name!r} has no place in model.kind='llama' (no biases, no "
                "other layers): not a plain Llama checkpoint"
            )


def _check_tied_head(slice_of: Callable[[str], Any], where: str) -> None:
    """Some tied checkpoints store the head too: it must be the table, row for row."""
    head, table = slice_of("lm_head.weight"), slice_of("model.embed_tokens.weight")
    rows = table.get_shape()[0]
    same = head.get_shape() == table.get_shape()
    for start in range(0, rows, _COMPARE_ROWS):
        if not same:
            break
        span = slice(start, min(start + _COMPARE_ROWS, rows))
        same = np.array_equal(head[span], table[span])
    if not same:
        raise ConfigError(
            f"{where}: lm_head.weight differs from model.embed_tokens.weight but "
            "config.json ties them (tie_word_embeddings): not a consistent checkpoint"
        )


def _read(
    slice_of: Callable[[str], Any],
    tensors: Sequence[names.HfTensor],
    dtype: np.dtype,
    index: tuple[slice, ...],
) -> np.ndarray:
    """The part `index` of a param, read from its HF tensor (one per layer, stacked, for a
    scanned model's blocks), transposed to jaxkit's (in, out) where HF stores (out, in)."""
    if len(tensors) > 1:  # scanned: index[0] picks layers, each its own HF tensor
        rows = range(*index[0].indices(len(tensors)))
        return np.stack([_read(slice_of, [tensors[i]], dtype, index[1:]) for i in rows])
    t = tensors[0]
    part = slice_of(t.name)[index[::-1] if t.transpose else index]
    return np.ascontiguousarray((part.T if t.transpose else part).astype(dtype))


def load_params(
    directory: pathlib.Path,
    m: LlamaModel,
    shapes: Any,
    shardings: Any,
    read: Callable[..., np.ndarray] = _read,
) -> Any:
    """The params of the Llama model section `m` from `directory`, as jax.Arrays placed as
    `shardings` says (a tree like `shapes`, the abstract params), in their dtype. Each
    process reads only the slices its devices hold."""
    import jax

    loaded: dict[Any, Any] = {}
    files = weight_files(directory)
    for path, tensors in _by_path(m).items():
        shape, sharding = _at(shapes, path), _at(shardings, path)
        dtype = np.dtype(shape.dtype)
        # One param at a time, its files closed after it: what this process mapped and
        # copied of the weights is one param's slices at most, never the model.
        with _opened(directory, files) as slice_of:
            callback = functools.partial(read, slice_of, tensors, dtype)
            array = jax.make_array_from_callback(shape.shape, sharding, callback, dtype=dtype)
        node = loaded
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = array
    return loaded


def _by_path(m: LlamaModel) -> dict[tuple[str | int, ...], list[names.HfTensor]]:
    """The HF tensors each param of the model section `m` is made of: one, or a scanned
    param's layers, in order."""
    scanned = m.scan_layers
    by_path: dict[tuple[str | int, ...], list[names.HfTensor]] = {}
    for t in names.hf_tensors(m):
        path, _ = names.param_path(t, scanned)
        by_path.setdefault(path, []).append(t)
    return by_path


def check_finite(
    directory: pathlib.Path,
    m: LlamaModel,
    params: Any,
    where: str | None = None,
    outcome: str = "training on them gives non-finite losses",
) -> None:
    """Refuses params that hold a NaN or an infinity (a damaged file, or one saved from a
    diverged run), naming the first tensor that does: the model section `m`'s params, as
    loaded from `directory`, whatever their sharding and however many processes hold them.
    `where` names the directory as the user gave it (default model.init_from=hf:DIR), and
    `outcome` what the command would have made of such weights.

    One jitted pass over every param gives a flag per HF tensor (a scanned param's one per
    layer). The flags come out replicated: the compiled program all-reduces each param's
    flag over the devices that hold its slices, so every device, and so every process,
    holds the same flags, and every process raises, or goes on, alike; a process whose own
    slices are finite neither waits for the others nor trains on without them. Only a
    failure looks up which tensor a flag stands for."""
    import jax
    import jax.numpy as jnp

    by_path = _by_path(m)

    def finite(tree: Any) -> jax.Array:
        flags = []
        for path, tensors in by_path.items():
            x = _at(tree, path)
            # A scanned param keeps its leading axis, one flag per layer's HF tensor.
            axes = tuple(range(1 if len(tensors) > 1 else 0, x.ndim))
            flags.append(jnp.all(jnp.isfinite(x), axis=axes).reshape(-1))
        return jnp.concatenate(flags)

    mesh = jax.tree.leaves(params)[0].sharding.mesh
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    flags = np.asarray(jax.jit(finite, out_shardings=replicated)(params))
    if flags.all():
        return
    order = [(path, i, t) for path, tensors in by_path.items() for i, t in enumerate(tensors)]
    path, layer, t = order[int(np.argmin(flags))]
    at = "/".join(map(str, path)) + (f"[{layer}]" if len(by_path[path]) > 1 else "")
    where = where or f"model.init_from=hf:{directory}"
    raise ConfigError(
        f"{where}: {t.name} (param {at}) holds NaN or infinite values as loaded: the weights "
        f"are damaged (or were saved from a run that diverged); {outcome}"
    )


def _at(tree: Mapping[Any, Any], path: tuple[str | int, ...]) -> Any:
    node: Any = tree
    for part in path:
        node = node[part]
    return node


def _value(config: RunConfig, key: str) -> object:
    section, leaf = key.split(".", 1)
    return getattr(getattr(config, section), leaf, None)  # a dict-valued key: a plain dict


def check_architecture(config: RunConfig, directory: pathlib.Path) -> None:
    """The config's model keys are config.json's (apply_init_from made them so): a config
    built in a notebook without it is refused, not loaded into a model of another shape."""
    keys = _model_keys(directory, read_hf_config(directory), config.data.seq_len)
    differing = [
        f"{key}={_value(config, key)!r}" for key, v in keys.items() if _value(config, key) != v
    ]
    if differing:
        raise ConfigError(
            f"model.init_from=hf:{directory}: the config's {', '.join(differing)} differ from "
            "its config.json: call jaxkit.hf.load.apply_init_from(config) first"
        )

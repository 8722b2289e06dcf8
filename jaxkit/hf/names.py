"""Hugging Face Llama checkpoints in jaxkit's names: which HF tensor each param of
model.kind="llama" is, and config.json as model keys (and back).

The map is renames and transposes only. HF's `Linear` weights are (out, in), jaxkit's
kernels (in, out); HF's rotary layout is the half-split ("rotate half") one jaxkit's
`rotary` uses, and query head h uses key/value head h // (heads / kv heads) in both, so
the q and k projections load as they are (Meta's original `consolidated.pth` files would
need HF's permutation first; HF's own checkpoints already have it).

Params are named as `nnx.to_pure_dict(nnx.state(model))` names them: unrolled blocks sit at
("blocks", i, ...) with an int i; with model.scan_layers the blocks are one stacked tree at
("blocks", ...) whose arrays carry a leading layer axis (`param_path`).

Pure Python and numpy: no JAX at import.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

import numpy as np

from jaxkit.keys import POSITIVE, REQUIRED, ConfigError, Rule, boolean, number
from jaxkit.models import llama
from jaxkit.sections import LlamaModel

# Tied or not, HF's torch code computes this buffer; old checkpoints saved it. Not a weight.
_IGNORED_SUFFIX = ".rotary_emb.inv_freq"
# (jaxkit's block module, param, HF's name after "model.layers.N.", transposed)
_BLOCK: tuple[tuple[str, str, str, bool], ...] = (
    ("attn_norm", "scale", "input_layernorm.weight", False),
    ("query", "kernel", "self_attn.q_proj.weight", True),
    ("key", "kernel", "self_attn.k_proj.weight", True),
    ("value", "kernel", "self_attn.v_proj.weight", True),
    ("attn_out", "kernel", "self_attn.o_proj.weight", True),
    ("mlp_norm", "scale", "post_attention_layernorm.weight", False),
    ("gate", "kernel", "mlp.gate_proj.weight", True),
    ("up", "kernel", "mlp.up_proj.weight", True),
    ("down", "kernel", "mlp.down_proj.weight", True),
)
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM"}


@dataclasses.dataclass(frozen=True)
class HfTensor:
    """One HF tensor and the jaxkit param it is.

    path: the param's path as the unrolled model names it, e.g. ("blocks", 0, "query",
        "kernel") (block indices are ints); `param_path` gives the scanned model's.
    name: HF's name, e.g. "model.layers.0.self_attn.q_proj.weight".
    transpose: HF stores it transposed (a kernel: HF (out, in), jaxkit (in, out)).
    layer: the block it belongs to, None outside the blocks.
    shape: its shape as HF stores it.
    """

    path: tuple[str | int, ...]
    name: str
    transpose: bool
    layer: int | None
    shape: tuple[int, ...]

    @property
    def param_shape(self) -> tuple[int, ...]:
        """Its shape as jaxkit's (unrolled) param."""
        return self.shape[::-1] if self.transpose else self.shape


def param_path(t: HfTensor, scanned: bool) -> tuple[tuple[str | int, ...], int | None]:
    """(path, layer index): where `t` lives in a model's params. Unrolled, the path is
    `t.path` and the index None; scanned (model.scan_layers), the block index leaves the
    path, ("blocks", "query", "kernel"), and `t` is row `index` of that array's leading
    layer axis."""
    if not scanned or t.layer is None:
        return t.path, None
    return tuple(part for i, part in enumerate(t.path) if i != 1), t.layer


def hf_tensors(m: LlamaModel) -> list[HfTensor]:
    """Every HF tensor of the Llama model section `m`, in the order HF lists them; a tied
    model has no lm_head.weight (its head is the embedding table)."""
    d, heads, kv_heads, f, v = m.d_model, m.num_heads, m.num_kv_heads, m.mlp_dim, m.vocab_size
    k = llama.head_dim(m)
    # HF's (out, in) for the kernels, (d_model,) for the norm scales.
    hf_shapes = {
        "attn_norm": (d,),
        "query": (heads * k, d),
        "key": (kv_heads * k, d),
        "value": (kv_heads * k, d),
        "attn_out": (d, heads * k),
        "mlp_norm": (d,),
        "gate": (f, d),
        "up": (f, d),
        "down": (d, f),
    }
    out = [HfTensor(("embed", "embedding"), "model.embed_tokens.weight", False, None, (v, d))]
    for i in range(m.num_layers):
        out += [
            HfTensor(
                ("blocks", i, module, param),
                f"model.layers.{i}.{name}",
                transpose,
                i,
                hf_shapes[module],
            )
            for module, param, name, transpose in _BLOCK
        ]
    out.append(HfTensor(("final_norm", "scale"), "model.norm.weight", False, None, (d,)))
    if not m.tie_embeddings:
        out.append(HfTensor(("head", "kernel"), "lm_head.weight", True, None, (v, d)))
    return out


def _scanned(m: LlamaModel) -> bool:
    return m.scan_layers


def _get(tree: Mapping[Any, Any], path: tuple[str | int, ...]) -> Any:
    node: Any = tree
    for part in path:
        node = node[part]
    return node


def to_hf(params: Mapping[Any, Any], m: LlamaModel) -> dict[str, np.ndarray]:
    """The whole model's params (a pure dict, as `nnx.to_pure_dict` gives them, scanned or
    not as model.scan_layers says) as HF tensors, by name, in the params' dtype."""
    scanned = _scanned(m)
    out = {}
    for t in hf_tensors(m):
        path, layer = param_path(t, scanned)
        value = np.asarray(_get(params, path))
        if layer is not None:
            value = value[layer]
        out[t.name] = np.ascontiguousarray(value.T if t.transpose else value)
    return out


def from_hf(tensors: Mapping[str, np.ndarray], m: LlamaModel) -> dict[Any, Any]:
    """HF tensors (by name) as the params of the Llama model section `m`: a pure dict for
    `nnx.replace_by_pure_dict`, blocks stacked where model.scan_layers says. Every tensor the
    model needs must be there with its shape; a tensor it would not read is an error."""
    expected = hf_tensors(m)
    names = {t.name for t in expected}
    for name in tensors:
        if name in names or name.endswith(_IGNORED_SUFFIX):
            continue
        if name == "lm_head.weight" and m.tie_embeddings:
            # Some tied checkpoints store the head anyway: it must be the table.
            table = tensors.get("model.embed_tokens.weight")
            if table is not None and np.array_equal(tensors[name], table):
                continue
            raise ConfigError(
                "lm_head.weight differs from model.embed_tokens.weight but "
                "model.tie_embeddings=true: set model.tie_embeddings=false"
            )
        raise ConfigError(
            f"HF tensor {name!r} has no place in model.kind='llama' (no biases, no other "
            "layers): the checkpoint is not a plain Llama"
        )
    params: dict[Any, Any] = {}
    for t in expected:
        if t.name not in tensors:
            raise ConfigError(f"HF tensor {t.name!r} is missing: the checkpoint is incomplete")
        value = np.asarray(tensors[t.name])
        if tuple(value.shape) != t.shape:
            raise ConfigError(
                f"HF tensor {t.name!r} has shape {tuple(value.shape)}, the model's config "
                f"says {t.shape}: config.json and the weights disagree"
            )
        node = params
        for part in t.path[:-1]:
            node = node.setdefault(part, {})
        node[t.path[-1]] = value.T if t.transpose else value
    if _scanned(m):
        blocks = [params["blocks"][i] for i in range(m.num_layers)]
        params["blocks"] = {
            module: {
                param: np.stack([block[module][param] for block in blocks])
                for param in blocks[0][module]
            }
            for module in blocks[0]
        }
    return params


def _rope_scaling(value: object) -> dict[str, float | int] | None:
    """HF's rope_scaling as model.rope_scaling: null for none (or "default"), the llama3
    fields, else an error."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ConfigError(f"config.json rope_scaling={value!r} is not a dict: not a Llama config")
    kind = value.get("rope_type", value.get("type"))
    if kind == "default":
        return None
    if kind != "llama3":
        raise ConfigError(
            f"config.json rope_scaling type {kind!r} is not supported: jaxkit's Llama scales "
            "rotary frequencies as Llama 3.1 does (rope_type 'llama3') or not at all"
        )
    missing = [field for field in llama.ROPE_SCALING_FIELDS if field not in value]
    if missing:
        raise ConfigError(f"config.json rope_scaling (llama3) lacks {', '.join(missing)}")
    fields = {field: value[field] for field in llama.ROPE_SCALING_FIELDS}
    problem = llama.ROPE_SCALING(fields)
    if problem:
        raise ConfigError(f"config.json rope_scaling={_shown(dict(value))}: {problem}")
    return fields


# The one model kind whose params these names map: the Llama family (its contract is
# jaxkit/models/llama.py); other kinds have no Hugging Face layout here.
KIND = "llama"


# The model keys config.json sets (model_keys_from_hf_config), each with the fields of
# config.json that say it (hf_config_from_model writes them; head_dim's width follows from
# d_model and the heads where model.head_dim is null).
_HF_FIELDS: dict[str, tuple[str, ...]] = {
    "model.kind": ("architectures", "model_type"),
    "model.vocab_size": ("vocab_size",),
    "model.d_model": ("hidden_size", "head_dim"),
    "model.num_layers": ("num_hidden_layers",),
    "model.num_heads": ("num_attention_heads", "head_dim"),
    "model.num_kv_heads": ("num_key_value_heads",),
    "model.mlp_dim": ("intermediate_size",),
    "model.tie_embeddings": ("tie_word_embeddings",),
    "model.rope_theta": ("rope_theta",),
    "model.norm_eps": ("rms_norm_eps",),
    "model.rope_scaling": ("rope_scaling",),
    "model.head_dim": ("head_dim",),
}
MODEL_KEYS = tuple(_HF_FIELDS)


def model_keys_from_hf_config(
    cfg: Mapping[str, Any], seq_len: int | None = None
) -> dict[str, object]:
    """config.json of a Llama or Mistral checkpoint as jaxkit's model keys
    ({"model.kind": "llama", "model.vocab_size": ..., ...}). What the kit cannot run is a
    ConfigError naming the option: biases, an activation other than SiLU, a rope type other
    than llama3, a sliding window shorter than `seq_len` (data.seq_len; None refuses any
    window, as the window could not be checked)."""
    model_type = cfg.get("model_type")
    if model_type not in _MODEL_TYPES:
        raise ConfigError(
            f"config.json model_type={model_type!r} is not supported: jaxkit loads "
            f"{' and '.join(repr(t) for t in _MODEL_TYPES)} (model.kind='llama')"
        )
    for option in ("attention_bias", "mlp_bias"):
        if _field(cfg, option, boolean(), False):
            raise ConfigError(
                f"config.json {option}=true: jaxkit's Llama has no biases; this checkpoint "
                "cannot be loaded"
            )
    act = _field(cfg, "hidden_act", Rule("a string", _string, "str"), "silu")
    if act != "silu":
        raise ConfigError(
            f"config.json hidden_act={act!r}: jaxkit's Llama MLP is SwiGLU (hidden_act 'silu')"
        )
    window = _field(cfg, "sliding_window", POSITIVE, None, nullable=True)
    if (
        window is not None
        and _field(cfg, "use_sliding_window", boolean(), True)
        and (seq_len is None or window < seq_len)
    ):
        raise ConfigError(
            f"config.json sliding_window={window} is shorter than data.seq_len={seq_len}: "
            f"jaxkit's attention sees the whole row; use data.seq_len ≤ {window}"
        )
    d_model = _field(cfg, "hidden_size", POSITIVE)
    heads = _field(cfg, "num_attention_heads", POSITIVE)
    kv_heads = _field(cfg, "num_key_value_heads", POSITIVE, heads, nullable=True)
    width = _field(cfg, "head_dim", POSITIVE, None, nullable=True)
    # The relations that size the tensors (the model's other rules, an even head width among
    # them, are validation's): checked here, before the weights are held against them.
    if width is None and d_model % heads:
        raise ConfigError(
            f"config.json hidden_size={d_model} is not divisible by num_attention_heads="
            f"{heads} and there is no head_dim: each head's width is not known"
        )
    if heads % kv_heads:
        raise ConfigError(
            f"config.json num_attention_heads={heads} is not divisible by "
            f"num_key_value_heads={kv_heads}: each key/value head serves an equal group"
        )
    return {
        "model.kind": KIND,
        "model.vocab_size": _field(cfg, "vocab_size", POSITIVE),
        "model.d_model": d_model,
        "model.num_layers": _field(cfg, "num_hidden_layers", POSITIVE),
        "model.num_heads": heads,
        "model.num_kv_heads": kv_heads,
        "model.mlp_dim": _field(cfg, "intermediate_size", POSITIVE),
        "model.tie_embeddings": _field(cfg, "tie_word_embeddings", boolean(), False),
        "model.rope_theta": float(_field(cfg, "rope_theta", _POSITIVE_NUMBER, 10000.0)),
        "model.norm_eps": float(_field(cfg, "rms_norm_eps", _POSITIVE_NUMBER, llama.NORM_EPS)),
        "model.rope_scaling": _rope_scaling(cfg.get("rope_scaling")),
        # null where it is the default width, so the config says only what differs
        "model.head_dim": None if width in (None, d_model // heads) else width,
    }


_POSITIVE_NUMBER = number(0, open_low=True, open_high=False)


def _string(value: object) -> str | None:
    return None if isinstance(value, str) else "must be a string"


def _shown(value: object) -> str:
    """A value as config.json writes it (a string in double quotes, true, null)."""
    return json.dumps(value)


def _field(
    cfg: Mapping[str, Any],
    field: str,
    rule: Rule,
    default: Any = REQUIRED,
    *,
    nullable: bool = False,
) -> Any:
    """config.json's `field`, which `rule` holds (keys.py's rules, as the model key it
    becomes is held to them). Absent it takes `default`; without one it is refused as
    missing, not taken from transformers' defaults (7B's sizes), which no small
    checkpoint's weights would match. Null is a wrong value, refused as the rule words it,
    except where `nullable`: a field transformers reads null as its default (a width from
    the sizes, as many key/value heads as heads, no sliding window) takes `default` then."""
    value = cfg.get(field)
    if field not in cfg or (value is None and nullable):
        if default is REQUIRED:
            raise ConfigError(
                f"config.json gives no {field}: a Llama checkpoint's config.json must give "
                "it, and jaxkit does not guess a size"
            )
        return default
    problem = rule(value)
    if problem:
        raise ConfigError(f"config.json {field}={_shown(value)}: {problem}")
    return value


def hf_config_from_model(
    m: LlamaModel,
    *,
    torch_dtype: str | None = None,
    max_position_embeddings: int = 2048,
) -> dict[str, Any]:
    """config.json of a LlamaForCausalLM for the Llama model section `m`; `torch_dtype` is
    the weights' ("float32", "bfloat16", "float16"; default model.param_dtype).
    `max_position_embeddings` only sizes HF's position tables (jaxkit's rotary takes any
    position)."""
    scaling = m.rope_scaling
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(m.vocab_size),
        "hidden_size": int(m.d_model),
        "intermediate_size": int(m.mlp_dim),
        "num_hidden_layers": int(m.num_layers),
        "num_attention_heads": int(m.num_heads),
        "num_key_value_heads": int(m.num_kv_heads),
        "head_dim": llama.head_dim(m),
        "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": float(m.norm_eps),
        "rope_theta": float(m.rope_theta),
        "rope_scaling": None if scaling is None else {"rope_type": "llama3", **dict(scaling)},
        "tie_word_embeddings": bool(m.tie_embeddings),
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": torch_dtype or m.param_dtype,
    }


def _model_value(m: LlamaModel, key: str) -> object:
    return getattr(m, key.split(".", 1)[1])  # a dict-valued key (rope_scaling): a plain dict


def carried_config(
    source: Mapping[str, Any],
    m: LlamaModel,
    *,
    seq_len: int | None,
    torch_dtype: str | None = None,
) -> dict[str, Any]:
    """config.json of the run's model where it started from `source` (that directory's
    config.json): every field of `source` carried through (max_position_embeddings, the
    bos/eos token ids, rope_scaling as written, ...), and only the fields of a model key
    whose value the run does not share with `source` taken from `m`. `torch_dtype`, where
    given, replaces the dtype `source` names (under "dtype", as transformers 4.56+ writes
    it, or "torch_dtype")."""
    ours = hf_config_from_model(m, torch_dtype=torch_dtype)
    theirs = model_keys_from_hf_config(source, seq_len)
    cfg = dict(source)
    for key, fields in _HF_FIELDS.items():
        if theirs[key] != _model_value(m, key):
            cfg |= {field: ours[field] for field in fields}
    if torch_dtype is not None:
        named = [field for field in ("torch_dtype", "dtype") if field in source]
        cfg |= dict.fromkeys(named or ["torch_dtype"], torch_dtype)
    return cfg

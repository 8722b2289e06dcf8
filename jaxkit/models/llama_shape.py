"""What the Llama contract (llama.py) and its network (llama_net.py) both read from the model
section: each head's width, RMSNorm's epsilon and the rotary frequency scaling (runs saved
before those keys read as their declared defaults: config.saved_config). Below both, so
neither imports the other."""

from __future__ import annotations

from jaxkit.sections import LlamaModel

# flax's RMSNorm epsilon: what every run before model.norm_eps ran with.
NORM_EPS = 1e-6
# model.rope_scaling's fields: Llama 3.1's frequency scaling ("rope_type": "llama3" in HF's).
ROPE_SCALING_FIELDS = (
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "original_max_position_embeddings",
)


def head_dim(m: LlamaModel) -> int:
    """Each attention head's width: model.head_dim, or d_model / num_heads where it is null
    (or the config predates it)."""
    return int(m.head_dim) if m.head_dim is not None else int(m.d_model // m.num_heads)


def norm_eps(m: LlamaModel) -> float:
    return float(m.norm_eps)


def rope_scaling(m: LlamaModel) -> dict[str, float] | None:
    """model.rope_scaling as a plain dict, or None (null, or a config that predates it)."""
    value = m.rope_scaling
    return None if value is None else {field: value[field] for field in ROPE_SCALING_FIELDS}

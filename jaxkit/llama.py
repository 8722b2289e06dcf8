"""The Llama network's name before jaxkit/models/ held each model kind: it lives in
jaxkit/models/llama_net.py (its contract in jaxkit/models/llama.py)."""

from jaxkit.models.llama_net import (
    INIT_STDDEV,
    LlamaBlock,
    LlamaLM,
    parameter_count,
    rotary,
)

__all__ = ["INIT_STDDEV", "LlamaBlock", "LlamaLM", "parameter_count", "rotary"]

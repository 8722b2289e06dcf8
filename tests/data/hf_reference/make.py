"""Writes the reference logits of Hugging Face's torch Llama for the cases its Flax Llama
cannot check (tests/test_hf_reference.py reads them): a rotary base of 5e5, Llama 3.1's
`rope_scaling` (rope_type llama3) and a head width other than hidden_size / heads.

Each case is a tiny random LlamaForCausalLM (seeded, float32, every weight drawn, norm
scales included, so a misplaced tensor shows) saved as a Hugging Face directory
(`config.json`, `model.safetensors`) under tests/data/hf_reference/CASE/, with
`reference.safetensors` beside it: `input_ids` (2 rows of fixed token ids), the torch
model's `logits` for them and its rotary `inv_freq`. The files are committed; torch is not
a test dependency (its wheels bring gigabytes of CUDA libraries).

Rerun (CPU torch, about a minute; the output is deterministic up to torch's own float32
arithmetic):

    python3 -m venv /tmp/torchvenv
    /tmp/torchvenv/bin/pip install torch==2.13.0 "transformers>=4.45,<5" safetensors numpy
    /tmp/torchvenv/bin/python tests/data/hf_reference/make.py
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
import torch
import transformers
from safetensors.numpy import save_file

HERE = pathlib.Path(__file__).resolve().parent
SHAPE = {  # small enough that all cases together stay a few hundred KB
    "vocab_size": 48,
    "hidden_size": 32,
    "intermediate_size": 40,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,  # grouped-query: two query heads per key/value head
    "max_position_embeddings": 512,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "attention_bias": False,
    "mlp_bias": False,
}
CASES = {
    # Llama 3's base period, untied head.
    "rope_theta_5e5": {"rope_theta": 500000.0, "tie_word_embeddings": False},
    # Llama 3.1's scaling. Head width 8 gives wavelengths 6.3, 167, 4.4e3 and 1.2e5 at theta
    # 5e5; an original context of 256 (low_freq_factor 1, high 4: bands at 64 and 256)
    # puts one in each band: kept, blended and slowed by `factor`.
    "rope_scaling_llama3": {
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
        },
    },
    # Heads 12 wide against hidden_size / heads = 8, tied embeddings (no lm_head saved).
    "head_dim_12": {"rope_theta": 10000.0, "tie_word_embeddings": True, "head_dim": 12},
}
ROWS, LENGTH = 2, 24


def make(name: str, overrides: dict, seed: int) -> None:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**SHAPE, **overrides)
    # The plain softmax(QK^T)V path, no fused kernel.
    model = transformers.LlamaForCausalLM._from_config(config, attn_implementation="eager")
    model = model.eval().to(torch.float32)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.08)
    out = HERE / name
    out.mkdir(exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    (out / "generation_config.json").unlink(missing_ok=True)
    rng = np.random.default_rng(seed)
    input_ids = rng.integers(0, SHAPE["vocab_size"], (ROWS, LENGTH))
    with torch.no_grad():
        logits = model(torch.from_numpy(input_ids)).logits
    save_file(
        {
            "input_ids": input_ids.astype(np.int32),
            "logits": logits.numpy().astype(np.float32),
            "inv_freq": model.model.rotary_emb.inv_freq.numpy().astype(np.float32),
        },
        str(out / "reference.safetensors"),
        metadata={"torch": torch.__version__, "transformers": transformers.__version__},
    )
    print(name, json.dumps({k: v for k, v in overrides.items()}), logits.abs().max().item())


def main() -> None:
    for seed, (name, overrides) in enumerate(CASES.items()):
        make(name, overrides, seed)


if __name__ == "__main__":
    main()

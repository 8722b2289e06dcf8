"""Llama-style decoder at 1.1B params (TinyLlama's shapes): grouped-query attention,
untied embeddings, bfloat16, full remat, scanned layers, sequences of 2,048.

Run:      jaxkit train lm_1b
Hardware: an accelerator slice: 8 chips of 16 GiB or more with mesh.fsdp=-1 (v5litepod-8,
          8 × H100); plan it first: `jaxkit plan lm_1b --target v5litepod-8 --all-splits`.
Time:     3.83 PFLOP per optimizer step (524,288 tokens; the model FLOPs of jaxkit/plan/flops.py
          for 256 rows: model_flops_per_step_all_devices of `jaxkit plan lm_1b --json`): an
          estimate, not a measurement: at 50% MFU (the goal) on 8 H100s (989 TFLOP/s bf16
          each, jaxkit/plan/peak.py), 1.0 s a step.
Expect:   as lm_125m: the loss on the synthetic counting rows falls from ln(32000) ≈ 10.4
          towards 0.
"""

import pathlib

import ml_collections

from jaxkit.config import load_config


def get_config() -> ml_collections.ConfigDict:
    c = load_config(str(pathlib.Path(__file__).with_name("lm_125m.py")))
    c.model.vocab_size = 32000  # Llama's tokenizer
    c.model.d_model = 2048
    c.model.num_layers = 22
    c.model.num_heads = 32  # head width 64
    c.model.num_kv_heads = 4  # 8 query heads share each key/value head
    c.model.mlp_dim = 5632
    c.model.tie_embeddings = False
    c.model.remat = "full"  # only each block's input is kept for the backward pass
    c.model.loss_chunk_tokens = 256  # the loss holds 256 positions' logits at a time (0: all)
    c.model.scan_layers = True
    c.data.seq_len = 2048
    c.mesh.data, c.mesh.fsdp = 1, -1  # params and optimizer state sharded over every chip
    c.optimizer.learning_rate = 4e-4
    c.batch.per_device_batch_size = 4
    return c

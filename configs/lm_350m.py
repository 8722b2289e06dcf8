"""Llama-style decoder at GPT-2-medium scale (360M params): bfloat16, remat, scanned layers.

Run:      jaxkit train lm_350m
Hardware: one GPU or TPU chip with 32 GiB or more (one H100, one v4 or v6e chip); plan it
          for yours first: `jaxkit plan lm_350m --all-splits --remat none,dots,full`.
Time:     about 0.6 PFLOP per optimizer step (262,144 tokens). An estimate, not a
          measurement: at 40% MFU on one H100 (the goal; lm_125m measured 18.7% before the
          attention kernels), 1.5 s a step, some 50 minutes for the 2,000 steps.
Expect:   as lm_125m: the loss on the synthetic counting rows falls from ≈ 10.8 towards 0.
"""

import pathlib

import ml_collections

from jaxkit.config import load_config


def get_config() -> ml_collections.ConfigDict:
    c = load_config(str(pathlib.Path(__file__).with_name("lm_125m.py")))
    c.model.d_model = 1024
    c.model.num_layers = 24
    c.model.num_heads = 16  # head width 64
    c.model.num_kv_heads = 16
    c.model.mlp_dim = 2816  # ≈ 8/3 × d_model, a multiple of 128
    c.model.remat = "dots"  # keeps matmul outputs, recomputes the elementwise work
    c.model.loss_chunk_tokens = 256  # the loss holds 256 positions' logits at a time (0: all)
    c.model.scan_layers = True  # 24 layers compile as one
    c.optimizer.learning_rate = 3e-4
    c.batch.per_device_batch_size = 8
    return c

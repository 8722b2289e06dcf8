"""Llama-style decoder at GPT-2-small scale (124M params), in bfloat16 on one accelerator.

Run:      jaxkit train lm_125m
Hardware: one GPU or TPU chip with 16 GiB or more (one H100, one v5e chip). On a CPU-only
          machine it runs, on 8 simulated devices, at minutes per step: plan it there
          (`jaxkit plan lm_125m --all-splits`), train it on an accelerator.
Time:     about 0.2 PFLOP per optimizer step (262,144 tokens). Measured on one H100 (bf16,
          `benchmarks/gpu_lm125m.py`, before the attention kernels and the chunked loss):
          216.6k tokens/s, 18.7% MFU, 1.2 s a step, some 40 minutes for the 2,000 steps.
          The goal with them is 40% MFU (an estimate until measured: half that time).
Expect:   the synthetic rows are counting sequences (start, stride 1–3, modulo the vocabulary):
          the loss falls from ln(50304) ≈ 10.8 nats/token towards 0 once the model has
          learned to add the stride (a few hundred steps).

Until the data issue's token files exist it trains on synthetic tokens; `data.source` then
switches it to a corpus.
"""

import ml_collections

from jaxkit.config import base_config


def get_config() -> ml_collections.ConfigDict:
    c = base_config()

    c.model = ml_collections.ConfigDict()
    c.model.kind = "llama"  # transformer (byte LM) | llama | mlp | package.module:factory
    c.model.vocab_size = 50304  # GPT-2's 50,257 rounded up to a multiple of 128
    c.model.d_model = 768  # divisible by num_heads, mesh.fsdp and mesh.tensor
    c.model.num_layers = 12
    c.model.num_heads = 12  # head width 64
    c.model.num_kv_heads = 12  # = num_heads: plain multi-head attention
    c.model.mlp_dim = 2048  # SwiGLU's 8/3 × d_model; divisible by mesh.tensor
    c.model.tie_embeddings = True  # the head is the embedding table, as in GPT-2
    c.model.rope_theta = 10000.0  # rotary base period
    c.model.norm_eps = 1e-6  # RMSNorm's epsilon (Llama 2 and 3 checkpoints use 1e-5)
    c.model.head_dim = ml_collections.config_dict.placeholder(int)  # null: d_model / num_heads
    # null, or Llama 3.1's {factor, low_freq_factor, high_freq_factor,
    # original_max_position_embeddings}; on the command line as JSON
    c.model.rope_scaling = None
    c.model.param_dtype = "float32"  # stored params (the optimizer state is float32 anyway)
    c.model.compute_dtype = "bfloat16"  # matmuls; norms, softmax and the loss stay float32
    c.model.remat = "none"  # none | dots | full: recompute activations to save memory
    c.model.attention = "auto"  # auto | xla | cudnn | splash: the kernel (auto: per backend)
    c.model.loss_chunk_tokens = 256  # the loss holds 256 positions' logits at a time (0: all)
    c.model.scan_layers = False  # true: one scanned block, compile time flat in depth

    c.data = ml_collections.ConfigDict()
    c.data.source = "synthetic"  # text | synthetic
    c.data.seq_len = 1024  # tokens per row
    c.data.num_examples = 8192  # synthetic rows, train and held-out together
    c.data.eval_fraction = 0.05  # held-out share of the rows

    c.batch.global_batch_size = 256  # 262,144 tokens per optimizer step
    c.batch.per_device_batch_size = 16  # grad_accum_steps is derived: 16 on one device

    c.optimizer.learning_rate = 6e-4  # GPT-2 small's
    c.optimizer.warmup_steps = 100
    c.optimizer.weight_decay = 0.1
    c.optimizer.b2 = 0.95
    c.optimizer.grad_clip_norm = 1.0

    c.train.steps = 2000
    c.train.log_every = 20
    c.train.eval_every = 500
    c.train.eval_examples = 64  # held-out rows per eval
    c.checkpoint.every = 500
    return c

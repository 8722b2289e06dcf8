"""Byte-level decoder-only Transformer on the Python standard library's own source.

Run:      jaxkit train lm_tiny   (on a CPU-only machine: 8 simulated devices by default)
Hardware: any; on 2 CPU cores the 300 optimizer steps take about 2 minutes.
Expect:   eval loss near 1.56 nats/byte against a unigram entropy near 3.19 nats/byte.

The corpus is the stdlib's .py files concatenated in sorted path order: every machine has
it without a download (its exact bytes follow the Python version).
"""

import ml_collections

from jaxkit.config import base_config


def get_config() -> ml_collections.ConfigDict:
    c = base_config()

    c.model = ml_collections.ConfigDict()
    c.model.kind = "transformer"  # transformer | llama | mlp | package.module:factory
    c.model.vocab_size = 256  # bytes
    c.model.d_model = 128  # residual width; divisible by num_heads, mesh.fsdp and mesh.tensor
    c.model.num_layers = 2
    c.model.num_heads = 4  # head width d_model / num_heads = 32
    c.model.mlp_dim = 512  # hidden width of each MLP block; divisible by mesh.tensor
    c.model.param_dtype = "float32"  # stored params: float32 | bfloat16
    c.model.compute_dtype = "float32"  # matmuls; CPUs gain nothing from bfloat16
    c.model.remat = "none"  # none | dots | full: recompute activations to save memory
    c.model.attention = "auto"  # auto | xla | cudnn | splash: the kernel (auto: per backend)
    c.model.loss_chunk_tokens = 256  # logits held per chunk of positions: rows of 128 take it whole
    c.model.scan_layers = False  # true: one scanned block, compile time flat in depth

    c.data = ml_collections.ConfigDict()
    c.data.source = "text"  # text | synthetic | tokens (files `jaxkit data prepare` writes)
    # text: a text file (null = the stdlib); tokens: a prepared directory, token files or a glob
    c.data.path = ml_collections.config_dict.placeholder(str)
    c.data.seq_len = 128  # bytes per row
    c.data.max_bytes = 4_000_000  # corpus bytes read, train and held-out together
    c.data.eval_fraction = 0.05  # held-out tail of the corpus
    c.data.num_examples = 4096  # rows of synthetic data (source=synthetic only)
    # source=tokens only:
    c.data.rows = "windows"  # windows: packed across documents | documents: one each, padded
    c.data.document_mask = False  # true: attention stays inside documents (windows)
    c.data.token_dtype = "uint16"  # foreign .bin files without meta.json: uint16 | uint32

    c.batch.global_batch_size = 64  # fixed: the same updates on any number of devices
    c.batch.per_device_batch_size = 4  # grad_accum_steps is derived: 2 on 8 devices

    c.optimizer.learning_rate = 3e-3
    c.optimizer.reference_batch_size = 64
    c.optimizer.warmup_steps = 30
    c.optimizer.weight_decay = 0.01
    c.optimizer.b2 = 0.98  # forgets faster than 0.999: short runs, noisy byte gradients
    c.optimizer.grad_clip_norm = 1.0

    c.train.steps = 300
    c.train.log_every = 25
    c.train.eval_every = 100
    return c

"""The Llama-style family at lm_tiny's size, on the same bytes: a CPU-sized check of it.

Run:      jaxkit train llama_tiny
Hardware: any; on 2 CPU cores (8 simulated devices) the 300 optimizer steps take about
          2–3 minutes.
Expect:   eval loss near 1.38 nats/byte against lm_tiny's 1.56 at about the same params.
"""

import pathlib

import ml_collections

from jaxkit.config import load_config


def get_config() -> ml_collections.ConfigDict:
    c = load_config(str(pathlib.Path(__file__).with_name("lm_tiny.py")))
    c.model = ml_collections.ConfigDict()
    c.model.kind = "llama"
    c.model.vocab_size = 256  # bytes
    c.model.d_model = 128
    c.model.num_layers = 2
    c.model.num_heads = 4  # head width 32
    c.model.num_kv_heads = 2  # two query heads share each key/value head
    c.model.mlp_dim = 384  # SwiGLU's three matrices: about lm_tiny's MLP params
    c.model.tie_embeddings = False
    c.model.rope_theta = 10000.0
    # or hf:DIR, a local Hugging Face Llama: its config.json then sets the sizes above
    c.model.init_from = ml_collections.config_dict.placeholder(str)
    c.model.norm_eps = 1e-6  # RMSNorm's epsilon (Llama 2 and 3 checkpoints use 1e-5)
    c.model.head_dim = ml_collections.config_dict.placeholder(int)  # null: d_model / num_heads
    # null, or Llama 3.1's {factor, low_freq_factor, high_freq_factor,
    # original_max_position_embeddings}; on the command line as JSON
    c.model.rope_scaling = None
    c.model.param_dtype = "float32"
    c.model.compute_dtype = "float32"  # CPUs gain nothing from bfloat16 matmuls
    c.model.remat = "none"
    c.model.attention = "auto"  # auto | xla | cudnn | splash: the kernel (auto: per backend)
    c.model.scan_layers = False
    return c

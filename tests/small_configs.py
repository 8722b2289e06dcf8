"""Overrides that shrink the tiny LM further, so tests that train it many times stay fast."""

SMALL_LM = [
    "model.d_model=32",
    "model.num_heads=2",
    "model.mlp_dim=64",
    "model.num_layers=1",
    "data.seq_len=16",
    "data.max_bytes=60000",
]

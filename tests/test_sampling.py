"""Sampling (jaxkit/sampling.py, jaxkit/kv_cache.py): the cache against a full forward pass,
the distribution each setting defines, and a seed's samples on other device counts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxkit import mesh as mesh_lib
from jaxkit import sampling
from jaxkit.config import apply_overrides, load_config
from jaxkit.models import build_model

# Tiny shapes: compiling is most of each test's time. Prompts of 3, 5 and 1 tokens pad on
# the left to different lengths in one batch.
TINY = ["model.d_model=32", "model.mlp_dim=64", "model.num_layers=2", "data.seq_len=32"]
PROMPTS = [[5, 6, 7], [10, 11, 12, 13, 14], [1]]
NEW = 8


def _model(name: str, *overrides: str) -> tuple:
    config = load_config(name)
    apply_overrides(config, [*TINY, *overrides])
    with nnx.use_eager_sharding(False):
        model = build_model(config, nnx.Rngs(1))
    return config, model


def _mesh(config, devices: int) -> jax.sharding.Mesh:
    return mesh_lib.make_mesh(dict(config.mesh), jax.devices()[:devices])


@pytest.mark.parametrize(
    "name, scan, devices, mesh",
    [
        ("lm_tiny", False, 1, []),
        ("lm_tiny", True, 8, ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]),
        ("llama_tiny", True, 1, []),
        ("llama_tiny", False, 8, ["mesh.data=1", "mesh.fsdp=4", "mesh.tensor=2"]),
    ],
)
def test_cached_logits_equal_a_full_forward_pass_at_every_generated_position(
    name, scan, devices, mesh
):
    """Both families, scanned and unrolled, on one device and on 8 with fsdp and tensor
    axes: the logits each new token was drawn from (prefill, then steps over the cache, rows
    padded on the left) are the model's own logits over the whole prefix."""
    if devices == 1:
        mesh = ["mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1"]
    config, model = _model(name, f"model.scan_layers={scan}", *mesh)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    sampler = sampling.Sampler(config, _mesh(config, devices), params)
    samples, logits = sampler.generate(
        PROMPTS, max_new=NEW, settings=sampling.Settings(temperature=1.0), seed=0, keep_logits=True
    )
    # The full forward on one device, each row padded on the right (causal: unseen).
    rows = [s.prompt_tokens + s.tokens for s in samples]
    width = max(map(len, rows))
    batch = np.array([r + [0] * (width - len(r)) for r in rows], np.int32)
    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda state, t: nnx.merge(graphdef, state)(t))
    full_BxLxV = np.asarray(forward(state, jnp.asarray(batch)))
    for sample, row_logits, full_LxV in zip(samples, logits, full_BxLxV, strict=True):
        assert sample.finish_reason == "length" and len(sample.tokens) == NEW
        first = len(sample.prompt_tokens) - 1  # position whose logits choose new token 0
        # float32 throughout: the cache and the full pass add the same terms in other orders
        # (a masked padding key, one query against a cache), which moves logits of size ~1
        # by ~1e-6; a key or position off by one slot moves them by ~1e-1.
        np.testing.assert_allclose(row_logits, full_LxV[first : first + NEW], atol=1e-4)

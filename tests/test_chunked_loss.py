"""The loss in chunks of positions (model.loss_chunk_tokens): the same loss, gradients and
eval sums as the whole logits give, for both LM families, tied and untied heads, weights
with zeros, packed documents and a chunk size that does not divide the row; less memory
where the vocabulary is large; and a resume may change it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxkit import mesh as mesh_lib
from jaxkit.batch.schedule import plan_from_config
from jaxkit.config import apply_overrides, load_config, run_config, validate
from jaxkit.models import build_model, eval_sums, model_loss, token_cross_entropy
from jaxkit.models.loss import chunking, row_sums
from jaxkit.plan import costs
from jaxkit.step.train_step import on_mesh
from jaxkit.train.loop import train
from tests.small_configs import SMALL_LM

ROWS, LENGTH, VOCAB = 8, 20, 300

# Chunks reorder float32 sums: each per-position loss and each gradient entry is a sum of
# at most ROWS × LENGTH = 160 terms (the head's gradient over positions; the loss over
# them), regrouped into chunks. float32's epsilon is 1.2e-7, and a regrouped sum of n terms
# moves by at most ~n·eps relative to the sum of magnitudes; measured: 1e-6 of each leaf's
# largest entry, 2e-7 relative on the loss. 1e-5 leaves room for other CPUs' kernels while
# a wrong chunk (a dropped, doubled or misaligned position) moves the loss by ~1/160.
RTOL = 1e-5

# One narrow block each: the chunks split positions of the head's logits, whatever the
# blocks under it compute, and one block compiles in a fraction of two wide ones' time.
NARROW = ["model.d_model=32", "model.num_heads=4", "model.num_layers=1"]
FAMILIES = {
    "transformer": ("lm_tiny", [*NARROW, "model.mlp_dim=64"]),
    "llama tied": ("llama_tiny", [*NARROW, "model.mlp_dim=48", "model.tie_embeddings=true"]),
    "llama untied": ("llama_tiny", [*NARROW, "model.mlp_dim=48", "model.tie_embeddings=false"]),
}


def model_and_params(family, chunk):
    name, overrides = FAMILIES[family]
    config = load_config(name)
    apply_overrides(config, [f"model.vocab_size={VOCAB}", f"data.seq_len={LENGTH}", *overrides])
    config.model.loss_chunk_tokens = chunk
    validate(config)
    with nnx.use_eager_sharding(False):
        return nnx.split(build_model(run_config(config), nnx.Rngs(0)))


def a_batch(packed):
    rng = np.random.default_rng(1)
    weights = rng.random((ROWS, LENGTH)) * (rng.random((ROWS, LENGTH)) > 0.3)
    weights[-1] = 0.0  # a padding row
    batch = {
        "inputs": rng.integers(0, VOCAB, (ROWS, LENGTH)),
        "targets": rng.integers(0, VOCAB, (ROWS, LENGTH)),
        "loss_weights": weights.astype(np.float32),
        "weights": weights.astype(np.float32),
    }
    if packed:  # two documents per row, positions restarting at the second
        cut = LENGTH // 3
        batch["segment_ids"] = (np.arange(LENGTH) >= cut).astype(np.int32)[None].repeat(ROWS, 0)
        pos = np.arange(LENGTH)
        batch["positions"] = np.where(pos >= cut, pos - cut, pos)[None].repeat(ROWS, 0)
    return {k: jnp.asarray(v) for k, v in batch.items()}


def loss_and_grads(graphdef, params, batch, mesh=None):
    def loss(p):
        return model_loss(nnx.merge(graphdef, p), batch)

    fn = jax.value_and_grad(loss)
    if mesh is None:
        return jax.jit(fn)(params)
    # Rows over the batch axes, params whole on every device, as a data-parallel step has them.
    batch = jax.device_put(batch, mesh_lib.batch_sharding(mesh))
    params = jax.device_put(params, mesh_lib.replicated(mesh))
    return jax.jit(on_mesh(fn, mesh))(params)


def close(chunked, whole):
    for a, b in zip(jax.tree.leaves(chunked), jax.tree.leaves(whole), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=RTOL * np.max(np.abs(b)))


def test_chunks_are_the_fewest_of_at_most_the_size_evened_out():
    assert chunking(1024, 256) == (4, 256)
    assert chunking(20, 7) == (3, 7)  # 21 positions: one of padding at weight 0
    assert chunking(1000, 300) == (4, 250)  # evened out: no padding
    assert chunking(128, 256) == (1, 128)  # a row no longer than a chunk: whole
    assert chunking(128, 0) == (1, 128)  # 0: whole


# 5: 4 chunks of 5; 7: 3 chunks of 7, the last padded at weight 0.
@pytest.mark.parametrize(
    ("family", "chunk", "packed"),
    [
        ("transformer", 5, False),
        ("transformer", 7, True),
        ("llama tied", 7, False),
        ("llama tied", 5, True),
        ("llama untied", 7, False),
    ],
)
def test_chunked_loss_and_gradients_match_the_whole_logits(family, chunk, packed):
    batch = a_batch(packed)
    graphdef, params = model_and_params(family, 0)
    whole = loss_and_grads(graphdef, params, batch)
    graphdef, _ = model_and_params(family, chunk)
    # On a data × fsdp mesh, so each device's rows are chunked on their own (models/loss.py)
    mesh = mesh_lib.make_mesh({"data": 4, "fsdp": 2, "tensor": 1}, jax.devices())
    chunked = loss_and_grads(graphdef, params, batch, mesh)
    close(chunked, whole)
    # Chunks are not a no-op: the loss is not that of the unweighted rows.
    assert abs(float(whole[0]) - float(jnp.sum(batch["loss_weights"]))) > 1.0


@pytest.mark.parametrize("family", ["transformer", "llama tied"])
def test_chunked_eval_sums_match_the_whole_logits(family):
    batch = a_batch(packed=False)
    graphdef, params = model_and_params(family, 0)
    # Compiled, as an eval step runs them: one program each, not an op at a time.
    whole = jax.jit(lambda p: eval_sums(nnx.merge(graphdef, p), batch))(params)
    chunked_graphdef, _ = model_and_params(family, 7)
    chunked = jax.jit(lambda p: eval_sums(nnx.merge(chunked_graphdef, p), batch))(params)
    # The hits are exact (argmax per position), the loss reordered as above.
    assert float(chunked["accuracy_sum"]) == float(whole["accuracy_sum"])
    np.testing.assert_allclose(chunked["loss_sum"], whole["loss_sum"], rtol=RTOL)
    assert float(chunked["weight"]) == float(whole["weight"])


def test_each_rows_sums_chunked_on_a_mesh_match_the_whole_logits():
    """row_sums (lm-evaluation-harness's scores, jaxkit/generate/lm_eval_model.py): each row's sums
    apart, chunked on a data × fsdp mesh (each device's rows in a shard_map of their own),
    against each row's Σ weight × cross-entropy of the whole logits."""
    batch = a_batch(packed=False)
    graphdef, params = model_and_params("transformer", 0)
    logits = jax.jit(lambda p, x: nnx.merge(graphdef, p)(x))(params, batch["inputs"])
    w = batch["weights"]
    loss = np.sum(w * token_cross_entropy(logits, batch["targets"]), -1)
    hits = np.sum(w * (np.argmax(logits, -1) == batch["targets"]), -1)
    graphdef, _ = model_and_params("transformer", 7)
    mesh = mesh_lib.make_mesh({"data": 4, "fsdp": 2, "tensor": 1}, jax.devices())
    sums = jax.jit(on_mesh(lambda p, b: row_sums(nnx.merge(graphdef, p), b), mesh))(
        jax.device_put(params, mesh_lib.replicated(mesh)),
        jax.device_put(batch, mesh_lib.batch_sharding(mesh)),
    )
    assert sums["loss_sum"].shape == (ROWS,)
    np.testing.assert_allclose(sums["loss_sum"], loss, rtol=RTOL)
    np.testing.assert_array_equal(sums["accuracy_sum"], hits)
    np.testing.assert_array_equal(sums["weight"], jnp.sum(w, -1))


def test_the_chunked_step_holds_fewer_temporaries_where_the_vocabulary_is_large():
    def temp_bytes(chunk):
        config = load_config("lm_tiny")
        apply_overrides(
            config,
            [
                *SMALL_LM,
                "model.vocab_size=8192",
                "data.seq_len=64",
                f"model.loss_chunk_tokens={chunk}",
                "batch.per_device_batch_size=4",
                "batch.global_batch_size=4",
                "batch.grad_accum_steps=null",
            ],
        )
        validate(config)
        # One device: what a step holds is per device, and one device compiles no
        # collectives.
        shape = mesh_lib.resolve_mesh_shape(config.mesh.to_dict(), 1)
        plan = plan_from_config(run_config(config), shape)
        return costs.step_cost(run_config(config), plan, jax.devices()[:1]).temp_bytes

    # The device's float32 logits: 4 rows × 64 positions × 8192 = 8 MiB; a step holds them
    # (and their gradient) whole, a chunked one a quarter at a time.
    logits_bytes = 4 * 64 * 8192 * 4
    whole, chunked = temp_bytes(0), temp_bytes(16)
    assert whole - chunked > logits_bytes / 2, (whole, chunked)


def test_a_resume_may_change_the_loss_chunks(tmp_path):
    def config(chunk):
        c = load_config("lm_tiny")
        overrides = ["train.steps=4", "train.log_every=1", "train.eval_every=0"]
        # Two micro-batches of 4 rows per optimizer step on one device: the resume's claim
        # does not depend on the mesh, and one device compiles no collectives.
        batch = ["batch.global_batch_size=8", "batch.per_device_batch_size=4"]
        apply_overrides(c, [*SMALL_LM, *overrides, *batch, "checkpoint.every=2"])
        apply_overrides(c, [f"model.loss_chunk_tokens={chunk}"])
        return c

    def run(c, workdir, **kw):
        devices = jax.devices()[:1]
        return train(c, workdir, devices=devices, progress=False, echo=lambda *a: None, **kw)

    # The uninterrupted reference needs no workdir: only the cut run's checkpoints are resumed.
    whole = run(config(0), None)
    run(config(0), tmp_path / "cut", stop_after_micro_steps=4)  # two optimizer steps
    resumed = run(config(5), tmp_path / "cut")  # rows of 16 in 4 chunks of 4
    assert int(resumed.state.step) == 4
    # The same model trained: the resumed run ends where the uninterrupted one did, to the
    # chunks' round-off compounded over two Adam steps (float32; measured below 1e-7).
    for a, b in zip(
        jax.tree.leaves(resumed.state.params), jax.tree.leaves(whole.state.params), strict=True
    ):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)

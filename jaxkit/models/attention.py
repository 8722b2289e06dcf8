"""Attention kernels (model.attention): one causal self-attention, three implementations.

- `xla`: `jax.nn.dot_product_attention` as XLA compiles it: the (B, H, L, L) probabilities
  are materialised and kept for the backward pass. Runs on every backend.
- `cudnn`: the same call with `implementation="cudnn"`, cuDNN's flash attention: NVIDIA GPUs,
  bfloat16 only here (cuDNN takes no float32).
- `splash`: Pallas's splash attention (`jax.experimental.pallas.ops.tpu.splash_attention`), a
  TPU kernel that works on blocks of 128 positions or more and keeps only each row's
  log-sum-exp for the backward pass. It runs per device inside a `jax.shard_map` over the
  mesh's batch axes (rows) and tensor axis (heads), as MaxText calls it.

`auto` (the default) takes, per backend (`auto_kernel`): splash on TPUs, live or described
by `--target`; cudnn on NVIDIA GPUs in bfloat16; xla elsewhere, where splash cannot take the
rows' length, and in the fused step (train.accumulation=fused: JAX 0.10 cannot differentiate
a Pallas call in a shard_map nested in the step's). `choose` refuses an explicit choice the
backend cannot run. A run's config, plan and summary carry the kernel that ran, never
`auto` (`train_step.with_kernel`).

Packed documents (data.document_mask): xla takes them as a (B, 1, L, L) mask, splash as
segment ids. JAX's cuDNN call takes no segment ids (a mask would become a dense bias), so
cudnn with packed documents runs xla, with one warning line.

Shape legend: B batch rows, L sequence length, H query heads, G key/value heads (H / G query
heads share each), K head dim.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxkit.keys import ConfigError
from jaxkit.mesh import BATCH_AXES

KERNELS = ("xla", "cudnn", "splash")
# Splash's blocks are multiples of a TPU vreg's 128 lanes, and a row holds whole blocks.
SPLASH_BLOCK = 128
# The blocks splash is given: the largest of these that divides the rows' length (MaxText's
# default is 512 on every block).
SPLASH_BLOCKS = (512, 256, 128)


def backend_of(device: jax.Device) -> str:
    """The device's backend as the kernels see it: tpu, nvidia (a CUDA GPU), or its platform
    (cpu; gpu for ROCm)."""
    if device.platform == "gpu" and "rocm" not in device.client.platform_version.lower():
        return "nvidia"
    return device.platform


def runnable(backend: str, compute_dtype: str, seq_len: int, fused: bool = False) -> list[str]:
    """The kernels a backend runs for matmuls in `compute_dtype` on rows of `seq_len`, in the
    order auto prefers them, last first; `fused`: in the fused step (train.accumulation)."""
    kernels = ["xla"]
    if backend == "nvidia" and compute_dtype == "bfloat16":
        kernels.append("cudnn")
    if backend == "tpu" and seq_len % SPLASH_BLOCK == 0 and not fused:
        kernels.append("splash")
    return kernels


def auto_kernel(backend: str, compute_dtype: str, seq_len: int, fused: bool = False) -> str:
    """`model.attention=auto`'s kernel: splash on a TPU, cudnn on an NVIDIA GPU in bfloat16,
    else (and where those cannot take the rows, or splash the fused step) xla."""
    return runnable(backend, compute_dtype, seq_len, fused)[-1]


def choose(
    choice: str,
    *,
    backend: str,
    compute_dtype: str,
    seq_len: int,
    document_mask: bool,
    fused: bool = False,
) -> tuple[str, str | None]:
    """The kernel that runs for `model.attention=choice`, and a warning line where it falls
    back; ConfigError (one line, the alternatives named) for a choice the backend cannot run."""
    here = runnable(backend, compute_dtype, seq_len, fused)
    kernel = here[-1] if choice == "auto" else choice
    if kernel not in here:
        others = ", ".join(k for k in here if k != kernel)
        instead = f"use model.attention=auto ({here[-1]} here) or {others}"
        if kernel == "splash" and backend == "tpu" and fused:
            # The step is a shard_map over data, and JAX 0.10 refuses the gradients of a
            # Pallas call in a shard_map nested in it (they come typed as one per data group).
            raise ConfigError(
                "model.attention='splash' does not run in the fused step "
                f"(train.accumulation=fused) yet: {instead}, or train.accumulation=multisteps"
            )
        if kernel == "splash" and backend == "tpu":
            raise ConfigError(
                f"model.attention='splash' needs data.seq_len a multiple of {SPLASH_BLOCK} "
                f"(the kernel's block), not {seq_len}: {instead}, or a data.seq_len of "
                f"{max(SPLASH_BLOCK, seq_len // SPLASH_BLOCK * SPLASH_BLOCK)} or "
                f"{-(-seq_len // SPLASH_BLOCK) * SPLASH_BLOCK}"
            )
        if kernel == "splash":
            raise ConfigError(
                f"model.attention='splash' is a TPU kernel (Pallas splash attention) and this "
                f"run is on {backend} devices: {instead}"
            )
        if backend == "nvidia":
            raise ConfigError(
                f"model.attention='cudnn' needs model.compute_dtype='bfloat16' (cuDNN's flash "
                f"attention takes no {compute_dtype}): {instead}, or set "
                "model.compute_dtype=bfloat16"
            )
        raise ConfigError(
            f"model.attention='cudnn' is cuDNN's flash attention for NVIDIA GPUs and this run "
            f"is on {backend} devices: {instead}"
        )
    if kernel == "cudnn" and document_mask:
        return "xla", (
            f"warning: model.attention={choice}: JAX's cuDNN attention takes no document "
            "segments, so with data.document_mask=true attention runs on xla"
        )
    return kernel, None


def document_mask(segment_ids_BxL: jax.Array | None) -> jax.Array | None:
    """Attention allowed only within a document: (B, 1, L, L), True where the query's and
    the key's segments agree (causality is applied on top); None without segments."""
    if segment_ids_BxL is None:
        return None
    return (segment_ids_BxL[:, :, None] == segment_ids_BxL[:, None, :])[:, None]


def attend(
    q_BxLxHxK: jax.Array,
    k_BxLxGxK: jax.Array,
    v_BxLxGxK: jax.Array,
    segment_ids_BxL: jax.Array | None,
    kernel: str,
) -> jax.Array:
    """Causal attention by `kernel` (auto: this process's default devices'), attention kept
    inside each document where segment ids are given; softmax in float32."""
    if kernel == "auto":  # a model built outside a run (train_step.with_kernel resolves a run's)
        dtype = "bfloat16" if q_BxLxHxK.dtype == jnp.bfloat16 else "float32"
        kernel = auto_kernel(backend_of(jax.devices()[0]), dtype, q_BxLxHxK.shape[1])
    if kernel == "splash":
        return splash_attention(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, segment_ids_BxL)
    mask_Bx1xLxL = document_mask(segment_ids_BxL)
    # choose() sent cudnn with segments to xla; here too where a caller did not ask it.
    cudnn = kernel == "cudnn" and mask_Bx1xLxL is None
    return jax.nn.dot_product_attention(
        q_BxLxHxK,
        k_BxLxGxK,
        v_BxLxGxK,
        mask=mask_Bx1xLxL,
        is_causal=True,
        implementation="cudnn" if cudnn else None,
    )


def splash_attention(
    q_BxLxHxK: jax.Array,
    k_BxLxGxK: jax.Array,
    v_BxLxGxK: jax.Array,
    segment_ids_BxL: jax.Array | None = None,
    *,
    interpret: bool = False,
) -> jax.Array:
    """Causal attention by the splash kernel, one call per device: under a mesh, inside a
    shard_map over its batch axes (rows) and tensor axis (heads). `interpret` runs the kernel
    in Pallas's interpreter (any backend: the tests' CPU)."""
    local = functools.partial(_splash_local, interpret=interpret)
    args = (q_BxLxHxK, k_BxLxGxK, v_BxLxGxK)
    segments = () if segment_ids_BxL is None else (segment_ids_BxL,)
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return local(*args, *segments)
    if mesh.manual_axes:
        # JAX 0.10 types the gradients out of a Pallas call in a shard_map nested in a
        # checked one as the same on every group of the outer axes, and refuses them.
        raise ValueError(
            f"splash attention inside a shard_map manual over {', '.join(mesh.manual_axes)} "
            "cannot be differentiated; choose() refuses it with fused accumulation"
        )
    rows = tuple(a for a in BATCH_AXES if a in mesh.axis_names)
    # Rows every device holds whole (the noise scale's one or two): each device takes all.
    if q_BxLxHxK.shape[0] % math.prod(mesh.shape[a] for a in rows):
        rows = ()
    split_heads = "tensor" in mesh.axis_names and k_BxLxGxK.shape[2] % mesh.shape["tensor"] == 0
    heads = "tensor" if split_heads else None
    axes = {*rows, *([heads] if heads else [])}
    if not axes:
        return local(*args, *segments)
    spec = P(rows or None, None, heads, None)
    return jax.shard_map(
        local,
        in_specs=(spec, spec, spec, *(P(rows or None, None) for _ in segments)),
        out_specs=spec,
        axis_names=axes,
        check_vma=False,  # a Pallas call states no varying axes (MaxText: check_rep=False)
    )(*args, *segments)


def _splash_local(
    q_BxLxHxK: jax.Array,
    k_BxLxGxK: jax.Array,
    v_BxLxGxK: jax.Array,
    segment_ids_BxL: jax.Array | None = None,
    *,
    interpret: bool,
) -> jax.Array:
    """The kernel on one device's rows and heads, vmapped over the rows."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    _, L, H, K = q_BxLxHxK.shape
    block = next(b for b in SPLASH_BLOCKS if L % b == 0)
    sizes = splash.BlockSizes(
        block_q=block,
        block_kv=block,
        block_kv_compute=block,
        block_q_dkv=block,
        block_kv_dkv=block,
        block_kv_dkv_compute=block,
        block_q_dq=block,
        block_kv_dq=block,
    )
    mask = splash.MultiHeadMask([splash.CausalMask((L, L))] * H)
    kernel = splash.make_splash_mha(
        mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret
    )
    # The kernel does not scale the logits: the queries come scaled, as in MaxText.
    q_BxHxLxK = (jnp.swapaxes(q_BxLxHxK, 1, 2) * (1.0 / math.sqrt(K))).astype(q_BxLxHxK.dtype)
    k_BxGxLxK, v_BxGxLxK = (jnp.swapaxes(t, 1, 2) for t in (k_BxLxGxK, v_BxLxGxK))
    ids = None if segment_ids_BxL is None else splash.SegmentIds(segment_ids_BxL, segment_ids_BxL)
    a_BxHxLxK = jax.vmap(kernel)(q_BxHxLxK, k_BxGxLxK, v_BxGxLxK, segment_ids=ids)
    return jnp.swapaxes(a_BxHxLxK, 1, 2)


__all__ = [
    "KERNELS",
    "attend",
    "auto_kernel",
    "backend_of",
    "choose",
    "document_mask",
    "splash_attention",
]

"""The device mesh, and the partition rules that place params and batches on it.

Axes: "data" and "fsdp" split the batch (their product is the data-parallel size);
"fsdp" also shards params and optimizer state; "tensor" shards attention heads and MLP
hidden units and holds whole rows of the batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")

# Partition rules: one entry per parameter role, named by mesh axes (None = replicated dim).
# Kernels are (in, out); the tensor axis sits on the wide, per-head or per-unit side.
RULES = {
    "embed": (None, "fsdp"),  # (vocab, d_model)
    "pos_embed": (None, "fsdp"),  # (seq_len, d_model)
    "in_proj": ("fsdp", "tensor"),  # d_model → heads·head_dim or mlp_dim
    "out_proj": ("tensor", "fsdp"),  # heads·head_dim or mlp_dim → d_model
    "hidden_bias": ("tensor",),  # bias of an in_proj
    "vector": (None,),  # layer-norm scales and biases, out_proj biases
    "logits": ("fsdp", None),  # d_model → vocab or classes: classes rarely divide an axis
}


# Activation layout, by logical dimension: rows over the batch axes, attention heads and MLP
# units over tensor, everything else whole. Without it GSPMD lays activations out along the
# model dimension the fsdp params are sharded on, and moves them around every matmul.
ACTIVATIONS: dict[str, str | tuple[str, ...] | None] = {
    "batch": BATCH_AXES,
    "heads": "tensor",
    "mlp": "tensor",
}


def constrain(x: jax.Array, *dims: str | None) -> jax.Array:
    """`x` laid out as ACTIVATIONS says for its logical `dims` (None: not sharded).

    A no-op outside a mesh (a model called on its own); inside a partly manual shard_map,
    the manual axes are left out (each device already holds its own rows there).
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    manual = set(mesh.manual_axes)

    def axes(dim: str | None) -> str | tuple[str, ...] | None:
        names = ACTIVATIONS.get(dim) if dim else None
        if names is None:
            return None
        kept = tuple(n for n in ((names,) if isinstance(names, str) else names) if n not in manual)
        return kept or None

    return jax.lax.with_sharding_constraint(x, P(*(axes(d) for d in dims)))


class MeshError(ValueError):
    """Mesh axis sizes that do not match the devices."""


def simulate_host_devices(count: int) -> None:
    """Makes the CPU backend offer `count` devices; must run before JAX starts its backend."""
    jax.config.update("jax_num_cpu_devices", count)


def resolve_mesh_shape(sizes: dict[str, int], num_devices: int) -> dict[str, int]:
    """Fills one -1 axis so the product of the sizes equals `num_devices`."""
    sizes = {axis: int(sizes[axis]) for axis in AXES}
    free = [axis for axis, size in sizes.items() if size == -1]
    bad = [f"mesh.{axis}={size}" for axis, size in sizes.items() if size == 0 or size < -1]
    if bad or len(free) > 1:
        raise MeshError(
            f"{', '.join(bad) or ', '.join(f'mesh.{a}=-1' for a in free)}: each mesh axis is a "
            "positive size, and at most one may be -1 (take the remaining devices)"
        )
    fixed = math.prod(size for size in sizes.values() if size != -1)
    if free:
        if num_devices % fixed:
            raise MeshError(
                f"mesh {_describe(sizes)}: the fixed axes multiply to {fixed}, which does not "
                f"divide the {num_devices} devices, so mesh.{free[0]}=-1 cannot fill them"
            )
        sizes[free[0]] = num_devices // fixed
    elif fixed != num_devices:
        raise MeshError(
            f"mesh {_describe(sizes)} has data × fsdp × tensor = {fixed} devices, but "
            f"{num_devices} are available; set one axis to -1 to fill the rest"
        )
    return sizes


def _describe(sizes: dict[str, int]) -> str:
    return " × ".join(f"{axis}={size}" for axis, size in sizes.items())


def make_mesh(sizes: dict[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ("data", "fsdp", "tensor") mesh with Auto axes (GSPMD places what we leave open)."""
    devices = jax.devices() if devices is None else devices
    shape = resolve_mesh_shape(sizes, len(devices))
    return jax.make_mesh(
        tuple(shape[axis] for axis in AXES),
        AXES,
        axis_types=(AxisType.Auto,) * len(AXES),
        devices=devices,
    )


def mesh_shape(mesh: Mesh) -> dict[str, int]:
    return {axis: int(mesh.shape[axis]) for axis in AXES}


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Rows split over (data, fsdp); every other dimension whole."""
    return NamedSharding(mesh, P(BATCH_AXES))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def named_shardings(mesh: Mesh, specs: Any) -> Any:
    """PartitionSpecs → NamedShardings on `mesh`, for a whole tree."""
    return jax.tree.map(
        lambda spec: NamedSharding(mesh, spec), specs, is_leaf=lambda x: isinstance(x, P)
    )


def bytes_per_device(tree: Any) -> int:
    """Bytes of one device's shard of each array in a tree: arrays, or abstract arrays that
    carry their sharding (jax.ShapeDtypeStruct), as the compiler would lay them out."""
    return sum(
        math.prod(x.sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
        for x in jax.tree.leaves(tree)
    )

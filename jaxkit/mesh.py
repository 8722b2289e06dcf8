"""The device mesh, and the partition rules that place params and batches on it.

Axes: "data" and "fsdp" split the batch (their product is the data-parallel size);
"fsdp" also shards params and optimizer state; "tensor" shards attention heads and MLP
hidden units and holds whole rows of the batch.

Several slices (chips joined by the slower data-centre network, DCN) keep the same three
axes: `mesh.dcn_data` and `mesh.dcn_fsdp` say how many slices the data and fsdp axes span,
`mesh.data`, `mesh.fsdp` and `mesh.tensor` the sizes within a slice, and the mesh's data
axis is dcn_data × data long (fsdp likewise), laid out as `create_hybrid_device_mesh` lays
it: a slice's devices are one contiguous block of each axis, so only the outer steps of an
axis cross slices, and the partition rules do not change.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")
# The axes that may span several slices, each by its key mesh.dcn_<axis>: the batch axes,
# whose gradient reduction is the one collective a step must send over the DCN.
DCN_AXES = ("data", "fsdp")
# Chips whose torus jax.make_mesh lets a logical axis split (it does so for v5e alone): the
# hybrid mesh of their slices is laid out as jax.make_mesh would lay out one.
SPLIT_PHYSICAL_AXES_KINDS = ("TPU v5 lite", "TPU v5e")

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


def dcn_shape(sizes: dict[str, int]) -> dict[str, int]:
    """Slices each axis spans: mesh.dcn_data and mesh.dcn_fsdp (1 where `sizes` leaves them
    out: a mesh of one slice, or a resolved shape), and 1 for tensor."""
    dcn = {axis: int(sizes.get(f"dcn_{axis}", 1)) for axis in AXES}
    bad = [f"mesh.dcn_{axis}={dcn[axis]}" for axis in DCN_AXES if dcn[axis] < 1]
    if bad:
        raise MeshError(f"{', '.join(bad)}: each is a number of slices, an integer ≥ 1")
    return dcn


def resolve_mesh_shape(sizes: dict[str, int], num_devices: int) -> dict[str, int]:
    """The mesh's {data, fsdp, tensor} on `num_devices` devices: one -1 axis filled so that
    the sizes within a slice multiply to the devices of a slice, then each batch axis
    multiplied by the slices it spans (mesh.dcn_data, mesh.dcn_fsdp: 1, one slice, where
    `sizes` leaves them out)."""
    dcn = dcn_shape(sizes)
    slices = math.prod(dcn.values())
    if num_devices % slices:
        valid = [n for n in range(1, num_devices + 1) if num_devices % n == 0]
        raise MeshError(
            f"mesh.dcn_data × mesh.dcn_fsdp = {dcn['data']} × {dcn['fsdp']} = {slices} slices "
            f"do not divide the {num_devices} devices; the slices must be one of "
            f"{', '.join(map(str, valid))}"
        )
    within = _resolve_within(sizes, num_devices // slices, slices)
    return {axis: dcn[axis] * within[axis] for axis in AXES}


def _resolve_within(sizes: dict[str, int], num_devices: int, slices: int) -> dict[str, int]:
    """Fills one -1 axis so the product of the sizes equals `num_devices`, the devices of
    each of `slices` slices."""
    sizes = {axis: int(sizes[axis]) for axis in AXES}
    free = [axis for axis, size in sizes.items() if size == -1]
    bad = [f"mesh.{axis}={size}" for axis, size in sizes.items() if size == 0 or size < -1]
    if bad or len(free) > 1:
        raise MeshError(
            f"{', '.join(bad) or ', '.join(f'mesh.{a}=-1' for a in free)}: each mesh axis is a "
            "positive size, and at most one may be -1 (take the remaining devices)"
        )
    # One slice: today's words. Several: the sizes are a slice's, and so are the devices.
    devices = f"{num_devices} devices" if slices == 1 else f"{num_devices} devices of a slice"
    available = (
        f"{num_devices} are available"
        if slices == 1
        else f"each of the {slices} slices has {num_devices}"
    )
    fixed = math.prod(size for size in sizes.values() if size != -1)
    if free:
        if num_devices % fixed:
            raise MeshError(
                f"mesh {_describe(sizes)}: the fixed axes multiply to {fixed}, which does not "
                f"divide the {devices}, so mesh.{free[0]}=-1 cannot fill them"
            )
        sizes[free[0]] = num_devices // fixed
    elif fixed != num_devices:
        raise MeshError(
            f"mesh {_describe(sizes)} has data × fsdp × tensor = {fixed} devices, but "
            f"{available}; set one axis to -1 to fill the rest"
        )
    return sizes


def _describe(sizes: dict[str, int]) -> str:
    return " × ".join(f"{axis}={size}" for axis, size in sizes.items())


def device_slices(devices: Sequence[jax.Device]) -> list[list[jax.Device]]:
    """`devices` grouped by slice, in slice order. A TPU device names its slice
    (`slice_index`; the chips of one slice described without the hardware carry none: one
    slice), and so does a GPU: XLA numbers the hosts (their boot ids), so a node's
    processes are one slice. On CPU each process is a slice (`create_hybrid_device_mesh`'s
    `process_is_granule`): the processes of one machine would all be slice 0."""
    attribute = _slice_attribute(devices)
    groups: dict[int, list[jax.Device]] = collections.defaultdict(list)
    for device in devices:
        groups[getattr(device, attribute, 0)].append(device)
    return [groups[key] for key in sorted(groups)]


def _slice_attribute(devices: Sequence[jax.Device]) -> str:
    return "process_index" if devices[0].platform == "cpu" else "slice_index"


def check_slices(sizes: dict[str, int], devices: Sequence[jax.Device]) -> None:
    """The slices mesh.dcn_data × mesh.dcn_fsdp says are the slices of `devices`: as many,
    each as large. With one (the default) a mesh may still span the processes of CPUs, or
    the nodes of GPUs where JAX lays one mesh over them; never several TPU slices."""
    dcn = dcn_shape(sizes)
    asked = math.prod(dcn.values())
    slices = device_slices(devices)
    by_slice = _slice_attribute(devices) == "slice_index"
    if asked == 1 and (len(slices) == 1 or devices[0].platform != "tpu"):
        return
    n = len(slices)
    if by_slice:
        where = f"{n} slices" if n > 1 else "one slice"
    else:
        where = f"{n} processes" if n > 1 else "one process"
        where += ", each process a slice (as on CPU)"
    if len({len(s) for s in slices}) > 1:
        held = ", ".join(str(len(s)) for s in slices)
        raise MeshError(
            f"the {len(devices)} devices are {where}, of unequal sizes ({held} devices): a "
            "mesh over several slices needs as many devices in each; run on slices of one "
            "size, with as many devices in every process"
        )
    if asked != n:
        choices = f"mesh.dcn_data × mesh.dcn_fsdp = {n} (e.g. mesh.dcn_data={n})"
        if n == 1:
            choices = "mesh.dcn_data=1 and mesh.dcn_fsdp=1"
        elif not by_slice:
            choices += ", or 1 for one mesh over every process"
        raise MeshError(
            f"mesh.dcn_data × mesh.dcn_fsdp = {dcn['data']} × {dcn['fsdp']} = {asked} "
            f"slice{'s' if asked > 1 else ''}, but the {len(devices)} {devices[0].platform} "
            f"devices are {where}: give {choices}"
        )


def make_mesh(sizes: dict[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ("data", "fsdp", "tensor") mesh with Auto axes (GSPMD places what we leave open).

    Over several slices (mesh.dcn_data × mesh.dcn_fsdp > 1) it is laid out by
    `create_hybrid_device_mesh`: jax.make_mesh refuses devices of several slices."""
    devices = jax.devices() if devices is None else devices
    shape = resolve_mesh_shape(sizes, len(devices))
    check_slices(sizes, devices)
    dcn = dcn_shape(sizes)
    axis_types = (AxisType.Auto,) * len(AXES)
    if math.prod(dcn.values()) == 1:
        try:
            return jax.make_mesh(
                tuple(shape[axis] for axis in AXES), AXES, axis_types=axis_types, devices=devices
            )
        except ValueError as err:  # a JAX that refuses several GPU nodes as one mesh
            slices = len(device_slices(devices))
            if slices == 1 or _slice_attribute(devices) != "slice_index":
                raise
            raise MeshError(
                f"JAX lays no single mesh over these {slices} slices ({str(err).splitlines()[0]}"
                f"): give mesh.dcn_data × mesh.dcn_fsdp = {slices}, e.g. mesh.dcn_data={slices}"
            ) from None
    grid = mesh_utils.create_hybrid_device_mesh(
        [shape[axis] // dcn[axis] for axis in AXES],  # within a slice
        [dcn[axis] for axis in AXES],
        devices,
        process_is_granule=_slice_attribute(devices) == "process_index",
        allow_split_physical_axes=devices[0].device_kind in SPLIT_PHYSICAL_AXES_KINDS,
    )
    return Mesh(grid, AXES, axis_types=axis_types)


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

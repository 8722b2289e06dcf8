"""Counting collectives in compiled HLO: which kind, across which mesh axes, how often.

A compiled SPMD program names, for each collective, the groups of devices that take part
(replica groups: explicit lists, iota patterns, or device ids laid on named axes). Mapping
each device id to its coordinates on the ("data", "fsdp", "tensor") mesh tells which axes
a collective crosses: a gradient reduction across "data", a parameter gather across
"fsdp", an activation reduction across "tensor". Collectives in a while-loop body (the
fused step's scan over micro-batches), or in what it calls, run once per iteration.

The TPU compiler writes a reduce-scatter as an all-reduce and the slices that follow it,
fused into a computation named `all-reduce-scatter...` (its AllReduceScatterFusion): such
an all-reduce counts as the reduce-scatter it is, with one group member's share of bytes.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable, Iterator, Sequence

import numpy as np

DTYPE_BYTES = {"f64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "s8": 1, "u8": 1}
KINDS = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_ARRAY = re.compile(r"\b(f64|f32|s32|u32|bf16|f16|s8|u8|pred)\[([\d,]*)\]")
_OP = re.compile(r"=\s*(.*?)\s(" + "|".join(KINDS) + r")(?:-start)?\(")
_CALLED = re.compile(r"\b(?:body|condition|calls|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str  # one of KINDS
    axes: frozenset[str]  # the mesh axes its device groups span
    result_bytes: int  # bytes of its result, per device
    in_loop: bool  # in a while body: runs once per iteration

    def runs(self, loop_trips: int) -> int:
        return loop_trips if self.in_loop else 1


def _computations(hlo: str) -> dict[str, list[str]]:
    blocks: dict[str, list[str]] = {}
    name = None
    for line in hlo.splitlines():
        match = _COMPUTATION.match(line)
        if match and name is None:
            name = match.group(1)
            blocks[name] = []
        elif line.strip() == "}":
            name = None
        elif name is not None:
            blocks[name].append(line)
    return blocks


def _in_loops(blocks: dict[str, list[str]]) -> set[str]:
    """Computations that run inside a while body, directly or through calls."""
    callees: dict[str, set[str]] = {}
    bodies: set[str] = set()
    for name, lines in blocks.items():
        text = " ".join(lines)
        callees[name] = set(_CALLED.findall(text))
        for branches in _BRANCHES.findall(text):
            callees[name] |= {b.strip().lstrip("%") for b in branches.split(",") if b.strip()}
        bodies |= set(re.findall(r"\bbody=%?([\w.\-]+)", text))
    inside, todo = set(bodies), list(bodies)
    while todo:
        for callee in callees.get(todo.pop(), ()):
            if callee not in inside:
                inside.add(callee)
                todo.append(callee)
    return inside


def _result_bytes(shape: str) -> int:
    total = 0
    for dtype, dims in _ARRAY.findall(shape):
        size = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
        total += size * DTYPE_BYTES.get(dtype, 1)
    return total


def _ints(text: str) -> list[int]:
    return [int(x) for x in re.findall(r"\d+", text)]


def _iota(dims: Sequence[int], perm: Sequence[int] | None) -> np.ndarray:
    ids = np.arange(math.prod(dims)).reshape(dims)
    return ids.transpose(perm) if perm else ids


# XLA of jax 0.12 leaves `device_ids=(...)` out where the ids run in mesh order.
_MESH_GROUPS = re.compile(
    r"replica_groups=mesh\[([^\]]*)\]"
    r"(?:,\s*device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))?\s*\{([^}]*)\}"
)
_IOTA_GROUPS = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_LIST_GROUPS = re.compile(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}")


def device_groups(line: str, num_devices: int) -> list[list[int]]:
    """The groups of device ids a collective instruction runs over."""
    if "source_target_pairs=" in line:  # a permute: each pair that moves data is a group
        pairs = re.findall(r"\{(\d+),(\d+)\}", line.split("source_target_pairs=", 1)[1])
        return [[int(a), int(b)] for a, b in pairs if a != b]
    mesh = _MESH_GROUPS.search(line)
    if mesh:  # device ids laid on named axes; a group runs along the axes in braces
        names = re.findall(r"'(\w+)'=", mesh.group(1))
        sizes = _ints(",".join(re.findall(r"=(\d+)", mesh.group(1))))
        perm = _ints(mesh.group(3)) if mesh.group(3) else None
        laid = _ints(mesh.group(2)) if mesh.group(2) else [math.prod(sizes)]
        ids = _iota(laid, perm).reshape(sizes)
        along = [names.index(n) for n in re.findall(r"'(\w+)'", mesh.group(4))]
        across = [i for i in range(len(sizes)) if i not in along]
        size = math.prod(sizes[i] for i in along)
        return ids.transpose(across + along).reshape(-1, size).tolist()
    iota = _IOTA_GROUPS.search(line)
    if iota:
        perm = _ints(iota.group(4)) if iota.group(4) else None
        ids = _iota(_ints(iota.group(3)), perm)
        return ids.reshape(int(iota.group(1)), int(iota.group(2))).tolist()
    listed = _LIST_GROUPS.search(line)
    if listed and listed.group(1):
        return [_ints(g) for g in re.findall(r"\{([\d,]*)\}", listed.group(1))]
    return [list(range(num_devices))]  # no groups given: every device


def axes_spanned(groups: Iterable[Sequence[int]], mesh_shape: dict[str, int]) -> frozenset[str]:
    """Mesh axes along which the devices of a group differ (device ids in mesh order)."""
    names, sizes = list(mesh_shape), list(mesh_shape.values())
    spanned: set[str] = set()
    for group in groups:
        coords = np.array(np.unravel_index(np.asarray(group), sizes)).T
        spanned |= {names[a] for a in range(len(names)) if len(set(coords[:, a])) > 1}
    return frozenset(spanned)


@dataclasses.dataclass(frozen=True)
class Found:
    """One collective instruction as written: where, what, how big, over which groups."""

    computation: str  # the computation it sits in
    kind: str  # one of KINDS (an all-reduce-scatter fusion's all-reduce: reduce-scatter)
    result_bytes: int  # per device
    groups: list[list[int]]  # device ids, as the program numbers them


def find(hlo: str, num_devices: int) -> Iterator[Found]:
    """Each collective instruction of a compiled module (`compiled.as_text()`) whose
    program runs on `num_devices` devices, with its device groups."""
    for name, lines in _computations(hlo).items():
        for line in lines:
            op = _OP.search(line)
            if op:
                groups = device_groups(line, num_devices)
                kind, result_bytes = op.group(2), _result_bytes(op.group(1))
                if kind == "all-reduce" and name.startswith("all-reduce-scatter"):
                    kind, result_bytes = "reduce-scatter", result_bytes // len(groups[0])
                yield Found(name, kind, result_bytes, groups)


def collectives(hlo: str, mesh_shape: dict[str, int]) -> list[Collective]:
    """Every collective of a compiled module (`compiled.as_text()`) on a mesh of this shape,
    whose devices are numbered in mesh order (as jax.jit lays out a NamedSharding's mesh)."""
    loops = _in_loops(_computations(hlo))
    return [
        Collective(
            kind=f.kind,
            axes=axes_spanned(f.groups, mesh_shape),
            result_bytes=f.result_bytes,
            in_loop=f.computation in loops,
        )
        for f in find(hlo, math.prod(mesh_shape.values()))
    ]


def runs_per_call(
    found: Iterable[Collective], kind: str, axis: str | None = None, *, loop_trips: int = 1
) -> int:
    """How often collectives of `kind` (crossing `axis`, if given) run in one call."""
    return sum(
        c.runs(loop_trips) for c in found if c.kind == kind and (axis is None or axis in c.axes)
    )


def bytes_per_call(
    found: Iterable[Collective], kind: str, axis: str | None = None, *, loop_trips: int = 1
) -> int:
    """Result bytes of those collectives per call, per device."""
    return sum(
        c.runs(loop_trips) * c.result_bytes
        for c in found
        if c.kind == kind and (axis is None or axis in c.axes)
    )

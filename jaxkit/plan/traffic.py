"""The bytes a compiled program moves: to and from HBM, and between devices.

HBM traffic is counted as XLA's own cost analysis counts "bytes accessed" (HloCostAnalysis):
each instruction outside a fusion reads its operands and writes its result, and a fusion is
one instruction (what happens inside it stays in registers and on-chip memory). That
analysis's refinements for slices are kept: a slice (or a fusion operand that the fusion
only slices) reads what it returns (a scanned layer's weights are one layer of the stacked
array, not all of them), and an update of a slice in place (or a fusion whose root is one)
writes the update, not the whole buffer. Unlike `cost_analysis()`, which counts a loop
body once, every computation counts as often as it runs (loop bodies times their trip
counts, as flops.py counts FLOPs), and arrays the TPU compiler placed in on-chip memory (a
layout's `S(n)`, n > 0: VMEM, SMEM) are not HBM traffic.

Between devices: each collective hlo.py finds, with the groups it runs over, how many slices
each group spans and along how many of the slice's torus dimensions its chips differ; and
for a program across slices, the TPU compiler's sends to the Megascale runtime, each the
data-centre-network part of a collective across the slices: what step_time.py prices at
the ICI's and the DCN's bandwidths.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from jaxkit.plan import hlo
from jaxkit.plan.flops import computation_runs

# A layout's memory space: {1,0:T(8,128)S(1)} lives in VMEM; none or S(0) is HBM.
_ARRAY = re.compile(
    r"\b(f64|f32|s32|u32|bf16|f16|s8|u8|s16|u16|s64|u64|pred)\[([\d,]*)\](\{[^}]*\})?"
)
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*?)\s([a-z][\w\-]*)\((.*)$")
_BYTES = {**hlo.DTYPE_BYTES, "s16": 2, "u16": 2, "s64": 8, "u64": 8, "pred": 1}
# Instructions that move no data of their own: bookkeeping, control flow (its computations
# are counted), aliases, and the second half of an async pair (counted at its start).
_FREE = {
    *("parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while"),
    *("conditional", "call", "after-all", "partition-id", "replica-id", "opt-barrier"),
    *("add-dependency", "copy-done", "all-gather-done", "all-reduce-done"),
    *("collective-permute-done", "async-done", "send-done", "recv-done"),
}
_SLICES = ("dynamic-slice", "slice", "gather")


def hbm_array_bytes(types: str) -> int:
    """Bytes of the arrays in an HLO type (an array or a tuple) that live in HBM."""
    total = 0
    for dtype, dims, layout in _ARRAY.findall(types):
        space = re.search(r"S\((\d+)\)", layout or "")
        if space and space.group(1) != "0":
            continue
        size = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
        total += size * _BYTES[dtype]
    return total


@dataclasses.dataclass(frozen=True)
class _Instruction:
    name: str
    types: str  # its result type, as written
    op: str
    operands: list[str]
    arguments: str  # between its parentheses: a parameter's number
    attributes: str
    root: bool  # the computation's result


def _parse(lines: Sequence[str]) -> list[_Instruction]:
    out = []
    for line in lines:
        found = _INSTRUCTION.match(re.sub(r"/\*[^*]*\*/", "", line))
        if not found:
            continue
        name, types, op, rest = found.groups()
        depth, end = 1, len(rest)
        for i, ch in enumerate(rest):  # the operand list ends at its closing parenthesis
            depth += {"(": 1, ")": -1}.get(ch, 0)
            if depth == 0:
                end = i
                break
        operands = re.findall(r"%([\w.\-]+)", rest[:end])
        root = line.lstrip().startswith("ROOT ")
        out.append(_Instruction(name, types, op, operands, rest[:end], rest[end:], root))
    return out


def _fusion_bytes(
    fusion: _Instruction, caller: dict[str, _Instruction], body: list[_Instruction]
) -> int:
    """What a fusion reads and writes in HBM, with XLA's refinements for slicing reads and
    in-place slice updates (of its one result, or of any result of a tuple)."""
    params = {int(i.arguments): i.name for i in body if i.op == "parameter"}
    defined = {i.name: i for i in body}
    users: dict[str, list[_Instruction]] = {}
    for i in body:
        for operand in i.operands:
            users.setdefault(operand, []).append(i)
    root = next((i for i in body if i.root), None)
    outputs = (root.operands if root.op == "tuple" else [root.name]) if root else []
    results = _ARRAY.findall(fusion.types)  # one array per output, in order
    updated: set[str] = set()  # parameters updated in place: not read whole, not written
    written = 0
    for j, (dtype, dims, layout) in enumerate(results):
        whole = hbm_array_bytes(f"{dtype}[{dims}]{layout}")
        node = defined.get(outputs[j]) if j < len(outputs) else None
        while node is not None and node.op == "bitcast" and node.operands:
            node = defined.get(node.operands[0])
        if node is not None and node.op == "dynamic-update-slice" and len(node.operands) > 1:
            update = defined.get(node.operands[1])
            if node.operands[0] in params.values() and update is not None:
                updated.add(node.operands[0])
                written += min(whole, hbm_array_bytes(update.types))
                continue
        written += whole
    read = 0
    for index, operand in enumerate(fusion.operands):
        source = caller.get(operand)
        full = hbm_array_bytes(source.types) if source is not None else 0
        param = params.get(index)
        if not full or param in updated:
            continue  # on chip, or the buffer updated in place (its update counted above)
        uses = users.get(param, []) if param else []
        if uses and all(u.op in _SLICES and u.operands[0] == param for u in uses):
            read += min(full, sum(hbm_array_bytes(u.types) for u in uses))
        else:
            read += full
    return read + written


def hbm_bytes(hlo_text: str) -> float:
    """Bytes one call of a compiled program (`compiled.as_text()`) moves to and from HBM,
    per device, each computation counted as often as it runs."""
    return sum(runs * moved for _, _, moved, runs in hbm_items(hlo_text))


def hbm_items(hlo_text: str) -> Iterator[tuple[str, str, int, int]]:
    """(computation, instruction, bytes per run, runs per call) of each instruction that
    moves HBM bytes: what hbm_bytes adds up, for finding where they go."""
    blocks = hlo._computations(hlo_text)
    runs = computation_runs(blocks)
    parsed = {name: _parse(lines) for name, lines in blocks.items()}
    fused = {
        callee
        for instructions in parsed.values()
        for i in instructions
        if i.op == "fusion"
        for callee in re.findall(r"calls=%?([\w.\-]+)", i.attributes)
    }
    reducers = {
        callee
        for instructions in parsed.values()
        for i in instructions
        for callee in re.findall(r"to_apply=%?([\w.\-]+)", i.attributes)
        if i.op != "call"
    }
    for name, instructions in parsed.items():
        if name in fused or name in reducers or not runs.get(name):
            continue
        defined = {i.name: i for i in instructions}
        for i in instructions:
            if i.op in _FREE:
                continue
            if i.op == "fusion":
                callee = re.search(r"calls=%?([\w.\-]+)", i.attributes)
                body = parsed.get(callee.group(1), []) if callee else []
                moved = _fusion_bytes(i, defined, body)
            elif i.op in _SLICES:  # reads the slice it returns, not the whole operand
                moved = 2 * hbm_array_bytes(i.types)
            elif i.op == "dynamic-update-slice" and len(i.operands) > 1:  # in place
                update = defined.get(i.operands[1])
                moved = 2 * hbm_array_bytes(update.types) if update else 0
            else:
                read = sum(hbm_array_bytes(defined[o].types) for o in i.operands if o in defined)
                moved = read + (0 if i.op.endswith("-start") else hbm_array_bytes(i.types))
            if moved:
                yield name, i.name, moved, runs[name]


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One collective of a program, as the time model needs it."""

    kind: str  # hlo.KINDS
    result_bytes: int  # per device, as hlo.Collective counts it
    runs: int  # per call of the program
    group_size: int  # devices in each of its groups
    slices: int  # slices each group spans (1: within a slice, over the ICI)
    torus_dims: int  # torus dimensions along which the chips of a group (in one slice) differ
    wraps: bool  # each of those dimensions is a full ring (wraparound links)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# Across slices the TPU compiler splits a collective in two: the part within each slice,
# written as an ordinary collective over the slice's chips, and the part between slices,
# a `send` to the Megascale runtime (host transfer) that names the collective it performs.
_MEGASCALE = re.compile(r'_xla_megascale_transfer_type="([A-Z_]+)"')
_MEGASCALE_KINDS = {
    "ALL_REDUCE": "all-reduce",
    "ALL_GATHER": "all-gather",
    "REDUCE_SCATTER": "reduce-scatter",
    "ALL_TO_ALL": "all-to-all",
}


def _megascale(line: str, runs: int, slices: int) -> Transfer | None:
    """The DCN part of a collective across slices: one chip's `send` of its piece."""
    kind = _MEGASCALE.search(line)
    sent = re.search(r"=\s*\(?(.*?)\s+send\(", line)
    if not kind or not sent or slices <= 1:
        return None
    piece = _first_array_bytes(sent.group(1))
    name = _MEGASCALE_KINDS.get(kind.group(1), "collective-permute")
    # As hlo.Collective counts results: an all-gather's is every slice's piece, a
    # reduce-scatter's one slice's share of the piece sent.
    result = {"all-gather": piece * slices, "reduce-scatter": piece // slices}.get(name, piece)
    return Transfer(name, result, runs, slices, slices, 0, False)


def _first_array_bytes(types: str) -> int:
    found = _ARRAY.search(types)
    if not found:
        return 0
    dims = found.group(2)
    size = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
    return size * _BYTES[found.group(1)]


def transfers(
    hlo_text: str,
    devices: Sequence[Any],
    wraparound: Callable[[int], bool] | None = None,
) -> list[Transfer]:
    """Each collective of a compiled program on `devices` (in mesh order, as the program
    numbers them), with its groups' slices and torus dimensions (read from the devices'
    `slice_index` and `coords` where they have them). `wraparound(extent)`: whether a torus
    dimension of that many chips is a ring (default: never)."""
    blocks = hlo._computations(hlo_text)
    runs = computation_runs(blocks)
    slice_of = [int(getattr(d, "slice_index", 0) or 0) for d in devices]
    coords = [tuple(getattr(d, "coords", ()) or ()) for d in devices]
    extents = [len({c[k] for c in coords if c}) for k in range(max(map(len, coords), default=0))]
    out = []
    for name, lines in blocks.items():  # the DCN parts of collectives across slices
        for line in lines:
            if " send(" in line and "_xla_megascale" in line:
                sent = _megascale(line, max(runs.get(name, 1), 1), len(set(slice_of)))
                if sent is not None:
                    out.append(sent)
    for f in hlo.find(hlo_text, len(devices)):
        group = f.groups[0] if f.groups else []
        slices = len({slice_of[i] for i in group}) if group else 1
        first = [i for i in group if slice_of[i] == slice_of[group[0]]] if group else []
        dims = [
            k for k in range(len(extents)) if len({coords[i][k] for i in first if coords[i]}) > 1
        ]
        wraps = bool(dims) and all(wraparound is not None and wraparound(extents[k]) for k in dims)
        out.append(
            Transfer(
                kind=f.kind,
                result_bytes=f.result_bytes,
                runs=max(runs.get(f.computation, 1), 1),
                group_size=max(len(group), 1),
                slices=slices,
                torus_dims=len(dims),
                wraps=wraps,
            )
        )
    return out

"""Counting collectives in compiled HLO: how often and how much a step all-reduces."""

from __future__ import annotations

import dataclasses
import math
import re

DTYPE_BYTES = {"f64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "s8": 1, "u8": 1}
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_ARRAY = re.compile(r"\b(f64|f32|s32|u32|bf16|f16|s8|u8|pred)\[([\d,]*)\]")


@dataclasses.dataclass(frozen=True)
class AllReduces:
    outside_loops: int  # all-reduce ops that run once per call
    inside_loops: int  # all-reduce ops in while-loop bodies: they run once per iteration
    bytes_outside_loops: int  # bytes all-reduced per call by the former

    def per_call(self, loop_trips: int) -> int:
        return self.outside_loops + self.inside_loops * loop_trips


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


def _result_bytes(line: str) -> int:
    """Bytes of an instruction's result shape (a tuple for a combined all-reduce)."""
    shape = line.split("=", 1)[1].split("all-reduce", 1)[0]
    total = 0
    for dtype, dims in _ARRAY.findall(shape):
        size = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
        total += size * DTYPE_BYTES.get(dtype, 1)
    return total


def count_all_reduces(hlo: str) -> AllReduces:
    """All-reduce ops of a compiled module (`compiled.as_text()`), split by loop nesting."""
    blocks = _computations(hlo)
    bodies = set(re.findall(r"body=%?([\w.\-]+)", hlo))
    outside = inside = nbytes = 0
    for name, lines in blocks.items():
        ops = [ln for ln in lines if re.search(r"\ball-reduce(-start)?\(", ln)]
        if name in bodies:
            inside += len(ops)
        else:
            outside += len(ops)
            nbytes += sum(_result_bytes(ln) for ln in ops)
    return AllReduces(outside_loops=outside, inside_loops=inside, bytes_outside_loops=nbytes)

"""Two FLOP counts per optimizer step per device: the model's and the hardware's.

XLA's `cost_analysis()` counts a while/scan body once and counts rematerialised work, so
its figure cannot define utilisation once layers are scanned or remat is on. So:

- model FLOPs (the basis of MFU) come from the architecture, the PaLM appendix B
  convention: per token, 6 × the params that take part in a matmul, plus attention's
  12 × layers × d_model × seq_len (scores and weighted values, forward and backward, over
  the whole square as the kernel computes it; heads × head_dim for a Llama whose
  model.head_dim is set). The params counted are all but the
  embedding tables read by lookup (a tied table is also the output head, so it counts);
  the MLP classifier counts 6 × its params per example, a model of your own 6 × all its
  params per token (its attention unknown). Remat and scanning leave it alone.
- hardware FLOPs (the basis of HFU) come from the compiled program: every matmul
  (`dot`, `convolution`, cuBLAS gemm calls) at 2 FLOPs per multiply-add, each computation
  counted as often as it runs, loop bodies times their trip counts. Recomputed matmuls
  count: with remat, hardware FLOPs exceed model FLOPs.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict

import jax

from jaxkit.models import contract
from jaxkit.plan import hlo
from jaxkit.sections import RunConfig

_SHAPE = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*\(?(\w+)\[([\d,]*)\]")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_OPERANDS = re.compile(r"\b(?:dot|convolution|custom-call)\((%[\w.\-]+),\s*(%[\w.\-]+)")


def matmul_params(config: RunConfig, params: dict) -> int:
    """Params that take part in a matmul, as the model kind's contract counts them."""
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    named = [(str(getattr(path[-1], "key", "")), leaf.size) for path, leaf in leaves]
    return contract(config).matmul_params(config, named)


def model_flops_per_example(config: RunConfig) -> float:
    """Training FLOPs (forward and backward) of one example, by the convention above."""
    from jaxkit.step.train_step import abstract_params  # the model's shapes, nothing allocated

    n = matmul_params(config, abstract_params(config))
    return contract(config).flops_per_example(config, n)


def hardware_flops(hlo_text: str) -> float:
    """Matmul FLOPs a compiled program executes (`compiled.as_text()`), loops unrolled."""
    blocks = hlo._computations(hlo_text)
    runs = computation_runs(blocks)
    total = 0.0
    for name, lines in blocks.items():
        # Names are unique within a computation only (every fusion has its %param_0).
        shapes: dict[str, tuple[int, ...]] = {}
        for line in lines:
            found = _SHAPE.match(line)
            if found:
                shapes[found.group(1)] = tuple(int(d) for d in found.group(3).split(",") if d)
        for line in lines:
            flops = _matmul_flops(line, shapes)
            if flops:
                total += runs.get(name, 0) * flops
    return total


def computation_runs(blocks: dict[str, list[str]]) -> dict[str, int]:
    """How often each computation runs in one call of the entry computation."""
    calls: dict[str, list[tuple[str, int]]] = defaultdict(list)
    called: set[str] = set()
    for name, lines in blocks.items():
        defs: dict[str, str] | None = None  # this computation's, read at its first loop
        for line in lines:
            body = re.search(r"\bbody=%?([\w.\-]+)", line)
            if body and defs is None:
                defs = _definitions(lines)
            trips = _trip_count(line, blocks, defs or {}) if body else 1
            for callee in hlo._CALLED.findall(line):
                times = trips if body and callee == body.group(1) else 1
                calls[name].append((callee, times))
                called.add(callee)
            for branches in hlo._BRANCHES.findall(line):
                for branch in (b.strip().lstrip("%") for b in branches.split(",")):
                    if branch:  # an upper bound: one branch runs
                        calls[name].append((branch, 1))
                        called.add(branch)
    runs: dict[str, int] = defaultdict(int)

    def visit(name: str, times: int) -> None:
        runs[name] += times
        for callee, factor in calls.get(name, ()):
            visit(callee, times * factor)

    for entry in (name for name in blocks if name not in called):
        visit(entry, 1)
    return runs


def _convolution_flops(
    line: str, out: int, lhs: tuple[int, ...] | None, rhs: tuple[int, ...] | None
) -> float:
    """2 × outputs × input features × the window taps that meet real input. The TPU compiler
    writes matmuls as convolutions, batch dimensions as windows over an lhs dilated by the
    window's own size: each output then meets one real input per window, not size many."""
    labels = re.search(r"dim_labels=(\w+)_(\w+)->", line)
    if rhs is None or lhs is None or not labels or "i" not in labels.group(2):
        return 0.0
    taps = 1
    window = re.search(r"window=\{([^}]*)\}", line)
    if window:
        sizes = re.search(r"size=([\dx]+)", window.group(1))
        dilate = re.search(r"lhs_dilate=([\dx]+)", window.group(1))
        size = [int(n) for n in sizes.group(1).split("x")] if sizes else []
        dilation = [int(n) for n in dilate.group(1).split("x")] if dilate else [1] * len(size)
        # Spatial dimension k of the input is labelled str(k); a window wider than it
        # (padding) still meets at most its size of real elements.
        inputs = [lhs[labels.group(1).index(str(k))] for k in range(len(size))]
        taps = math.prod(min(-(-k // d), n) for k, d, n in zip(size, dilation, inputs, strict=True))
    return 2.0 * out * rhs[labels.group(2).index("i")] * taps


def _trip_count(while_line: str, blocks: dict[str, list[str]], caller: dict[str, str]) -> int:
    """A while loop's trips: XLA's `known_trip_count` (CPU, GPU), else read off the loop the
    TPU compiler writes: its condition's `counter < N` (or `<=`) against a constant, the
    counter's start in the loop's initial tuple (among `caller`'s definitions), its step in
    the body's root tuple. Its windowed matmuls over sharded weights start at 0, step by 2."""
    known = _TRIPS.search(while_line)
    if known:
        return int(known.group(1))
    condition = re.search(r"\bcondition=%?([\w.\-]+)", while_line)
    body = re.search(r"\bbody=%?([\w.\-]+)", while_line)
    cond_lines = blocks.get(condition.group(1), []) if condition else []
    defs = _definitions(cond_lines)
    for line in cond_lines:
        found = re.search(r"ROOT .*compare\(%([\w.\-]+), %([\w.\-]+)\), direction=(LT|LE)", line)
        if not found:
            continue
        limit = _constant(found.group(2), defs)
        if limit is None:
            break
        limit += found.group(3) == "LE"
        index = _tuple_index(defs.get(found.group(1), ""))
        if index is None:  # a counter computed in the condition: from 0 by 1
            return max(0, limit)
        start = _loop_start(while_line, caller, index)
        step = _loop_step(blocks.get(body.group(1), []) if body else [], index)
        if step <= 0:
            break
        return max(0, -(-(limit - start) // step))
    return 1  # unknown: counted once, as cost_analysis() does


_DEF = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*)$")


def _definitions(lines: list[str]) -> dict[str, str]:
    """Each instruction's right-hand side, by name."""
    return {m.group(1): m.group(2) for m in map(_DEF.match, lines) if m}


def _constant(name: str, defs: dict[str, str]) -> int | None:
    """The integer scalar `name` holds, through copies and conversions; None if not one."""
    for _ in range(8):
        rhs = defs.get(name, "")
        found = re.match(r"[su](?:8|16|32|64)\[\]\S*\s+constant\((-?\d+)\)", rhs)
        if found:
            return int(found.group(1))
        passed = re.match(
            r"[su](?:8|16|32|64)\[\]\S*\s+(?:copy|convert|bitcast)\(%([\w.\-]+)\)", rhs
        )
        if not passed:
            return None
        name = passed.group(1)
    return None


def _tuple_index(rhs: str) -> int | None:
    """The index of a `get-tuple-element` of the loop's parameter."""
    found = re.search(r"get-tuple-element\(%[\w.\-]+\), index=(\d+)", rhs)
    return int(found.group(1)) if found else None


def _operands(rhs: str, op: str) -> list[str]:
    found = re.search(rf"\b{op}\(([^)]*)\)", re.sub(r"/\*[^*]*\*/", "", rhs))
    return [x.strip().lstrip("%") for x in found.group(1).split(",")] if found else []


def _loop_start(while_line: str, defs: dict[str, str], index: int) -> int:
    """The counter's initial value: element `index` of the while's operand tuple (0 when it
    is not a constant there: XLA's loops count up from 0)."""
    names = _operands(while_line, "while")
    elements = _operands(defs.get(names[0], ""), "tuple") if names else []
    start = _constant(elements[index], defs) if index < len(elements) else None
    return 0 if start is None else start


def _loop_step(body: list[str], index: int) -> int:
    """What the body adds to tuple element `index` each trip (1 when that is not plain)."""
    defs = _definitions(body)
    root = next((_DEF.match(line) for line in body if line.lstrip().startswith("ROOT ")), None)
    elements = _operands(root.group(2), "tuple") if root else []
    if index >= len(elements):
        return 1
    added = _operands(defs.get(elements[index], ""), "add")
    if len(added) == 2:
        for counter, amount in (added, added[::-1]):
            step = _constant(amount, defs)
            if step is not None and _tuple_index(defs.get(counter, "")) == index:
                return step
    return 1


def _matmul_flops(line: str, shapes: dict[str, tuple[int, ...]]) -> float:
    if " dot(" in line:
        kind = "dot"
    elif " convolution(" in line:
        kind = "convolution"
    elif "custom-call(" in line and "gemm" in line:  # cuBLAS / cuBLASLt on GPU
        kind = "gemm"
    else:
        return 0.0
    result = _SHAPE.match(line)
    operands = _OPERANDS.search(line)
    if not result or not operands:
        return 0.0
    out = math.prod(int(d) for d in result.group(3).split(",") if d)
    lhs, rhs = shapes.get(operands.group(1)[1:]), shapes.get(operands.group(2)[1:])
    if kind == "convolution":
        return _convolution_flops(line, out, lhs, rhs)
    pattern = (
        r"lhs_contracting_dims=\{([\d,]*)\}"
        if kind == "dot"
        else (r'"lhs_contracting_dimensions":\[([^\]]*)\]')
    )
    contracting = re.search(pattern, line)
    if lhs is None or not contracting:
        return 0.0
    dims = [int(d) for d in re.findall(r"\d+", contracting.group(1))]
    return 2.0 * out * math.prod(lhs[d] for d in dims)


def param_count(config: RunConfig) -> int:
    from jaxkit.step.train_step import abstract_params

    return sum(leaf.size for leaf in jax.tree.leaves(abstract_params(config)))


def model_facts(config: RunConfig) -> dict:
    """Param count, and for a language model its precision, remat and layer layout."""
    from jaxkit.plan.flops import param_count

    return {"param_count": param_count(config), **contract(config).facts(config)}

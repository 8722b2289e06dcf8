"""Two FLOP counts per optimizer step per device: the model's and the hardware's.

XLA's `cost_analysis()` counts a while/scan body once and counts rematerialised work, so
its figure cannot define utilisation once layers are scanned or remat is on. So:

- model FLOPs (the basis of MFU) come from the architecture, the PaLM appendix B
  convention: per token, 6 × the params that take part in a matmul, plus attention's
  12 × layers × d_model × seq_len (scores and weighted values, forward and backward, over
  the whole square as the kernel computes it). The params counted are all but the
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
import ml_collections

from jaxkit import hlo
from jaxkit.config import LM_KINDS, is_lm

_SHAPE = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*\(?(\w+)\[([\d,]*)\]")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_OPERANDS = re.compile(r"\b(?:dot|convolution|custom-call)\((%[\w.\-]+),\s*(%[\w.\-]+)")


def matmul_params(config: ml_collections.ConfigDict, params: dict) -> int:
    """Params that take part in a matmul: all but the tables read by lookup."""
    m = config.model
    if m.kind not in LM_KINDS:  # the MLP's, or a model of your own: every param
        return sum(leaf.size for leaf in jax.tree.leaves(params))
    # Kernels, and a tied table (it is the head); not biases or norm scales (no matmul),
    # nor tables read by lookup.
    tied = m.kind == "llama" and m.tie_embeddings
    weights = {"kernel", "embedding"} if tied else {"kernel"}
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    return sum(leaf.size for path, leaf in leaves if str(getattr(path[-1], "key", "")) in weights)


def model_flops_per_example(config: ml_collections.ConfigDict) -> float:
    """Training FLOPs (forward and backward) of one example, by the convention above."""
    from jaxkit.train_step import abstract_params  # the model's shapes, nothing allocated

    n = matmul_params(config, abstract_params(config))
    if not is_lm(config.model.kind):
        return 6.0 * n
    m, seq_len = config.model, config.data.seq_len
    if m.kind not in LM_KINDS:  # a model of your own: its architecture is not known here
        return 6.0 * n * seq_len
    per_token = 6.0 * n + 12.0 * m.num_layers * m.d_model * seq_len
    return per_token * seq_len


def hardware_flops(hlo_text: str) -> float:
    """Matmul FLOPs a compiled program executes (`compiled.as_text()`), loops unrolled."""
    blocks = hlo._computations(hlo_text)
    runs = _runs(blocks)
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


def _runs(blocks: dict[str, list[str]]) -> dict[str, int]:
    """How often each computation runs in one call of the entry computation."""
    calls: dict[str, list[tuple[str, int]]] = defaultdict(list)
    called: set[str] = set()
    for name, lines in blocks.items():
        for line in lines:
            body = re.search(r"\bbody=%?([\w.\-]+)", line)
            trips = _trip_count(line, blocks) if body else 1
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


def _trip_count(while_line: str, blocks: dict[str, list[str]]) -> int:
    """A while loop's trips: XLA's `known_trip_count` (CPU, GPU), else its condition's
    `counter < N` against a constant (the TPU compiler's loops, counting up from 0)."""
    known = _TRIPS.search(while_line)
    if known:
        return int(known.group(1))
    condition = re.search(r"\bcondition=%?([\w.\-]+)", while_line)
    lines = blocks.get(condition.group(1), []) if condition else []
    constants = {
        m.group(1): int(m.group(2))
        for m in (
            re.match(r"\s*%([\w.\-]+)\s*=\s*s32\[\]\S*\s+constant\((-?\d+)\)", x) for x in lines
        )
        if m
    }
    for line in lines:
        found = re.search(r"ROOT .*compare\(%[\w.\-]+, %([\w.\-]+)\), direction=(LT|LE)", line)
        if found and found.group(1) in constants:
            return constants[found.group(1)] + (found.group(2) == "LE")
    return 1  # unknown: counted once, as cost_analysis() does


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


def param_count(config: ml_collections.ConfigDict) -> int:
    from jaxkit.train_step import abstract_params

    return sum(leaf.size for leaf in jax.tree.leaves(abstract_params(config)))

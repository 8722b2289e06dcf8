"""The batch relation as an object.

    global_batch_size  = data_parallel_size × per_device_batch_size × grad_accum_steps
    data_parallel_size = dcn_data × dcn_fsdp × data × fsdp
    tokens_per_step    = global_batch_size × seq_len

(dcn_data and dcn_fsdp: the slices the batch axes span, 1 on one slice; data and fsdp:
the sizes within a slice.)

The user gives any two of (global, per-device, accumulation); the third is derived
against the live data-parallel size. Nothing is rounded: an inconsistent request is a
`BatchPlanError` that shows the formula, the numbers, and the nearest valid choices.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Iterable, Sequence
from fractions import Fraction

LR_SCALINGS = ("none", "linear", "sqrt")


class Accumulation(enum.StrEnum):
    """How a step accumulates its K micro-batches (`train.accumulation`). Both keep
    optax.MultiSteps' state layout, so a resume may switch."""

    MULTISTEPS = "multisteps"  # one call per micro-batch: K gradient all-reduces per step
    FUSED = "fused"  # one call per optimizer step: a local scan over K and one all-reduce


FORMULA = "global_batch_size = data_parallel_size × per_device_batch_size × grad_accum_steps"


class BatchPlanError(ValueError):
    """A batch configuration that cannot be honoured exactly."""


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    mesh_shape: dict[str, int]
    data_parallel_size: int  # data × fsdp: the mesh axes the batch is split over, slices in them
    per_device_batch_size: int  # rows per data-parallel rank per micro-step
    grad_accum_steps: int  # micro-steps per optimizer step
    global_batch_size: int  # rows per optimizer step
    seq_len: int | None  # tokens per row; None for non-sequence data
    base_learning_rate: float
    lr_scaling: str
    reference_batch_size: int | None
    learning_rate: float  # peak learning rate after scaling
    # Slices the batch axes span, {"data": dcn_data, "fsdp": dcn_fsdp}; empty on one slice.
    # mesh_shape's data and fsdp already count them (data = dcn_data × data of a slice).
    dcn_shape: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def micro_batch_size(self) -> int:
        """Global rows per micro-step."""
        return self.data_parallel_size * self.per_device_batch_size

    @property
    def tokens_per_step(self) -> int | None:
        return None if self.seq_len is None else self.global_batch_size * self.seq_len

    def to_json(self) -> dict:
        return {
            "mesh_shape": dict(self.mesh_shape),
            "data_parallel_size": self.data_parallel_size,
            "per_device_batch_size": self.per_device_batch_size,
            "grad_accum_steps": self.grad_accum_steps,
            "global_batch_size": self.global_batch_size,
            "micro_batch_size": self.micro_batch_size,
            "seq_len": self.seq_len,
            "tokens_per_step": self.tokens_per_step,
            "learning_rate": self.learning_rate,
            "base_learning_rate": self.base_learning_rate,
            "lr_scaling": self.lr_scaling,
            "reference_batch_size": self.reference_batch_size,
            **({"dcn_shape": dict(self.dcn_shape)} if self.dcn_shape else {}),
        }

    def table(self) -> str:
        """The plan as the seed articles tabulate it: item | value | meaning."""
        mesh = " × ".join(f"{name}={size}" for name, size in self.mesh_shape.items())
        dp, b, k = self.data_parallel_size, self.per_device_batch_size, self.grad_accum_steps
        ranks = ("devices (data × fsdp)", dp, f"data-parallel ranks; mesh {mesh}")
        if self.dcn_shape:  # several slices: the ranks counted slice by slice
            dcn_data, dcn_fsdp = self.dcn_shape["data"], self.dcn_shape["fsdp"]
            data = self.mesh_shape["data"] // dcn_data
            fsdp = self.mesh_shape["fsdp"] // dcn_fsdp
            ranks = (
                "devices (dcn_data × dcn_fsdp × data × fsdp)",
                dp,
                f"data-parallel ranks = {dcn_data} × {dcn_fsdp} × {data} × {fsdp} over "
                f"{dcn_data * dcn_fsdp} slices; mesh {mesh}",
            )
        rows: list[tuple[str, object, str]] = [
            ranks,
            ("per_device_batch_size", b, "rows per rank per micro-step (memory-bound)"),
            ("grad_accum_steps", k, "micro-steps accumulated per optimizer step"),
            ("global_batch_size", self.global_batch_size, f"= {dp} × {b} × {k} rows per update"),
            ("micro_batch_size", self.micro_batch_size, f"= {dp} × {b} rows per micro-step"),
        ]
        if self.seq_len is not None:
            rows += [
                ("seq_len", self.seq_len, "tokens per row"),
                (
                    "tokens_per_step",
                    f"{self.tokens_per_step:,}",
                    f"= {self.global_batch_size} × {self.seq_len}",
                ),
            ]
        if self.lr_scaling == "none":
            lr_note = "as configured (lr_scaling=none)"
        else:
            ratio = f"{self.global_batch_size}/{self.reference_batch_size}"
            factor = ratio if self.lr_scaling == "linear" else f"sqrt({ratio})"
            lr_note = f"= {self.base_learning_rate:g} × {factor} ({self.lr_scaling})"
        rows.append(("learning_rate", f"{self.learning_rate:.6g}", lr_note))
        return format_table(("item", "value", "meaning"), rows)


def format_table(header: Sequence[object], rows: Iterable[Sequence[object]]) -> str:
    cells = [tuple(str(c) for c in header)] + [tuple(str(c) for c in row) for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = [
        " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells
    ]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def splits_table(plans: list[BatchPlan]) -> str:
    """Several plans side by side, one row each, as in the seeds' comparison table."""
    header = ("devices", "per_device_batch_size", "grad_accum_steps", "global_batch_size")
    rows = [
        (p.data_parallel_size, p.per_device_batch_size, p.grad_accum_steps, p.global_batch_size)
        for p in plans
    ]
    return format_table(header, rows)


def scaled_learning_rate(
    base_learning_rate: float,
    global_batch_size: int,
    lr_scaling: str,
    reference_batch_size: int | None,
) -> float:
    """Peak learning rate for `global_batch_size` under a scaling rule."""
    if lr_scaling not in LR_SCALINGS:
        raise BatchPlanError(
            f"optimizer.lr_scaling={lr_scaling!r} is not one of {', '.join(LR_SCALINGS)}"
        )
    if lr_scaling == "none":
        return base_learning_rate
    if reference_batch_size is None or reference_batch_size <= 0:
        raise BatchPlanError(
            f"optimizer.lr_scaling={lr_scaling!r} scales the learning rate by "
            "global_batch_size / reference_batch_size, so optimizer.reference_batch_size must "
            f"be a positive integer (got {reference_batch_size!r})"
        )
    ratio = global_batch_size / reference_batch_size
    return base_learning_rate * (ratio if lr_scaling == "linear" else math.sqrt(ratio))


def divisors(n: int, trials: int | None = None) -> list[int]:
    """Every divisor of n ≥ 1, ascending, in √n trials: they pair up as d and n / d. With
    `trials`, at most that many: the divisors up to `trials` and their partners."""
    last = math.isqrt(n) if trials is None else min(math.isqrt(n), trials)
    small = [d for d in range(1, last + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


# The trials behind a refusal's "or keep G with ... in": √G of them took minutes from
# G ≈ 10^18 on (a digit too many), before a word was printed.
KEEP_TRIALS = 10**6


def _nearest_multiples(value: int, unit: int, count: int = 2) -> list[int]:
    """Multiples of `unit` around `value`: up to `count` below and `count` above."""
    below = (value // unit) * unit
    if below == value:
        below -= unit
    lows = [below - i * unit for i in range(count) if below - i * unit > 0]
    above = (value // unit + 1) * unit
    highs = [above + i * unit for i in range(count)]
    return sorted(lows) + highs


def _quotient(a: int, b: int) -> str:
    """a / b exactly, with every digit of its whole part and four after (more where four
    would make it look whole, which it is not): ".4g" wrote 1e8+7 / 2 as 5e+07, off by
    three, and a float's 53 bits wrote (10^20 - 1) / 32 as 3125000000000000000."""
    places = 4
    while (rounded := round(Fraction(a, b), places)).denominator == 1 and a % b:
        places += 1
    whole, rest = divmod(rounded * 10**places, 10**places)
    return f"{whole}.{int(rest):0{places}d}".rstrip("0").rstrip(".")


def _join(values: Iterable[object]) -> str:
    return ", ".join(str(v) for v in values)


def _solve(g: int, dp: int, known: int, known_name: str, free_name: str) -> int:
    """The free factor x of g = dp × known × x, or an error naming the nearest valid choices."""
    if g % (dp * known) == 0:
        return g // (dp * known)
    factors = {known_name: str(known), free_name: free_name}
    product = f"{dp} × {factors['per_device_batch_size']} × {factors['grad_accum_steps']}"
    # d keeps g where dp × d divides it, that is where d divides g / dp.
    per_rank = g // dp if g % dp == 0 else 0
    keep = divisors(per_rank, KEEP_TRIALS) if per_rank else []
    unlisted = ""
    if math.isqrt(per_rank) > KEEP_TRIALS:
        unlisted = f" (any between {KEEP_TRIALS:,} and {per_rank // KEEP_TRIALS:,} not listed)"
    raise BatchPlanError(
        f"{FORMULA}: {g} = {product} has no integer solution "
        f"({g} / ({dp} × {known}) = {_quotient(g, dp * known)}). "
        f"Valid global_batch_size near {g} for {product}: "
        f"{_join(_nearest_multiples(g, dp * known))}"
        + (
            f"; or keep {g} with {known_name} in {_join(keep)}{unlisted}"
            if keep
            else f"; {g} is not divisible by data_parallel_size={dp} at all"
        )
    )


def _check_positive(name: str, value: object) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise BatchPlanError(f"batch.{name} must be a positive integer, got {value!r}")
    if value <= 0:
        raise BatchPlanError(
            f"batch.{name}={value} must be a positive integer "
            "(global_batch_size = data_parallel_size × per_device_batch_size × grad_accum_steps)"
        )


def make_batch_plan(
    *,
    mesh_shape: dict[str, int],
    global_batch_size: int | None,
    per_device_batch_size: int | None,
    grad_accum_steps: int | None,
    seq_len: int | None = None,
    learning_rate: float = 1e-3,
    lr_scaling: str = "none",
    reference_batch_size: int | None = None,
    dcn_shape: dict[str, int] | None = None,
) -> BatchPlan:
    """Derives the missing one of (global, per-device, accumulation) for a mesh.

    `data_parallel_size` is mesh_shape["data"] × mesh_shape["fsdp"], the mesh's axes with
    their slices in them (dcn_data × dcn_fsdp × data × fsdp); the tensor axis holds one
    copy of each row and does not multiply the batch. `dcn_shape` ({"data": dcn_data,
    "fsdp": dcn_fsdp}) says how many slices those axes span, for the plan to show.
    """
    dp = mesh_shape.get("data", 1) * mesh_shape.get("fsdp", 1)
    g, b, k = global_batch_size, per_device_batch_size, grad_accum_steps
    for name, value in (
        ("global_batch_size", g),
        ("per_device_batch_size", b),
        ("grad_accum_steps", k),
    ):
        _check_positive(name, value)
    given = sum(v is not None for v in (g, b, k))
    if given < 2:
        raise BatchPlanError(
            f"give two of batch.global_batch_size, batch.per_device_batch_size and "
            f"batch.grad_accum_steps (got global={g}, per_device={b}, accum={k}); "
            f"the third is derived from {FORMULA} with data_parallel_size={dp}"
        )

    if g is None:
        assert b is not None and k is not None
        g = dp * b * k
    elif b is None:
        assert k is not None
        b = _solve(g, dp, k, "grad_accum_steps", "per_device_batch_size")
    elif k is None:
        k = _solve(g, dp, b, "per_device_batch_size", "grad_accum_steps")
    elif g != dp * b * k:
        raise BatchPlanError(
            f"{FORMULA}: {dp} × {b} × {k} = {dp * b * k}, not the global_batch_size={g} given. "
            "Give only two of the three (set the third to null), or make them agree: "
            f"global_batch_size={dp * b * k}, or per_device_batch_size={_quotient(g, dp * k)}, "
            f"or grad_accum_steps={_quotient(g, dp * b)}"
        )

    if seq_len is not None and (isinstance(seq_len, bool) or seq_len <= 0):
        raise BatchPlanError(f"data.seq_len must be a positive integer, got {seq_len!r}")
    lr = scaled_learning_rate(learning_rate, g, lr_scaling, reference_batch_size)
    return BatchPlan(
        mesh_shape=dict(mesh_shape),
        data_parallel_size=dp,
        per_device_batch_size=b,
        grad_accum_steps=k,
        global_batch_size=g,
        seq_len=seq_len,
        base_learning_rate=learning_rate,
        lr_scaling=lr_scaling,
        reference_batch_size=reference_batch_size,
        learning_rate=lr,
        dcn_shape={} if not dcn_shape or math.prod(dcn_shape.values()) == 1 else dict(dcn_shape),
    )

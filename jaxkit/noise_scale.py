"""The gradient noise scale B_simple, estimated online from gradients the step already has.

McCandlish et al. 2018, "An Empirical Model of Large-Batch Training", appendix A.1: with
G_B the mean gradient of a batch of B rows, E|G_B|² = |G|² + tr(Σ)/B, where G is the true
gradient and Σ the per-row gradient covariance. Two batch sizes B_small < B_big give
unbiased estimates

    |G|²  ≈ (B_big·|G_big|² − B_small·|G_small|²) / (B_big − B_small)
    tr Σ  ≈ (|G_small|² − |G_big|²) / (1/B_small − 1/B_big)

and B_simple = tr Σ / |G|², the batch size at which the gradient's noise equals its signal:
the critical batch size to first order. Each estimate is noisy (|G|² can even come out
negative), so both are smoothed by an exponential moving average before dividing.

In the kit, the small batch is a micro-batch (MultiSteps: data_parallel × per_device rows,
averaged over the K micro-steps of an optimizer step) or one data group's share of it
(fused: fsdp × per_device rows, the rows one index of the "data" axis holds, averaged over
the groups and micro-steps); the big batch is the accumulated
global batch the optimizer applies.
"""

from __future__ import annotations

import dataclasses

from jaxkit.batch_plan import BatchPlan


def small_batch_size(plan: BatchPlan, accumulation: str) -> int:
    """Rows behind the step's small-batch gradient: one data group's share of a micro-batch
    in fused mode (its local gradient), a whole micro-batch with MultiSteps."""
    if accumulation == "fused":
        return plan.micro_batch_size // plan.mesh_shape["data"]
    return plan.micro_batch_size


def unbiased_estimates(
    small_sq: float, big_sq: float, b_small: float, b_big: float
) -> tuple[float, float]:
    """(|G|², tr Σ) from mean squared gradient norms at two batch sizes."""
    if not 0 < b_small < b_big:
        raise ValueError(f"need 0 < b_small < b_big, got {b_small} and {b_big}")
    grad_sq = (b_big * big_sq - b_small * small_sq) / (b_big - b_small)
    trace = (small_sq - big_sq) / (1.0 / b_small - 1.0 / b_big)
    return grad_sq, trace


@dataclasses.dataclass
class NoiseScale:
    """Bias-corrected moving averages of |G|² and tr Σ, one update per optimizer step."""

    b_small: int
    b_big: int
    decay: float = 0.95
    grad_sq_avg: float = 0.0
    trace_avg: float = 0.0
    updates: int = 0

    def update(self, small_sq: float, big_sq: float) -> dict[str, float]:
        grad_sq, trace = unbiased_estimates(small_sq, big_sq, self.b_small, self.b_big)
        d = self.decay
        self.grad_sq_avg = d * self.grad_sq_avg + (1 - d) * grad_sq
        self.trace_avg = d * self.trace_avg + (1 - d) * trace
        self.updates += 1
        return self.estimate()

    def estimate(self) -> dict[str, float]:
        """The smoothed |G|², tr Σ and B_simple (as Adam does, corrected for the zero start)."""
        if not self.updates:
            return {}
        correction = 1 - self.decay**self.updates
        grad_sq, trace = self.grad_sq_avg / correction, self.trace_avg / correction
        out = {"grad_sq_estimate": grad_sq, "grad_var_estimate": trace}
        if grad_sq > 0:
            out["noise_scale"] = trace / grad_sq
        return out

    def state(self) -> dict:
        return {
            "grad_sq_avg": self.grad_sq_avg,
            "trace_avg": self.trace_avg,
            "updates": self.updates,
        }

    def load(self, saved: dict) -> None:
        self.grad_sq_avg = float(saved["grad_sq_avg"])
        self.trace_avg = float(saved["trace_avg"])
        self.updates = int(saved["updates"])

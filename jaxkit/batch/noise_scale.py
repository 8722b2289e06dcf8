"""The gradient noise scale B_simple, estimated online from two gradients of a sampled step.

McCandlish et al. 2018, "An Empirical Model of Large-Batch Training", appendix A.1: with
G_B the mean gradient of a batch of B rows, E|G_B|² = |G|² + tr(Σ)/B, where G is the true
gradient and Σ the per-row gradient covariance. Two batch sizes B_small < B_big give
unbiased estimates

    |G|²  ≈ (B_big·|G_big|² − B_small·|G_small|²) / (B_big − B_small)
    tr Σ  ≈ (|G_small|² − |G_big|²) / (1/B_small − 1/B_big)

and B_simple = tr Σ / |G|², the batch size at which the gradient's noise equals its signal:
the critical batch size to first order. Each estimate is noisy (|G|² can even come out
negative), so both are smoothed by an exponential moving average before dividing.

In the kit, the big batch is the global batch the optimizer applies (its gradient is the
accumulated one, behind grad_norm), and the small batch is the first SMALL_BATCH_ROWS rows
of that global batch, whose gradient a call of its own takes at the step's starting params
(train_step.small_batch_grad_sq). Both are fixed rows of the global batch, which is the same
for every split (global batch i is rows perm[i·G : (i+1)·G], in that order), so the two
squared norms, and all that is estimated from them, are the same for every split to float
round-off, and a sampled step with G > SMALL_BATCH_ROWS gives a sample, whatever its K. The
micro-batch, which accumulation hands out for free, would not do: its size and rows follow
the split, and a stage with K = 1 has none. The price is one forward and backward pass over
SMALL_BATCH_ROWS rows, on one device where params are whole on each; where they are
sharded, every device joins it and it costs the collectives of a whole step. So only the
steps numbered N with N % train.noise_scale_every = 0 take it (`samples_at`): which steps
depends on the step count alone, the same for every split; the others never dispatch it.
"""

from __future__ import annotations

import dataclasses

# Rows of the small batch. Any fixed count below the global batch keeps the estimate the
# same for every split; the estimators are unbiased at any B_small < B_big, and for
# Gaussian-like gradient noise their spread hardly depends on B_small, so the cheapest
# (one row) is taken; every global batch of two rows or more then gives a sample.
SMALL_BATCH_ROWS = 1


def has_two_batch_sizes(global_batch_size: int) -> bool:
    """Whether steps of this global batch give the noise scale its second batch size."""
    return global_batch_size > SMALL_BATCH_ROWS


def samples_at(step: int, every: int) -> bool:
    """Whether optimizer step number `step` (1 for the first, as metrics.jsonl counts)
    samples the noise scale when `train.noise_scale_every` is `every` (0: none does)."""
    return every > 0 and step % every == 0


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
    """Bias-corrected moving averages of |G|² and tr Σ, one update per sample."""

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

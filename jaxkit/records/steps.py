"""Host-side records of a run: what each fetched micro-step adds up to, and the summary.

Step records are what metrics.jsonl, TensorBoard and the console show; the summary is what
a finished run ends with.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import jax
import numpy as np

from jaxkit.batch.noise_scale import SMALL_BATCH_ROWS, NoiseScale, has_two_batch_sizes
from jaxkit.batch.plan import Accumulation, BatchPlan
from jaxkit.batch.schedule import Position
from jaxkit.data import sources as data_lib
from jaxkit.plan.costs import StepCost
from jaxkit.plan.flops import model_facts
from jaxkit.plan.peak import Peak
from jaxkit.sections import RunConfig
from jaxkit.step.train_step import Setup


class NonFiniteLossError(RuntimeError):
    """Too many non-finite micro-batches in a row."""


@dataclasses.dataclass(frozen=True)
class StepInfo:
    """What the host knew of an optimizer step when it dispatched it."""

    plan: BatchPlan  # its stage of the batch schedule
    learning_rate: float  # the rate it applies
    cost: StepCost | None = None  # compiled FLOPs and memory of its program
    # Σ weight of its global batch's targets (weights are 0 or 1: the targets it scores);
    # 0 makes its loss 0 / 0, logged as null. None where the caller does not say.
    scored_targets: float | None = None


class StepTracker:
    """Host-side bookkeeping for fetched micro-steps: losses, timing, non-finite streaks."""

    def __init__(
        self,
        config: RunConfig,
        plan: BatchPlan,
        setup: Setup,
        cost: StepCost | None = None,
        peak: Peak | None = None,
    ):
        self.plan, self.setup = plan, setup
        self.cost, self.peak = cost, peak  # compiled FLOPs per step; the devices' peak
        # The noise scale's small batch: the first rows of each global batch, whatever the
        # split; updated by every sampled step (noise_scale.samples_at) whose global batch
        # is larger.
        decay = config.train.noise_scale_decay
        self.noise_scale = NoiseScale(SMALL_BATCH_ROWS, plan.global_batch_size, decay)
        self.learning_rate = float("nan")
        # A sampled optimizer step's small-batch |gradient|², which comes with its last call.
        self.small_grad_sq: float | None = None
        self.step_nonfinite = 0
        self.log_every = config.train.log_every
        self.max_nonfinite = config.train.max_nonfinite_in_row
        # What a skip is: one micro-batch (MultiSteps drops just that one), or one whole
        # optimizer step (fused mode learns of a bad micro-batch only after the local sums).
        self.fused = setup.accumulation is Accumulation.FUSED
        self.losses: list[float] = []
        self.window_times: list[float] = []
        self.all_times: list[float] = []
        self.nonfinite_in_row = 0
        self.skipped = 0
        # The two counters as they stood when the current optimizer step began: what a
        # redone half-step goes back to.
        self.in_row_at_step_start = 0
        self.micro_steps = 0  # micro-steps kept in all, across resumes and splits
        self.first_step_s = 0.0  # the first optimizer step: warm-up, kept out of throughput
        self.first_step_done = False
        self.last_mark = time.perf_counter()
        self.examples_seen = 0  # examples consumed by the optimizer steps fetched so far
        self.scored_targets: float | None = None  # of the optimizer step being fetched

    def loop_state(self, position: Position) -> dict:
        """What a checkpoint at `position` needs to continue these metrics exactly."""
        return {
            "step": position.step,
            "micro": position.micro,
            "examples_seen": position.examples,
            "partial_step_losses": list(self.losses),  # micro-batches of an unfinished step
            "micro_steps": self.micro_steps,
            "skipped_micro_batches": self.skipped,
            "nonfinite_in_row": self.nonfinite_in_row,
            "nonfinite_in_row_at_step_start": self.in_row_at_step_start,
            "partial_step_nonfinite": self.step_nonfinite,
            "noise_scale": self.noise_scale.state(),
        }

    def load_loop_state(self, saved: dict, *, partial_step: bool = True) -> None:
        """Continues from a checkpoint's loop state; `partial_step=False` when the saved
        half-step is redone rather than continued."""
        if partial_step:
            self.losses = [float(x) for x in saved["partial_step_losses"]]
            self.step_nonfinite = int(saved.get("partial_step_nonfinite", 0))
        if saved.get("noise_scale"):
            # Batch sizes may differ after a plan change: the averages carry over regardless.
            self.noise_scale.load(saved["noise_scale"])
        self.skipped = int(saved["skipped_micro_batches"])
        self.nonfinite_in_row = int(saved["nonfinite_in_row"])
        self.in_row_at_step_start = int(
            saved.get("nonfinite_in_row_at_step_start", self.nonfinite_in_row)
        )
        self.examples_seen = int(saved["examples_seen"])
        # Records of the micro-step numbering counted micro-steps under the saved plan.
        self.micro_steps = int(saved.get("micro_steps", saved.get("legacy_micro_steps", 0)))
        if not partial_step and saved.get("micro"):  # the half-step is redone: undo its counts
            self.skipped -= int(saved.get("partial_step_nonfinite", 0))
            self.nonfinite_in_row = self.in_row_at_step_start
            self.micro_steps -= int(saved["micro"])

    def restart_clock(self) -> None:
        self.last_mark = time.perf_counter()

    def micro_step_done(
        self, step: int, micro: int, metrics: dict[str, jax.Array], info: StepInfo
    ) -> dict | None:
        """Takes a fetched micro-step of a step dispatched under `info`; returns the step's
        record when it ends a log window."""
        m = jax.device_get(metrics)
        if info.plan.global_batch_size != self.plan.global_batch_size:
            # A new stage of the batch schedule: its step times are its own.
            self.window_times, self.all_times = [], []
        self.plan, self.learning_rate = info.plan, info.learning_rate
        self.cost = info.cost or self.cost
        self.scored_targets = info.scored_targets
        self.micro_steps += self.plan.grad_accum_steps if self.fused else 1
        self.losses.append(float(m["loss"]))
        if "small_grad_sq" in m:  # none where the small batch scores no target
            self.small_grad_sq = float(m["small_grad_sq"])
        nonfinite = int(m["nonfinite"])  # micro-batches whose gradient was dropped
        self.step_nonfinite += nonfinite
        self.skipped += nonfinite
        if nonfinite == 0:
            self.nonfinite_in_row = 0
        else:
            self.nonfinite_in_row += 1  # one bad micro-batch, or one skipped fused step
            if self.nonfinite_in_row >= self.max_nonfinite:
                what = "skipped optimizer steps" if self.fused else "non-finite micro-batches"
                raise NonFiniteLossError(
                    f"{self.nonfinite_in_row} {what} in a row (step {step}, "
                    f"micro-step {micro}); last loss {float(m['loss'])}. Lower "
                    "optimizer.learning_rate or set optimizer.grad_clip_norm; "
                    "train.max_nonfinite_in_row sets the limit"
                )
        if micro < self.plan.grad_accum_steps - 1:
            return None
        done = step + 1
        self.examples_seen += self.plan.global_batch_size
        now = time.perf_counter()
        elapsed, self.last_mark = now - self.last_mark, now
        if not self.first_step_done:
            self.first_step_done = True
            self.first_step_s = elapsed
        else:
            self.window_times.append(elapsed)
            self.all_times.append(elapsed)
        # A fused step with a bad micro-batch was not applied: it has no gradient norm.
        skipped_whole = self.fused and self.step_nonfinite > 0
        grad_norm = None if skipped_whole else float(m["grad_norm"])
        self.noise_scale.b_big = self.plan.global_batch_size
        # A step that scores nothing has a zero gradient: no sample of the noise.
        sampled = False  # whether this step moved the estimates
        if (
            self.step_nonfinite == 0
            and grad_norm is not None
            and self.has_two_batch_sizes
            and self.scored_targets != 0
            and self.small_grad_sq is not None
            and np.isfinite(self.small_grad_sq)
        ):
            self.noise_scale.update(self.small_grad_sq, grad_norm**2)
            sampled = True
        self.small_grad_sq, self.step_nonfinite = None, 0
        self.in_row_at_step_start = self.nonfinite_in_row
        record = self._record(done, grad_norm, sampled)
        self.losses = []
        return record

    @property
    def has_two_batch_sizes(self) -> bool:
        """Whether this stage's steps give the noise scale its second batch size."""
        return has_two_batch_sizes(self.plan.global_batch_size)

    def _record(self, done: int, grad_norm: float | None, sampled: bool) -> dict:
        plan = self.plan
        step_time = statistics.mean(self.window_times) if self.window_times else self.first_step_s
        # A global batch with no scored target has no loss (0 / 0), not loss 0.
        unscored = self.scored_targets == 0
        record = {
            "step": done,
            "micro_step": self.micro_steps,
            "loss": None if unscored else float(np.mean(self.losses)),  # over the global batch
            "learning_rate": self.learning_rate,
            "grad_norm": grad_norm,
            "examples_seen": self.examples_seen,
            "step_time_s": step_time,
            "examples_per_s": plan.global_batch_size / step_time,
            "skipped_micro_batches": self.skipped,
            "global_batch_size": plan.global_batch_size,
            "grad_accum_steps": plan.grad_accum_steps,
        }
        if self.scored_targets is not None:
            weight = self.scored_targets
            record["scored_targets"] = int(weight) if float(weight).is_integer() else weight
        if plan.seq_len is not None and plan.tokens_per_step is not None:
            record["tokens_seen"] = self.examples_seen * plan.seq_len
            record["tokens_per_s"] = plan.tokens_per_step / step_time
        record.update(self.utilisation(step_time))
        if sampled:  # the estimates only where a sample moved them, not repeated between
            record.update(self.noise_scale.estimate())
        return record

    def utilisation(self, step_time: float | None) -> dict:
        """FLOPs per optimizer step and achieved FLOP/s per device, and MFU against the peak."""
        if self.cost is None or not step_time:
            return {}
        c = self.cost
        out = {
            "flops_per_step": c.flops_per_step,
            "flops_per_s": c.flops_per_step / step_time,
            "model_flops_per_step": c.model_flops_per_step,
            "hardware_flops_per_step": c.hardware_flops_per_step,
        }
        if self.peak is not None:
            out["mfu"] = c.model_flops_per_step / step_time / self.peak.flops_per_s
            out["hfu"] = c.hardware_flops_per_step / step_time / self.peak.flops_per_s
        return out

    def close_window(self) -> None:
        self.window_times = []


def eval_record(done: int, plan: BatchPlan, result: dict, tracker: StepTracker) -> dict:
    record = {"step": done, "micro_step": tracker.micro_steps, **result}
    record["examples_seen"] = tracker.examples_seen
    if plan.seq_len is not None:
        record["tokens_seen"] = record["examples_seen"] * plan.seq_len
    return record


def format_record(record: dict) -> str:
    if "eval_loss" in record:
        return (
            f"step {record['step']:>6}  eval_loss {record['eval_loss']:.4f}  "
            f"eval_accuracy {record['eval_accuracy']:.3f}"
        )
    rate = (
        f"{record['tokens_per_s']:,.0f} tokens/s"
        if "tokens_per_s" in record
        else f"{record['examples_per_s']:,.0f} examples/s"
    )
    norm = record["grad_norm"]
    norm_text = "skipped (non-finite)" if norm is None else f"{norm:.3f}"
    loss = record["loss"]
    loss_text = "none (no scored target)" if loss is None else f"{loss:.4f}"
    return (
        f"step {record['step']:>6}  loss {loss_text}  lr {record['learning_rate']:.3g}  "
        f"grad_norm {norm_text}  {record['step_time_s'] * 1e3:.1f} ms/step  {rate}"
    )


def summarize(
    config: RunConfig,
    plan: BatchPlan,
    records: list[dict],
    tracker: StepTracker,
    eval_source: data_lib.Source,
    wall_s: float,
    steps: int,
    schedule: dict | None = None,
) -> dict:
    """The finished run: `plan` is its last stage's, whose steps the timings describe;
    `schedule` the batch schedule's JSON when the batch changed during the run."""
    train_records = [r for r in records if "loss" in r]
    eval_records = [r for r in records if "eval_loss" in r]
    step_time = statistics.median(tracker.all_times) if tracker.all_times else None
    summary = {
        "config": config.name,
        "steps": steps,
        "examples_seen": tracker.examples_seen,
        "global_batch_size": plan.global_batch_size,
        "grad_accum_steps": plan.grad_accum_steps,
        "final_loss": train_records[-1]["loss"] if train_records else None,
        "eval_loss": eval_records[-1]["eval_loss"] if eval_records else None,
        "eval_accuracy": eval_records[-1]["eval_accuracy"] if eval_records else None,
        **(
            {"eval_loss_by_source": eval_records[-1]["eval_loss_by_source"]}
            if eval_records and "eval_loss_by_source" in eval_records[-1]
            else {}
        ),
        "median_step_time_s": step_time,
        "examples_per_s": plan.global_batch_size / step_time if step_time else None,
        "first_step_s": tracker.first_step_s,
        "skipped_micro_batches": tracker.skipped,
        "wall_time_s": wall_s,
    }
    if plan.tokens_per_step is not None and step_time:
        summary["tokens_per_s"] = plan.tokens_per_step / step_time
    summary.update(tracker.utilisation(step_time))
    summary.update(tracker.noise_scale.estimate())
    if schedule is not None:
        summary["batch_schedule"] = schedule
    if tracker.cost is not None:
        summary["compile_s"] = tracker.cost.compile_s  # the whole wait for the step program
        summary["trace_s"] = tracker.cost.trace_s  # of which tracing and lowering
        summary["compile_cache_hit"] = bool(tracker.cost.compile_cache_hit)
        summary["memory_bytes"] = tracker.cost.memory_bytes  # compiled, per device
    if tracker.peak is not None:
        summary.update(tracker.peak.to_json())
    summary.update(model_facts(config))
    if isinstance(eval_source, data_lib.TokenWindows):
        # Over the bytes the eval scored: train.eval_examples may leave rows out.
        evaluated = data_lib.eval_row_count(eval_source, config.train.eval_examples)
        summary["unigram_entropy"] = eval_source.unigram_entropy(evaluated)
    return summary


def above_the_peak(s: dict) -> list[str]:
    """The line that says why a utilisation above 100% is no share of the peak, if any."""
    if s.get("hfu", 0) > 1 and "measured on" in s.get("peak_source", ""):
        # A peak cached while the machine was busier than now reads low ever after.
        return [
            "  warning: above 100% of the peak: the CPU peak was cached while this machine "
            "was busier; delete cpu_peak.json in the cache directory to measure it again"
        ]
    if s.get("hfu", 0) > 1:
        return [
            f"  warning: above 100% of the peak: {s['peak_source']} is below what this device "
            "ran, so MFU and HFU compare with no other run"
        ]
    if s.get("mfu", 0) > 1:  # and HFU is not: the FLOPs counted outnumber the matmuls run
        run = s["hardware_flops_per_step"]
        counted = (
            f"are {s['model_flops_per_step'] / run:.2f}× the matmul FLOPs the step runs"
            if run
            else "are more than the step runs (it runs no matmul)"
        )
        return [
            "  MFU above 100% is no share of the peak and compares with no other run: the model "
            f"FLOPs counted {counted} (a model of your own counts 6 × all its params per token, "
            "lookups too); HFU is the share that ran"
        ]
    return []


def format_summary(s: dict) -> str:
    steps, wall = s["steps"], s.get("wall_time_s")
    took = "" if wall is None else f" in {wall:.1f} s"  # None: a summary rebuilt from the log
    this_attempt = s.get("steps_this_attempt", steps)
    if this_attempt != steps:  # a resumed run: its time is this attempt's, not the run's
        head = f"done: {this_attempt} optimizer steps this attempt{took}; {steps} in all"
    else:
        head = f"done: {steps} optimizer steps{took}"
    lines = [head]
    if s["median_step_time_s"]:
        rate = f"{s['examples_per_s']:,.1f} examples/s"
        if "tokens_per_s" in s:
            rate += f", {s['tokens_per_s']:,.0f} tokens/s"
        cached = " from the compile cache" if s.get("compile_cache_hit") else ""
        compiled = s.get("compile_s")  # None where unknown (a summary rebuilt from the log)
        compile_s = f"compile {compiled:.1f} s{cached}, " if compiled is not None else ""
        lines.append(
            f"  median step {s['median_step_time_s'] * 1e3:.1f} ms ({rate}); "
            f"{compile_s}first step {s['first_step_s']:.1f} s"
        )
    if "model_flops_per_step" in s:
        use = f", MFU {s['mfu']:.1%} (HFU {s['hfu']:.1%})" if "mfu" in s else ""
        lines.append(
            f"  {s['model_flops_per_step'] / 1e9:,.4g} GFLOPs per step per device (model; "
            f"{s['hardware_flops_per_step'] / 1e9:,.4g} executed), "
            f"{s['model_flops_per_step'] / s['median_step_time_s'] / 1e9:,.3g} GFLOP/s "
            f"per device{use}" + (f" of {s['peak_source']}" if "mfu" in s else "")
        )
        lines += above_the_peak(s)
    if "param_dtype" in s:
        lines.append(
            f"  params {s['param_count']:,} in {s['param_dtype']}, matmuls in "
            f"{s['compute_dtype']}, remat {s['remat']}, "
            + ("scanned layers" if s["scan_layers"] else "unrolled layers")
            + (f", attention {s['attention']}" if "attention" in s else "")
        )
    if s["eval_loss"] is not None:
        if s.get("unigram_entropy"):  # 0 for a held-out split of one repeated byte
            h = s["unigram_entropy"]
            lines.append(
                f"  eval loss {s['eval_loss']:.3f} nats/byte, {s['eval_loss'] / h:.0%} of the "
                f"unigram entropy of the held-out bytes evaluated ({h:.3f} nats/byte)"
            )
        else:
            lines.append(
                f"  eval loss {s['eval_loss']:.4f}, eval accuracy {s['eval_accuracy']:.1%}"
            )
    if "noise_scale" in s:
        lines.append(
            f"  gradient noise scale B_simple ≈ {s['noise_scale']:,.0f} rows (the critical "
            f"batch to first order; this run's global batch is {s['global_batch_size']})"
        )
    if s["skipped_micro_batches"]:
        lines.append(f"  skipped {s['skipped_micro_batches']} non-finite micro-batches")
    return "\n".join(lines)

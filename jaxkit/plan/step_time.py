"""A predicted step time for a split compiled for a TPU slice (or several): a lower bound.

Four resources serve an optimizer step, each at its peak rate, and at best they all work at
once, so the step takes at least the longest of their four times (a roofline):

- compute: the compiled program's hardware FLOPs (flops.py: every matmul, loop bodies times
  their trips, recomputation included) over the chip's dense peak for the matmul dtype
  (peak.py); never fewer than the model FLOPs, as costs.predicted_speed holds (a program
  that executes fewer matmul FLOPs than the convention counts is not faster for it);
- hbm: the bytes the program moves to and from HBM (traffic.py, counted as the FLOPs are)
  over the chip's HBM bandwidth;
- ici: each collective within a slice, priced as a ring over the torus dimensions its
  groups span (the scaling book's model, "How to Think About TPUs", section on collectives:
  https://jax-ml.github.io/scaling-book/tpus/): an all-gather or a reduce-scatter of an
  array of V bytes over n chips sends (n − 1)/n · V from each chip, over two links per
  dimension spanned (one each way) where the dimension wraps around into a ring, one where
  it does not; an all-reduce is a reduce-scatter then an all-gather (twice the bytes); an
  all-to-all costs a quarter of an all-gather; a permute sends its bytes over one link;
- dcn: a collective whose groups span slices, priced as a hierarchical collective (as
  MaxText's multi-slice guide describes XLA's over the data-centre network): within each
  slice an ICI reduce-scatter, across the slices a DCN all-reduce of 1/n_ici of the bytes
  (2 (s − 1)/s of that from each chip of s slices), then an ICI all-gather; an all-gather
  or reduce-scatter across slices moves (s − 1)/s of 1/n_ici of the bytes over the DCN.

Left out, so a real step is slower: latency (about a microsecond a hop), the host's input
pipeline, work that does not overlap (a collective that waits for the gradients it
reduces), the vector units' work (the compute time counts matmuls only), and the MXU's
efficiency on small or oddly shaped matmuls. One assumption runs the other way: the ICI
times of a step's collectives add up, as if each had the links to itself in turn, though
collectives over different torus sides could run at once (the data-parallel layouts the
kit plans gather and reduce over every side of a slice at once, where adding is right).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jaxkit.plan.targets import Generation
from jaxkit.plan.traffic import Transfer

BOUNDS = ("compute", "hbm", "ici", "dcn")


@dataclasses.dataclass(frozen=True)
class Chip:
    """What the time model needs of a chip: its peak and bandwidths, per chip."""

    peak_flops_per_s: float
    hbm_bytes_per_s: float
    ici_link_bytes_per_s: float  # one way, per link
    dcn_bytes_per_s: float  # per chip (its host's network shared by its chips)

    @classmethod
    def of(cls, generation: Generation, peak_flops_per_s: float) -> Chip:
        return cls(
            peak_flops_per_s,
            generation.hbm_bytes_per_s,
            generation.ici_link_bytes_per_s,
            generation.dcn_bytes_per_s,
        )


def _full_bytes(t: Transfer) -> float:
    """V: the bytes of the whole array a collective gathers or reduces, per device."""
    return float(t.result_bytes * t.group_size if t.kind == "reduce-scatter" else t.result_bytes)


def _ici(t: Transfer, members: int, volume: float) -> float:
    """Bytes each chip sends over the ICI for a collective of `members` chips in a slice."""
    if members <= 1:
        return 0.0
    share = (members - 1) / members * volume
    return {
        "all-reduce": 2 * share,
        "all-gather": share,
        "reduce-scatter": share,
        "all-to-all": share / 4,  # in link time: a quarter of an all-gather's
        "collective-permute": volume,
    }[t.kind]


def _ici_bandwidth(t: Transfer, chip: Chip) -> float:
    """Bytes per second a chip sends over the ICI in this collective: one link each way per
    torus dimension its group spans where that dimension is a ring, one link where not."""
    if t.kind == "collective-permute":
        return chip.ici_link_bytes_per_s
    return max(t.torus_dims, 1) * chip.ici_link_bytes_per_s * (2 if t.wraps else 1)


def _dcn(t: Transfer, per_slice: int, volume: float) -> float:
    """Bytes each chip sends over the DCN for a collective across t.slices slices."""
    s = t.slices
    if s <= 1:
        return 0.0
    part = volume / per_slice  # what each chip holds after the ICI reduce-scatter
    return {
        "all-reduce": 2 * (s - 1) / s * part,
        "all-gather": (s - 1) / s * part,
        "reduce-scatter": (s - 1) / s * part,
        "all-to-all": (s - 1) / s * volume,
        "collective-permute": volume,
    }[t.kind]


@dataclasses.dataclass(frozen=True)
class Traffic:
    """Seconds and bytes of one optimizer step's collectives, per chip."""

    ici_s: float
    dcn_s: float
    ici_bytes: float
    dcn_bytes: float


def collective_traffic(transfers: Sequence[Transfer], calls: int, chip: Chip) -> Traffic:
    """The collectives of `calls` calls of a program (K with MultiSteps, 1 fused)."""
    ici_s = dcn_s = ici_bytes = dcn_bytes = 0.0
    for t in transfers:
        times = t.runs * calls
        volume = _full_bytes(t)
        per_slice = max(t.group_size // max(t.slices, 1), 1)
        sent = _ici(t, per_slice, volume)
        ici_bytes += times * sent
        ici_s += times * sent / _ici_bandwidth(t, chip) if sent else 0.0
        over = _dcn(t, per_slice, volume)
        dcn_bytes += times * over
        dcn_s += times * over / chip.dcn_bytes_per_s if over else 0.0
    return Traffic(ici_s, dcn_s, ici_bytes, dcn_bytes)


@dataclasses.dataclass(frozen=True)
class Prediction:
    """A split's predicted optimizer step on its slice(s): a lower bound, and what bounds it."""

    compute_s: float
    hbm_s: float
    ici_s: float
    dcn_s: float
    ici_bytes: float
    dcn_bytes: float
    tokens_per_step: int  # or examples, for a classifier (unit)
    devices: int
    model_flops_per_step: float  # per device
    peak_flops_per_s: float
    usd_per_chip_hour: float | None = None
    unit: str = "tokens"  # what tokens_per_step counts: "examples" for a classifier

    @property
    def step_s(self) -> float:
        return max(self.compute_s, self.hbm_s, self.ici_s, self.dcn_s)

    @property
    def bound(self) -> str:
        times = (self.compute_s, self.hbm_s, self.ici_s, self.dcn_s)
        return BOUNDS[times.index(max(times))]

    @property
    def tokens_per_s_per_device(self) -> float:
        return self.tokens_per_step / self.step_s / self.devices

    @property
    def mfu(self) -> float:
        return self.model_flops_per_step / self.step_s / self.peak_flops_per_s

    @property
    def usd_per_billion_tokens(self) -> float | None:
        if self.usd_per_chip_hour is None:
            return None
        usd_per_step = self.usd_per_chip_hour * self.devices * self.step_s / 3600
        return usd_per_step / self.tokens_per_step * 1e9

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {
            "predicted_step_time_s": self.step_s,
            "bound": self.bound,
            "compute_s": self.compute_s,
            "hbm_s": self.hbm_s,
            "ici_s": self.ici_s,
            "dcn_s": self.dcn_s,
            "collective_bytes": {"ici": self.ici_bytes, "dcn": self.dcn_bytes},
            f"{self.unit}_per_s_per_device": self.tokens_per_s_per_device,
            "predicted_mfu": self.mfu,
        }
        if self.usd_per_chip_hour is not None:
            out[f"usd_per_billion_{self.unit}"] = self.usd_per_billion_tokens
        return out


def predict(
    *,
    hardware_flops_per_step: float,
    hbm_bytes_per_step: float,
    transfers: Sequence[Transfer],
    calls_per_step: int,
    model_flops_per_step: float,
    tokens_per_step: int,
    devices: int,
    chip: Chip,
    usd_per_chip_hour: float | None = None,
    unit: str = "tokens",
) -> Prediction:
    """The lower bound for one optimizer step whose compiled program runs `calls_per_step`
    times (K with MultiSteps, once fused); FLOPs and HBM bytes are per step, per device.
    `unit`: what `tokens_per_step` counts, "tokens" or a classifier's "examples" (the JSON
    then says examples_per_s_per_device and usd_per_billion_examples)."""
    traffic = collective_traffic(transfers, calls_per_step, chip)
    return Prediction(
        compute_s=max(hardware_flops_per_step, model_flops_per_step) / chip.peak_flops_per_s,
        hbm_s=hbm_bytes_per_step / chip.hbm_bytes_per_s,
        ici_s=traffic.ici_s,
        dcn_s=traffic.dcn_s,
        ici_bytes=traffic.ici_bytes,
        dcn_bytes=traffic.dcn_bytes,
        tokens_per_step=tokens_per_step,
        devices=devices,
        model_flops_per_step=model_flops_per_step,
        peak_flops_per_s=chip.peak_flops_per_s,
        usd_per_chip_hour=usd_per_chip_hour,
        unit=unit,
    )

"""The batch plan of a config on its devices, and the compile-only searches over it.

What `jaxkit plan` answers, as functions a notebook can call: the plan (and its batch
schedule) on the live devices or on a described TPU slice (`--target`), every split of the
global batch with its compiled memory and FLOPs (`--all-splits`), and the largest
per-device batch under a memory budget (`--max-per-device-batch`). Each returns an object
whose `to_json()` is what `jaxkit plan ... --json` prints; the CLI only prints them.

    request = planning.request(config)                  # the live devices, the config's mesh
    planning.summary(request).to_json()                 # jaxkit plan --json
    planning.all_splits(request, device_counts=[8, 4])  # jaxkit plan --all-splits
    planning.max_batch(planning.request(config, memory_budget="2GiB"))
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence

import jax

from jaxkit import mesh as mesh_lib
from jaxkit.batch.plan import BatchPlan
from jaxkit.batch.schedule import BatchSchedule, plan_from_config, schedule_from_config
from jaxkit.config import ConfigError
from jaxkit.data.sources import checked_sources
from jaxkit.models import check_mesh_divides, contract
from jaxkit.models.layers import REMAT_POLICIES
from jaxkit.plan import costs, peak, step_time
from jaxkit.plan.flops import model_facts, model_flops_per_example
from jaxkit.plan.targets import Target, batch_shards_per_host, target_devices
from jaxkit.sections import RunConfig
from jaxkit.step.train_step import check_on_mesh, with_kernel


class PlanError(ValueError):
    """A plan request that cannot be answered (the CLI's exit status 2)."""


def devices_for(target: Target | None) -> Sequence[jax.Device]:
    """A described TPU slice's devices, else the live ones."""
    return target_devices(target) if target is not None else jax.devices()


def mesh_shape(
    config: RunConfig, devices: Sequence[jax.Device], target: Target | None = None
) -> dict[str, int]:
    """The config's mesh on `devices`, checked to shard the model evenly: every command
    plans, trains and measures on it."""
    sizes = dataclasses.asdict(config.mesh)
    try:
        if target is not None:  # a target's slices first: the error then names their count
            mesh_lib.check_slices(sizes, devices)
        shape = mesh_lib.resolve_mesh_shape(sizes, len(devices))
    except mesh_lib.MeshError as err:
        if target is None:
            raise
        chips = f"{len(devices)} chips"
        if target.slices > 1:
            chips = f"{target.slices} slices of {target.chips} chips"
        asked = config.mesh.dcn_data * config.mesh.dcn_fsdp
        hint = f"; or plan {asked} such slices: --slices {asked}" if asked > 1 else ""
        raise mesh_lib.MeshError(f"--target {target.name} has {chips}: {err}{hint}") from None
    check_on_mesh(config, shape)
    return shape


def resolve_remat(policies: str | Sequence[str] | None, config: RunConfig) -> list[str | None]:
    """The activation-recompute policies to compare (--remat's comma-separated list, or a
    sequence); without them the config's own (None for a model without remat)."""
    has_remat = contract(config).READS_LM_OPTIONS
    if policies is None:
        return [config.model.remat if has_remat else None]
    text = policies if isinstance(policies, str) else ",".join(policies)
    if not has_remat:
        raise PlanError(
            f"--remat: model.kind={config.model.kind!r} has no activation recompute policies "
            "(the transformer and llama kinds do)"
        )
    names = [part.strip() for part in text.split(",")]
    bad = [p for p in names if p not in REMAT_POLICIES]
    if bad or not names:
        raise PlanError(
            f"--remat {text!r}: {', '.join(map(repr, bad)) or 'nothing'} is not a policy; give "
            f"a comma-separated list of {', '.join(REMAT_POLICIES)}"
        )
    return list(dict.fromkeys(names))


def resolve_memory_budget(
    size: str | int | None, device: jax.Device, target: Target | None = None
) -> int | None:
    """The per-device memory to fit: `size` (bytes, or text such as 16GiB), else a target
    chip's HBM, else what the live device reports (None where it reports none)."""
    if size is None and target is not None:
        return target.generation.hbm_bytes
    if size is None:
        return costs.device_memory_bytes(device)
    try:
        budget = size if isinstance(size, int) else costs.parse_bytes(size)
    except (ValueError, OverflowError):  # 1e999 overflows int()
        budget = 0
    if budget < 1:
        raise PlanError(
            f"--memory-budget {size!r} is not a memory size of at least one byte; write e.g. "
            "16GiB, 512MiB, 2GB or a byte count"
        )
    return budget


def resolve_device_counts(counts: str | Sequence[int] | None, live: int) -> list[int]:
    """The device counts the splits are sought on (--device-counts' list, or a sequence),
    most first; by default every divisor of the live count."""
    if counts is None:
        return [n for n in range(live, 0, -1) if live % n == 0]
    if isinstance(counts, str):
        try:
            counts = [int(part) for part in counts.split(",")]
        except ValueError:
            raise PlanError(f"--device-counts={counts!r} is not a comma-separated list") from None
    bad = [n for n in counts if not 1 <= n <= live]
    if bad:
        raise PlanError(f"--device-counts: {bad} outside 1..{live} (the live device count)")
    return sorted(set(counts), reverse=True)


def check_counts_shard_evenly(config: RunConfig, counts: Sequence[int]) -> None:
    """The mesh on each device count (where it fits) must shard the parameters evenly."""
    for n in counts:
        try:
            shape = mesh_lib.resolve_mesh_shape(dataclasses.asdict(config.mesh), n)
        except mesh_lib.MeshError:
            continue  # enumerate_splits leaves out the counts this mesh cannot use
        try:
            check_mesh_divides(config, shape)
        except ConfigError as err:
            raise PlanError(f"--device-counts {n}: {err}") from None


@dataclasses.dataclass(frozen=True)
class Request:
    """A plan request, checked: the config's schedule on its mesh, the devices (live or a
    described slice's), the memory budget and the remat policies to compare."""

    config: RunConfig
    devices: Sequence[jax.Device]
    shape: dict[str, int]
    schedule: BatchSchedule
    budget: int | None  # bytes per device; None: the devices report no limit
    policies: list[str | None]
    target: Target | None = None
    batch_shards_per_host: int | None = None  # a target's: per-device batches a host loads
    slice: dict[str, object] = dataclasses.field(default_factory=dict)  # a target's facts
    usd_per_chip_hour: float | None = None  # what a chip of the target costs, for the plan

    @property
    def chip(self) -> step_time.Chip | None:
        """What the step-time model needs of a target's chips (None: no target)."""
        if self.target is None:
            return None
        g = self.target.generation
        found = peak.table_peak(g.device_kind, self.config.model.compute_dtype)
        return step_time.Chip.of(g, found.flops_per_s) if found else None

    @property
    def plan(self) -> BatchPlan:
        return self.schedule.first

    @property
    def rows_per_host(self) -> int | None:
        """Rows each host loads per micro-step on a target slice (None on live devices)."""
        shards = self.batch_shards_per_host
        return None if shards is None else shards * self.plan.per_device_batch_size


def request(
    config: RunConfig,
    devices: Sequence[jax.Device] | None = None,
    shape: dict[str, int] | None = None,
    *,
    target: Target | None = None,
    memory_budget: str | int | None = None,
    remat: str | Sequence[str] | None = None,
    usd_per_chip_hour: float | str | None = None,
) -> Request:
    """Checks a plan request, in the order the CLI reports problems: remat policies, the
    batch schedule on the mesh (and token files against it), the memory budget.

    Args:
      devices: default the target's (when given) or the live ones.
      shape: the config's mesh on them (default: resolved and checked here).
      memory_budget: bytes or text (16GiB); default a target chip's HBM or the device's own.
      remat: policies to compare, a list or comma-separated text; default the config's.
      usd_per_chip_hour: a target chip's price, for the cost of a billion tokens.
    """
    if devices is None:
        devices = devices_for(target)
    if shape is None:
        shape = mesh_shape(config, devices, target)
    policies = resolve_remat(remat, config)
    price = resolve_price(usd_per_chip_hour, target)
    config = with_kernel(config, devices)  # the kernel these devices run, for auto
    schedule = schedule_from_config(config, shape)  # every stage must hold on this mesh
    if config.data.source == "tokens":
        # Token files are the one source the config does not describe: train's checks of
        # them (ids against model.vocab_size, rows, scored targets) apply to the plan too.
        checked_sources(config, schedule.largest)
    budget = resolve_memory_budget(memory_budget, devices[0], target)
    info: dict[str, object] = {}
    shards = None
    if target is not None:
        shards = batch_shards_per_host(devices, dataclasses.asdict(config.mesh))
        info = {
            "target": target.name,
            "topology": target.topology,
            "device_kind": target.generation.device_kind,
            "num_devices": target.devices,
            "num_slices": target.slices,
            "num_hosts": target.hosts * target.slices,
            "memory_budget_bytes": budget,
            "batch_shards_per_host": shards,
        }
    return Request(config, devices, shape, schedule, budget, policies, target, shards, info, price)


def parse_price(usd: float | str) -> float:
    """A chip-hour's price: a positive, finite number of dollars, else ValueError."""
    try:
        price = float(usd)
    except ValueError:
        price = math.nan
    if not (math.isfinite(price) and price > 0):
        raise ValueError(f"{usd!r} is not a positive number of dollars")
    return price


def resolve_price(usd: float | str | None, target: Target | None) -> float | None:
    """--usd-per-chip-hour: a positive number of dollars, and only with a target."""
    if usd is None:
        return None
    try:
        price = parse_price(usd)
    except ValueError as err:
        raise PlanError(f"--usd-per-chip-hour {err}") from None
    if target is None:
        raise PlanError(
            "--usd-per-chip-hour prices a target's chips: give --target (the live devices "
            "have no predicted step time)"
        )
    return price


def prediction(request: Request, split: costs.Split) -> step_time.Prediction | None:
    """A compiled split's predicted step on the request's target (None: no target, a split
    that did not compile, or a generation the time model has no figures for)."""
    chip, cost = request.chip, split.cost
    if chip is None or cost is None:
        return None
    if not (chip.hbm_bytes_per_s and chip.ici_link_bytes_per_s and chip.dcn_bytes_per_s):
        return None  # a generation whose bandwidths the table lacks
    p = split.plan
    return step_time.predict(
        hardware_flops_per_step=cost.hardware_flops_per_step,
        hbm_bytes_per_step=cost.hbm_bytes_per_step,
        transfers=cost.transfers,
        calls_per_step=1,  # the costs count each collective's runs per optimizer step
        model_flops_per_step=cost.model_flops_per_step,
        tokens_per_step=p.tokens_per_step or p.global_batch_size,
        unit="tokens" if p.tokens_per_step else "examples",  # a classifier's rows
        devices=split.devices,
        chip=chip,
        usd_per_chip_hour=request.usd_per_chip_hour,
    )


def model_json(config: RunConfig, plan: BatchPlan) -> dict[str, object]:
    """The model's size, precision and layout, and its model FLOPs per optimizer step: per
    device, as records and summaries give them, and on all devices together."""
    facts = {"kind": config.model.kind, **model_facts(config)}
    every = model_flops_per_example(config) * plan.global_batch_size
    facts["model_flops_per_step"] = every / math.prod(plan.mesh_shape.values())
    facts["model_flops_per_step_all_devices"] = every
    return facts


@dataclasses.dataclass(frozen=True)
class Summary:
    """`jaxkit plan`: the batch plan, its schedule, the model, and a target's slice."""

    request: Request
    model: dict[str, object]

    def to_json(self) -> dict[str, object]:
        r = self.request
        rows = {"rows_per_host": r.rows_per_host} if r.target is not None else {}
        ramp = {"batch_schedule": r.schedule.to_json()} if r.schedule.kind != "fixed" else {}
        return {**r.plan.to_json(), **r.slice, **rows, **ramp, "model": self.model}


def summary(request: Request) -> Summary:
    """The plan `jaxkit plan` prints."""
    return Summary(request, model_json(request.config, request.plan))


def split_json(
    split: costs.Split, predicted: step_time.Prediction | None = None
) -> dict[str, object]:
    out: dict[str, object] = {"devices": split.devices, **split.plan.to_json()}
    out["remat"] = split.remat
    if split.cost is not None:
        out |= split.cost.to_json()
    if predicted is not None:
        out |= predicted.to_json()
    if split.out_of_memory is not None:  # the compiler refused it
        out |= {
            "memory_bytes": None,
            "out_of_memory": str(split.out_of_memory),
            "needed_bytes": split.out_of_memory.needed_bytes,
        }
    return out


@dataclasses.dataclass(frozen=True)
class Candidates:
    """The splits to compile: each remat policy's, on each device count that has one."""

    splits: list[costs.Split]
    left_out: dict[int, str]  # device count → why it has no split
    counts: list[int]  # the device counts that have splits, most first


@dataclasses.dataclass(frozen=True)
class AllSplits:
    """`jaxkit plan --all-splits`: every split with its compiled cost, and the one
    recommended within the budget on all the devices (None without a budget or a fit)."""

    request: Request
    splits: list[costs.Split]
    left_out: dict[int, str]
    counts: list[int]
    recommended: costs.Split | None
    # With a target: each compiled split's predicted step (step_time.py), by Split.key.
    predictions: dict[tuple[int, int, int, str | None], step_time.Prediction] = dataclasses.field(
        default_factory=dict
    )

    def predicted(self, split: costs.Split) -> step_time.Prediction | None:
        return self.predictions.get(split.key)

    def to_json(self) -> dict[str, object]:
        chosen = self.recommended
        return {
            **self.request.slice,
            "memory_budget_bytes": self.request.budget,
            "left_out_device_counts": {str(n): why for n, why in self.left_out.items()},
            "recommended": {**chosen.plan.to_json(), "remat": chosen.remat} if chosen else None,
            "splits": [split_json(s, self.predicted(s)) for s in self.splits],
        }


def candidate_splits(
    request: Request, device_counts: str | Sequence[int] | None = None
) -> Candidates:
    """Every exact split of the global batch on each device count (default: every divisor
    of the device count; a target's slice is planned whole), for each remat policy."""
    config, live = request.config, len(request.devices)
    if request.target is not None and device_counts is not None:
        raise PlanError(
            "--device-counts does not apply with --target: the plan is for the whole "
            "slice (plan a smaller slice as a target of its own)"
        )
    counts = [live] if request.target is not None else resolve_device_counts(device_counts, live)
    check_counts_shard_evenly(config, counts)
    splits = costs.enumerate_splits(config, counts)
    dropped = costs.left_out(config, counts, splits)
    if not splits:
        raise PlanError(
            "no split on any of the device counts: "
            + "; ".join(f"{n} devices: {why}" for n, why in dropped.items())
        )
    counts = sorted({s.devices for s in splits}, reverse=True)
    splits = [dataclasses.replace(s, remat=r) for r in request.policies for s in splits]
    return Candidates(splits, dropped, counts)


def cost_splits(
    request: Request,
    candidates: Candidates,
    progress: Callable[[costs.Split], None] = lambda split: None,
) -> AllSplits:
    """Compiles each candidate (nothing runs) and recommends one; `progress(split)` after
    each compile."""
    splits = costs.with_costs(request.config, candidates.splits, request.devices, progress)
    budget, devices = request.budget, len(request.devices)
    predictions = {s.key: p for s in splits if (p := prediction(request, s)) is not None}
    chosen = None
    if budget is not None:
        chosen = costs.recommend(splits, budget, devices, predictions)
    return AllSplits(request, splits, candidates.left_out, candidates.counts, chosen, predictions)


def all_splits(
    request: Request,
    device_counts: str | Sequence[int] | None = None,
    progress: Callable[[costs.Split], None] = lambda split: None,
) -> AllSplits:
    """`jaxkit plan --all-splits`: `candidate_splits`, each compiled."""
    return cost_splits(request, candidate_splits(request, device_counts), progress)


def _as_dict(
    policy: str | None,
    result: costs.BatchSearch,
    predicted: step_time.Prediction | None = None,
) -> dict[str, object]:
    c = result.cost
    timed = predicted.to_json() if predicted is not None else {}
    return {
        "remat": policy,
        "max_per_device_batch_size": result.per_device_batch_size,
        "memory_bytes": c.memory_bytes if c else None,
        "model_flops_per_step": c.model_flops_per_step if c else None,
        "hardware_flops_per_step": c.hardware_flops_per_step if c else None,
        "compiles": result.compiles,
        "seconds": result.seconds,
        "tried": {str(b): m for b, m in sorted(result.tried.items())},
        "out_of_memory": {str(b): str(e) for b, e in sorted(result.refused.items())},
        **timed,
    }


def predicted(result: costs.BatchSearch) -> tuple[float, int, int]:
    """The order of predicted model FLOP/s (costs.recommend's): less recompute, wider."""
    assert result.cost is not None
    c = result.cost
    ratio = c.hardware_flops_per_step / c.model_flops_per_step
    return costs.predicted_speed(ratio, result.per_device_batch_size, 1)


@dataclasses.dataclass(frozen=True)
class MaxBatch:
    """`jaxkit plan --max-per-device-batch`: a search per remat policy; with several, the
    one with the most model FLOPs per second predicted is recommended (`best`)."""

    request: Request
    budget: int
    searches: list[tuple[str | None, costs.BatchSearch]]
    # With a target: the predicted step of each policy's largest batch (K = 1).
    predictions: dict[str | None, step_time.Prediction] = dataclasses.field(default_factory=dict)

    @property
    def fitting(self) -> list[tuple[str | None, costs.BatchSearch]]:
        return [(p, r) for p, r in self.searches if r.cost is not None]

    @property
    def best(self) -> tuple[str | None, costs.BatchSearch]:
        return max(self.fitting, key=lambda pr: predicted(pr[1]), default=self.searches[0])

    def to_json(self) -> dict[str, object]:
        """What each size needed, also from a search that found nothing."""
        return {
            **self.request.slice,
            "memory_budget_bytes": self.budget,
            **_as_dict(*self.best, self.predictions.get(self.best[0])),
            "by_remat": [_as_dict(p, r, self.predictions.get(p)) for p, r in self.searches],
        }

    def check(self) -> None:
        """Raises PlanError when even a per-device batch of 1 does not fit."""
        if self.fitting:
            return
        policy, result = self.searches[0]
        one = result.tried[1]
        needs = (
            costs.format_bytes(one)
            if one is not None
            else f"more than the device has (the compiler: {result.refused[1]})"
        )
        raise PlanError(
            f"even per_device_batch_size=1 needs {needs} per device on "
            f"{len(self.request.devices)} devices, more than the budget of "
            f"{costs.format_bytes(self.budget)}: a smaller model, a larger budget, "
            + ("model.remat=full, " if policy not in (None, "full") else "")
            + "or more devices (mesh.fsdp shards the state)"
        )


def max_batch(
    request: Request,
    starting: Callable[[str | None, int], None] = lambda policy, b: None,
    progress: Callable[[str | None, int, int | None], None] = lambda policy, b, memory: None,
) -> MaxBatch:
    """The largest per-device batch under the budget, by compile-only search for each remat
    policy. `starting(policy, b)` as each compile begins, `progress(policy, b, memory)` as it
    ends (memory None: the compiler refused it). `check()` the result for a fit."""
    budget = request.budget
    if budget is None:
        raise PlanError(
            f"{request.devices[0].platform} devices report no memory limit: give "
            "--memory-budget, e.g. --memory-budget 2GiB"
        )
    searches = []
    for policy in request.policies:
        found = costs.max_per_device_batch(
            costs.with_remat(request.config, policy),
            request.devices,
            budget,
            progress=functools.partial(progress, policy),
            starting=functools.partial(starting, policy),
        )
        searches.append((policy, found))
    predictions = {}
    for policy, found in searches:
        if found.cost is None:
            continue
        config = costs.split_config(
            costs.with_remat(request.config, policy), found.per_device_batch_size, 1
        )
        split = costs.Split(len(request.devices), plan_from_config(config, request.shape))
        timed = prediction(request, dataclasses.replace(split, cost=found.cost))
        if timed is not None:
            predictions[policy] = timed
    return MaxBatch(request, budget, searches, predictions)

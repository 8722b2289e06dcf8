"""What the experiments share: the request and its preamble (devices, mesh, plan, steps), the
checks every unit passes before the first starts, training a unit or a split, and the report
rewritten as units finish. The experiments import this module; `jaxkit.experiments` imports
them, and nothing here imports it back.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import math
import pathlib
import sys
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple, TypeVar

import jax
import ml_collections
import numpy as np
import tqdm
from etils import epath
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from jaxkit import mesh as mesh_lib
from jaxkit.batch.plan import LR_SCALINGS, BatchPlan, BatchPlanError
from jaxkit.batch.schedule import plan_from_config, schedule_from_config
from jaxkit.config import ConfigError, run_config, validate
from jaxkit.data import sources as data_lib
from jaxkit.models import check_mesh_divides
from jaxkit.plan.costs import split_batch
from jaxkit.step.train_step import check_on_mesh
from jaxkit.train.loop import RunResult, stop_requests, train
from jaxkit.workdir import write_text_atomic

U = TypeVar("U")  # one unit of an experiment's work


class ExperimentError(ValueError):
    """An experiment that cannot run as asked."""


class Interrupted(Exception):  # noqa: N818 — it is what happened, not a failure
    """Ctrl-C (or SIGTERM) during an experiment: the report so far is written and marked.
    `signal_name` is the stop's: SIGINT or SIGTERM (the command's exit status follows it)."""

    def __init__(self, signal_name: str = "SIGINT"):
        super().__init__(signal_name)
        self.signal_name = signal_name

    @property
    def how(self) -> str:
        """What stopped the experiment, as its report and the command say it."""
        return "terminated (SIGTERM)" if self.signal_name == "SIGTERM" else "interrupted"


def stopped_by(result: RunResult) -> None:
    """Raises Interrupted if a stop was asked for while `result`'s run trained: also one at
    its last step, which finished that run but must stop the experiment."""
    if result.stop_requests:  # also there when it stopped the run (result.stopped)
        first = result.stop_requests[0]  # or the test hook stop_after_micro_steps
        raise Interrupted(first if first.startswith("SIG") else "SIGINT")


@dataclasses.dataclass
class Options:
    """What the experiment commands take besides the config."""

    steps: int | None = None  # optimizer steps per training unit (each has its default)
    splits: str | None = None  # equivalence, normalisation: "DxBxK,..." D × per-device × K
    global_batch_sizes: str | None = None  # batch-size: "16,32,64"
    lr_scaling: str | None = None  # batch-size: none | linear | sqrt
    max_per_device_batch: int | None = None  # memory/throughput: the largest batch swept
    rss_points: int = 3  # memory: measured resident-memory points (CPU, Linux)
    devices: Sequence[jax.Device] | None = None  # default: the live ones
    target: str | None = None  # memory: the described TPU slice `devices` are, in words


class Report:
    """A Markdown report with PNG figures, rewritten whole after every unit of work."""

    def __init__(self, out: pathlib.Path, title: str, replaces: Sequence[str] = ()):
        """`replaces`: files beside report.md that the rendering writes (a JSON of numbers):
        an earlier experiment's, left in OUT, go with the first write, so that they cannot
        pass for this one's before its first drawing writes them, or if it never does."""
        # OUT is made by the first write (`drive`'s, once its signal handlers are in place):
        # a stop before it leaves no empty OUT behind.
        self.out, self.title = out, title
        self.replaces = tuple(replaces)
        self.blocks: list[str] = []
        self.started = datetime.datetime.now().isoformat(timespec="seconds")

    def text(self, markdown: str) -> None:
        self.blocks.append(markdown.strip())

    def table(self, header: Sequence[object], rows: Sequence[Sequence[object]]) -> None:
        self.blocks.append(markdown_table(header, rows))

    def figure(self, fig: Figure, name: str, caption: str) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        fig.savefig(self.out / name, dpi=110, bbox_inches="tight")
        self.blocks.append(f"![{caption}]({name})\n\n*{caption}*")

    def write(self, status: str | None = None) -> pathlib.Path:
        """Writes report.md; `status` (e.g. partial) goes at the top in bold."""
        head = [f"# {self.title}", f"Started {self.started}."]
        if status:
            head.append(f"**{status}**")
        self.out.mkdir(parents=True, exist_ok=True)
        path = self.out / "report.md"
        write_text_atomic(epath.Path(path), "\n\n".join(head + self.blocks) + "\n")
        for name in self.replaces:  # after the report that is marked as this one's
            (self.out / name).unlink(missing_ok=True)
        self.replaces = ()
        return path


# How often a running experiment redraws its partial report, at most. Drawing the figures
# costs about as much as a short unit of work on a CPU, so a unit that ends within this time
# of the last drawing leaves the report as it was; the last unit, Ctrl-C and an error always
# redraw it.
REDRAW_SECONDS = 30.0


def drive(
    report: Report,
    units: Sequence[U],
    do_unit: Callable[[U], None],
    render: Callable[[Report], None],
    what: str,
    echo: Callable[[str], None] = print,
) -> pathlib.Path:
    """Does each unit, re-rendering and rewriting the report after a unit when REDRAW_SECONDS
    have passed since it was last drawn, and after the last unit.

    Ctrl-C or SIGTERM (during a unit's training, the loop's own stop) writes what is done
    so far, marked partial, and raises Interrupted naming the signal; any other error writes
    it marked as stopped by that error, and goes on up.
    """
    done = 0

    def rewrite(status: str | None = None) -> pathlib.Path:
        report.blocks = []
        render(report)
        return report.write(status)

    # The handlers first: a stop as the report's path is said still leaves that report.
    # Between and around the units (whose loop takes the signals over while it trains),
    # the first stop is raised at once, and noted in case that exception is dropped.
    with stop_requests(interrupt=True) as noted:
        bar: tqdm.tqdm | None = None
        try:
            # Said here, once every unit has passed its checks, not before: a refused
            # request writes nothing.
            echo(
                f"{report.title}: {len(units)} {what}, writing "
                f"{(report.out / 'report.md').resolve()}"
            )
            # At once, without figures: a report an earlier experiment left in this directory
            # must not pass for this one's until the first drawing.
            bar = tqdm.tqdm(total=len(units), unit=what, file=sys.stderr, dynamic_ncols=True)
            report.blocks = []
            report.write(f"Partial report: 0 of {len(units)} {what} done, still running.")
            drawn = time.monotonic()
            for unit in units:
                bar.set_postfix_str(str(unit))
                do_unit(unit)
                done += 1
                bar.update(1)
                if noted:  # a stop whose KeyboardInterrupt was dropped on the way
                    raise KeyboardInterrupt
                if done < len(units) and time.monotonic() - drawn >= REDRAW_SECONDS:
                    rewrite(f"Partial report: {done} of {len(units)} {what} done, still running.")
                    drawn = time.monotonic()
            # Inside the try: Ctrl-C or an error while the last drawing runs (seconds) still
            # leaves a report that says so.
            path = rewrite()
            if noted:
                raise KeyboardInterrupt
            return path
        except (KeyboardInterrupt, Interrupted) as e:
            stop = Interrupted(noted[0] if noted else getattr(e, "signal_name", "SIGINT"))
            rewrite(
                f"Partial report: {stop.how} after {done} of {len(units)} {what}; "
                "the figures below cover only those."
            )
            raise stop from None
        except Exception as e:
            # The error goes on up whatever happens here: a report that cannot be drawn from
            # the units done so far must not hide it.
            with contextlib.suppress(Exception):
                rewrite(
                    f"Partial report: stopped by an error after {done} of {len(units)} {what} "
                    f"({type(e).__name__}); the figures below cover only those."
                )
            raise
        finally:
            if bar is not None:
                bar.close()


def relative_difference(diff: np.ndarray, ref: np.ndarray) -> float | None:
    """Max of diff / |ref| step by step, over the scored steps whose reference loss is not
    0 (nothing to be relative to); None if none."""
    scored = np.isfinite(ref) & np.isfinite(diff) & (np.abs(ref) > 0)
    return float(np.max(diff[scored] / np.abs(ref[scored]))) if scored.any() else None


def markdown_table(header: Sequence[object], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(str(h) for h in header) + " |"]
    lines.append("|" + "|".join("---" for _ in header) + "|")
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class Split:
    """devices × per_device_batch_size × grad_accum_steps, as the seeds write it."""

    devices: int
    per_device: int
    accum: int

    @property
    def name(self) -> str:
        return f"{self.devices}×{self.per_device}×{self.accum}"

    def __str__(self) -> str:
        return self.name


def check_global_batch(split: Split, global_batch: int) -> None:
    """Refuses a split whose devices × per-device batch × K is not `global_batch`."""
    made = split.devices * split.per_device * split.accum
    if made != global_batch:
        raise ExperimentError(
            f"split {split.name} makes a global batch of {made}, not the config's {global_batch}"
        )


def parse_splits(text: str) -> list[Split]:
    splits = []
    for part in text.split(","):
        try:
            d, b, k = (int(x) for x in part.lower().replace("×", "x").split("x"))
        except ValueError:
            raise ExperimentError(
                f"--splits: {part!r} is not DEVICESxPER_DEVICExACCUM (e.g. 4x8x1)"
            ) from None
        if min(d, b, k) < 1:  # as --global-batch-sizes: said as such, not as its product
            raise ExperimentError(
                f"--splits: {part!r}: devices, per-device batch and accumulation steps must "
                "each be at least 1"
            )
        split = Split(d, b, k)
        if split in splits:  # trained twice, it would show once in every table and figure
            raise ExperimentError(f"--splits: {split.name} is given twice")
        splits.append(split)
    return splits


def unit_config(config: ml_collections.ConfigDict, steps: int) -> ml_collections.ConfigDict:
    """What `train_unit` trains: `steps` optimizer steps, logging every step, one eval at the
    end on a single held-out micro-batch (the experiments compare training curves; the eval
    only keeps the loop's end-of-run contract cheap)."""
    c = ml_collections.ConfigDict(config.to_dict())
    c.train.steps, c.train.log_every = steps, 1
    c.train.eval_every, c.train.eval_examples = 0, 32
    c.train.profile_steps = ""
    return c


def train_unit(
    config: ml_collections.ConfigDict,
    devices: Sequence[jax.Device],
    steps: int,
    echo: Callable[[str], None] = lambda line: None,
) -> RunResult:
    """Trains `unit_config(config, steps)` on `devices`."""
    result = train(unit_config(config, steps), None, devices=devices, progress=False, echo=echo)
    stopped_by(result)
    return result


def split_unit(
    config: ml_collections.ConfigDict, split: Split, devices: Sequence[jax.Device]
) -> tuple[ml_collections.ConfigDict, list[jax.Device]]:
    """A split's config (its per-device batch, K and mesh) and the devices it runs on."""
    if split.devices > len(devices):
        raise ExperimentError(
            f"split {split.name} needs {split.devices} devices; {len(devices)} are available "
            "(--host-devices N simulates more on the CPU)"
        )
    c = ml_collections.ConfigDict(config.to_dict())
    c.batch.update(split_batch(split.per_device, split.accum))
    shape = split_mesh(config, split)
    # The sizes within a slice: the dcn keys, kept, multiply them back to `shape`.
    c.mesh.data = shape["data"] // c.mesh.dcn_data
    c.mesh.fsdp = shape["fsdp"] // c.mesh.dcn_fsdp
    c.mesh.tensor = shape["tensor"]
    return c, list(devices[: split.devices])


def train_split(
    config: ml_collections.ConfigDict,
    split: Split,
    devices: Sequence[jax.Device],
    steps: int,
) -> RunResult:
    return train_unit(*split_unit(config, split, devices), steps)


def check_splits(
    config: ml_collections.ConfigDict,
    splits: Sequence[Split],
    devices: Sequence[jax.Device],
    steps: int,
) -> None:
    """`check_units` for what `train_split` trains of each split."""
    units = []
    for split in splits:
        c, on = split_unit(config, split, devices)
        units.append((f"split {split.name}", unit_config(c, steps), on))
    check_units(units)


def check_units(
    units: Sequence[tuple[str, ml_collections.ConfigDict, Sequence[jax.Device]]],
) -> None:
    """Refuses, naming the unit, any `(label, config, devices)` that `train` would refuse
    at its start: before OUT exists and before anything compiles, rather than after hours
    of the units before it. Each distinct data section is read once."""
    sources: dict[str, tuple[data_lib.Source, data_lib.Source]] = {}
    for label, c, devices in units:
        try:
            validate(c)
            typed = run_config(c)
            shape = mesh_lib.resolve_mesh_shape(c.mesh.to_dict(), len(devices))
            check_on_mesh(typed, shape)
            largest = schedule_from_config(typed, shape).largest
            # The sources depend on the data section and the model (its vocabulary).
            key = json.dumps([c.data.to_dict(), c.model.to_dict()], sort_keys=True, default=str)
            if key not in sources:
                sources[key] = data_lib.make_sources(typed)
            train_source, eval_source = sources[key]
            data_lib.check_sources(train_source, largest)
            data_lib.check_eval_weight(eval_source, c.train.eval_examples)
        except (ConfigError, BatchPlanError, mesh_lib.MeshError, data_lib.DataError) as err:
            raise ExperimentError(f"{label}: {err}") from None


def split_mesh(config: ml_collections.ConfigDict, split: Split) -> dict[str, int]:
    """The config's mesh on a split's devices, every one of them a data-parallel rank (the
    seeds' D × B × K is the global batch): data × fsdp, as the config divides them."""
    try:
        shape = mesh_lib.resolve_mesh_shape(config.mesh.to_dict(), split.devices)
    except mesh_lib.MeshError as err:
        raise ExperimentError(f"split {split.name}: {err}") from None
    if shape["tensor"] != 1:
        raise ExperimentError(
            f"split {split.name}: a split's {split.devices} devices are its data-parallel "
            f"ranks (devices × per-device batch × accumulation = the global batch), but "
            f"mesh.tensor={shape['tensor']} would give several of them the same rows; use "
            "mesh.tensor=1 (data and fsdp both split the batch)"
        )
    try:
        check_mesh_divides(run_config(config), shape)
    except ConfigError as err:
        raise ExperimentError(f"split {split.name}: {err}") from None
    return shape


@dataclasses.dataclass(frozen=True)
class Request:
    """One experiment as the command asked for it: what each experiment's `run` takes."""

    config: ml_collections.ConfigDict
    out: pathlib.Path  # where report.md and its figures go
    options: Options
    echo: Callable[[str], None] = print  # progress lines


class Preamble(NamedTuple):
    """Where every experiment starts."""

    devices: list[jax.Device]  # Options.devices, by default the live ones
    shape: dict[str, int]  # the config's mesh on them (one device: see `preamble`)
    plan: BatchPlan  # the config's batch plan on that mesh, its K included
    steps: int  # optimizer steps per training unit: --steps, or the experiment's default


ONE_DEVICE = {"data": 1, "fsdp": 1, "tensor": 1}


def preamble(request: Request, default_steps: int = 0, *, own_meshes: bool = False) -> Preamble:
    """The devices, the config's mesh and batch plan on them, and the steps of each unit.

    `own_meshes`: each unit brings its mesh (a split's devices), so the config's own mesh
    is not asked for; the plan is taken on one device, for the global batch alone.
    """
    config, options = request.config, request.options
    devices = list(jax.devices() if options.devices is None else options.devices)
    shape = (
        ONE_DEVICE
        if own_meshes
        else mesh_lib.resolve_mesh_shape(config.mesh.to_dict(), len(devices))
    )
    plan = plan_from_config(run_config(config), shape)
    return Preamble(devices, shape, plan, options.steps or default_steps)


def params_note(config: ml_collections.ConfigDict, measures: str | None = None) -> str | None:
    """Where a report's runs start, where model.init_from names a directory (None: random
    params from train.seed, as every report says by default). `measures`: what the
    experiment measures, where the params' values cannot change it (speed, memory): its
    runs start from random params of the directory's shape (`random_params`)."""
    source = config.model.get("init_from")
    if source is None:
        return None
    if measures is None:
        return f"Every run starts from the params of `{source}` (model.init_from)."
    return (
        f"The params' values do not change {measures}: the runs start from random params "
        f"of the shape `{source}` gives (model.init_from), without reading its weights."
    )


def random_params(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """`config` with model.init_from unset: the architecture it gave kept, the weights not
    read (a multi-GB load per unit, for what the values do not change)."""
    if config.model.get("init_from") is None:
        return config
    c = ml_collections.ConfigDict(config.to_dict())
    c.model.init_from = None
    return c


def lr_scaling(request: Request) -> str:
    """--lr-scaling, else the config's optimizer.lr_scaling: the rule a run's rate follows."""
    rule = request.options.lr_scaling or request.config.optimizer.lr_scaling
    if rule not in LR_SCALINGS:
        raise ExperimentError(f"--lr-scaling={rule!r} is not one of {', '.join(LR_SCALINGS)}")
    return str(rule)


def powers_of_two(limit: int) -> list[int]:
    """1, 2, 4, ... up to `limit`: the per-device batches a sweep tries."""
    return [2**i for i in range(int(math.log2(max(limit, 1))) + 1)]


def new_figure() -> tuple[Figure, Axes]:
    fig = Figure(figsize=(7, 4.2))
    return fig, fig.subplots()


def loss_figures(report: Report, curves: dict[str, dict], target: float | None = None) -> None:
    """Loss against examples seen and against optimizer steps (log scale), one line per
    run (`curves[label]` holds arrays "examples", "steps", "loss"); `target` a dotted line."""
    for x, label, name in (
        ("examples", "examples seen", "loss_vs_examples.png"),
        ("steps", "optimizer steps", "loss_vs_steps.png"),
    ):
        fig, ax = new_figure()
        for run_label, r in curves.items():
            ax.plot(r[x], r["loss"], label=run_label)
        if target is not None:
            ax.axhline(target, color="grey", linestyle=":", linewidth=1)
        ax.set_xlabel(label)
        ax.set_ylabel("training loss")
        if x == "steps":
            ax.set_xscale("log")
        ax.grid(alpha=0.3)
        ax.legend()
        report.figure(fig, name, f"Loss against {label}")

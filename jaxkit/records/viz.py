"""Pictures and tables of the batch relation, for the notebooks.

Each function reads what the kit did (the batches the loop loads, the records a run returns,
the arrays of a train state) and draws or tabulates it; nothing here decides anything.
Plots draw on matplotlib axes the caller makes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh
from matplotlib.axes import Axes
from matplotlib.patches import Patch, Rectangle
from matplotlib.ticker import MaxNLocator

from jaxkit import mesh as mesh_lib
from jaxkit.batch.plan import BatchPlan, format_table
from jaxkit.data import sources as data_lib


@dataclasses.dataclass(frozen=True)
class BatchLayout:
    """Where each row of one optimizer step's global batch is processed.

    Index p is position p of the global batch; `example[p]` is the data set row there.
    """

    example: np.ndarray  # (global_batch_size,) data set rows, in global-batch order
    device: np.ndarray  # (global_batch_size,) index of the device in the mesh
    micro_step: np.ndarray  # (global_batch_size,) micro-step 0..K-1


def batch_layout(
    plan: BatchPlan, mesh: Mesh, num_rows: int, seed: int, step: int = 0
) -> BatchLayout:
    """Loads optimizer step `step`'s micro-batches as the loop does and reads back which
    device holds which rows.

    The source holds each row's own index, so every loaded value names a data set row of
    a data set of `num_rows` rows.
    """
    ids = np.arange(num_rows)
    source = data_lib.ArraySource(inputs=ids[:, None], targets=ids)
    order = data_lib.global_batch_rows(step, plan.global_batch_size, num_rows, seed)
    position = {int(row): p for p, row in enumerate(order)}
    flat_devices = list(mesh.devices.flat)
    g = plan.global_batch_size
    device, micro_step = np.full(g, -1), np.full(g, -1)
    sharding = mesh_lib.batch_sharding(mesh)
    for micro in range(plan.grad_accum_steps):
        first = step * plan.global_batch_size  # the data position of a fixed global batch
        batch = data_lib.load_micro_batch(source, first, micro, plan, seed, sharding)
        for shard in batch["targets"].addressable_shards:
            # With a tensor axis, several devices hold the same rows: name the first.
            for row in np.asarray(shard.data):
                p = position[int(row)]
                if device[p] == -1:
                    device[p] = flat_devices.index(shard.device)
                    micro_step[p] = micro
    if (device < 0).any():
        raise AssertionError("some rows of the global batch were not loaded")
    return BatchLayout(example=order, device=device, micro_step=micro_step)


def plot_batch_layouts(ax: Axes, layouts: Mapping[str, BatchLayout]) -> None:
    """One bar per split: the global batch's rows coloured by device, cut into micro-steps."""
    colors = [f"C{i}" for i in range(10)]
    for y, layout in enumerate(layouts.values()):
        for p, (d, m) in enumerate(zip(layout.device, layout.micro_step, strict=True)):
            cell = Rectangle((p, y - 0.4), 1, 0.8, facecolor=colors[d % len(colors)], lw=0)
            ax.add_patch(cell)
            if p == 0 or layout.micro_step[p - 1] != m:  # a micro-step begins here
                ax.plot([p, p], [y - 0.45, y + 0.45], color="black", lw=2.5)
                ax.text(p + 0.3, y, f"micro-step {m}", color="white", fontsize=8, va="center")
    ax.set_xlim(0, max(len(layout.device) for layout in layouts.values()))
    ax.set_ylim(len(layouts) - 0.5, -0.5)
    ax.set_yticks(range(len(layouts)), list(layouts))
    ax.set_xlabel("position in the global batch of optimizer step 0")
    most = max(int(layout.device.max()) + 1 for layout in layouts.values())
    handles = [Patch(color=colors[d % len(colors)], label=f"device {d}") for d in range(most)]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)


def loss_curve(records: Sequence[dict]) -> tuple[np.ndarray, np.ndarray]:
    """(optimizer steps, losses) of a run's train records (eval records left out); NaN,
    drawn as a gap, for a step that scored no target (its loss is logged as null)."""
    train = [r for r in records if "loss" in r]
    return np.array([r["step"] for r in train]), np.array([r["loss"] for r in train], dtype=float)


def _style(i: int, label: str, styles: Mapping[str, dict] | None) -> dict:
    """Line i's colour from the default cycle, unless `styles` says otherwise."""
    return {"color": f"C{i}", **(styles or {}).get(label, {})}


def plot_losses(
    ax: Axes,
    curves: Mapping[str, tuple[np.ndarray, np.ndarray]],
    styles: Mapping[str, dict] | None = None,
) -> None:
    """Loss against optimizer steps, one line per run."""
    for i, (label, (steps, losses)) in enumerate(curves.items()):
        ax.plot(steps, losses, label=label, **_style(i, label, styles))
    ax.set_xlabel("optimizer step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("training loss")
    ax.legend(fontsize=8)


FLOOR = 1e-10  # where bitwise-equal losses are drawn on the log axis


def plot_relative_differences(
    ax: Axes,
    curves: Mapping[str, tuple[np.ndarray, np.ndarray]],
    reference: str,
    tolerance: float | None = None,
    styles: Mapping[str, dict] | None = None,
) -> None:
    """|loss − reference loss| / reference loss per optimizer step, on a log scale.

    Colours match `plot_losses` for the same `curves` and `styles`.
    """
    ref_steps, ref = curves[reference]
    for i, (label, (steps, losses)) in enumerate(curves.items()):
        if label == reference:
            continue
        if not np.array_equal(steps, ref_steps):
            raise ValueError(f"{label} logged other steps than {reference}")
        diff = np.maximum(np.abs(losses - ref) / np.abs(ref), FLOOR)
        style = {"marker": ".", "lw": 0.8, **_style(i, label, styles)}
        ax.plot(steps, diff, label=label, **style)
    if tolerance is not None:
        ax.axhline(tolerance, color="black", ls=":", lw=1, label=f"tolerance {tolerance:g}")
    ax.set_yscale("log")
    ax.set_ylim(bottom=FLOOR / 3)
    ax.set_xlabel("optimizer step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(f"relative difference from {reference}\n(bottom edge: bitwise equal)")
    ax.legend(fontsize=8)


def _path_name(path: tuple) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def sharding_table(tree: Any) -> str:
    """Each array of a tree: its shape, its PartitionSpec, and the shape one device holds."""
    rows = []
    for path, x in jax.tree_util.tree_leaves_with_path(tree):
        spec = getattr(x.sharding, "spec", "?")
        shard = x.addressable_shards[0].data.shape
        rows.append((_path_name(path), tuple(x.shape), spec, tuple(shard)))
    return format_table(("array", "shape", "PartitionSpec", "per device"), rows)

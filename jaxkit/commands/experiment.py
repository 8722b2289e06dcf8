"""`jaxkit experiment`: measures a seed claim on a config and writes a Markdown report."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from jaxkit.batch.plan import LR_SCALINGS
from jaxkit.commands import common

if TYPE_CHECKING:
    import jax
    import ml_collections


EXPERIMENTS = (
    "equivalence",
    "memory",
    "throughput",
    "batch-size",
    "noise-scale",
    "batch-ramp",
    "normalisation",
)
# The experiments that read each experiment option: elsewhere a value would be ignored.
EXPERIMENT_OPTIONS = {
    "steps": (
        "equivalence",
        "throughput",
        "batch-size",
        "noise-scale",
        "batch-ramp",
        "normalisation",
    ),
    "splits": ("equivalence", "normalisation"),
    "global_batch_sizes": ("batch-size",),
    "lr_scaling": ("batch-size", "batch-ramp"),
    "max_per_device_batch": ("memory", "throughput"),
    "rss_points": ("memory",),
    "target": ("memory",),
}


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    experiment = sub.add_parser(
        "experiment",
        help="measure a seed claim on a config: a Markdown report with tables and plots",
    )
    experiment.add_argument(
        "name",
        choices=EXPERIMENTS,
        help="equivalence: every split of the global batch trains the same model; memory: "
        "compiled (and measured) memory against per-device batch and accumulation; "
        "throughput: speed against the same; batch-size: several global batches on the same "
        "examples; noise-scale: the critical batch size from the gradient noise scale; "
        "batch-ramp: fixed small, fixed large, scheduled and automatic growing batches on the "
        "same examples; normalisation: exact against naive loss normalisation over splits "
        "that vary the accumulation steps",
    )
    common.add_common(experiment)
    experiment.add_argument(
        "--out",
        type=common.directory,
        metavar="DIR",
        help="default runs/experiment-NAME-CONFIG-TIME",
    )
    experiment.add_argument(
        "--steps",
        type=common.int_at_least(1),
        metavar="N",
        help="optimizer steps per run (batch-ramp: of the small-batch run; the others train on "
        "as many examples)",
    )
    experiment.add_argument(
        "--splits",
        metavar="DxBxK,...",
        help="equivalence, normalisation: e.g. 1x32x1,4x8x1,2x8x2,1x8x4",
    )
    experiment.add_argument(
        "--global-batch-sizes", metavar="G,G,...", help="batch-size: e.g. 16,32,64,128"
    )
    experiment.add_argument(
        "--lr-scaling",
        choices=LR_SCALINGS,
        help="batch-size, batch-ramp: scaling rule",
    )
    experiment.add_argument(
        "--max-per-device-batch",
        type=common.int_at_least(1),
        metavar="B",
        help="memory, throughput: the largest per-device batch swept (powers of two up to B)",
    )
    experiment.add_argument(
        "--rss-points",
        type=common.int_at_least(0),
        metavar="N",
        help="memory: measured points (CPU; default 3, 0 = none)",
    )
    experiment.add_argument("--target", metavar="TARGET", help="memory: " + common.TARGET_HELP)
    return experiment


def ignored_option(opts: argparse.Namespace) -> str | None:
    """An option the named experiment would ignore, said as a usage error."""
    for option, users in EXPERIMENT_OPTIONS.items():
        if getattr(opts, option) is not None and opts.name not in users:
            flag = "--" + option.replace("_", "-")
            return f"{flag} applies to experiment {' and '.join(users)}, not {opts.name}"
    return None


def run(
    config: ml_collections.ConfigDict, opts: argparse.Namespace, devices: Sequence[jax.Device]
) -> int:
    import pathlib

    from jaxkit import experiments

    out = opts.out or common.default_dir(f"experiment-{opts.name}-{config.name}")
    common.check_can_write(out, "--out")
    options = experiments.Options(
        steps=opts.steps,
        splits=opts.splits,
        global_batch_sizes=opts.global_batch_sizes,
        lr_scaling=opts.lr_scaling,
        max_per_device_batch=opts.max_per_device_batch,
        devices=devices,
        target=opts.target.describe() if opts.target is not None else None,
    )
    if opts.rss_points is not None:  # None: the option was not given, the default holds
        options.rss_points = opts.rss_points
    # Where the report goes is said by the experiment once every unit has passed its
    # checks: a refused request writes nothing.
    try:
        path = experiments.run(opts.name, config, pathlib.Path(out), options)
    except experiments.ExperimentError as err:
        print(f"jaxkit: error: {err}", file=sys.stderr)
        return 2
    except experiments.Interrupted as stop:
        print(f"{stop.how}: partial report at {pathlib.Path(out).resolve()}/report.md")
        return common.TERMINATED if stop.signal_name == "SIGTERM" else common.INTERRUPTED
    print(f"report: {path.resolve()}")
    return 0

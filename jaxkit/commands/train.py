"""`jaxkit train`: trains a config and writes config, plan, metrics and checkpoints to a workdir."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from jaxkit.commands import common

if TYPE_CHECKING:
    import ml_collections


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    train = sub.add_parser("train", help="train and write config, plan and metrics to a workdir")
    common.add_common(train)
    train.add_argument(
        "--workdir",
        type=common.directory,
        metavar="DIR",
        help="where to write: a path or gs://BUCKET/PATH (default runs/CONFIG-TIMESTAMP)",
    )
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    multi = train.add_argument_group(
        "multi-process (automatic on Cloud TPU VMs and SLURM, Open MPI or Kubernetes "
        "clusters; or JAXKIT_COORDINATOR etc.)"
    )
    multi.add_argument("--coordinator", metavar="HOST:PORT", help="process 0's address")
    multi.add_argument(
        "--num-processes", type=common.int_at_least(1), metavar="P", help="processes in the run"
    )
    multi.add_argument(
        "--process-id", type=common.int_at_least(0), metavar="I", help="this process, 0..P-1"
    )
    train.add_argument(
        "--allow-batch-change",
        action="store_true",
        help="resume even if the global batch changes (learning rate rescaled by the policy)",
    )
    train.add_argument(
        "--allow-longer",
        action="store_true",
        help="extend a finished or running run to a larger train.steps; the learning-rate "
        "schedule is re-laid over the new length",
    )
    return train


def run(config: ml_collections.ConfigDict, opts: argparse.Namespace) -> int:
    import jax

    from jaxkit.records.steps import NonFiniteLossError
    from jaxkit.train.loop import train
    from jaxkit.workdir import absolute

    workdir = opts.workdir or common.default_dir(config.name)
    common.check_can_write(workdir, "--workdir")
    if jax.process_index() == 0:  # one voice: the others write no run directory
        print(f"workdir: {absolute(workdir)}")  # a gs:// URL as given
    try:
        train(
            config,
            workdir,
            progress=not opts.no_progress,
            allow_batch_change=opts.allow_batch_change,
            allow_longer=opts.allow_longer,
        )
    except NonFiniteLossError as err:
        print(f"jaxkit: error: {err}", file=sys.stderr)
        return 3
    return 0

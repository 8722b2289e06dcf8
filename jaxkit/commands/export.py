"""`jaxkit export`: a run's checkpoint as a Hugging Face Llama directory
(jaxkit/generate/hf_export.py)."""

from __future__ import annotations

import argparse

from jaxkit.commands import common


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from jaxkit.generate.hf_export import DTYPES

    export = sub.add_parser(
        "export",
        help="write a run's checkpoint as a Hugging Face Llama directory",
        usage="%(prog)s WORKDIR --hf OUT [--step N] [--dtype {bfloat16,float16,float32}]",
    )
    export.add_argument("workdir", type=common.directory, metavar="WORKDIR", help="a run's workdir")
    export.add_argument(
        "--hf",
        required=True,
        type=common.directory,
        metavar="OUT",
        help="a new directory: config.json, model.safetensors and the run's tokenizer files "
        "(where its data was prepared with a tokenizer.json)",
    )
    export.add_argument(
        "--step",
        type=common.int_at_least(0),
        metavar="N",
        help="the checkpoint of optimizer step N (default: the latest)",
    )
    export.add_argument(
        "--dtype",
        choices=DTYPES,
        help="the tensors' dtype (default: the dtype model.init_from's weights were stored "
        "in, else the run's model.param_dtype); bfloat16 and float16 round to nearest, and "
        "give a source of their dtype back exactly; float16 refuses values beyond ±65504",
    )
    return export


def run(opts: argparse.Namespace) -> int:
    import jax

    from jaxkit.generate.hf_export import export_hf
    from jaxkit.train.checkpoint import CheckpointError

    # The params are gathered on the host to be written: no accelerator is needed.
    jax.config.update("jax_platforms", "cpu")
    try:
        common.check_can_write(opts.hf, "--hf")
        export_hf(opts.workdir, opts.hf, step=opts.step, dtype=opts.dtype)
    except (CheckpointError, common.UsageError) as err:
        return common.error(err)
    return 0

"""`jaxkit data prepare`: tokenizes text into train and eval shards (JAX need not start)."""

from __future__ import annotations

import argparse

from jaxkit.commands import common


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from jaxkit.data import prepare

    data = sub.add_parser(
        "data",
        help="prepare text into token shards for training",
        usage="%(prog)s prepare INPUT [INPUT ...] --tokenizer {bytes,PATH} --out DIR [options]",
    )
    data.add_argument(
        "action",
        choices=("prepare",),
        help="prepare: tokenize INPUTs into train and eval shards in DIR (see token_format.py)",
    )
    data.add_argument(
        "inputs",
        nargs="+",
        metavar="INPUT",
        help="files, directories (recursively) and globs: a .jsonl line, a .parquet row or a "
        "row of a Hugging Face dataset saved to disk (its directory) holds a text or a prompt "
        "and a completion; any other file is one document",
    )
    data.add_argument(
        "--tokenizer",
        required=True,
        metavar="{bytes,PATH}",
        help="bytes (a token per byte) or a Hugging Face tokenizer.json, loaded offline",
    )
    data.add_argument("--out", required=True, type=common.directory, metavar="DIR")
    data.add_argument(
        "--eod-token",
        metavar="TEXT",
        help="the tokenizer.json's end-of-document token (default: the first of "
        f"{', '.join(prepare.EOD_CANDIDATES)} in its vocabulary)",
    )
    data.add_argument(
        "--bos",
        action="store_true",
        help="put the tokenizer.json's beginning-of-sequence token (the one its post-processor "
        "adds) before each document, as Llama checkpoints expect",
    )
    data.add_argument(
        "--text-field",
        metavar="NAME",
        help='the field or column of a document\'s text (default "text"; named alone, no '
        "prompt/completion pairs are read)",
    )
    data.add_argument(
        "--prompt-field",
        metavar="NAME",
        help='the field or column of a pair\'s prompt, scored 0 (default "prompt"; named '
        "without --text-field, no plain texts are read)",
    )
    data.add_argument(
        "--completion-field",
        metavar="NAME",
        help='the field or column of a pair\'s completion (default "completion"; named '
        "without --text-field, no plain texts are read)",
    )
    data.add_argument(
        "--split",
        metavar="NAME",
        help="the split of a DatasetDict saved to disk (its dataset_dict.json) to read "
        f"(default {prepare.DEFAULT_SPLIT})",
    )
    data.add_argument(
        "--eval-fraction",
        type=common.fraction,
        default=prepare.DEFAULT_EVAL_FRACTION,
        metavar="F",
        help="of the documents, held out whole (default %(default)s)",
    )
    data.add_argument(
        "--seed", type=common.int_at_least(0), default=0, help="draws the held-out documents"
    )
    data.add_argument(
        "--shard-tokens",
        type=common.int_at_least(1),
        default=prepare.DEFAULT_SHARD_TOKENS,
        metavar="N",
        help="the most tokens in a shard, which ends at a document's end (default %(default)s)",
    )
    data.add_argument(
        "--workers",
        type=common.int_at_least(1),
        metavar="N",
        help="tokenizing processes (default: one per CPU)",
    )
    data.add_argument(
        "--overwrite", action="store_true", help="replace a prepared DIR once the new one is done"
    )
    data.add_argument("--no-progress", action="store_true", help="no progress bar")
    return data


def run(opts: argparse.Namespace) -> int:
    from jaxkit.data.prepare import Fields, PrepareError, prepare, summary

    try:
        common.check_can_write(opts.out, "--out")
        fields = Fields.named(opts.text_field, opts.prompt_field, opts.completion_field)
        meta = prepare(
            opts.inputs,
            opts.tokenizer,
            opts.out,
            eval_fraction=opts.eval_fraction,
            seed=opts.seed,
            shard_tokens=opts.shard_tokens,
            eod_token=opts.eod_token,
            bos=opts.bos,
            workers=opts.workers,
            overwrite=opts.overwrite,
            progress=not opts.no_progress,
            fields=fields,
            split=opts.split,
        )
    except (PrepareError, common.UsageError) as err:
        return common.error(err)
    print(summary(meta, opts.out))
    return 0

"""`jaxkit eval SOURCE`: the held-out loss of a run's checkpoint or a Hugging Face
directory, outside a run. The run's own eval (loop_pieces.evaluate) on the run's mesh and
plan: on the run's held-out split at its final checkpoint, the summary's `eval_loss`.

With `--tasks T[,T...]`, lm-evaluation-harness's tasks instead (the `eval` extra), the
model driven through jaxkit/generate/lm_eval_model.py."""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import re
import subprocess
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any
from unittest import mock

from jaxkit.commands import common
from jaxkit.generate import source as source_lib

if TYPE_CHECKING:
    import ml_collections

    from jaxkit.batch.plan import BatchPlan
    from jaxkit.data import sources as data_lib
    from jaxkit.sections import RunConfig


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = sub.add_parser(
        "eval",
        help="the held-out loss of a run's checkpoint or a Hugging Face directory",
        usage="%(prog)s SOURCE [key=value ...] [--data PATH] [--examples N] [options]\n"
        "       jaxkit eval SOURCE [key=value ...] --tasks T[,T...] [--limit N] "
        "[--num-fewshot K] [--include-path DIR] [--out PATH] [options]",
    )
    common.add_source(
        parser,
        hf_note="; it needs --data",
        hf_keys=" (and data.seq_len, within its context, for hf:DIR)",
    )
    parser.add_argument(
        "--data",
        type=common.directory,
        metavar="PATH",
        help="what the run's data.path takes: its held-out split is evaluated (default: the "
        "run's own); for hf:DIR, token files prepared with DIR's tokenizer",
    )
    parser.add_argument(
        "--examples",
        type=common.int_at_least(1),
        metavar="N",
        help="the first N held-out rows, all of them where there are fewer (default: the "
        "run's train.eval_examples, where 0 is every row)",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="one JSON object: eval_loss, eval_accuracy, eval_perplexity, eval_bits_per_byte "
        "(byte data), eval_examples, eval_targets",
    )
    harness = parser.add_argument_group(
        "lm-evaluation-harness (pip install 'jaxkit[eval]')",
    )
    harness.add_argument(
        "--tasks",
        type=_task_names,
        metavar="T[,T...]",
        help="run lm-evaluation-harness's tasks (or --include-path's) on the model and print "
        "its table, instead of the held-out loss",
    )
    harness.add_argument(
        "--limit",
        type=common.int_at_least(1),
        metavar="N",
        help="the first N documents of each task (default: all)",
    )
    harness.add_argument(
        "--num-fewshot",
        type=common.int_at_least(0),
        metavar="K",
        help="K examples before each question (default: each task's own)",
    )
    harness.add_argument(
        "--include-path",
        metavar="DIR",
        help="a directory of task YAML files of your own, as lm_eval's option of that name",
    )
    harness.add_argument(
        "--out",
        metavar="PATH",
        help="write the harness's results to PATH as JSON, each document's requests and "
        "the model's responses under samples",
    )
    common.add_options(parser)
    return parser


HARNESS_OPTIONS = ("limit", "num_fewshot", "include_path", "out")
HELD_OUT_OPTIONS = ("data", "examples", "json")
EXTRA = "pip install 'jaxkit[eval]'"


def _task_names(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",")]
    if not all(names):
        raise argparse.ArgumentTypeError(f"{text!r}: task names separated by commas")
    return names


def run(
    opts: argparse.Namespace,
    load_config: Callable[[list[str]], ml_collections.ConfigDict],
    start_jax: Callable[[int | None, bool, bool], None],
) -> int:
    """`load_config` and `start_jax` are the CLI's (jaxkit/cli.py)."""
    from jaxkit.batch.plan import BatchPlanError
    from jaxkit.config import ConfigError
    from jaxkit.data.sources import DataError, TokenWindows
    from jaxkit.data.tokenizer import TokenizerError
    from jaxkit.mesh import MeshError
    from jaxkit.train.checkpoint import CheckpointError

    if opts.tasks is not None:
        return _harness(opts, start_jax)
    hf = opts.source.startswith(source_lib.HF_PREFIX)
    try:
        for name in HARNESS_OPTIONS:
            if getattr(opts, name) is not None:
                raise common.UsageError(f"--{name.replace('_', '-')} applies with --tasks only")
        # hf:DIR's rows may be shorter than its context (a run's are the run's)
        source_lib.check_overrides(opts.overrides, "an eval", ("data.seq_len",) if hf else ())
        if hf and opts.data is None:
            raise common.UsageError(
                f"{opts.source} holds no held-out split: give --data PATH, token files "
                "prepared with its tokenizer"
            )
        # Before anything reads a checkpoint: the device count is fixed when JAX starts.
        start_jax(opts.host_devices, False, not opts.no_compile_cache)
        hf_data = [*_hf_rows(opts.source), "data.source=tokens", f"data.path={opts.data}"]
        source = source_lib.open_source(opts, load_config, hf_data if hf else [])
        if hf:
            _check_hf_rows(source)
            source.hf_tokenizer()  # refuses ids that are no bytes and no tokenizer's
        examples = source.config.train.eval_examples if opts.examples is None else opts.examples
        held_out = _held_out(source, opts.data, examples)
        result = _evaluate(source, held_out, examples, opts.overrides)
    except (
        common.UsageError,
        BatchPlanError,
        CheckpointError,
        ConfigError,
        DataError,
        MeshError,
        TokenizerError,
    ) as err:
        said = source_lib.as_typed(_as_typed(str(err), opts.data), opts.source)
        return common.error(common.UsageError(said))
    print(_report(result, source, isinstance(held_out, TokenWindows), opts.json))
    return 0


def _hf_rows(source: str) -> list[str]:
    """hf:DIR's rows as its context (config.json's max_position_embeddings): the
    data.seq_len an eval of it reads, unless an override gives one within it."""
    from jaxkit.hf.load import read_hf_config

    if not source.startswith(source_lib.HF_PREFIX):
        return []
    directory = source_lib.hf_directory(source)
    context, _ = source_lib.hf_context(read_hf_config(directory), source)
    return [f"data.seq_len={context}"]


def _check_hf_rows(source: source_lib.Source) -> None:
    """A data.seq_len override beyond hf:DIR's context is refused: its positions end there."""
    context, why = source.context(source.decoding("it has no held-out loss of text"))
    seq_len = int(source.config.data.seq_len)
    if seq_len > context:
        raise common.UsageError(
            f"data.seq_len={seq_len}: {source.where} takes {context} positions ({why}); give "
            f"data.seq_len={context} or less"
        )


def _as_typed(message: str, data: str | None) -> str:
    """A refusal of --data's path as the user gave it: the data layer names it data.path."""
    return message if data is None else re.sub(r"\bdata\.path=", "--data ", message)


def _harness(opts: argparse.Namespace, start_jax: Callable[[int | None, bool, bool], None]) -> int:
    """lm-evaluation-harness's tasks on the model: its table on stdout, --out its JSON."""
    from jaxkit.config import ConfigError
    from jaxkit.data.tokenizer import TokenizerError
    from jaxkit.mesh import MeshError
    from jaxkit.train.checkpoint import CheckpointError

    try:
        for name in HELD_OUT_OPTIONS:
            if getattr(opts, name) not in (None, False):
                raise common.UsageError(
                    f"--{name} applies to the held-out loss, not to --tasks (the harness's)"
                )
        try:
            import lm_eval
            import lm_eval.evaluator
        except ImportError:
            raise common.UsageError(
                f"--tasks runs lm-evaluation-harness, which is not installed: {EXTRA}"
            ) from None
        source_lib.check_overrides(opts.overrides, "an eval")
        if opts.include_path is not None and not pathlib.Path(opts.include_path).is_dir():
            raise common.UsageError(f"--include-path {opts.include_path}: not a directory")
        if opts.out is not None:
            if pathlib.Path(opts.out).is_dir():
                raise common.UsageError(f"--out {opts.out}: a directory; name a file")
            common.check_can_write(str(pathlib.Path(opts.out).parent), "--out")
        tasks = _task_manager(opts.tasks, opts.include_path)
        # Before anything reads a checkpoint: the device count is fixed when JAX starts.
        start_jax(opts.host_devices, False, not opts.no_compile_cache)
        from jaxkit.generate.lm_eval_model import JaxkitLM  # its errors are usage errors

        model = JaxkitLM(opts.source, *opts.overrides, step=opts.step)
        # The harness records the git commit of the directory it runs in with `git describe`,
        # whose "fatal: not a git repository" outside one went to the user's terminal.
        with mock.patch.object(lm_eval.evaluator, "get_git_commit_hash", _git_commit_quietly):
            results = lm_eval.simple_evaluate(
                model=model,
                tasks=opts.tasks,
                num_fewshot=opts.num_fewshot,
                limit=opts.limit,
                task_manager=tasks,
            )
    except (
        common.UsageError,
        CheckpointError,
        ConfigError,
        MeshError,
        TokenizerError,
    ) as err:
        return common.error(common.UsageError(source_lib.as_typed(str(err), opts.source)))
    assert results is not None  # a single process: the harness returns to rank 0
    from lm_eval.utils import handle_non_serializable, make_table

    print(make_table(results))
    if "groups" in results:
        print(make_table(results, "groups"))
    if opts.out is not None:
        text = json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False)
        out = pathlib.Path(opts.out)
        out.parent.mkdir(parents=True, exist_ok=True)  # checked writable before any work
        out.write_text(text + "\n")
    return 0


def _git_commit_quietly() -> str | None:
    """lm_eval.loggers.utils.get_git_commit_hash, git's stderr kept off the terminal."""
    from lm_eval.loggers.utils import get_commit_from_path

    try:
        found = subprocess.run(
            ["git", "describe", "--always"], capture_output=True, check=True, text=True
        )
        return found.stdout.strip()
    except (subprocess.CalledProcessError, FileNotFoundError):
        return get_commit_from_path(os.getcwd())


def _task_manager(names: list[str], include_path: str | None) -> Any:
    """The harness's task index holding every name, --include-path's first: the harness's
    own (some 14,000 YAML files, 15 s to read) only where a name is not found there."""
    from lm_eval.tasks import TaskManager

    if include_path is not None:
        tasks = TaskManager(include_path=include_path, include_defaults=False)
        if not _missing(tasks, names):
            return tasks
    tasks = TaskManager(include_path=include_path)
    missing = _missing(tasks, names)
    if missing:
        where = " (nor --include-path's)" if include_path is not None else ""
        raise common.UsageError(
            f"--tasks: {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not among "
            f"lm-evaluation-harness's tasks{where}"
        )
    return tasks


def _missing(tasks: Any, names: list[str]) -> list[str]:
    found = set(tasks.match_tasks(names))
    return [name for name in names if name not in found]


# --json's keys, in order; eval_bits_per_byte for byte data only, eval_loss_by_source for a
# mixture's held-out data only (each source's own loss, as the run's records give it).
KEYS = (
    "eval_loss",
    "eval_accuracy",
    "eval_perplexity",
    "eval_bits_per_byte",
    "eval_examples",
    "eval_targets",
    "eval_loss_by_source",
)


def _report(
    result: dict[str, Any], source: source_lib.Source, byte_data: bool, as_json: bool
) -> str:
    """The eval's result as --json's object or as lines of text."""
    from jaxkit.config import is_lm

    loss = result["eval_loss"]
    result["eval_perplexity"] = math.exp(loss) if loss < 700 else math.inf  # exp overflows
    if byte_data:
        result["eval_bits_per_byte"] = loss / math.log(2)
    if as_json:
        return json.dumps({key: result[key] for key in KEYS if key in result})
    unit = "byte" if byte_data else "token" if is_lm(source.sections()) else "example"
    bits = f" ({result['eval_bits_per_byte']:.4f} bits/byte)" if byte_data else ""
    at = f", step {source.step}" if source.step is not None else ""
    lines = [
        f"{source.where}{at}: {result['eval_examples']:,} held-out rows, "
        f"{result['eval_targets']:,} targets scored",
        f"  eval loss {loss:.4f} nats/{unit}{bits}, perplexity {result['eval_perplexity']:.4g}, "
        f"accuracy {result['eval_accuracy']:.2%}",
    ]
    for name, each in (result.get("eval_loss_by_source") or {}).items():
        lines.append(f"    {name}: eval loss {each:.4f} nats/{unit}")
    return "\n".join(lines)


def _held_out(source: source_lib.Source, path: str | None, examples: int) -> data_lib.Source:
    """The held-out split of `path` (data.path; None: the run's own data, where it was
    read, refused where it has changed since), checked against the model, its first
    `examples` rows scoring a target."""
    from jaxkit.config import apply_overrides, validate
    from jaxkit.data import sources as data_lib
    from jaxkit.train.checkpoint import data_changes

    config, saved = source.config, source.meta.get("data") or {}
    if source.hf_dir is None and path is not None:
        if config.data.source not in ("text", "tokens"):
            raise common.UsageError(
                f"--data: {source.where} trained on data.source={config.data.source}, which "
                "reads no data.path"
            )
        # --data names the one source evaluated, in place of a mixture's
        apply_overrides(config, ["data.mixture=null", "data.mixture_stages=", f"data.path={path}"])
        validate(config)
    elif (recorded := saved.get(data_lib.PATHS, {}).get("data.path")) is not None:
        config.data.path = recorded  # the absolute location the run read: from any directory
    train, held_out = data_lib.make_sources(source.sections())
    if source.hf_dir is None:
        if path is None:
            facts = data_lib.data_facts(train, held_out, data_lib.input_paths(source.sections()))
            changes = data_changes(saved, facts)
            if changes:
                raise data_lib.DataError(
                    f"{source.where} was trained on other data than its data.path holds now "
                    f"({'; '.join(c.strip() for c in changes)}): its held-out split is not "
                    "there; give --data PATH to evaluate on that data as it is"
                )
        else:
            _check_tokenizer(source, saved.get(data_lib.TOKENIZER), train, path)
    data_lib.check_eval_weight(held_out, examples)
    note = getattr(train, "note", None)  # how token files were read, where it matters
    if note:
        print(_eval_note(note, str(config.data.path), path), file=sys.stderr)
    if path is not None and _split_by_fraction(config):
        # A file given as --data (nanoGPT's val.bin, say) is not read whole: as a run on it
        # would, the eval holds out its tail only.
        print(
            f"data: --data {path} is not read whole: its held-out split, as a run on it "
            f"holds it out, is its last data.eval_fraction={config.data.eval_fraction:g} "
            f"({len(held_out):,} rows; a directory in nanoGPT's layout holds out val.bin whole)",
            file=sys.stderr,
        )
    return held_out


def _eval_note(note: str, data_path: str, given: str | None) -> str:
    """The data layer's note on how it read `data_path` (--data `given`, named as typed), as
    an eval's: a run on nanoGPT's layout is told it trains on train.bin; an eval trains
    nothing, and says what it evaluates."""
    from jaxkit.data import sources as data_lib

    named = f"--data {given}" if given is not None else data_path
    said = f"data: {named} is in nanoGPT's layout: its held-out val.bin is evaluated"
    nanogpt = data_lib.nanogpt_note(data_path)
    lines = note.splitlines()
    return "\n".join(said if line == nanogpt else _as_typed(line, given) for line in lines)


def _split_by_fraction(config: Any) -> bool:
    """Whether data.path's held-out split is its last data.eval_fraction: text, and token
    files neither prepared nor in nanoGPT's layout (which hold out their own split)."""
    from jaxkit.data import token_files

    return config.data.source == "text" or token_files.held_out_by_fraction(str(config.data.path))


def _check_tokenizer(source: source_lib.Source, trained: Any, train: Any, path: str) -> None:
    """Token data prepared with another tokenizer than the run's (their records, see
    jaxkit/data/tokenizer.py): its ids are other tokens, at any vocabulary size."""
    from jaxkit.data.tokenizer import BYTES

    unknown = "a tokenizer.json whose tokenizer_sha256 was not recorded"

    def known_as(record: Any) -> str | None:
        if not isinstance(record, dict):
            return None  # foreign token files, or a run on bytes of text
        if record.get("tokenizer") == BYTES:
            return BYTES
        sha = record.get("tokenizer_sha256")
        return f"tokenizer_sha256 {sha[:12]}..." if sha else unknown

    was, now = known_as(trained), known_as(getattr(train, "tokenizer", None))
    if was is None or now is None or was == now:
        return
    if unknown in (was, now) and BYTES not in (was, now):
        return  # two tokenizer.json files, one of them unknown: the kit cannot tell
    raise common.UsageError(
        f"--data {path} was prepared with another tokenizer ({now}) than {source.where}'s "
        f"data ({was}): its ids would be read as other tokens"
    )


def _evaluate(
    source: source_lib.Source, held_out: data_lib.Source, examples: int, overrides: list[str]
) -> dict[str, Any]:
    """The run's eval on the run's mesh here, in the micro-batches of the run's plan at the
    checkpoint: the same batches, summed in the same order, on the same device count."""
    from jaxkit import mesh as mesh_lib
    from jaxkit.step.train_step import abstract_params, build
    from jaxkit.train.loop_pieces import evaluate

    config = source.sections()
    mesh = source_lib.make_mesh(source.config, overrides)
    plan = _eval_plan(config, mesh_lib.mesh_shape(mesh), source.meta)
    setup = build(config, plan, mesh)
    params = source_lib.load_params(
        source,
        abstract_params(config),
        setup.state_shardings.params,
        "evaluating them gives a NaN loss",
    )
    return evaluate(setup, params, held_out, plan, examples)


def _eval_plan(config: RunConfig, shape: dict[str, int], meta: dict) -> BatchPlan:
    """The run's plan at the checkpoint on this mesh (hf:DIR: the first a run of it would
    train with); where the run's global batch does not split over this mesh, its rows per
    device in one micro-step: an eval has no global batch to keep."""
    from jaxkit.batch.plan import BatchPlanError, make_batch_plan
    from jaxkit.batch.schedule import plan_from_config
    from jaxkit.train.resume import saved_plan

    try:
        return saved_plan(config, shape, meta) if meta else plan_from_config(config, shape)
    except BatchPlanError:
        per_device = (meta.get("plan") or {}).get("per_device_batch_size")
        return make_batch_plan(
            mesh_shape=shape,
            global_batch_size=None,
            per_device_batch_size=per_device or config.batch.per_device_batch_size or 1,
            grad_accum_steps=1,
        )

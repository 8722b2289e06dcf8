"""`jaxkit export WORKDIR --hf OUT`: a run's checkpoint as a Hugging Face Llama directory
(config.json, model.safetensors, and the tokenizer the run's data was prepared with), which
`transformers` loads as it loads its own.

The params are restored from the checkpoint (checkpoint.restore_params) onto one CPU
device, renamed and transposed to HF's layout (names.to_hf) and written in the asked
dtype. A run started from model.init_from=hf:DIR recorded at its start what it needs of
DIR (hf/load.py's source_record, in every checkpoint's record), so DIR need not be there:
by default each tensor is written in the dtype the source stored it in, and config.json is
the source's with only what the run's model keys change (names.carried_config), and its
max_position_embeddings the run's context (data.seq_len where the run trained on longer
rows: generate/source.py's run_context, as `jaxkit sample` takes it). A model
loaded from bfloat16 weights into float32 params and exported untouched gives the source
back, bit for bit. Other runs write model.param_dtype and a config.json of their model keys,
with the token ids of their data's meta.json (eod_id as eos_token_id, a --bos id as
bos_token_id).
"""

from __future__ import annotations

import collections
import json
import os
import pathlib
import shutil
from collections.abc import Callable
from typing import Any

import numpy as np

from jaxkit.config import saved_run_config
from jaxkit.data import tokenizer as tokenizer_lib
from jaxkit.data.token_format import META_NAME
from jaxkit.hf import names
from jaxkit.models.llama import llama_model
from jaxkit.sections import RunConfig
from jaxkit.train.checkpoint import CheckpointError, restore_params, saved_steps
from jaxkit.workdir import as_path

DTYPES = ("bfloat16", "float16", "float32")
WEIGHTS_NAME = "model.safetensors"
# A tokenizer.json's companions in a Hugging Face directory, copied where they sit beside it.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _dtype(name: str) -> np.dtype:
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def export_hf(
    workdir: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    step: int | None = None,
    dtype: str | None = None,
    echo: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Writes the checkpoint of optimizer step `step` (default: the latest) of the run in
    `workdir` to the new directory `out` as HF's Llama; `dtype` defaults to the source's
    (each tensor's, for a run from model.init_from) else the run's model.param_dtype.
    Returns the config.json written."""
    checkpoints = as_path(workdir) / "checkpoints"
    steps = saved_steps(checkpoints)
    if not steps:
        raise CheckpointError(f"{workdir} holds no checkpoint (checkpoints/step_N) to export")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise CheckpointError(
            f"--step {step}: {workdir} has checkpoints at steps {', '.join(map(str, steps))}"
        )
    target = pathlib.Path(out)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise CheckpointError(f"--hf {out} exists and is not an empty directory: name a new one")
    params, meta = restore_params(checkpoints, step)
    kind = (meta["config"].get("model") or {}).get("kind")
    if kind != names.KIND:
        raise CheckpointError(
            f"--hf writes Hugging Face Llama checkpoints: the run in {workdir} trained "
            f"model.kind={kind!r}, not {names.KIND!r}"
        )
    config = saved_run_config(meta["config"])
    m = llama_model(config)
    source = meta.get("hf_source")  # None: a run from random weights, or saved before
    if dtype is None and source is not None:
        other = source.get("other_dtypes") or {}
        dtypes = {t.name: other.get(t.name, source["dtype"]) for t in names.hf_tensors(m)}
    else:
        dtype = dtype or m.param_dtype
        dtypes = {t.name: dtype for t in names.hf_tensors(m)}
    hf = names.to_hf(params, m)
    del params
    with np.errstate(over="ignore"):  # said in one line below, not as numpy's warning
        tensors = {name: t.astype(_dtype(dtypes[name])) for name, t in hf.items()}
    _check_in_range(hf, tensors)
    del hf
    assert config.data.seq_len is not None  # a language model's rows
    seq_len = config.data.seq_len
    if source is not None:
        from jaxkit.generate.source import HF_CONTEXT, run_context

        cfg = names.carried_config(source["config"], m, seq_len=seq_len, torch_dtype=dtype)
        # Fine-tuned on rows longer than the source's context: the run's context is theirs.
        context, _ = run_context(seq_len, source["config"], f"the run in {workdir}")
        if context != cfg.get("max_position_embeddings", HF_CONTEXT):
            cfg["max_position_embeddings"] = context
    else:
        cfg = names.hf_config_from_model(
            m, torch_dtype=dtype, max_position_embeddings=max(2048, seq_len)
        ) | _token_ids(meta)
    target.mkdir(parents=True, exist_ok=True)
    from safetensors.numpy import save_file

    # transformers reads only safetensors files that say which framework wrote them.
    save_file(tensors, str(target / WEIGHTS_NAME), metadata={"format": "pt"})
    (target / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    copied = _copy_tokenizer(meta, config, target, echo)
    echo(
        f"wrote {target}: step {step}, {len(tensors)} tensors{_in_dtypes(dtypes, source)}"
        + (f", {copied}" if copied else "")
    )
    return cfg


def _token_ids(meta: dict) -> dict[str, int]:
    """config.json's eos_token_id (the data's end-of-document id) and bos_token_id (where
    `jaxkit data prepare --bos` put one before each document), from the token data's
    meta.json as the run recorded it (its fingerprint): without them transformers takes
    Llama's 1 and 2, and generate() does not stop where the run learned documents end."""
    prepared = ((meta.get("data") or {}).get("fingerprint")) or {}
    fields = {"eos_token_id": prepared.get("eod_id"), "bos_token_id": prepared.get("bos_id")}
    return {field: i for field, i in fields.items() if isinstance(i, int)}


def _check_in_range(params: dict[str, np.ndarray], tensors: dict[str, np.ndarray]) -> None:
    """Refuses a cast that made a finite param infinite: float16 holds ±65504 at most, and
    a file of infinities is no model (model.init_from refuses it)."""
    import ml_dtypes

    for name, written in tensors.items():
        if np.isfinite(written).all() or not np.isfinite(params[name]).all():
            continue
        largest, most = np.abs(params[name]).max(), ml_dtypes.finfo(written.dtype).max
        raise CheckpointError(
            f"--dtype {written.dtype}: {name} holds values up to {float(largest):.6g} in "
            f"magnitude, beyond {written.dtype}'s largest ({float(most):.6g}): export in "
            "bfloat16 or float32"
        )


def _in_dtypes(dtypes: dict[str, str], source: dict | None) -> str:
    """The dtypes written, after the count of tensors: ` in bfloat16` where all share one,
    else each's count, `: 19 in bfloat16, 2 in float32, as hf:DIR stored them`."""
    counts = collections.Counter(dtypes.values()).most_common()
    if len(counts) == 1:
        said = f" in {counts[0][0]}"
    else:
        said = ": " + ", ".join(f"{n} in {d}" for d, n in counts)
    if source is not None and all(
        d == (source.get("other_dtypes") or {}).get(name, source["dtype"])
        for name, d in dtypes.items()
    ):
        said += f", as {source['init_from']} stored them"
    return said


def _copy_tokenizer(
    meta: dict,
    config: RunConfig,
    target: pathlib.Path,
    echo: Callable[[str], None],
) -> str:
    """The tokenizer.json the run's token data was prepared with, and its companion files;
    the bytes tokenizer has no file to copy. Runs record it, absolute, with its
    tokenizer_sha256 (jaxkit/data/tokenizer.py); a checkpoint saved before has its fingerprint's
    name of it, and the meta.json of the run's data.path."""
    record = (meta.get("data") or {}).get("tokenizer")
    if isinstance(record, dict):
        tokenizer, found = record.get("tokenizer"), record.get("tokenizer_file")
        source = pathlib.Path(found) if isinstance(found, str) else None
    else:
        tokenizer = ((meta.get("data") or {}).get("fingerprint") or {}).get("tokenizer")
        source = None if tokenizer is None else pathlib.Path(tokenizer)
        if source is not None and not source.is_absolute():
            source = _prepared_tokenizer(config, str(tokenizer)) or source
    if tokenizer is None or tokenizer == tokenizer_lib.BYTES:
        return ""
    if source is None or not source.is_file():
        echo(
            f"warning: the run's data was prepared with {tokenizer}, which is not there now "
            f"({source or 'no path recorded'}): {target} has no tokenizer (copy it beside "
            "config.json)"
        )
        return ""
    expected = record.get("tokenizer_sha256") if isinstance(record, dict) else None
    if expected is not None:
        try:
            now = tokenizer_lib.file_sha256(source)
        except tokenizer_lib.TokenizerError as err:
            now = str(err)
        if now != expected:
            echo(
                f"warning: {source} is not the tokenizer the run's data was prepared with "
                f"(tokenizer_sha256 {expected[:12]}... recorded): {target} has no tokenizer "
                "(copy that one beside config.json)"
            )
            return ""
    shutil.copyfile(source, target / "tokenizer.json")
    copied = ["tokenizer.json"]
    for name in TOKENIZER_FILES[1:]:
        if (source.parent / name).is_file():
            shutil.copyfile(source.parent / name, target / name)
            copied.append(name)
    return ", ".join(copied)


def _prepared_tokenizer(config: RunConfig, tokenizer: str) -> pathlib.Path | None:
    """The absolute path `jaxkit data prepare` recorded for `tokenizer` (as typed, relative
    to where it ran) in the meta.json of the run's data.path, where that is the same data."""
    path = config.data.path
    if not path:
        return None
    try:
        prepared = json.loads((pathlib.Path(path) / META_NAME).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(prepared, dict) or prepared.get("tokenizer") != tokenizer:
        return None
    found = prepared.get("tokenizer_file")
    return pathlib.Path(found) if isinstance(found, str) else None

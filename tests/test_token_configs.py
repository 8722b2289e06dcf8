"""The token configs' docstrings are commands that work: prepare as they say, then train
(shrunk) on what was prepared."""

import json
import subprocess
import sys

import jax
import numpy as np
import pytest
from small_configs import SMALL_LM

from jaxkit.config import apply_overrides, load_config, run_config
from jaxkit.data import docstrings
from jaxkit.data.prepare import prepare
from jaxkit.data.sources import make_sources
from jaxkit.train.loop import train

SHRINK = [o for o in SMALL_LM if not o.startswith("data.max_bytes")]


@pytest.fixture(scope="module")
def docstrings_jsonl(tmp_path_factory):
    """sft_tiny's first command, `python -m jaxkit.data.docstrings docstrings.jsonl`, run once
    for the module: the pairs file and the finished process."""
    out = tmp_path_factory.mktemp("docstrings") / "docstrings.jsonl"
    done = subprocess.run(
        [sys.executable, "-m", "jaxkit.data.docstrings", str(out)], capture_output=True, text=True
    )
    return out, done


def test_docstring_pairs_are_signatures_and_first_paragraphs(tmp_path, docstrings_jsonl):
    (tmp_path / "m.py").write_text(
        'def f(a, b=2, *c):\n    """Add things.\n\n    More detail."""\n\n'
        "def g():\n    pass\n\n"
        'class K:\n    async def h(self):\n        """Wait."""\n'
    )
    assert list(docstrings.pairs(tmp_path)) == [
        {"prompt": "def f(a, b=2, *c):\n", "completion": '    """Add things."""\n'},
        {"prompt": "def h(self):\n", "completion": '    """Wait."""\n'},
    ]
    out, done = docstrings_jsonl
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) > 1000 and all(set(x) == {"prompt", "completion"} for x in lines)


@pytest.mark.parametrize("name", ["sft_tiny", "lm_tiny_tokens"])
def test_a_token_config_trains_on_what_its_prepare_command_wrote(
    name, tmp_path, monkeypatch, request
):
    monkeypatch.chdir(tmp_path)  # the configs name data/... relative to where they run
    if name == "sft_tiny":
        pairs, done = request.getfixturevalue("docstrings_jsonl")
        assert done.returncode == 0, done.stderr
        prepare([str(pairs)], "bytes", "data/docstrings", eval_fraction=0.05,
                progress=False)  # fmt: skip
    else:
        stdlib = docstrings.pairs.__globals__["sysconfig"].get_paths()["stdlib"]
        prepare([f"{stdlib}/*.py"], "bytes", "data/stdlib", eval_fraction=0.05, progress=False)
    config = load_config(name)
    apply_overrides(config, [*SHRINK, "train.steps=4", "train.eval_every=0",
                             "train.eval_examples=64", "checkpoint.every=0"])  # fmt: skip
    train_rows, _ = make_sources(run_config(config))
    if name == "sft_tiny":  # padded documents: prompts and padding weigh 0
        assert 0 < train_rows[np.arange(64)]["weights"].mean() < 1
    else:  # packed windows with segments: the row where the second document starts
        row = train_rows[np.array([train_rows.split.doc_starts[1] // 16])]
        assert "weights" not in row and row["segment_ids"].max() == 1
    # One device, two micro-batches of 4 rows a step: what is under test is the data.
    apply_overrides(config, ["batch.global_batch_size=8", "batch.per_device_batch_size=4"])
    result = train(config, devices=jax.devices()[:1], progress=False, echo=lambda *a: None)
    assert np.isfinite(result.summary["eval_loss"])

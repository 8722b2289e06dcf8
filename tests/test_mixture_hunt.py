"""data.mixture's sources as users give them: token files that two sources share."""

import json

import numpy as np
import pytest
from cli_run import jaxkit

RUN = [
    "train", "lm_tiny", "model.num_layers=1", "model.d_model=32", "model.num_heads=2",
    "model.mlp_dim=64", "model.vocab_size=64", "data.seq_len=16", "data.source=tokens",
    "train.steps=1", "train.eval_every=1", "train.eval_examples=4",
    "batch.global_batch_size=32", "--no-progress",
]  # fmt: skip


@pytest.fixture(scope="module")
def nanogpt(tmp_path_factory):
    """A directory in nanoGPT's layout: train.bin (trained on) and val.bin (held out)."""
    tmp = tmp_path_factory.mktemp("nanogpt")
    rng = np.random.default_rng(0)
    rng.integers(0, 64, 1200).astype(np.uint16).tofile(tmp / "train.bin")
    rng.integers(0, 64, 3000).astype(np.uint16).tofile(tmp / "val.bin")
    return tmp


def _mix(**sources):
    return "data.mixture=" + json.dumps(
        {name: {"path": str(path), "weight": 1} for name, path in sources.items()}
    )


@pytest.mark.parametrize(
    "other",
    [
        "train.bin",  # holds out train.bin's tail, which the directory trains on
        "val.bin",  # trains on the directory's held-out split
    ],
)
def test_a_file_two_sources_split_otherwise_is_refused(nanogpt, tmp_path, other):
    """One source trains on rows another holds out: refused in one line naming both."""
    done = jaxkit(*RUN, _mix(web=nanogpt, code=nanogpt / other), "--workdir", str(tmp_path / "run"))
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    said = f"data.mixture.web reads {nanogpt / other}, which data.mixture.code reads with"
    assert said in done.stderr, done.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_one_path_under_two_names_trains(nanogpt, tmp_path):
    """The same files read the same way split alike: nothing is held out of one and trained
    on by the other."""
    done = jaxkit(*RUN, _mix(web=nanogpt, code=nanogpt), "--workdir", str(tmp_path / "run"))
    assert done.returncode == 0, done.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["examples_by_source"] == {"code": 16, "web": 16}

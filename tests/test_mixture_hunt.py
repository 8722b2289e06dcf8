"""data.mixture's sources as users give them: token files that two sources share, a
source whose training or held-out rows score nothing."""

import json

import numpy as np
import pytest
from cli_run import jaxkit
from token_dirs import write_prepared

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


def _refused_for_qa(tmp_path, qa_eval_plain, *overrides):
    """A mixture of plain text and `qa` (20 prompts of 40 tokens, each answered by one token:
    a window of 16 is all prompt) trained: the one stderr line it is refused with, nothing
    trained. `qa_eval_plain`: qa's held-out split is plain text, not its prompts."""
    rng = np.random.default_rng(0)
    plain = [([], rng.integers(2, 64, 40).tolist()) for _ in range(20)]
    asked = [(rng.integers(2, 64, 40).tolist(), [5]) for _ in range(20)]
    qa_eval = plain[:2] if qa_eval_plain else asked[:2]
    write_prepared(tmp_path / "plain", {"train": plain, "eval": plain[:2]}, vocab_size=64, eod_id=1)
    write_prepared(tmp_path / "qa", {"train": asked, "eval": qa_eval}, vocab_size=64, eod_id=1)
    mix = _mix(plain=tmp_path / "plain", qa=tmp_path / "qa")
    done = jaxkit(*RUN, *overrides, mix, "--workdir", str(tmp_path / "run"))
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    return done.stderr


def test_a_source_whose_held_out_rows_score_nothing_is_refused_before_training(tmp_path):
    """Each source is evaluated on its own: one whose held-out rows an eval reads are all
    prompt (weight 0) is refused before any step, naming it, even where another source's
    held-out rows, first in the mixture's ids, score targets."""
    said = _refused_for_qa(tmp_path, False, "train.eval_examples=1")
    assert "data.mixture.qa: the 1 held-out rows an eval reads score no target" in said, said


def test_a_source_whose_training_rows_score_nothing_is_refused(tmp_path):
    """Alone, a source whose training rows score no target is refused; in a mixture it
    would take its share of every batch and train on none of it: refused too, named.
    (Documents cut at seq_len + 1 tokens: a prompt of 40 leaves nothing scored.)"""
    said = _refused_for_qa(tmp_path, True, "data.rows=documents")
    assert "data.mixture.qa: the 20 training rows score no target" in said, said


@pytest.mark.parametrize(
    ("value", "said"),
    [
        # json.loads keeps the last of two keys: web's first source was dropped unsaid
        (
            '{"web": {"path": "a", "weight": 0.5}, "web": {"path": "b", "weight": 0.5}}',
            "data.mixture=the JSON object gives 'web' twice",
        ),
        ('{"web": {"path": "a", "weight": Infinity}}', "data.mixture.web.weight=inf: must be"),
    ],
)
def test_a_source_given_twice_or_an_infinite_weight_is_refused(tmp_path, value, said):
    done = jaxkit(*RUN, "data.mixture=" + value, "--workdir", str(tmp_path / "run"))
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    assert said in done.stderr, done.stderr


def test_stages_take_spaces_around_equals_and_refuse_an_infinite_weight(nanogpt, tmp_path):
    mix = _mix(web=nanogpt / "train.bin", code=nanogpt / "val.bin")
    spaced = "data.mixture_stages=0: web = 1 + code = 1 , 32:web=3+code=1"
    done = jaxkit(*RUN, "train.steps=2", mix, spaced, "--workdir", str(tmp_path / "run"))
    assert done.returncode == 0, done.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["examples_by_source"] == {"code": 16 + 8, "web": 16 + 24}
    infinite = "data.mixture_stages=0:web=1+code=inf"
    done = jaxkit(*RUN, mix, infinite, "--workdir", str(tmp_path / "inf"))
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    assert "'code=inf' needs a finite weight > 0" in done.stderr, done.stderr


@pytest.fixture(scope="module")
def config_file_run(nanogpt, tmp_path_factory):
    """A run of a config file whose data.mixture (web alone) the command line replaces
    with web and code: the config file, the run's workdir and its summary."""
    tmp = tmp_path_factory.mktemp("config_file")
    (tmp / "mix.py").write_text(
        "from jaxkit.config import load_config\n\n"
        "def get_config():\n"
        "    c = load_config('lm_tiny')\n"
        "    c.data.source = 'tokens'\n"
        "    c.data.path = None\n"
        f"    c.data.mixture = {{'web': {{'path': {str(nanogpt)!r}, 'weight': 1}}}}\n"
        "    return c\n"
    )
    mix = _mix(web=nanogpt / "train.bin", code=nanogpt / "val.bin")
    done = jaxkit(*RUN[:1], str(tmp / "mix.py"), *RUN[2:], mix, "--workdir", str(tmp / "run"))
    assert done.returncode == 0, done.stderr
    return tmp / "mix.py", str(tmp / "run"), json.loads((tmp / "run" / "summary.json").read_text())


def test_eval_of_a_mixture_run_gives_the_runs_eval_loss(nanogpt, config_file_run):
    """`jaxkit eval RUN` reads the run's saved config, data.mixture and all (a key saved as
    its fields was taken for one added since, and set to null), and evaluates every source's
    held-out rows as the run did: the same batches in the same order, so the same loss. The
    run's mixture is the command line's, not its config file's (web alone)."""
    _, run, summary = config_file_run
    done = jaxkit("eval", run, "--json")
    assert done.returncode == 0, done.stderr
    said = json.loads(done.stdout.splitlines()[-1])
    assert said["eval_loss"] == summary["eval_loss"]
    # each source's loss too (--json left them out), in the text as well
    assert said["eval_loss_by_source"] == summary["eval_loss_by_source"]
    done = jaxkit("eval", run)
    for name, loss in summary["eval_loss_by_source"].items():
        assert f"    {name}: eval loss {loss:.4f} nats/" in done.stdout, done.stdout
    # --data names one source's files in place of the mixture: web's held-out rows again
    done = jaxkit("eval", run, "--data", str(nanogpt / "train.bin"), "--json")
    assert done.returncode == 0, done.stderr
    said = json.loads(done.stdout.splitlines()[-1])["eval_loss"]
    assert said == summary["eval_loss_by_source"]["web"]


def test_the_command_line_replaces_a_config_files_mixture(nanogpt, tmp_path, config_file_run):
    """A config file's data.mixture (a dict) is replaced whole by data.mixture=JSON, or
    unset by data.mixture=null beside a data.path, as any dict-valued key is."""
    config_file, _, summary = config_file_run
    assert summary["examples_by_source"] == {"code": 16, "web": 16}
    one = ["data.mixture=null", f"data.path={nanogpt}"]
    done = jaxkit(*RUN[:1], str(config_file), *RUN[2:], *one, "--workdir", str(tmp_path / "b"))
    assert done.returncode == 0, done.stderr
    assert "examples_by_source" not in json.loads((tmp_path / "b" / "summary.json").read_text())


def test_a_saved_config_keeps_its_dict_valued_keys():
    """A run's saved config, as eval and sample read it back, keeps each dict-valued key
    it was saved with (saved as its fields): model.rope_scaling was set to null, so a
    Llama 3.1 run was sampled and evaluated without its rotary scaling, and data.mixture
    was lost."""
    from jaxkit.config import apply_overrides, load_config, saved_config

    config = load_config("llama_tiny")
    rope = {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    apply_overrides(config, ["model.rope_scaling=" + json.dumps(rope)])
    saved = saved_config(json.loads(json.dumps(config.to_dict())))
    assert saved.model.rope_scaling.to_dict() == config.model.rope_scaling.to_dict()


def test_a_fractional_weight_may_replace_a_whole_one_field_by_field():
    """data.mixture.web.weight=0.3 after a mixture whose weights were whole numbers was
    refused as "expected int, got float"; a JSON object's number is a number. A section's
    own int field still refuses a fraction."""
    from fractions import Fraction

    from jaxkit.batch import mixture
    from jaxkit.config import ConfigError, apply_overrides, load_config

    config = load_config("llama_tiny")
    whole = {"web": {"path": "w", "weight": 1}, "code": {"path": "c", "weight": 2}}
    apply_overrides(config, ["data.source=tokens", "data.mixture=" + json.dumps(whole)])
    apply_overrides(config, ["data.mixture.web.weight=0.3"])
    sources = mixture.sources_of(config.data.mixture.to_dict())
    assert sources["web"]["weight"] == Fraction(3, 10) and sources["code"]["weight"] == 2
    with pytest.raises(ConfigError, match="expected float, got bool"):
        apply_overrides(config, ["data.mixture.web.weight=true"])
    with pytest.raises(ConfigError, match=r"train\.steps='0\.5': expected int, got float"):
        apply_overrides(config, ["train.steps=0.5"])

"""`jaxkit eval SOURCE --tasks T` (jaxkit/commands/evaluate.py, jaxkit/generate/lm_eval_model.py):
lm-evaluation-harness on a run's checkpoint, offline, with tasks of its own that read local
files (tests/data/lm_eval); what the harness gets checked against the model's own numbers."""

import json
import pathlib
import sys

import datasets.config
import huggingface_hub.constants
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cli_run import ROOT, jaxkit
from flax import nnx
from small_configs import SMALL_LM

from jaxkit.config import apply_overrides, load_config, run_config
from jaxkit.step.train_step import _abstract_model
from jaxkit.train.checkpoint import restore_params

TASKS = "tests/data/lm_eval"
MAX_LENGTH = 16  # the byte LM's learned positions: data.seq_len
UNTIL = (":", "\n")  # jaxkit_until.yaml's stop strings
NEW = 6  # and its max_gen_toks
# The harness's sums against a plain forward pass on one device: the same float32 logits
# (each row's matmuls on one device, there in a batch of 64 rows, here of one), summed by
# the loss code's logsumexp − logit there and by log_softmax here. Measured: at most 3.8e-6
# apart on sums of -35 to -58 (6.6e-8 relative, one float32 ulp of the sum); 1e-6 relative
# is 8 float32 epsilons. A token scored too many or too few, or read at the wrong position,
# moves a sum by a whole log-probability (about -5 here: 1e-1 relative).
RTOL = 1e-6


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> str:
    """test_eval's and test_sampling's byte LM (2 steps at SMALL_LM's size, rows of 16 bytes;
    the same programs, read from the compilation cache)."""
    workdir = tmp_path_factory.mktemp("lm_eval") / "run"
    args = ["train", "lm_tiny", *SMALL_LM, "train.steps=2", "train.eval_every=0"]
    done = jaxkit(*args, "--workdir", str(workdir), "--no-progress")
    assert done.returncode == 0, done.stderr
    return str(workdir)


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """Nothing downloaded: the hub and datasets offline (also where either was imported
    before the variables were set), datasets' cache in the test's directory."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets")


def _log_probs(workdir: str):
    """log p of every byte given those before it (at most MAX_LENGTH of them), by a plain
    forward pass of the checkpoint's model on one device."""
    config = load_config("lm_tiny")
    apply_overrides(config, [*SMALL_LM, "mesh.data=1"])
    graphdef, _ = _abstract_model(run_config(config))
    params, _ = restore_params(f"{workdir}/checkpoints", 2)
    forward = jax.jit(lambda p, x: jax.nn.log_softmax(nnx.merge(graphdef, p)(x), axis=-1))

    def score(ids: list[int], scored: int) -> tuple[float, bool]:
        ids = ids[-(MAX_LENGTH + 1) :]  # the harness's left cut: MAX_LENGTH inputs
        inputs, targets = ids[:-1], ids[len(ids) - scored :]
        log_p = np.asarray(forward(params, jnp.asarray([inputs], jnp.int32)))[0]
        rows = log_p[len(inputs) - scored :]
        picked = rows[np.arange(scored), targets]
        return float(picked.sum()), bool((rows.argmax(-1) == targets).all())

    return score


def test_the_harness_gets_the_models_log_probabilities_and_samples_greedy_text(
    run, offline, tmp_path
):
    out = tmp_path / "new" / "results.json"  # --out's directory is made, as a workdir is
    tasks = "jaxkit_choice,jaxkit_until,jaxkit_rolling"
    done = jaxkit("eval", run, "--tasks", tasks, "--include-path", TASKS, "--out", str(out))
    assert done.returncode == 0, done.stderr
    table = [line.split("|") for line in done.stdout.splitlines() if line.startswith("|")]
    assert table[0][1].strip() == "Tasks"  # the harness's table (lm_eval.utils.make_table)
    assert {row[1].strip() for row in table[2:]} >= set(tasks.split(","))
    results = json.loads(out.read_text())
    assert set(results["results"]) == set(tasks.split(","))
    score = _log_probs(run)

    # Multiple choice: "question" + " " + each choice; contexts of 20 bytes are cut on the left.
    choice = results["samples"]["jaxkit_choice"]
    assert [len(doc["resps"]) for doc in choice] == [3, 3, 2]
    for doc in choice:
        for (context, continuation), ((logprob, greedy),) in zip(
            doc["arguments"], doc["resps"], strict=True
        ):
            ids = list((context + continuation).encode())
            expected, expected_greedy = score(ids, len(continuation.encode()))
            assert float(logprob) == pytest.approx(expected, rel=RTOL)
            assert greedy == expected_greedy
    assert any(len(d["arguments"][0][0]) > MAX_LENGTH for d in choice)

    # Rolling: each text after the prefix token (a newline for byte text), in windows of
    # MAX_LENGTH targets, each read with the MAX_LENGTH tokens before its last target: the
    # sum of them all.
    rolling = results["samples"]["jaxkit_rolling"]
    for doc in rolling:
        row = [10, *doc["arguments"][0][0].encode()]
        targets = len(row) - 1
        expected = 0.0
        for first in range(0, targets, MAX_LENGTH):
            end = min(first + MAX_LENGTH, targets)  # the window's targets: row[first+1:end+1]
            expected += score(row[max(0, end - MAX_LENGTH) : end + 1], end - first)[0]
        assert float(doc["resps"][0][0]) == pytest.approx(expected, rel=RTOL)
    assert any(len(d["arguments"][0][0]) > MAX_LENGTH for d in rolling)  # two windows

    # Generation: `jaxkit sample`'s greedy text from the context cut to MAX_LENGTH - NEW bytes
    # (10 of them), cut at the first stop string.
    until = results["samples"]["jaxkit_until"]
    for doc in until:
        prompt = doc["arguments"][0][0].encode()[-(MAX_LENGTH - NEW) :]
        sampled = jaxkit(
            "sample", run, "--prompt", prompt.decode(), "--temperature", "0",
            "--max-new-tokens", str(NEW), "--json",
        )  # fmt: skip
        assert sampled.returncode == 0, sampled.stderr
        text = json.loads(sampled.stdout)["text"]
        for stop in UNTIL:
            text = text.split(stop)[0]
        assert doc["resps"] == [[text]]
    assert any(len(d["arguments"][0][0]) > MAX_LENGTH - NEW for d in until)

    # A task asking for as many new tokens as the model takes leaves no room for a context.
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    yaml = (pathlib.Path(ROOT) / TASKS / "jaxkit_until.yaml").read_text()
    yaml = yaml.replace("task: jaxkit_until", "task: jaxkit_too_long")
    yaml = yaml.replace(f"max_gen_toks: {NEW}", f"max_gen_toks: {MAX_LENGTH}")
    (tasks / "too_long.yaml").write_text(yaml.replace("tests/", f"{ROOT}/tests/"))
    done = jaxkit("eval", run, "--tasks", "jaxkit_too_long", "--include-path", str(tasks))
    assert done.returncode == 2
    assert done.stderr.splitlines()[-1] == (
        f"jaxkit: error: a task asks for {MAX_LENGTH} new tokens (max_gen_toks): the model "
        f"takes {MAX_LENGTH} (max_length), context included"
    )


def test_is_greedy_needs_every_continuation_token_to_be_the_most_probable(run):
    """A continuation whose first token is its position's most probable and whose second
    is not is not greedy; with the second the most probable too, it is."""
    from jaxkit.generate.lm_eval_model import JaxkitLM

    lm = JaxkitLM(run)
    log_p = _next_log_probs(run)
    context = list(b"import os")
    best = int(np.argmax(log_p(context)))
    after = log_p([*context, best])
    top, other = int(np.argmax(after)), int(np.argmin(after))
    (first,), (both,), (mixed,) = (
        lm.score_rows([(row, n)])
        for row, n in (
            ([*context, best], 1),
            ([*context, best, top], 2),
            ([*context, best, other], 2),
        )
    )
    assert first[1] and both[1]
    assert not mixed[1]
    assert mixed[0] == pytest.approx(float(log_p(context)[best] + after[other]), rel=RTOL)


def _next_log_probs(workdir: str):
    """log p of the next byte after `ids`, by a plain forward pass on one device."""
    config = load_config("lm_tiny")
    apply_overrides(config, [*SMALL_LM, "mesh.data=1"])
    graphdef, _ = _abstract_model(run_config(config))
    params, _ = restore_params(f"{workdir}/checkpoints", 2)
    forward = jax.jit(lambda p, x: jax.nn.log_softmax(nnx.merge(graphdef, p)(x), axis=-1))
    return lambda ids: np.asarray(forward(params, jnp.asarray([ids], jnp.int32)))[0, -1]


def test_the_harness_s_git_lookup_prints_nothing_outside_a_repository(
    run, offline, tmp_path, monkeypatch, capfd
):
    """lm-evaluation-harness records the commit of the directory it runs in with `git
    describe`: outside a repository git's "fatal: not a git repository" reached the
    terminal (stderr's file descriptor, where no redirect of sys.stderr catches it)."""
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    yaml = (pathlib.Path(ROOT) / TASKS / "jaxkit_choice.yaml").read_text()
    (tasks / "choice.yaml").write_text(yaml.replace("tests/", f"{ROOT}/tests/"))
    monkeypatch.setenv("GIT_DIR", str(tmp_path / "no_repository"))
    args = ("eval", run, "--tasks", "jaxkit_choice", "--include-path", str(tasks), "--limit", "1")
    done = jaxkit(*args, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "not a git repository" not in done.stderr + capfd.readouterr().err


# Refusals come before any work: the SOURCE is never opened (there is none).
NO_RUN = "runs/none"


def test_tasks_are_refused_in_one_line_without_the_extra_and_where_they_do_not_apply(
    monkeypatch,
):
    cases = {
        ("--tasks", "jaxkit_choice", "--json"): "--json applies to the held-out loss",
        ("--limit", "3"): "--limit applies with --tasks only",
        ("--tasks", "a,,b"): "task names separated by commas",
        ("--tasks", "jaxkit_choice", "--include-path", "nowhere"): "not a directory",
        ("--tasks", "jaxkit_choice", "--out", "tests"): "--out tests: a directory",
    }
    for args, expected in cases.items():
        done = jaxkit("eval", NO_RUN, *args)
        assert done.returncode == 2 and expected in done.stderr, done.stderr
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # `import lm_eval` now fails
    done = jaxkit("eval", NO_RUN, "--tasks", "hellaswag")
    assert done.returncode == 2
    assert done.stderr == (
        "jaxkit: error: --tasks runs lm-evaluation-harness, which is not installed: "
        "pip install 'jaxkit[eval]'\n"
    )


def test_an_unknown_task_is_refused_in_one_line_before_the_model_loads(monkeypatch):
    # A name not in --include-path is looked for in the harness's own index too, which takes
    # 15 CPU-s to read (some 14,000 YAML files): left out here, the refusal is the same.
    import lm_eval.tasks

    manager = lm_eval.tasks.TaskManager
    monkeypatch.setattr(
        lm_eval.tasks,
        "TaskManager",
        lambda include_path, include_defaults=True: manager(
            include_path=include_path, include_defaults=False
        ),
    )
    args = ("--tasks", "jaxkit_choice,no_such_task", "--include-path", TASKS)
    done = jaxkit("eval", NO_RUN, *args)
    assert done.returncode == 2
    assert done.stderr == (
        "jaxkit: error: --tasks: no_such_task is not among lm-evaluation-harness's tasks "
        "(nor --include-path's)\n"
    )

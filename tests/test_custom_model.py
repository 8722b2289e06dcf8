"""A model of your own, `model.kind="package.module:factory"`, from a file outside jaxkit/:
it trains through the CLI, its splits match the full-batch reference, the params it does not
annotate are replicated (with a warning naming them), and each mistake is refused by name.
"""

import dataclasses
import json
import os
import subprocess
import sys
import warnings

import jax
import numpy as np
import pytest
from cli_run import jaxkit as run_cli
from jax.sharding import PartitionSpec as P
from small_configs import SMALL_LM
from test_equivalence import (
    GRAD_NORM_RTOL,
    LOSS_RTOL,
    PARAM_ATOL,
    STEPS,
    max_param_diff,
    reference_for,
    run_splits,
)
from test_loop import reference as eval_reference

from jaxkit import cli
from jaxkit.batch.schedule import plan_from_config
from jaxkit.config import (
    ConfigError,
    apply_overrides,
    is_lm,
    load_config,
    run_config,
    validate,
)
from jaxkit.data.sources import make_sources
from jaxkit.mesh import make_mesh, mesh_shape
from jaxkit.models import check_mesh_divides, custom_model
from jaxkit.plan.costs import batch_row_spec
from jaxkit.step.train_step import build

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KIND = "model.kind=mymodel:make"

# Partly annotated: the head is sharded over fsdp, the embedding annotated as replicated,
# and `scale` has no annotation at all. The other factories are the mistakes refused below.
MODEL = """
import jax
import jax.numpy as jnp
from flax import nnx


class TinyLM(nnx.Module):
    def __init__(self, vocab_size, d_model, rngs, vocab_out=None, head_axes=("fsdp", None)):
        replicated = nnx.with_partitioning(nnx.initializers.normal(1.0), (None, None))
        self.embed = nnx.Embed(vocab_size, d_model, embedding_init=replicated, rngs=rngs)
        self.scale = nnx.Param(jnp.ones((d_model,)))
        self.head = nnx.Linear(
            d_model,
            vocab_out or vocab_size,
            kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), head_axes),
            bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), (None,)),
            rngs=rngs,
        )

    def __call__(self, tokens_BxL):
        return self.head(jax.nn.gelu(self.embed(tokens_BxL) * self.scale))


def make(config, rngs):
    return TinyLM(config.model.vocab_size, config.model.d_model, rngs)


def wrong_vocab(config, rngs):
    return TinyLM(config.model.vocab_size, 8, rngs, vocab_out=config.model.vocab_size - 1)


def bad_axis(config, rngs):
    return TinyLM(config.model.vocab_size, 8, rngs, head_axes=("model", None))


def returns_dict(config, rngs):
    return {"embed": 0}


def with_dropout(config, rngs):
    model = TinyLM(config.model.vocab_size, 8, rngs)
    model.drop = nnx.Dropout(0.1, rngs=rngs)
    return model


class TinyClassifier(nnx.Module):  # features to class logits, every param annotated
    def __init__(self, num_features, hidden, num_classes, rngs):
        annotated = nnx.with_partitioning

        self.hidden = nnx.Linear(
            num_features,
            hidden,
            kernel_init=annotated(nnx.initializers.lecun_normal(), ("fsdp", None)),
            bias_init=annotated(nnx.initializers.zeros_init(), (None,)),
            rngs=rngs,
        )
        self.head = nnx.Linear(
            hidden,
            num_classes,
            kernel_init=annotated(nnx.initializers.lecun_normal(), (None, None)),
            bias_init=annotated(nnx.initializers.zeros_init(), (None,)),
            rngs=rngs,
        )

    def __call__(self, x_BxI):
        return self.head(jax.nn.relu(self.hidden(x_BxI)))


def classifier(config, rngs):
    return TinyClassifier(config.data.num_features, 32, config.model.num_classes, rngs)


def nine_classes(config, rngs):
    return TinyClassifier(config.data.num_features, 32, 9, rngs)


NOT_CALLABLE = 3


def one_argument(config):
    return make(config, None)
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A directory outside jaxkit/ with mymodel.py (and a module with a missing import),
    on sys.path for the in-process tests."""
    path = tmp_path_factory.mktemp("models")
    (path / "mymodel.py").write_text(MODEL)
    (path / "broken_model.py").write_text("import no_such_dependency_xyz\n")
    sys.path.insert(0, str(path))
    yield path
    sys.path.remove(str(path))
    for name in ("mymodel", "broken_model"):
        sys.modules.pop(name, None)


def lm_config(*overrides):
    config = load_config("lm_tiny")
    apply_overrides(config, [*SMALL_LM, *overrides])
    return config


def test_trains_through_the_cli_from_the_current_directory(model_dir, tmp_path):
    # As the `jaxkit` console script runs: its sys.path starts at its own directory, not at
    # the current one (`python -m jaxkit` would find ./mymodel.py by itself).
    script = tmp_path / "bin" / "jaxkit"
    script.parent.mkdir()
    script.write_text("import sys\nfrom jaxkit.cli import main\nsys.exit(main())\n")
    workdir = tmp_path / "run"
    overrides = [KIND, "mesh.fsdp=2", *SMALL_LM, "train.steps=12", "train.log_every=4"]
    overrides += [
        "train.eval_examples=64",
        "optimizer.warmup_steps=2",
        "optimizer.learning_rate=0.01",
    ]
    options = ["--host-devices", "4", "--no-progress", "--workdir", str(workdir)]
    out = subprocess.run(
        [sys.executable, script, "train", "lm_tiny", *overrides, *options],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=model_dir,
        env=dict(os.environ, PYTHONPATH=ROOT),
    )
    assert out.returncode == 0, out.stderr
    warned = [line for line in out.stderr.splitlines() if "replicated on every device" in line]
    assert len(warned) == 1, out.stderr  # once, though the CLI and the loop both validate
    assert warned[0].endswith("(nnx.with_partitioning): scale"), warned[0]
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    # Untrained it guesses bytes uniformly (ln 256 = 5.5 nats); by step 12 about 0.9 below step 4.
    assert len(losses) == 3 and losses[-1] < losses[0] - 0.5, losses
    assert "mesh data=2 × fsdp=2" in out.stdout
    # 6 × all its params per token counts the embedding table, which the step reads by
    # lookup: more model FLOPs than matmuls run, and an MFU above 100% is said to be no share.
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["model_flops_per_step"] > summary["hardware_flops_per_step"]
    assert ("MFU above 100% is no share" in out.stdout) == (summary["mfu"] > 1), out.stdout


@pytest.mark.filterwarnings("ignore:.*replicated on every device")
def test_splits_match_a_full_batch_reference(model_dir):
    # Two seed splits of 32 on fsdp=2 (the head sharded, `scale` replicated) against the
    # plain full-batch reference on one device, to the tolerances of test_equivalence.py.
    splits = [(4, 8, 1), (2, 8, 2)]
    runs = run_splits("lm_tiny", splits, [KIND, "mesh.fsdp=2"])
    ref_losses, ref_grad_norms, trajectory = reference_for("lm_tiny", [KIND])
    assert ref_losses[-1] < ref_losses[0]  # the reference itself trains
    for split, (losses, grad_norms, params) in runs.items():
        np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL, err_msg=str(split))
        np.testing.assert_allclose(
            grad_norms, ref_grad_norms, rtol=GRAD_NORM_RTOL, err_msg=f"grad_norm {split}"
        )
        worst = max_param_diff(params, trajectory[-1])
        assert worst < PARAM_ATOL, (split, worst)


@pytest.mark.filterwarnings("ignore:.*replicated on every device")
def test_params_without_annotation_are_replicated_the_rest_as_annotated(model_dir, monkeypatch):
    monkeypatch.setattr(custom_model, "_WARNED", set())  # as in a fresh process
    config = lm_config(KIND, "mesh.data=1", "mesh.fsdp=2")
    with pytest.warns(UserWarning, match=r"\(nnx.with_partitioning\): scale$"):
        validate(config)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second validation stays silent
        validate(config)
    typed = run_config(config)
    mesh = make_mesh(dataclasses.asdict(typed.mesh), jax.devices()[:2])
    setup = build(typed, plan_from_config(typed, mesh_shape(mesh)), mesh)
    params = setup.state_shardings.params
    assert params["scale"].spec == P()
    assert params["head"]["kernel"].spec == P("fsdp", None)
    assert params["embed"]["embedding"].spec == P(None, None)


def test_a_custom_kind_reads_the_language_model_data(model_dir):
    config = run_config(lm_config(KIND, "data.source=synthetic", "data.num_examples=64"))
    assert is_lm(config)
    assert batch_row_spec(config) == {
        "inputs": ((16,), "int32"),
        "targets": ((16,), "int32"),
        "loss_weights": ((16,), "float32"),
    }
    rows = make_sources(config)[0][np.arange(2)]
    assert rows["inputs"].shape == (2, 16) and rows["inputs"].dtype == np.int32
    # Counting sequences: each row's targets are its inputs one position on.
    np.testing.assert_array_equal(rows["inputs"][:, 1:], rows["targets"][:, :-1])


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "model.kind=mymodel.make",
            "model.kind='mymodel.make': must be one of transformer, llama, mlp, or "
            "package.module:factory",
        ),
        ("model.kind=mymodel:", "model.kind='mymodel:' is not package.module:factory"),
        ("model.kind=a:b:c", "model.kind='a:b:c' is not package.module:factory"),
        ("model.kind=no_such_module_xyz:make", "no module named 'no_such_module_xyz' on the"),
        (
            "model.kind=broken_model:make",
            "importing broken_model failed: No module named 'no_such_dependency_xyz'",
        ),
        ("model.kind=mymodel:mak", "has no attribute 'mak' (did you mean 'make'?)"),
        ("model.kind=mymodel:NOT_CALLABLE", "mymodel.NOT_CALLABLE is not callable (of type int)"),
        ("model.kind=mymodel:returns_dict", "returned a builtins.dict, not an nnx.Module"),
        (
            "model.kind=mymodel:one_argument",
            "cannot be called as factory(config, rngs): too many positional arguments",
        ),
        (
            "model.kind=mymodel:wrong_vocab",
            "returns logits of shape (1, 16, 255); expected (1, 16, 256)",
        ),
        ("model.kind=mymodel:with_dropout", "(drop.rngs.count: RngCount, drop.rngs.key: RngKey)"),
    ],
)
def test_mistakes_are_refused_by_name(model_dir, override, message):
    with pytest.raises(ConfigError) as err:
        validate(lm_config(override))
    assert message in str(err.value)


@pytest.mark.filterwarnings("ignore:.*replicated on every device")
def test_rules_of_the_language_model_data_apply(model_dir):
    with pytest.raises(ConfigError, match=r"model.vocab_size=100: data.source='text' feeds"):
        validate(lm_config(KIND, "model.vocab_size=100"))
    with pytest.raises(ConfigError, match=r"data.seq_len=0: must be an integer ≥ 1"):
        validate(lm_config(KIND, "data.seq_len=0"))
    # Its sizes are its own: the transformer's are neither needed nor checked.
    config = lm_config(KIND, "model.d_model=8", "model.num_heads=3")
    validate(config)
    del config.model.mlp_dim
    validate(config)


@pytest.mark.filterwarnings("ignore:.*replicated on every device")
def test_annotations_must_name_mesh_axes_and_divide_evenly(model_dir):
    """Refused as soon as the mesh shape is known, not by JAX once the step is traced."""
    mesh = {"data": 1, "fsdp": 4, "tensor": 1}
    check_mesh_divides(run_config(lm_config(KIND)), mesh)  # d_model 32 over fsdp=4
    with pytest.raises(ConfigError) as err:
        check_mesh_divides(run_config(lm_config(KIND, "model.d_model=30")), mesh)
    assert "param head.kernel of shape (30, 256) splits dimension 0 (30) over mesh.fsdp=4" in str(
        err.value
    )
    with pytest.raises(ConfigError, match=r"head.kernel is annotated with mesh axis 'model', not"):
        check_mesh_divides(run_config(lm_config("model.kind=mymodel:bad_axis")), mesh)


CLASSIFIER = "model.kind=mymodel:classifier"


def digits_config(*overrides):
    config = load_config("mlp_digits")
    apply_overrides(config, list(overrides))
    return config


def test_a_classifier_trains_through_the_cli_and_matches_the_full_batch_reference(
    model_dir, tmp_path, capsys
):
    """mlp_digits with a classifier of your own, through the CLI's entry point on two splits
    of 32 rows (8 × 4 × 1, and 4 data × 2 fsdp × 2 × 2 with its hidden kernel sharded):
    losses, gradient norms and the last step's eval match a plain optax loop over the same
    rows (test_equivalence's reference) and its params' eval (test_loop's)."""
    ref_losses, ref_grad_norms, trajectory = reference_for("mlp_digits", [CLASSIFIER])
    assert ref_losses[-1] < ref_losses[0]  # the reference itself trains
    ref_loss, ref_accuracy = eval_reference(
        run_config(digits_config(CLASSIFIER)), trajectory[-1], 32
    )
    common = [CLASSIFIER, "batch.global_batch_size=32", "train.eval_examples=32"]
    common += [f"train.steps={STEPS}", "train.log_every=1", f"train.eval_every={STEPS}"]
    common += ["optimizer.warmup_steps=2", "mesh.data=-1", "--no-progress"]
    splits = {"K1": ["batch.per_device_batch_size=4"]}
    splits["K2"] = ["batch.per_device_batch_size=2", "mesh.fsdp=2"]
    for name, split in splits.items():
        workdir = tmp_path / name
        assert cli.main(["train", "mlp_digits", *common, *split, "--workdir", str(workdir)]) == 0
        records = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
        logged = [r for r in records if "loss" in r]
        assert [r["grad_accum_steps"] for r in logged] == [int(name[1])] * STEPS
        np.testing.assert_allclose([r["loss"] for r in logged], ref_losses, rtol=LOSS_RTOL)
        np.testing.assert_allclose(
            [r["grad_norm"] for r in logged], ref_grad_norms, rtol=GRAD_NORM_RTOL
        )
        (evaluated,) = [r for r in records if "eval_loss" in r]
        # Params PARAM_ATOL apart: the same loss to a few ulps of ~2, and the same argmax
        # on these 32 rows.
        assert evaluated["eval_loss"] == pytest.approx(ref_loss, rel=LOSS_RTOL), name
        assert evaluated["eval_accuracy"] == ref_accuracy, name
    assert "mesh data=4 × fsdp=2" in capsys.readouterr().out


def test_a_classifier_takes_the_mlps_data_and_the_datas_classes(model_dir):
    config = digits_config(CLASSIFIER)
    validate(config)  # neither model.vocab_size nor data.seq_len: rows of features
    assert not is_lm(run_config(config))
    assert batch_row_spec(run_config(config)) == {
        "inputs": ((64,), "float32"),
        "targets": ((), "int32"),
        "loss_weights": ((), "float32"),
    }
    with pytest.raises(ConfigError) as err:
        validate(digits_config("model.kind=mymodel:nine_classes"))
    assert (
        "for inputs of shape (1, 64) (rows, data.num_features) the model returns logits of "
        "shape (1, 9); expected (1, 10) (rows, the 10 classes of data.source='digits')"
    ) in str(err.value)
    with pytest.raises(ConfigError, match=r"data.num_features=60: data.source='digits' gives 64"):
        validate(digits_config(CLASSIFIER, "data.num_features=60"))
    # Synthetic rows are labelled in model.num_classes: 9 of them for a classifier of 9.
    config = digits_config(
        "data.source=synthetic", "model.num_classes=9", "model.kind=mymodel:nine_classes"
    )
    validate(config)
    train_rows, _ = make_sources(run_config(config))
    assert set(np.unique(train_rows[np.arange(len(train_rows))]["targets"])) <= set(range(9))
    del config.model.num_classes
    with pytest.raises(ConfigError, match=r"no model.num_classes, which data.source='synthetic'"):
        validate(config)


def test_a_model_of_your_own_samples_by_recomputing_the_prefix_and_says_so(model_dir, tmp_path):
    """It has no key/value cache the kit knows: `jaxkit sample` runs it over the whole
    prefix for each new token, and says so in one line."""
    workdir = str(tmp_path / "run")
    args = ["lm_tiny", *SMALL_LM, KIND, "train.steps=1", "train.eval_every=0"]
    assert run_cli("train", *args, "--workdir", workdir, "--no-progress").returncode == 0
    # --no-progress: on a loaded machine the recomputed prefix passes the 2 s after which a
    # bar shows on stderr, beside the note.
    done = run_cli(
        "sample", workdir, "--prompt", "ab", "--max-new-tokens", "3", "--json", "--no-progress"
    )
    assert done.returncode == 0, done.stderr
    (note,) = done.stderr.splitlines()
    assert note.startswith("note: mymodel:make is a model of your own") and "recomputes" in note
    (line,) = [json.loads(x) for x in done.stdout.splitlines()]
    assert line["prompt_tokens"] == [97, 98] and len(line["tokens"]) == 3

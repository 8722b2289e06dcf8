"""A model of your own, `model.kind="package.module:factory"`, from a file outside jaxkit/:
it trains through the CLI, its splits match the full-batch reference, the params it does not
annotate are replicated (with a warning naming them), and each mistake is refused by name.
"""

import json
import os
import subprocess
import sys
import warnings

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from small_configs import SMALL_LM
from test_equivalence import (
    GRAD_NORM_RTOL,
    LOSS_RTOL,
    PARAM_ATOL,
    max_param_diff,
    reference_for,
    run_splits,
)

from jaxkit import custom_model
from jaxkit.batch_schedule import plan_from_config
from jaxkit.config import ConfigError, apply_overrides, is_lm, load_config, validate
from jaxkit.costs import batch_row_spec
from jaxkit.data import make_sources
from jaxkit.mesh import make_mesh, mesh_shape
from jaxkit.models import check_mesh_divides
from jaxkit.train_step import build

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
    mesh = make_mesh(config.mesh.to_dict(), jax.devices()[:2])
    setup = build(config, plan_from_config(config, mesh_shape(mesh)), mesh)
    params = setup.state_shardings.params
    assert params["scale"].spec == P()
    assert params["head"]["kernel"].spec == P("fsdp", None)
    assert params["embed"]["embedding"].spec == P(None, None)


def test_a_custom_kind_reads_the_language_model_data(model_dir):
    config = lm_config(KIND, "data.source=synthetic", "data.num_examples=64")
    assert is_lm(config.model.kind)
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
    check_mesh_divides(lm_config(KIND), mesh)  # d_model 32 over fsdp=4
    with pytest.raises(ConfigError) as err:
        check_mesh_divides(lm_config(KIND, "model.d_model=30"), mesh)
    assert "param head.kernel of shape (30, 256) splits dimension 0 (30) over mesh.fsdp=4" in str(
        err.value
    )
    with pytest.raises(ConfigError, match=r"head.kernel is annotated with mesh axis 'model', not"):
        check_mesh_divides(lm_config("model.kind=mymodel:bad_axis"), mesh)

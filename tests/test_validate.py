"""validate.validate and models.check_mesh_divides: every bad value named before any work."""

import math

import jax
import ml_collections
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxkit import config as config_lib
from jaxkit.config import (
    ConfigError,
    apply_overrides,
    flat_keys,
    load_config,
    run_config,
    validate,
)
from jaxkit.models import check_mesh_divides, sharded_sizes
from jaxkit.step.train_step import _abstract_model


def _refusal(config):
    """The ConfigError validate raises for `config`, as text."""
    with pytest.raises(ConfigError) as err:
        validate(config)
    return str(err.value)


def _config(name, *overrides):
    config = load_config(name)
    apply_overrides(config, list(overrides))
    return config


@pytest.mark.parametrize("name", ["lm_tiny", "mlp_digits"])
def test_the_shipped_configs_are_valid(name):
    validate(load_config(name))


@pytest.mark.parametrize("name", ["lm_tiny", "mlp_digits"])
def test_every_key_of_a_config_has_a_rule(name):
    config = load_config(name)
    kind = config.model.kind
    ruled = set(config_lib.BASE_RULES) | set(config_lib.MODEL_RULES[kind])
    ruled |= set(config_lib.OPTIONAL_RULES[kind])
    for rules in config_lib.SOURCE_RULES.values():
        ruled |= set(rules)
    assert set(flat_keys(config)) - {"name"} <= ruled


# (config, override, what the message must say): one per constraint of the base config and
# of each model kind. Each value is one the code before validation accepted or crashed on.
BAD = [
    ("mlp_digits", "mesh.data=null", "mesh.data=null: must be a positive axis size, or -1"),
    ("mlp_digits", "mesh.fsdp=0", "mesh.fsdp=0: must be a positive axis size"),
    ("mlp_digits", "mesh.tensor=-2", "mesh.tensor=-2"),
    ("mlp_digits", "mesh.fsdp=-1", "mesh.data, mesh.fsdp are -1: at most one mesh axis"),
    ("mlp_digits", "batch.global_batch_size=0", "batch.global_batch_size=0: must be null or an"),
    ("mlp_digits", "batch.grad_accum_steps=-1", "batch.grad_accum_steps=-1"),
    ("mlp_digits", "train.log_every=0", "train.log_every=0: must be an integer ≥ 1"),
    ("mlp_digits", "train.steps=0", "train.steps=0: must be null or an integer in [1, 2147483648)"),
    (
        "mlp_digits",
        "train.steps=-5",
        "train.steps=-5: must be null or an integer in [1, 2147483648)",
    ),
    ("mlp_digits", "train.seed=-1", "train.seed=-1: must be an integer in [0, 4294967296)"),
    ("mlp_digits", "train.seed=4294967296", "train.seed=4294967296"),
    ("mlp_digits", "train.eval_every=-1", "train.eval_every=-1: must be an integer ≥ 0"),
    ("mlp_digits", "train.eval_examples=-3", "train.eval_examples=-3: must be an integer ≥ 0"),
    ("mlp_digits", "train.max_nonfinite_in_row=0", "train.max_nonfinite_in_row=0"),
    ("mlp_digits", "train.accumulation=scan", "train.accumulation='scan': must be one of"),
    ("mlp_digits", "train.noise_scale_decay=1", "train.noise_scale_decay=1.0: must be in [0, 1)"),
    ("mlp_digits", "train.noise_scale_decay=-0.1", "train.noise_scale_decay=-0.1"),
    ("mlp_digits", "train.profile_steps=5:3", "train.profile_steps='5:3' needs 0 <= START"),
    ("mlp_digits", "train.profile_steps=abc", "train.profile_steps='abc' is not START:END"),
    ("mlp_digits", "checkpoint.keep=0", "checkpoint.keep=0: must be an integer ≥ 1"),
    ("mlp_digits", "checkpoint.every=-1", "checkpoint.every=-1: must be an integer ≥ 0"),
    ("mlp_digits", "optimizer.name=adam", "optimizer.name='adam': must be one of adamw, sgd"),
    ("mlp_digits", "optimizer.learning_rate=nan", "optimizer.learning_rate=nan: must be a finite"),
    ("mlp_digits", "optimizer.learning_rate=inf", "optimizer.learning_rate=inf"),
    ("mlp_digits", "optimizer.learning_rate=0", "optimizer.learning_rate=0.0: must be > 0"),
    ("mlp_digits", "optimizer.learning_rate=-1e-3", "optimizer.learning_rate=-0.001"),
    ("mlp_digits", "optimizer.lr_scaling=cubic", "optimizer.lr_scaling='cubic': must be one"),
    ("mlp_digits", "optimizer.reference_batch_size=0", "optimizer.reference_batch_size=0"),
    ("mlp_digits", "optimizer.warmup_steps=-1", "optimizer.warmup_steps=-1"),
    ("mlp_digits", "optimizer.final_lr_fraction=1.5", "optimizer.final_lr_fraction=1.5: must be"),
    ("mlp_digits", "optimizer.final_lr_fraction=-0.1", "optimizer.final_lr_fraction=-0.1"),
    ("mlp_digits", "optimizer.weight_decay=-0.01", "optimizer.weight_decay=-0.01: must be ≥ 0"),
    ("mlp_digits", "optimizer.b1=1", "optimizer.b1=1.0: must be in [0, 1)"),
    ("mlp_digits", "optimizer.b2=1.5", "optimizer.b2=1.5"),
    ("mlp_digits", "optimizer.momentum=1", "optimizer.momentum=1.0: must be in [0, 1)"),
    ("mlp_digits", "optimizer.grad_clip_norm=-1", "optimizer.grad_clip_norm=-1.0: must be ≥ 0"),
    ("mlp_digits", "optimizer.grad_clip_norm=nan", "optimizer.grad_clip_norm=nan"),
    (
        "mlp_digits",
        "model.kind=cnn",
        "model.kind='cnn': must be one of transformer, llama, mlp, or package.module:factory",
    ),
    ("mlp_digits", "model.hidden_size=0", "model.hidden_size=0: must be an integer ≥ 1"),
    ("mlp_digits", "model.num_layers=0", "model.num_layers=0"),
    ("mlp_digits", "model.num_classes=0", "model.num_classes=0"),
    ("mlp_digits", "model.num_classes=5", "model.num_classes=5: data.source='digits' has labels"),
    ("mlp_digits", "data.source=text", "data.source='text': must be one of digits, synthetic"),
    ("mlp_digits", "data.num_features=32", "data.num_features=32: data.source='digits' gives 64"),
    ("mlp_digits", "data.num_features=0", "data.num_features=0"),
    ("mlp_digits", "data.seq_len=16", "data.seq_len=16: must be null: the mlp reads rows"),
    ("mlp_digits", "data.eval_fraction=0", "data.eval_fraction=0.0: must be in (0, 1)"),
    ("mlp_digits", "data.eval_fraction=1", "data.eval_fraction=1.0"),
    ("mlp_digits", "data.num_examples=0", "data.num_examples=0"),
    ("lm_tiny", "model.num_heads=3", "model.d_model=128 is not divisible by model.num_heads=3"),
    ("lm_tiny", "model.d_model=0", "model.d_model=0: must be an integer ≥ 1"),
    ("lm_tiny", "model.mlp_dim=-4", "model.mlp_dim=-4"),
    ("lm_tiny", "model.num_heads=0", "model.num_heads=0"),
    ("lm_tiny", "model.vocab_size=100", "model.vocab_size=100: data.source='text' feeds bytes"),
    ("lm_tiny", "data.seq_len=null", "data.seq_len=null: must be an integer ≥ 1"),
    ("lm_tiny", "data.seq_len=0", "data.seq_len=0"),
    ("lm_tiny", "data.max_bytes=0", "data.max_bytes=0: must be an integer ≥ 1"),
    ("lm_tiny", "data.source=digits", "data.source='digits': must be one of text, synthetic"),
    ("lm_tiny", "data.eval_fraction=1.5", "data.eval_fraction=1.5: must be in (0, 1)"),
    # Optimizer step counts are int32: past 2**31 they overflow while compiling.
    ("mlp_digits", "optimizer.warmup_steps=3000000000", "optimizer.warmup_steps=3000000000"),
    ("mlp_digits", "train.steps=2147483648", "train.steps=2147483648: must be null or an"),
    ("mlp_digits", "train.examples=0", "train.examples=0: must be null or an integer ≥ 1"),
    ("mlp_digits", "batch.auto_patience=0", "batch.auto_patience=0: must be an integer ≥ 1"),
    ("lm_tiny", "data.path=", "data.path='': must be null (the default corpus) or the path"),
    ("lm_tiny", "data.path=/nonexistent/corpus.txt", "data.path='/nonexistent/corpus.txt': is"),
    ("lm_tiny", "data.path=/", "data.path='/': is not a file"),
]


@pytest.mark.parametrize("name,override,message", BAD)
def test_each_bad_value_is_named_with_its_constraint(name, override, message):
    assert message in _refusal(_config(name, override))


def test_lr_scaling_needs_a_reference_batch():
    config = _config(
        "mlp_digits", "optimizer.lr_scaling=linear", "optimizer.reference_batch_size=null"
    )
    assert "give optimizer.reference_batch_size" in _refusal(config)


def test_a_config_file_with_the_old_key_or_of_another_type_is_refused():
    config = load_config("mlp_digits")
    config.train.eval_batches = 1  # a config file written before the rename
    assert "train.eval_batches was replaced by train.eval_exa" in _refusal(config)
    # A config file writes whole sections, of any type; overrides keep the types.
    config = load_config("mlp_digits")
    config.model = ml_collections.ConfigDict(dict(config.model.to_dict(), hidden_size=128.0))
    assert "model.hidden_size=128.0: must be an integer" in _refusal(config)
    config = load_config("mlp_digits")
    config.train = ml_collections.ConfigDict(dict(config.train.to_dict(), log_every=True))
    assert "train.log_every=True: must be an integer" in _refusal(config)


def test_a_missing_key_is_named_with_what_needs_it():
    config = _config("mlp_digits", "model.kind=transformer")
    assert "no model.vocab_size, which model.kind='transformer'" in _refusal(config)


def test_in_range_edges_pass():
    validate(
        _config(
            "mlp_digits",
            "optimizer.final_lr_fraction=1",
            "optimizer.final_lr_fraction=0",
            "optimizer.momentum=0",
            "optimizer.b1=0",
            "optimizer.grad_clip_norm=0",
            "train.noise_scale_decay=0",
            "train.seed=4294967295",
            "train.eval_examples=0",
            "checkpoint.every=0",
            "checkpoint.keep=1",
            "mesh.data=1",
            "mesh.tensor=-1",
            "train.profile_steps=0:1",
        )
    )


def _sharded_dims(config):
    """(size, axis) of every parameter dimension the partition rules shard, from the model."""
    _, abstract = _abstract_model(config)
    specs = jax.tree.leaves(
        nnx.to_pure_dict(nnx.get_partition_spec(abstract)), is_leaf=lambda x: isinstance(x, P)
    )
    shapes = [leaf.shape for leaf in jax.tree.leaves(nnx.to_pure_dict(abstract))]
    return {
        (size, axis)
        for shape, spec in zip(shapes, specs, strict=True)
        for size, axis in zip(shape, spec, strict=False)  # a spec may omit trailing dims
        if axis is not None
    }


@pytest.mark.parametrize(
    "name,overrides",
    [
        # Distinct sizes, so each sharded dimension points at one key.
        ("lm_tiny", ["model.d_model=48", "model.num_heads=4", "model.mlp_dim=80"]),
        ("lm_tiny", ["model.d_model=48", "model.num_layers=1", "model.mlp_dim=80"]),
        # heads × head_dim 56 and kv heads × head_dim 28 apart from d_model 48 (tensor side)
        ("llama_tiny", ["model.d_model=48", "model.head_dim=14", "model.mlp_dim=80"]),
        ("mlp_digits", ["model.hidden_size=96"]),
        ("mlp_digits", ["model.hidden_size=96", "model.num_layers=3"]),
        ("mlp_digits", ["model.hidden_size=96", "model.num_layers=1"]),
    ],
)
def test_sharded_sizes_are_exactly_what_the_partition_rules_shard(name, overrides):
    config = run_config(_config(name, *overrides))
    listed = {(size, axis) for _, size, axes in sharded_sizes(config) for axis in axes}
    assert _sharded_dims(config) == listed


@pytest.mark.parametrize(
    "name,overrides,shape,message",
    [
        ("lm_tiny", ["model.d_model=36", "model.num_heads=4"], (1, 8, 1), "mesh.fsdp=8"),
        ("lm_tiny", ["model.d_model=36", "model.num_heads=4"], (1, 1, 8), "d_model=36 is"),
        ("lm_tiny", ["model.mlp_dim=500"], (1, 1, 8), "model.mlp_dim=500 is not divisible"),
        ("mlp_digits", ["model.hidden_size=100"], (1, 1, 8), "model.hidden_size=100 is not"),
        ("mlp_digits", ["model.hidden_size=100"], (1, 8, 1), "mesh.fsdp=8"),
        ("mlp_digits", [], (1, 3, 1), "data.num_features=64 is not divisible by mesh.fsdp=3"),
    ],
)
def test_uneven_shards_are_refused_naming_the_key_and_axis(name, overrides, shape, message):
    config = run_config(_config(name, *overrides))
    mesh_shape = dict(zip(("data", "fsdp", "tensor"), shape, strict=True))
    with pytest.raises(ConfigError, match="shards must be even") as err:
        check_mesh_divides(config, mesh_shape)
    assert message in str(err.value)
    check_mesh_divides(config, {"data": math.prod(shape), "fsdp": 1, "tensor": 1})


@pytest.mark.parametrize("heads,d_model,tensor", [(4, 128, 8), (3, 96, 2)])
def test_heads_that_do_not_divide_over_tensor_are_refused(heads, d_model, tensor):
    # d_model divides over tensor in both, so only the heads can be uneven.
    config = run_config(_config("lm_tiny", f"model.num_heads={heads}", f"model.d_model={d_model}"))
    shape = {"data": 8 // tensor, "fsdp": 1, "tensor": tensor}
    with pytest.raises(ConfigError, match=f"model.num_heads={heads} is not divisible by mesh"):
        check_mesh_divides(config, shape)
    config = run_config(
        _config("lm_tiny", f"model.num_heads={2 * tensor}", f"model.d_model={d_model}")
    )
    check_mesh_divides(config, shape)  # whole heads on every device


def test_an_empty_text_file_is_refused(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    assert "is an empty file" in _refusal(_config("lm_tiny", f"data.path={empty}"))

import pytest

from jaxkit.config import ConfigError, apply_overrides, flat_keys, load_config

FIXED_KEYS = [
    "batch.global_batch_size",
    "batch.per_device_batch_size",
    "batch.grad_accum_steps",
    "mesh.data",
    "mesh.fsdp",
    "mesh.tensor",
    "train.steps",
    "train.seed",
    "train.log_every",
    "optimizer.learning_rate",
    "optimizer.lr_scaling",
    "optimizer.reference_batch_size",
]


@pytest.mark.parametrize("name", ["lm_tiny", "mlp_digits"])
def test_configs_have_the_fixed_keys(name):
    keys = flat_keys(load_config(name))
    assert set(FIXED_KEYS) <= set(keys)


def test_overrides_keep_types_and_null_switches_the_free_value():
    c = load_config("mlp_digits")
    apply_overrides(
        c,
        [
            "batch.per_device_batch_size=null",
            "batch.grad_accum_steps=4",
            "optimizer.learning_rate=1",
            "optimizer.lr_scaling=sqrt",
            "train.steps=7",
        ],
    )
    assert c.batch.per_device_batch_size is None and c.batch.grad_accum_steps == 4
    assert c.optimizer.learning_rate == 1.0 and isinstance(c.optimizer.learning_rate, float)
    assert c.optimizer.lr_scaling == "sqrt" and c.train.steps == 7
    apply_overrides(c, ["batch.per_device_batch_size=8"])  # a nulled field keeps its type
    assert c.batch.per_device_batch_size == 8


def test_unknown_key_suggests_the_closest():
    c = load_config("lm_tiny")
    with pytest.raises(
        ConfigError, match=r"unknown config key 'batch\.global_batch'.*'batch\.global_batch_size'"
    ):
        apply_overrides(c, ["batch.global_batch=64"])
    with pytest.raises(ConfigError, match=r"'train\.steps'"):
        apply_overrides(c, ["optimizer.steps=3"])


@pytest.mark.parametrize(
    "item,match",
    [
        ("train.steps=ten", "train.steps='ten': expected int, got str"),
        ("train.steps=2.5", "expected int, got float"),
        ("batch.grad_accum_steps=true", "expected int, got bool"),
        ("optimizer.learning_rate=fast", "expected float"),
        ("train.steps", "not of the form"),
        ("train.steps=None", "write train.steps=null"),
    ],
)
def test_ill_typed_values_name_the_key(item, match):
    with pytest.raises(ConfigError, match=match):
        apply_overrides(load_config("lm_tiny"), [item])


def test_unknown_config_suggests_a_name():
    with pytest.raises(ConfigError, match="did you mean 'lm_tiny'"):
        load_config("lm_tiyn")


def test_only_null_unsets_and_none_stays_a_string_where_strings_go():
    c = load_config("lm_tiny")
    apply_overrides(c, ["optimizer.lr_scaling=none", "data.path=None", "train.profile_steps=none"])
    assert c.optimizer.lr_scaling == "none"  # the documented value, not Python's None
    assert c.data.path == "None" and c.train.profile_steps == "none"
    apply_overrides(c, ["data.path=null", "batch.grad_accum_steps=null"])
    assert c.data.path is None and c.batch.grad_accum_steps is None


@pytest.mark.parametrize(
    "item",
    [
        "train.steps=none",  # int
        "optimizer.learning_rate=None",  # float
        "batch.global_batch_size=none",  # placeholder int
        "optimizer.reference_batch_size=None",  # placeholder int
    ],
)
def test_none_in_a_non_string_field_says_to_write_null(item):
    key = item.split("=")[0]
    with pytest.raises(ConfigError) as err:
        apply_overrides(load_config("lm_tiny"), [item])
    assert key in str(err.value) and f"write {key}=null to unset it" in str(err.value)


def test_the_renamed_eval_key_points_at_its_replacement():
    with pytest.raises(ConfigError) as err:
        apply_overrides(load_config("lm_tiny"), ["train.eval_batches=2"])
    message = str(err.value)
    assert "train.eval_batches was replaced by train.eval_examples" in message
    assert "held-out rows" in message and "not micro-batches" in message


def test_a_float_override_too_large_for_a_float_is_inf_not_a_crash():
    c = load_config("lm_tiny")
    apply_overrides(c, ["optimizer.learning_rate=1" + "0" * 400])  # int() reads it, float() not
    assert c.optimizer.learning_rate == float("inf")  # which validate() refuses as not finite

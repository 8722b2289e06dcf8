import pytest

from jaxkit.config import ConfigError, apply_overrides, flat_keys, load_config

FIXED_KEYS = [
    "batch.global_batch_size",
    "batch.per_device_batch_size",
    "batch.grad_accum_steps",
    "mesh.data",
    "mesh.fsdp",
    "mesh.tensor",
    "mesh.dcn_data",
    "mesh.dcn_fsdp",
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


# Each key is declared once (jaxkit/keys.py's form); what the kit reads is derived from it.


def test_every_declared_key_has_a_doc_and_its_default_passes_its_rule():
    from jaxkit.config import all_keys, available_configs
    from jaxkit.keys import REQUIRED

    keys = all_keys()
    for name in available_configs():  # every key a shipped config sets is declared
        assert set(flat_keys(load_config(name))) - {"name"} <= {k.name for k in keys}, name
    for key in keys:
        assert key.doc.strip(), key.name
        assert str(key.rule.text).strip(), key.name
        if key.default is not REQUIRED:
            assert key.rule(key.default) is None, (key.name, key.default)


def test_base_config_and_the_rules_come_from_the_declaration():
    from jaxkit.config import BASE_KEYS, BASE_RULES, base_config, flatten

    flat = flatten(base_config())
    assert sorted(flat) == sorted(k.name for k in BASE_KEYS)
    for key in BASE_KEYS:
        assert flat[key.name] == key.default
        assert BASE_RULES[key.name] is key.rule
    # A placeholder keeps its declared type: an override is read as that type.
    c = base_config()
    apply_overrides(c, ["batch.global_batch_size=8", "optimizer.learning_rate=1"])
    assert c.batch.global_batch_size == 8 and isinstance(c.optimizer.learning_rate, float)


def test_a_resume_may_change_exactly_the_keys_declared_resumable():
    from jaxkit.config import all_keys, resumable
    from jaxkit.train.checkpoint import config_conflicts

    saved = load_config("lm_tiny").to_dict()
    for key in all_keys():
        if key.name not in flat_keys(load_config("lm_tiny")):
            continue
        section, leaf = key.name.split(".")
        current = load_config("lm_tiny").to_dict()
        current[section][leaf] = "changed"
        assert bool(config_conflicts(saved, current)) is not key.resumable, key.name
        assert resumable(key.name) is key.resumable
    # Keys an older run saved in a section that is wholly resumable stay resumable.
    assert resumable("mesh.some_older_axis") and not resumable("model.some_older_size")


# What a resume may change, whatever the model: where the run happens (the mesh), how the
# global batch is split and how it grows, what is logged, evaluated and saved, the input's
# prefetch, and the run's length and global batch, which have checks of their own
# (--allow-longer, --allow-batch-change). Written out, not read from the declarations: a
# key marked resumable by mistake (model.norm_eps: a resume without the override would go
# on as another model) shows here.
RESUMABLE_EVERYWHERE = {
    "name",
    *("mesh.data", "mesh.fsdp", "mesh.tensor", "mesh.dcn_data", "mesh.dcn_fsdp"),
    *("batch.global_batch_size", "batch.per_device_batch_size", "batch.grad_accum_steps"),
    *("batch.schedule", "batch.max_global_batch_size", "batch.auto_patience"),
    *("train.steps", "train.examples", "train.accumulation", "train.prefetch"),
    *("train.log_every", "train.eval_every", "train.eval_examples", "train.profile_steps"),
    *("train.noise_scale_every", "train.noise_scale_decay", "train.max_nonfinite_in_row"),
    *("checkpoint.every", "checkpoint.keep"),
    *("wandb.project", "wandb.entity", "wandb.run_name"),  # where it is also logged
}
# How a language model computes the same function: recomputation, the attention kernel,
# the loss's chunks; and for a Llama the weights it started from (a resume reads its own).
# data.mixture_stages: a resume checks it against the checkpoint's position instead (a
# stage the saved position read must not change; jaxkit/batch/mixture.py stage_changes).
LM_RESUMABLE = {
    "model.remat",
    "model.attention",
    "model.loss_chunk_tokens",
    "data.mixture_stages",
}
RESUMABLE = {
    "transformer": RESUMABLE_EVERYWHERE | LM_RESUMABLE,
    "llama": RESUMABLE_EVERYWHERE | LM_RESUMABLE | {"model.init_from"},
    "mlp": RESUMABLE_EVERYWHERE,
}


@pytest.mark.parametrize(
    ("name", "kind"), [("lm_tiny", "transformer"), ("llama_tiny", "llama"), ("mlp_digits", "mlp")]
)
def test_a_resume_may_change_these_keys_of_each_model_kind_and_no_other(name, kind):
    from jaxkit.config import BASE_KEYS, KIND_KEYS, flatten
    from jaxkit.train.checkpoint import config_conflicts

    config = load_config(name)
    assert config.model.kind == kind
    saved = flatten(config.to_dict())
    declared = {k.name for k in BASE_KEYS} | {k.name for k in KIND_KEYS[kind]} | saved.keys()
    changeable = {key for key in declared if not config_conflicts(saved, saved | {key: "other"})}
    assert changeable == RESUMABLE[kind]


def test_a_run_saved_before_a_key_existed_ran_as_its_added_default():
    from jaxkit.config import ADDED_DEFAULTS
    from jaxkit.train.checkpoint import config_conflicts

    current = load_config("lm_tiny").to_dict()
    for name, added in ADDED_DEFAULTS.items():
        section, leaf = name.split(".")
        saved = load_config("lm_tiny").to_dict()
        saved[section].pop(leaf, None)
        current[section][leaf] = added
        assert config_conflicts(saved, current) == [], name
    assert ADDED_DEFAULTS["model.remat"] == "none" and ADDED_DEFAULTS["data.rows"] == "windows"


def test_an_option_the_kind_declares_can_be_set_where_the_config_file_leaves_it_out():
    import ml_collections

    def without_options():  # a config file that lists only llama's required keys
        saved = load_config("llama_tiny").to_dict()
        for leaf in ("loss_chunk_tokens", "head_dim", "remat"):
            saved["model"].pop(leaf, None)
        return ml_collections.ConfigDict(saved)

    # Their declared defaults apply, and an override sets them, typed as declared.
    config = without_options()
    apply_overrides(config, ["model.loss_chunk_tokens=64", "model.head_dim=16"])
    assert config.model.loss_chunk_tokens == 64 and config.model.head_dim == 16
    apply_overrides(config, ["model.remat=full"])
    assert config.model.remat == "full"
    with pytest.raises(ConfigError, match="expected int"):
        apply_overrides(without_options(), ["model.head_dim=wide"])
    # A key another kind declares stays unknown here.
    with pytest.raises(ConfigError, match=r"unknown config key 'model\.loss_chunk_tokens'"):
        apply_overrides(load_config("mlp_digits"), ["model.loss_chunk_tokens=64"])


ROPE_SCALING = (
    'model.rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, '
    '"original_max_position_embeddings": 8192}'
)


def test_a_field_of_a_dict_key_sets_the_value_given_whole_before_it_on_the_line():
    """docs/models-at-scale.md's `model.rope_scaling.factor=16.0` after the whole value on
    the same line: the keys were listed before any override applied, so the field was an
    unknown key wherever it came."""
    from cli_run import jaxkit

    config = load_config("llama_tiny")  # model.rope_scaling is null here
    apply_overrides(config, [ROPE_SCALING, "model.rope_scaling.factor=16.0"])
    assert config.model.rope_scaling.to_dict() == {
        "factor": 16.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    # Through the command line: the field is applied, and then checked (a factor below 1
    # is refused as a factor, in one line).
    done = jaxkit("plan", "llama_tiny", ROPE_SCALING, "model.rope_scaling.factor=0.5")
    (line,) = done.stderr.splitlines()
    assert done.returncode == 2 and "'factor': 0.5" in line and "factor ≥ 1" in line, line
    # A field of a null value, or before the whole value that replaces it, is refused.
    done = jaxkit("plan", "llama_tiny", "model.rope_scaling.factor=16.0")
    (line,) = done.stderr.splitlines()
    assert done.returncode == 2, line
    assert line.startswith("jaxkit: error: model.rope_scaling is null: set it whole as JSON first")
    with pytest.raises(ConfigError, match=r"comes before model\.rope_scaling on the line"):
        line = ["model.rope_scaling.factor=2.0", ROPE_SCALING]  # as the CLI applies a line
        apply_overrides(load_config("llama_tiny"), line, held=[])
    with pytest.raises(ConfigError, match="is null"):
        apply_overrides(config, ["model.rope_scaling=null", "model.rope_scaling.factor=2.0"])

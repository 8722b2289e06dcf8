"""jaxkit.models: every model kind provides the whole contract, and it describes the network
the kind builds."""

import ast
import inspect
import pathlib

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from jaxkit import models
from jaxkit.config import apply_overrides, flatten, load_config, run_config
from jaxkit.keys import REQUIRED, ConfigError
from jaxkit.models import Contract


def _annotated(fan_in, fan_out, rngs):
    init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("fsdp", None))
    bias = nnx.with_partitioning(nnx.initializers.zeros_init(), (None,))
    return nnx.Linear(fan_in, fan_out, kernel_init=init, bias_init=bias, rngs=rngs)


def tiny_lm(config, rngs):
    """A model of your own over token rows: one-hot tokens through a linear map."""
    vocab = config.model.vocab_size
    linear = _annotated(vocab, vocab, rngs)
    return nnx.Sequential(lambda tokens: jax.nn.one_hot(tokens, vocab), linear)


def tiny_classifier(config, rngs):
    """A model of your own over rows of features."""
    return _annotated(config.data.num_features, config.model.num_classes, rngs)


# Each kind, and a config of it (a model of your own from the factories above).
KIND_CONFIGS = {
    "transformer": ("lm_tiny", []),
    "llama": ("llama_tiny", []),
    "mlp": ("mlp_digits", []),
    "custom": ("lm_tiny", [f"model.kind={__name__}:tiny_lm"]),
    "custom_classifier": ("mlp_digits", [f"model.kind={__name__}:tiny_classifier"]),
}


def _contract_of(kind):
    return models.KINDS.get(kind, models.CUSTOM)


def _config(kind):
    name, overrides = KIND_CONFIGS[kind]
    config = load_config(name)
    apply_overrides(config, overrides)
    return config


def _members():
    """The contract's members: its attributes, and its functions with their parameters."""
    hints = inspect.get_annotations(Contract)
    functions = {
        name: list(inspect.signature(fn).parameters)[1:]  # less self
        for name, fn in vars(Contract).items()
        if inspect.isfunction(fn) and not name.startswith("_")
    }
    return hints, functions


def test_every_kind_is_registered_once_and_a_factory_names_your_own():
    assert set(models.KINDS) == {"transformer", "llama", "mlp"}
    for name, kind in models.KINDS.items():
        assert models.kind_of(name) is kind
    assert models.kind_of("mymodel:make") is models.CUSTOM
    with pytest.raises(ConfigError) as err:
        models.kind_of("gpt")
    assert str(err.value) == (
        "model.kind='gpt' is not one of transformer, llama, mlp, package.module:factory"
    )


@pytest.mark.parametrize("kind", sorted(KIND_CONFIGS))
def test_each_kind_provides_the_whole_contract(kind):
    contract = _contract_of(kind)
    hints, functions = _members()
    assert hints and len(functions) >= 8  # the reader found the contract
    for name in hints:
        assert isinstance(getattr(contract, name), bool), name
    for name, parameters in functions.items():
        fn = getattr(contract, name)
        assert list(inspect.signature(fn).parameters) == parameters, name


@pytest.mark.parametrize("kind", sorted(KIND_CONFIGS))
def test_the_contract_describes_the_network_it_builds(kind):
    config = _config(kind)
    typed = run_config(config)
    contract = models.contract(typed)
    assert contract is _contract_of(kind)
    # Its keys: the config gives each required one, every present one keeps its rule, and
    # the checks between them pass (a bad value is refused: test_validate.py).
    flat = flatten(config)
    for key in contract.keys(flat):
        if key.default is REQUIRED:
            assert key.name in flat, key.name
        if key.name in flat:
            assert key.rule(flat[key.name]) is None, key.name
    contract.check_values(flat)
    contract.check_model(typed)
    with nnx.use_eager_sharding(False):
        model = nnx.eval_shape(lambda: contract.build(typed, nnx.Rngs(0)))
    d = config.data
    if contract.is_lm(typed):
        inputs = jax.ShapeDtypeStruct((2, d.seq_len), jnp.int32)
        want = (2, d.seq_len, config.model.vocab_size)
    else:
        inputs = jax.ShapeDtypeStruct((2, d.num_features), jnp.float32)
        want = (2, config.model.num_classes)
    assert nnx.eval_shape(lambda m, x: m(x), model, inputs).shape == want
    # Every size the contract lists as sharded is a config value the network has a dimension of.
    shapes = {s for _, p in nnx.to_flat_state(nnx.state(model, nnx.Param)) for s in p.shape}
    for key, size, _ in contract.sharded_sizes(typed):
        section, leaf = key.split(".")
        assert config[section][leaf] == size and size in shapes, key
    # Matmul params are a part of the params, and model FLOPs follow from them: 6 per matmul
    # param per example for a classifier, more (× tokens, and attention) for an LM.
    params = [(str(path[-1]), p.size) for path, p in nnx.to_flat_state(nnx.state(model, nnx.Param))]
    n = contract.matmul_params(typed, params)
    assert 0 < n <= sum(size for _, size in params)
    per_example = contract.flops_per_example(typed, n)
    assert per_example >= 6 * n * (d.seq_len if contract.is_lm(typed) else 1)
    # Only the kinds that read the LM options report them.
    facts = contract.facts(typed)
    assert bool(facts) == contract.READS_LM_OPTIONS
    options = {"param_dtype", "compute_dtype", "remat", "scan_layers", "attention"}
    assert set(facts) <= options | {"loss_chunk_tokens"}


def test_the_networks_and_losses_keep_their_names_in_the_package():
    for name in ("TransformerLM", "MLPClassifier", "token_cross_entropy", "cross_entropy"):
        assert getattr(models, name).__name__ == name
    for name in ("logits_of", "weighted_loss", "build_model", "check_mesh_divides"):
        assert callable(getattr(models, name))
    with pytest.raises(AttributeError):
        models.NoSuchModel  # noqa: B018


PACKAGE = pathlib.Path(models.__file__).parent.parent
# Names that stood for "is it this kind" before each kind was one contract.
KIND_TESTS = {"LM_KINDS", "is_custom", "CUSTOM_CLASSIFIER", "_rules_key"}


def _is_model_kind(node):
    """`config.model.kind` or `m.kind` of a model section, or the key "model.kind"."""
    if isinstance(node, ast.Constant):
        return node.value == "model.kind"
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "kind"
        and (
            (isinstance(node.value, ast.Name) and node.value.id == "m")
            or (isinstance(node.value, ast.Attribute) and node.value.attr == "model")
        )
    )


def kind_chains(source, names):
    """(line, what) of each place in `source` that tests a model kind by its name."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name | ast.Attribute):
            name = node.id if isinstance(node, ast.Name) else node.attr
            if name in KIND_TESTS:
                found.append((node.lineno, name))
        if isinstance(node, ast.Compare):
            inside = list(ast.walk(node))
            kinds = [n.value for n in inside if isinstance(n, ast.Constant) and n.value in names]
            if kinds or any(_is_model_kind(n) for n in inside):
                found.append((node.lineno, ast.unparse(node)))
    return found


def test_the_chain_reader_finds_each_form_of_a_kind_test():
    names = set(models.KINDS)
    source = (
        'if m.kind == "llama": pass\n'
        "if config.model.kind in LM_KINDS: pass\n"
        'x = kind != "mlp"\n'
        "if is_custom(kind): pass\n"
        'if flat["model.kind"] == k: pass\n'
        'if schedule.kind == "auto" or op == "dot": pass\n'  # other kinds of kind
    )
    assert sorted(line for line, _ in kind_chains(source, names)) == [1, 2, 2, 3, 4, 5]


def test_no_kind_chains_outside_the_models_package():
    """Code outside jaxkit/models/ asks a kind's contract, never its name."""
    names = set(models.KINDS)
    found = [
        f"{path.relative_to(PACKAGE)}:{line}: {what}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if "models" not in path.relative_to(PACKAGE).parts[:2]
        for line, what in kind_chains(path.read_text(), names)
    ]
    assert not found, "tests of a model kind's name outside jaxkit/models/:\n" + "\n".join(found)

"""The typed config sections: jaxkit/sections.py is what the keys' declarations generate, and
every shipped config becomes a RunConfig whose every field holds the checked value, of its
declared type."""

import dataclasses
import pathlib
import types
import typing

import pytest

from jaxkit import sections
from jaxkit.config import (
    SHARED_SECTIONS,
    apply_overrides,
    available_configs,
    flatten,
    load_config,
    run_config,
    sections_module,
    validate,
)

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_the_committed_sections_are_what_the_declarations_generate():
    committed = (ROOT / "jaxkit" / "sections.py").read_text()
    assert committed == sections_module(), (
        "jaxkit/sections.py is stale: run python docs/generate.py"
    )


def _fits(value: object, annotation: object) -> bool:
    """`value` is of the type `annotation` names (an int is a float, as PEP 484 says)."""
    origin = typing.get_origin(annotation)
    if annotation is None or annotation is type(None):
        return value is None
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, arm) for arm in typing.get_args(annotation))
    if origin is typing.Literal:
        return value in typing.get_args(annotation)
    if origin is dict:
        return isinstance(value, dict)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    assert isinstance(annotation, type), annotation
    return isinstance(value, annotation)


def _checked(name: str, overrides: list[str]) -> object:
    config = load_config(name)
    apply_overrides(config, overrides)
    validate(config)
    return config


@pytest.mark.parametrize("name", available_configs())
def test_every_config_s_sections_hold_its_values_with_their_declared_types(name):
    config = load_config(name)
    if config.model.get("init_from"):  # its shape from a Hugging Face directory: llama_tiny's
        config.model.init_from = None
        for key, value in load_config("llama_tiny").model.items():
            if key not in config.model:
                config.model[key] = value
    validate(config)
    run = run_config(config)
    flat = flatten(config.to_dict())
    for section in (*SHARED_SECTIONS, "model", "data"):
        part = getattr(run, section)
        hints = typing.get_type_hints(type(part))
        for field in dataclasses.fields(part):
            value = getattr(part, field.name)
            key = f"{section}.{field.name}"
            assert _fits(value, hints[field.name]), (key, value, hints[field.name])
            if key in flat:  # the config's value, else the declared default (or None)
                assert value == flat[key], key
            elif isinstance(value, dict) or key == "data.mixture":
                assert value == config.data.get("mixture", None) or value is None, key
            else:
                assert value == field.default, key
    assert run.name == name
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.batch.global_batch_size = 1  # type: ignore[misc]


def test_a_kind_s_sections_are_chosen_by_its_declared_kind():
    assert isinstance(run_config(_checked("lm_tiny", [])).model, sections.TransformerModel)
    run = run_config(_checked("mlp_digits", []))
    assert isinstance(run.model, sections.MlpModel) and isinstance(run.data, sections.MlpData)
    assert run.data.seq_len is None and run.data.path is None  # digits read no file
    scaling = (
        '{"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, '
        '"original_max_position_embeddings": 64}'
    )
    llama = run_config(_checked("llama_tiny", [f"model.rope_scaling={scaling}"]))
    assert isinstance(llama.model, sections.LlamaModel)
    assert isinstance(llama.model.rope_scaling, dict) and llama.model.rope_scaling["factor"] == 8.0


def test_a_run_config_is_not_changed_by_later_edits_of_its_config_dict():
    """What a model of your own is handed (RunConfig.config) is the config as it was checked,
    as the sections are: an edit of the ConfigDict afterwards reaches neither."""
    config = _checked("lm_tiny", [])
    run = run_config(config)
    config.model.d_model = 7
    config.train.steps = 12345
    assert run.model.d_model == 128 and run.config.model.d_model == 128
    assert run.train.steps == run.config.train.steps != 12345

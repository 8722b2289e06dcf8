"""pyproject.toml bounds the core dependencies at the newest versions the suite has passed on,
and the suite runs inside those bounds: a suite run on a newer jax fails here until the bound
is raised, so the bounds and the tested set cannot drift apart (docs/contributing.md)."""

import importlib.metadata
import pathlib
import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

PYPROJECT = pathlib.Path(__file__).resolve().parent.parent / "pyproject.toml"
# What a model, a train step and a checkpoint are made of: a new release of any of them can
# change a number the suite checks.
CORE = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint")


def _requirements() -> tuple[dict[str, Requirement], list[Requirement]]:
    """The core dependencies by name, and every requirement of the extras."""
    with open(PYPROJECT, "rb") as f:
        project = tomllib.load(f)["project"]
    core = {}
    for line in project["dependencies"]:
        requirement = Requirement(line)
        if requirement.name in CORE:
            core[requirement.name] = requirement
    extras = [Requirement(line) for group in project["optional-dependencies"].values()
              for line in group]  # fmt: skip
    return core, extras


def _upper_bound(requirement: Requirement) -> Version:
    bounds = [Version(s.version) for s in requirement.specifier if s.operator == "<="]
    assert len(bounds) == 1 and len(requirement.specifier) == 2, (
        f"pyproject.toml: {requirement} should read NAME>=LOWEST,<=NEWEST_TESTED"
    )
    return bounds[0]


@pytest.mark.parametrize("name", CORE)
def test_each_core_dependency_is_bounded_at_a_version_the_suite_runs_on(name):
    core, _ = _requirements()
    assert name in core, f"pyproject.toml's dependencies leave out {name}"
    newest_tested = _upper_bound(core[name])
    installed = Version(importlib.metadata.version(name))
    assert installed in core[name].specifier, (
        f"the suite runs on {name} {installed}, outside pyproject.toml's {core[name]}: once "
        f"the whole suite passes on {installed}, raise the bound (from {newest_tested}) as "
        "docs/contributing.md says"
    )


def test_jax_extras_and_jaxlib_follow_jax_s_bounds():
    core, extras = _requirements()
    jax_extras = [r for r in extras if r.name == "jax"]
    assert jax_extras  # jax[tpu]: the tpu-plan and test extras
    for requirement in jax_extras:
        assert requirement.specifier == core["jax"].specifier, requirement
    assert core["jaxlib"].specifier == core["jax"].specifier


def _lower_bound(requirement: Requirement) -> Version:
    (bound,) = [Version(s.version) for s in requirement.specifier if s.operator == ">="]
    return bound


def test_ci_s_lowest_set_is_each_core_dependency_s_lower_bound():
    """.ci/run runs the quick tests on the lowest versions the bounds admit: its constraints
    name exactly those, so a raised lower bound cannot leave CI testing an older set."""
    core, _ = _requirements()
    pinned = {}
    for line in (PYPROJECT.parent / ".ci" / "constraints-lowest.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            requirement = Requirement(line)
            (spec,) = requirement.specifier
            assert spec.operator == "==", line
            pinned[requirement.name] = Version(spec.version)
    assert pinned == {name: _lower_bound(core[name]) for name in CORE}

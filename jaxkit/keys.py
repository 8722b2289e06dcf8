"""The form every config key is declared in: its default, its rule, one line of doc, and
whether a resume may change it.

`jaxkit.config` declares the keys every job shares (`config.BASE_KEYS`); each model kind
declares its own with its contract. `base_config()`, the validation rules, the keys a
resume may change, the defaults of keys added after runs were saved, and the config
reference (docs/reference/config.md) are all read from these declarations.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
from collections.abc import Callable, Iterable

# Only this word unsets a value: "none" is a value of some string fields (lr_scaling=none).
NULL_WORD = "null"


class ConfigError(ValueError):
    """A config name, key or value that cannot be used."""


@dataclasses.dataclass(frozen=True)
class Rule:
    """What a value must be: `text` in words (the config reference's), a check that
    returns None when a value is fine, else the message's "must be ..." part, and the
    Python type every value it passes has, as jaxkit/sections.py writes it (`int | None`,
    `Literal["adamw", "sgd"]`): the typed sections are generated from it."""

    text: str
    check: Callable[[object], str | None]
    annotation: str

    def __call__(self, value: object) -> str | None:
        return self.check(value)


class _Sentinel:
    def __init__(self, name: str) -> None:
        self._name = name

    def __repr__(self) -> str:
        return self._name


# The default of a key a config file must give (a model's sizes); never in base_config().
REQUIRED: object = _Sentinel("REQUIRED")
# The `added` of a key that every saved run already had.
ALWAYS: object = _Sentinel("ALWAYS")


@dataclasses.dataclass(frozen=True)
class Key:
    """One config key, declared once.

    default: the value `base_config()` holds (None with `type` for a placeholder), or
        REQUIRED where the config file must give it.
    resumable: a resume may change it (where the run happens, how the batch is split, what
        is logged or saved; not what is trained).
    added: for a key added after runs were saved, the value a saved config without it ran
        as (read at a resume); ALWAYS for keys every checkpoint has.
    normalise: for a dict-valued key, what an override's JSON object becomes before it is
        set (a spelling another tool writes, said once); it raises ConfigError for a dict
        it cannot take.
    """

    name: str
    default: object
    rule: Rule
    doc: str
    type: type | None = None
    resumable: bool = False
    added: object = ALWAYS
    normalise: Callable[[dict], dict] | None = None

    @property
    def section(self) -> str:
        return self.name.split(".", 1)[0]

    @property
    def leaf(self) -> str:
        return self.name.split(".", 1)[1]


def rules(keys: Iterable[Key]) -> dict[str, Rule]:
    return {key.name: key.rule for key in keys}


def show(value: object) -> str:
    """A value in a message: null, a quoted string, or the value itself."""
    if value is None:
        return NULL_WORD
    return repr(value) if isinstance(value, str) else str(value)


# The rules.


def integer(low: int, high: int | None = None, *, nullable: bool = False) -> Rule:
    """An int (not a bool) in [low, high), or null where `nullable`."""
    want = f"an integer ≥ {low}" if high is None else f"an integer in [{low}, {high})"
    want = f"null or {want}" if nullable else want
    annotation = "int | None" if nullable else "int"

    def check(value: object) -> str | None:
        if value is None and nullable:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            return f"must be {want}"
        return None if value >= low and (high is None or value < high) else f"must be {want}"

    return Rule(want, check, annotation)


def number(low: float, high: float | None = None, *, open_low: bool, open_high: bool) -> Rule:
    """A finite real (int or float, not a bool) between `low` and `high`."""
    if high is None:
        want = f"{'>' if open_low else '≥'} {low:g}"
    else:
        want = f"in {'(' if open_low else '['}{low:g}, {high:g}{')' if open_high else ']'}"

    def check(value: object) -> str | None:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"must be a number {want}"
        if not math.isfinite(value):
            return f"must be a finite number {want}"
        above = value > low if open_low else value >= low
        below = high is None or (value < high if open_high else value <= high)
        return None if above and below else f"must be {want}"

    return Rule(f"a finite number {want}", check, "float")


def one_of(*choices: str) -> Rule:
    want = f"one of {', '.join(choices)}"
    literal = f"Literal[{', '.join(repr(choice) for choice in choices)}]".replace("'", '"')
    return Rule(want, lambda value: None if value in choices else f"must be {want}", literal)


def text(*, nullable: bool) -> Rule:
    want = "null or a string" if nullable else "a string"

    def check(value: object) -> str | None:
        return None if isinstance(value, str) or (nullable and value is None) else f"must be {want}"

    return Rule(want, check, "str | None" if nullable else "str")


def boolean() -> Rule:
    return Rule(
        "true or false",
        lambda value: None if isinstance(value, bool) else "must be true or false",
        "bool",
    )


def null(why: str) -> Rule:
    return Rule(
        f"null: {why}", lambda value: None if value is None else f"must be null: {why}", "None"
    )


def _mesh_axis(value: object) -> str | None:
    if isinstance(value, bool) or not isinstance(value, int) or not (value >= 1 or value == -1):
        return "must be a positive axis size, or -1 to take the remaining devices"
    return None


MESH_AXIS = Rule("an integer ≥ 1, or -1 to take the remaining devices", _mesh_axis, "int")


def _token_path(value: object) -> str | None:
    if isinstance(value, str) and value.strip():
        return None
    return (
        "must name token files: a directory `jaxkit data prepare` wrote, a file, a directory "
        "of .bin/.npy files or a glob (local or gs://)"
    )


TOKEN_PATH = Rule(
    "a prepared directory, a token file, a directory of them or a glob", _token_path, "str"
)


def _text_file(value: object) -> str | None:
    """null (the default corpus), or a readable, non-empty local file."""
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        return "must be null (the default corpus) or the path of a text file"
    path = pathlib.Path(value).expanduser()
    if not path.is_file():
        return "is not a file"
    if path.stat().st_size == 0:
        return "is an empty file"
    return None


TEXT_FILE = Rule("null (the default corpus) or a non-empty local file", _text_file, "str | None")

POSITIVE = integer(1)
COUNT = integer(0)  # 0 has a documented meaning (off, or every row)
FRACTION_OPEN = number(0, 1, open_low=False, open_high=True)  # [0, 1)

"""`data.mixture`: several token sources in one exact, seeded order.

Rows are drawn in blocks of BLOCK (32). Within a stage of weights w, after n blocks source
s has given R_s(n) rows: n·32·w_s rounded by the largest remainder (ties in NAME order),
so a weight as small as 0.01 gives its row every few blocks and is never rounded away.
Where the largest remainder would take a row back from a source (a weight below 1/32 can
lose its extra row as the others' remainders grow), that source keeps its rows and the
sources most over their quota give one fewer: the counts never go down, and a block
always holds 32 rows. The places of each block's rows are shuffled by the seed and the
block's index. Within a source, its k-th row is its own seeded stream (data.stream_rows:
a permutation per epoch, the next epoch starting where one runs out).

Global row i is then a function of the seed, the stages starting at or before i, and i:
every split of a global batch, every device count, a batch ramp and a resume read the
same rows (the loader asks `data.MixtureRows.stream_rows`, as it asks data.stream_rows of one
source).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import re
from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import Any

import numpy as np

from jaxkit.keys import ConfigError, show

BLOCK = 32
NAME = re.compile(r"[a-z0-9_]+")
_FIELDS = ("path", "weight")
_SHUFFLE_TAG = 0x6D6978  # "mix": the block shuffles' stream, apart from the sources' own


@dataclasses.dataclass(frozen=True)
class Stage:
    """Weights from global example `start` (a multiple of BLOCK) on, in NAME order."""

    start: int
    weights: tuple[Fraction, ...]
    # As the user wrote it (`64:web=0.5+code=0.5`), for messages; not part of what it draws.
    typed: str = dataclasses.field(default="", compare=False)


def _weight(name: str, value: object) -> Fraction:
    infinity = float("inf")  # NaN fails 0 < value too
    if not isinstance(value, bool) and isinstance(value, (int, float)) and 0 < value < infinity:
        return Fraction(str(value)) if isinstance(value, float) else Fraction(value)
    raise ConfigError(f"data.mixture.{name}.weight={show(value)}: must be a number > 0 and finite")


def sources_of(value: Mapping[str, Any]) -> dict[str, dict]:
    """data.mixture's sources checked, in NAME order: {NAME: {"path", "weight" or None}}."""
    out: dict[str, dict] = {}
    for name in sorted(value):
        fields = value[name]
        if not NAME.fullmatch(name):
            raise ConfigError(f"data.mixture: the name {name!r} is not [a-z0-9_]+")
        if not isinstance(fields, Mapping):
            raise ConfigError(
                f'data.mixture.{name}={show(fields)}: must be {{"path": PATH, "weight": W}}'
            )
        extra = sorted(set(fields) - set(_FIELDS))
        if extra:
            raise ConfigError(
                f"data.mixture.{name}: unknown field {extra[0]!r} (a source has path and weight)"
            )
        path = fields.get("path")
        if not isinstance(path, str) or not path.strip():
            raise ConfigError(
                f"data.mixture.{name}.path={show(path)}: must name token files, as data.path does"
            )
        weight = fields.get("weight")
        out[name] = {"path": path, "weight": None if weight is None else _weight(name, weight)}
    if len(out) < 1:
        raise ConfigError("data.mixture names no source: give NAME: {path, weight} for each")
    return out


def from_flat(flat: Mapping[str, object]) -> dict[str, dict] | None:
    """data.mixture rebuilt from a flattened config (data.mixture.NAME.FIELD), or None."""
    prefix = "data.mixture."
    value: dict[str, dict] = {}
    for key, field_value in flat.items():
        if key.startswith(prefix):
            name, _, field = key[len(prefix) :].partition(".")
            if not field:
                raise ConfigError(
                    f"data.mixture.{name}={show(field_value)}: must be "
                    '{"path": PATH, "weight": W}'
                )
            value.setdefault(name, {})[field] = field_value
    return value or None


def check_flat(flat: Mapping[str, object]) -> None:
    """data.mixture's and data.mixture_stages' values, where a config gives them."""
    value = from_flat(flat)
    stages_text = flat.get("data.mixture_stages") or ""
    if value is None:
        if stages_text:
            raise ConfigError(
                "data.mixture_stages gives weights of data.mixture's sources: give data.mixture"
            )
        return
    if flat.get("data.source") != "tokens":
        raise ConfigError(
            f"data.mixture mixes token sources: set data.source=tokens "
            f"(not {show(flat.get('data.source'))})"
        )
    if flat.get("data.path") is not None:
        raise ConfigError(
            f"data.path={show(flat['data.path'])} and data.mixture: give one (data.mixture "
            "names each source's path)"
        )
    stages(value, str(stages_text), flat.get("data.seq_len"))  # type: ignore[arg-type]


def stages(value: Mapping[str, Any], text: str, seq_len: int | None) -> list[Stage]:
    """The stages of weights: data.mixture's own weights alone, or data.mixture_stages'."""
    sources = sources_of(value)
    names = list(sources)
    if not text:
        missing = [n for n in names if sources[n]["weight"] is None]
        if missing:
            raise ConfigError(
                f"data.mixture.{missing[0]} has no weight: give one (or data.mixture_stages)"
            )
        typed = "+".join(f"{n}={show(value[n]['weight'])}" for n in names)
        return [Stage(0, _normalised([sources[n]["weight"] for n in names]), f"0:{typed}")]
    parsed = parse_stages(text, names, seq_len)
    first = parsed[0].weights
    given = [sources[n]["weight"] for n in names]
    if any(w is not None for w in given) and (
        any(w is None for w in given) or _normalised(given) != first
    ):
        raise ConfigError(
            "data.mixture's weights differ from data.mixture_stages' first stage: leave "
            "them out, or give the same"
        )
    return parsed


def _normalised(weights: Sequence[Fraction]) -> tuple[Fraction, ...]:
    total = sum(weights)
    return tuple(w / total for w in weights)


_POSITION = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kMG]?)\s*(t?)\s*")
_SCALE = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9}


def parse_stages(text: str, names: Sequence[str], seq_len: int | None) -> list[Stage]:
    """`"0:web=0.9+code=0.1,20Mt:web=0.5+code=0.5"` → stages, each start moved to the next
    block start; positions as batch.schedule writes them (k/M/G, `t` = tokens)."""
    import decimal

    out: list[Stage] = []
    for item in text.split(","):
        said = item.strip()
        where, colon, spec = item.partition(":")
        found = _POSITION.fullmatch(where)
        if not colon or not found:
            raise ConfigError(
                f"data.mixture_stages stage {said!r} is not POSITION:NAME=W+NAME=W (e.g. "
                "0:web=0.9+code=0.1,20Mt:web=0.5+code=0.5)"
            )
        number, scale, tokens = found.groups()
        count = decimal.Decimal(number) * _SCALE[scale]
        if count != int(count):
            raise ConfigError(f"data.mixture_stages stage {said!r}: not a whole count")
        start = int(count)
        if tokens:
            if not seq_len:
                raise ConfigError(f"data.mixture_stages stage {said!r} counts tokens: no seq_len")
            start = -(-start // seq_len)
        start = -(-start // BLOCK) * BLOCK  # the next block start
        weights: dict[str, Fraction] = {}
        for part in spec.split("+"):
            name, equals, number_text = part.partition("=")
            name = name.strip()
            if not equals or name not in names:
                raise ConfigError(
                    f"data.mixture_stages stage {said!r}: {part.strip()!r} is not NAME=WEIGHT "
                    f"for a source of data.mixture ({', '.join(names)})"
                )
            try:
                weight = float(number_text)
            except ValueError:
                weight = float("nan")
            if name in weights or not 0 < weight < float("inf"):
                raise ConfigError(
                    f"data.mixture_stages stage {said!r}: {part.strip()!r} needs a finite "
                    "weight > 0, once per source"
                )
            weights[name] = Fraction(number_text.strip())
        missing = [n for n in names if n not in weights]
        if missing:
            raise ConfigError(
                f"data.mixture_stages stage {said!r} gives no weight for {missing[0]}"
            )
        if out and start <= out[-1].start:
            raise ConfigError(
                f"data.mixture_stages stage {said!r} starts at example {start:,} (a block "
                f"start), not after the stage before it ({out[-1].start:,})"
            )
        out.append(Stage(start, _normalised([weights[n] for n in names]), said))
    if out[0].start != 0:
        raise ConfigError("data.mixture_stages must start at 0: write 0:NAME=W+... first")
    return out


class _Quota:
    """R(n) of one stage's weights: rows per source after n blocks.

    R(n) is the largest remainder LR(n) wherever that takes no row back, else
    `_keep_counts` of R(n - 1): a walk forward from R(0). The walk keeps R at every
    _WINDOW-th block and the last two it reached, so memory grows by one count per source
    every _WINDOW blocks, and any R(n) is at most a window's walk from a kept one (the last
    window walked again is kept too)."""

    _WINDOW = 4096

    def __init__(self, weights: Sequence[Fraction]) -> None:
        self.denominator = math.lcm(*(w.denominator for w in weights))
        self.numerators = np.array(
            [w.numerator * (self.denominator // w.denominator) for w in weights], dtype=object
        )
        zero = np.zeros(len(weights), dtype=np.int64)
        self.walked = 0  # R(walked) = self.last, R(walked - 1) = self.before
        self.last, self.before = zero, zero
        self.marks: dict[int, np.ndarray] = {0: zero}  # R(m) for m a multiple of _WINDOW
        self.again: tuple[int, np.ndarray] | None = None  # a window behind the walk: R(m...)

    def _largest_remainder(self, blocks: np.ndarray) -> np.ndarray:
        # exact in int64 while quota × denominator stays below 2**62, else Python ints
        small = int(max(self.numerators)) * BLOCK * int(blocks.max(initial=0)) < 2**62
        kind = np.int64 if small else object
        total = blocks.astype(kind) * BLOCK
        exact = total[:, None] * self.numerators.astype(kind)[None, :]  # quota × denominator
        floor = (exact // self.denominator).astype(np.int64)
        remainder = exact % self.denominator  # < denominator: exact as a float below 2**53
        if self.denominator <= 2**53:
            remainder = remainder.astype(np.float64)
        left = total.astype(np.int64) - floor.sum(axis=1)
        # rank by remainder, largest first, ties in NAME order (a stable sort)
        order = np.argsort(-remainder, axis=1, kind="stable")
        rank = np.empty_like(order)
        np.put_along_axis(rank, order, np.arange(order.shape[1])[None, :], axis=1)
        return floor + (rank < left[:, None])

    def _keep_counts(self, before: np.ndarray, after: np.ndarray, blocks: int) -> np.ndarray:
        """R(blocks) from R(blocks - 1) where the largest remainder would take rows back."""
        counts = after - before
        excess = int(-counts[counts < 0].sum())
        counts[counts < 0] = 0
        over = after.astype(object) * self.denominator - blocks * BLOCK * self.numerators
        for s in sorted(range(len(counts)), key=lambda s: -over[s]):  # most over first
            if excess == 0:
                break
            if counts[s] > 0:
                counts[s] -= 1
                excess -= 1
        return before + counts

    def _forward(self, n: int, given_n: np.ndarray, end: int) -> np.ndarray:
        """R(n), ..., R(end) from R(n) = given_n (end - n ≤ _WINDOW)."""
        given = np.concatenate(
            [given_n[None, :], self._largest_remainder(np.arange(n + 1, end + 1))]
        )
        # R(i) departs from LR(i) where it falls below R(i - 1): at a fall of LR itself, or
        # right after a departure (the one place whose R(i - 1) is not LR's)
        falls = (np.nonzero((np.diff(given, axis=0) < 0).any(axis=1))[0] + 1).tolist()
        k, at = 0, 0  # at: the last departure
        while True:
            if at and at + 1 < len(given) and (given[at + 1] < given[at]).any():
                at += 1
            else:
                while k < len(falls) and falls[k] <= at + (1 if at else 0):
                    k += 1
                if k == len(falls):
                    break
                at = falls[k]
            given[at] = self._keep_counts(given[at - 1], given[at], n + at)
        return given

    def at(self, blocks: int) -> np.ndarray:
        """R(blocks)."""
        while self.walked < blocks:  # walk forward, a window (to its next mark) at a time
            n = self.walked
            end = min((n // self._WINDOW + 1) * self._WINDOW, blocks)
            given = self._forward(n, self.last, end)
            self.walked, self.last, self.before = end, given[-1], given[-2]
            if end % self._WINDOW == 0:
                self.marks[end] = self.last
        if blocks == self.walked:
            return self.last
        if blocks == self.walked - 1:
            return self.before
        # behind the walk: its window again from the mark, kept for the next ask
        mark = blocks // self._WINDOW * self._WINDOW
        if self.again is None or self.again[0] != mark or len(self.again[1]) <= blocks - mark:
            end = min(mark + self._WINDOW, self.walked)
            self.again = mark, self._forward(mark, self.marks[mark], end)
        return self.again[1][blocks - mark]


class Order:
    """Which source, and which of its stream's rows, each global example is."""

    def __init__(self, stages: Sequence[Stage]) -> None:
        self.stages = list(stages)
        self.quotas = [_Quota(stage.weights) for stage in self.stages]
        self.sources = len(self.stages[0].weights)

    def _stage_of(self, block: int) -> int:
        starts = [stage.start // BLOCK for stage in self.stages]
        return int(np.searchsorted(starts, block, side="right")) - 1

    def given_before(self, block: int) -> np.ndarray:
        """Rows each source gave in blocks [0, block)."""
        total = np.zeros(self.sources, dtype=np.int64)
        for j, stage in enumerate(self.stages):
            first = stage.start // BLOCK
            if first >= block:
                break
            end = self.stages[j + 1].start // BLOCK if j + 1 < len(self.stages) else None
            n = block - first if end is None else min(block, end) - first
            total += self.quotas[j].at(n)
        return total

    def counts(self, block: int) -> np.ndarray:
        """Rows each source gives in block `block`."""
        j = self._stage_of(block)
        n = block - self.stages[j].start // BLOCK
        return self.quotas[j].at(n + 1) - self.quotas[j].at(n)

    def block_sources(self, block: int, seed: int) -> np.ndarray:
        """The source of each of the block's 32 places: NAME order, shuffled by the seed."""
        labels = np.repeat(np.arange(self.sources), self.counts(block))
        shuffle = np.random.default_rng([seed, _SHUFFLE_TAG, block]).permutation(BLOCK)
        return labels[shuffle]

    def examples(self, first: int, count: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, k) of global examples [first, first + count): the k-th row of that
        source's own stream."""
        source = np.empty(count, dtype=np.int64)
        k = np.empty(count, dtype=np.int64)
        start = first // BLOCK
        before = self.given_before(start)  # then carried block to block
        for block in range(start, -(-(first + count) // BLOCK)):
            places = self.block_sources(block, seed)
            # each place's rank among its source's places in the block
            order = np.argsort(places, kind="stable")
            rank = np.empty(BLOCK, dtype=np.int64)
            rank[order] = np.arange(BLOCK) - np.searchsorted(places[order], places[order])
            lo, hi = max(first, block * BLOCK), min(first + count, (block + 1) * BLOCK)
            place = np.arange(lo, hi) - block * BLOCK
            source[lo - first : hi - first] = places[place]
            k[lo - first : hi - first] = before[places[place]] + rank[place]
            before = before + np.bincount(places, minlength=self.sources)
        return source, k

    def given(self, examples: int, seed: int) -> np.ndarray:
        """Rows each source gave in global examples [0, examples)."""
        block, inside = divmod(examples, BLOCK)
        total = self.given_before(block)
        if inside:
            total += np.bincount(self.block_sources(block, seed)[:inside], minlength=self.sources)
        return total


def source_seed(seed: int, name: str) -> int:
    """The seed of source `name`'s own permutations: apart from every other source's."""
    digest = hashlib.sha256(f"jaxkit mixture {seed} {name}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


def stage_changes(saved: list[dict] | None, current: list[dict] | None, read: int) -> list[str]:
    """Lines naming each stage that draws rows the saved run trained on (global examples
    [0, read)) and that a resume would draw otherwise, with the sources whose share moved.
    Stages are compared as they draw rows: normalised weights, so `web=0.7+code=0.3` and
    `web=7+code=3` are one stage, and data.mixture's weights left out beside
    data.mixture_stages change nothing. A stage from `read` on may be added or changed:
    no trained row came from it."""
    if saved is None or current is None:
        return []

    def drawn(stages: list[dict]) -> dict[int, dict]:
        return {stage["start"]: stage for stage in stages if stage["start"] < read}

    old, new = drawn(saved), drawn(current)
    lines = []
    for start in sorted(old.keys() | new.keys()):
        was, now = old.get(start), new.get(start)
        if was is not None and now is not None and _shares(was) == _shares(now):
            continue
        where = (
            f"  data.mixture's stage from example {start:,}, whose rows the saved run trained "
            f"on (examples 0-{read - 1:,})"
        )
        if now is None:
            assert was is not None  # a start from one side or the other
            lines.append(f"{where}, is left out (saved: {_typed(was)}): give it again")
        elif was is None:
            lines.append(
                f"{where}, is new ({_typed(now)}): the saved run drew those rows under the "
                "stage before it"
            )
        else:
            lines.append(
                f"{where}: {_moved(_shares(was), _shares(now))} (saved: {_typed(was)}; "
                f"now: {_typed(now)})"
            )
    return lines


def _shares(stage: dict) -> dict[str, Fraction]:
    """A recorded stage's share of the rows for each source (its normalised weights)."""
    return {name: Fraction(w) for name, w in stage["weights"].items()}


def _typed(stage: dict) -> str:
    """A recorded stage as data.mixture_stages takes it: as the user wrote it, or, for a
    checkpoint that did not record that, its shares as the smallest whole weights."""
    if stage.get("typed"):
        return str(stage["typed"])
    shares = _shares(stage)
    scale = math.lcm(*(s.denominator for s in shares.values()))
    whole = {name: s.numerator * (scale // s.denominator) for name, s in shares.items()}
    common = math.gcd(*whole.values())
    return f"{stage['start']}:" + "+".join(f"{n}={w // common}" for n, w in whole.items())


def _moved(was: dict[str, Fraction], now: dict[str, Fraction]) -> str:
    """`code draws 10% of the rows (saved) -> 50%, web 90% -> 50%`: each source whose share
    differs, with as many digits as tell the two shares apart."""

    def percent(share: Fraction | None, digits: int) -> str:
        return "none" if share is None else f"{float(share) * 100:.{digits}g}%"

    parts: list[str] = []
    for name in sorted(was.keys() | now.keys()):
        a, b = was.get(name), now.get(name)
        if a == b:
            continue
        digits = next((d for d in range(3, 18) if percent(a, d) != percent(b, d)), 17)
        a_text, b_text = percent(a, digits), percent(b, digits)
        if not parts:
            parts.append(f"{name} draws {a_text} of the rows (saved) -> {b_text}")
        else:
            parts.append(f"{name} {a_text} -> {b_text}")
    return ", ".join(parts)

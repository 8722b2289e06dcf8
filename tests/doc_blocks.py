"""What a page of the docs shows a command printing, held to what the command prints now.

For the tests that a `<!-- tested by ... -->` marker names (docs/contributing.md): the block
is read from the page itself, so a figure that drifts fails the test that stands behind it.
"""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:e[+-]?\d+)?")


def shown(page: str, command: str) -> list[str]:
    """The lines `page` (relative to the repository) shows after `    $ COMMAND`, up to the
    end of the indented block, without their indentation."""
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        lines = f.read().split("\n")
    start = lines.index(f"    $ {command}") + 1
    end = start
    while end < len(lines) and lines[end].startswith("    "):
        end += 1
    return [line[4:] for line in lines[start:end]]


def same_line(expected: str, printed: str, rel: float) -> bool:
    """The same text, and numbers within `rel` of each other (column padding aside)."""
    if set(expected) <= set("-+|") and set(printed) <= set("-+|"):
        return True  # a table's rule: its widths follow the numbers
    words = [" ".join(part.split()) for part in NUMBER.split(expected)]
    if words != [" ".join(part.split()) for part in NUMBER.split(printed)]:
        return False
    for a, b in zip(NUMBER.findall(expected), NUMBER.findall(printed), strict=True):
        x, y = float(a.replace(",", "")), float(b.replace(",", ""))
        if abs(x - y) > rel * abs(x):
            return False
    return True


def mismatches(expected: list[str], printed: list[str], rel: float) -> list[str]:
    """Where `printed` first differs from `expected` (a line `...` there stands for any
    lines), or nothing."""
    at, skipping = 0, False
    for line in expected:
        if line.strip() == "...":
            skipping = True
            continue
        candidates = range(at, len(printed)) if skipping else range(at, min(at + 1, len(printed)))
        found = next((i for i in candidates if same_line(line, printed[i], rel)), None)
        if found is None:  # the first difference; what follows would differ from it on
            near = printed[at] if at < len(printed) else "(nothing)"
            return [f"the docs show  {line!r}\n  the command printed {near!r}"]
        at, skipping = found + 1, False
    left = [line for line in printed[at:] if line.strip()]
    if left and not skipping:
        return [f"the command printed more than the docs show: {left[0]!r}"]
    return []

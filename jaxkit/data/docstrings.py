"""Prompt/completion pairs every machine has: a Python standard library function's signature
as the prompt, its docstring's first paragraph as the completion.

    python -m jaxkit.data.docstrings docstrings.jsonl
    jaxkit data prepare docstrings.jsonl --tokenizer bytes --out data/docstrings
    jaxkit train sft_tiny

One JSON object per line, {"prompt": "def name(args):\\n", "completion": "..."}, as
`jaxkit data prepare` reads them: only the completion (and its end of document) is scored.
"""

from __future__ import annotations

import ast
import inspect
import json
import pathlib
import sys
import sysconfig
from collections.abc import Iterator

MAX_COMPLETION_CHARS = 200  # a first paragraph, cut at a word near this length


def pairs(root: pathlib.Path | None = None) -> Iterator[dict[str, str]]:
    """Every documented function and method of the top-level stdlib modules, sorted by file."""
    root = root or pathlib.Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.glob("*.py")):
        try:
            tree = ast.parse(path.read_bytes(), filename=str(path))
        except (SyntaxError, ValueError):  # a module for another Python version
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            doc = ast.get_docstring(node)
            if not doc or not doc.strip():
                continue
            first = inspect.cleandoc(doc).split("\n\n")[0].replace("\n", " ").strip()
            if len(first) > MAX_COMPLETION_CHARS:
                first = first[:MAX_COMPLETION_CHARS].rsplit(" ", 1)[0] + " ..."
            yield {
                "prompt": f"def {node.name}({ast.unparse(node.args)}):\n",
                "completion": f'    """{first}"""\n',
            }


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m jaxkit.data.docstrings OUT.jsonl", file=sys.stderr)
        return 2
    out = pathlib.Path(args[0])
    lines = [json.dumps(pair) for pair in pairs()]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print(f"{len(lines)} prompt/completion pairs from the standard library in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The import graph of jaxkit/ has no circles, also between the modules of one package.

The layers between packages (the measuring ones below the loop, the faces on top) are
import-linter's `layers` contract in pyproject.toml, which CI runs as `lint-imports`; it does
not look inside a package, so this reads the graph from the source with `ast`, where an import
inside a function counts as much as one at the top of a module: deferring an import hides a
circle from Python, not from a reader.
"""

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "jaxkit"


def _module_names() -> dict[str, pathlib.Path]:
    names = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def _resolve(name: str, modules: dict[str, pathlib.Path]) -> str | None:
    """The jaxkit module an imported dotted name lives in (`jaxkit.a.b` where b is a
    function of jaxkit.a is jaxkit.a), or None outside jaxkit."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def _imports(module: str, path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    """Every jaxkit module `module` imports, anywhere in its body (a submodule import is an
    arrow to that submodule, not to the packages above it)."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".")
                if not is_package:
                    package = package[:-1]
                package = package[: len(package) - (node.level - 1)]
                base = ".".join([*package, base] if base else package)
            # `from a import b` imports a.b where b is a submodule, else a name of a.
            names = [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        found |= {target for n in names if (target := _resolve(n, modules)) is not None}
    found.discard(module)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = _module_names()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The shortest circle through each module that lies on one, as a chain that starts and
    ends at the same module (its least name)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm; the graph is a few dozen modules deep
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)

    cycles = set()
    for group in groups:
        for start in sorted(group):
            # Breadth-first from start back to itself, inside the group: the shortest
            # circle through start.
            previous: dict[str, str] = {}
            frontier = [start]
            while frontier and start not in previous:
                following = []
                for v in frontier:
                    for w in sorted(graph[v] & group):
                        if w not in previous:
                            previous[w] = v
                            following.append(w)
                frontier = following
            chain = [start]
            while len(chain) == 1 or chain[-1] != start:
                chain.append(previous[chain[-1]])
            chain = chain[:0:-1]  # forwards, without the repeated start
            first = chain.index(min(chain))  # one spelling per circle, whatever its start
            chain = chain[first:] + chain[:first]
            cycles.add((*chain, chain[0]))
    return sorted(list(chain) for chain in cycles)


def test_the_graph_is_read_from_every_kind_of_import(tmp_path):
    """The reader sees each form of import, in a function as at the top."""
    pkg = tmp_path / "jaxkit"
    (pkg / "sub").mkdir(parents=True)
    for name in ("__init__", "a", "b", "c", "d", "e", "sub/__init__", "sub/f", "sub/g"):
        (pkg / f"{name}.py").write_text("")
    (pkg / "a.py").write_text(
        "import os\nimport jaxkit.b\nfrom jaxkit import c\n"
        "def f():\n    from jaxkit.d import thing\n    from .e import other\n"
    )
    (pkg / "sub" / "f.py").write_text("from . import g\nfrom .. import a\nfrom ..sub import g\n")
    modules = {
        ".".join(p.relative_to(tmp_path).with_suffix("").parts).removesuffix(".__init__"): p
        for p in pkg.rglob("*.py")
    }
    assert _imports("jaxkit.a", pkg / "a.py", modules) == {
        "jaxkit.b",
        "jaxkit.c",
        "jaxkit.d",
        "jaxkit.e",
    }
    assert _imports("jaxkit.sub.f", pkg / "sub" / "f.py", modules) == {
        "jaxkit.sub.g",
        "jaxkit.a",
    }
    graph = {"x": {"y"}, "y": {"z"}, "z": {"x"}, "w": {"x"}}
    assert _cycles(graph) == [["x", "y", "z", "x"]]
    # One package and two children that import it back: two circles, each named.
    graph = {"p": {"p.a", "p.b"}, "p.a": {"p"}, "p.b": {"p"}, "q": {"p"}}
    assert _cycles(graph) == [["p", "p.a", "p"], ["p", "p.b", "p"]]
    assert _cycles({"x": {"y"}, "y": set()}) == []


def test_no_import_circles():
    graph = import_graph()
    assert "jaxkit.train.loop" in graph and graph["jaxkit.cli"]  # the reader found the package
    cycles = _cycles(graph)
    assert not cycles, "import circles in jaxkit/:\n" + "\n".join(
        " -> ".join(chain) for chain in cycles
    )


def test_a_wheel_holds_every_package_under_jaxkit():
    # setuptools installs the packages pyproject.toml lists, and only those: one left out
    # works in a checkout (editable install) and is missing from a wheel.
    import pathlib
    import tomllib

    root = pathlib.Path(__file__).resolve().parent.parent
    listed = set(
        tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    found = {
        ".".join(init.parent.relative_to(root).parts)
        for init in (root / "jaxkit").rglob("__init__.py")
    }
    assert found <= listed, sorted(found - listed)


def _third_party_imports(path: pathlib.Path) -> set[str]:
    """The top-level names of every package a module imports, anywhere in its body."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.split(".")[0])
    return found


def test_lm_eval_is_imported_by_the_harness_model_and_inside_eval_tasks_only():
    # lm-evaluation-harness is an extra (`jaxkit[eval]`): the kit works without it, and
    # `jaxkit eval --tasks` (commands/evaluate.py, inside a function) says in one line how
    # to install it. The model class it drives is imported there only.
    modules = _module_names()
    importers = {name for name, path in modules.items() if "lm_eval" in _third_party_imports(path)}
    assert importers == {"jaxkit.generate.lm_eval_model", "jaxkit.commands.evaluate"}
    graph = import_graph()
    users = {
        name for name, imported in graph.items() if "jaxkit.generate.lm_eval_model" in imported
    }
    assert users == {"jaxkit.commands.evaluate"}
    top_level = ast.parse(modules["jaxkit.commands.evaluate"].read_text()).body
    assert not any(
        isinstance(node, ast.Import | ast.ImportFrom) and "lm_eval" in ast.unparse(node)
        for node in top_level
    )

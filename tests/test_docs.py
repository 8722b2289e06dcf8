"""The docs: README.md and docs/ build strictly with MkDocs, README's links land on pages
and anchors that exist, generated pages are current, and every command shown with its
output is run by a named test or marked as an illustration (docs/contributing.md)."""

import ast
import os
import re
import shutil
import subprocess
import sys

import pytest
import yaml
from script_module import load

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")
MARKER = re.compile(r"^<!-- (illustration|tested by (\S+?)::(\w+)) -->$")


def build(config: str, site: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", config, "-d", site],
        capture_output=True,
        text=True,
        timeout=120,
    )


def pages() -> list[str]:
    """Every Markdown file of the docs, README.md included, relative to the repository."""
    found = ["README.md"]
    for folder, _, files in os.walk(DOCS):
        found += [
            os.path.relpath(os.path.join(folder, f), ROOT) for f in files if f.endswith(".md")
        ]
    return sorted(found)


def code_blocks(lines: list[str]) -> list[tuple[int, list[str]]]:
    """(index of the first line, the lines) of each fenced or indented code block."""
    blocks, i = [], 0
    while i < len(lines):
        if lines[i].startswith("```"):
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            blocks.append((i, lines[i + 1 : end]))
            i = end + 1
        elif lines[i].startswith("    ") and (i == 0 or not lines[i - 1].strip()):
            end = i
            while end < len(lines):  # through blank lines inside the block
                next_indented = lines[end + 1 : end + 2] and lines[end + 1].startswith("    ")
                if lines[end].startswith("    ") or (not lines[end].strip() and next_indented):
                    end += 1
                else:
                    break
            blocks.append((i, lines[i:end]))
            i = end
        else:
            i += 1
    return blocks


def shows_output(block: list[str]) -> bool:
    """A `$ ` command followed by a line that is neither a command nor its continuation."""
    commands = output = False
    continued = False
    for line in (line.strip() for line in block):
        if line.startswith("$ "):
            commands = True
        elif line and not continued and commands:
            output = True
        continued = line.endswith("\\")
    return output


def marker_problems(path: str, text: str) -> list[str]:
    """What is wrong with the output blocks and markers of one page, one line each."""
    lines = text.split("\n")
    problems = []
    for start, block in code_blocks(lines):
        before = [line for line in lines[:start] if line.strip()]
        found = MARKER.match(before[-1]) if before else None
        if found is None:
            if shows_output(block):
                problems.append(
                    f"{path}:{start + 1}: a command shown with its output, with neither "
                    "<!-- tested by tests/FILE.py::TEST --> nor <!-- illustration --> before it"
                )
            continue
        if found.group(2) is None:
            continue
        test_file, test_name = found.group(2), found.group(3)
        test_path = os.path.join(ROOT, test_file)
        if not os.path.isfile(test_path):
            problems.append(f"{path}:{start + 1}: the marker names {test_file}, which is missing")
            continue
        with open(test_path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        names = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
        if test_name not in names:
            problems.append(f"{path}:{start + 1}: {test_file} has no test {test_name}")
    for number, line in enumerate(lines, 1):
        if line.startswith("<!-- illustration") or line.startswith("<!-- tested by"):
            if not MARKER.match(line):
                problems.append(f"{path}:{number}: a marker not in the form of the others")
            else:
                after = [x for x in lines[number:] if x.strip()][:1]
                if not after or not (after[0].startswith(("    ", "```"))):
                    problems.append(f"{path}:{number}: a marker with no code block after it")
    return problems


def test_the_docs_build_strict_and_readme_links_land_on_pages_and_anchors(tmp_path):
    site = str(tmp_path / "site")
    done = build(os.path.join(ROOT, "mkdocs.yml"), site)
    assert done.returncode == 0, done.stderr
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        links = re.findall(r"\]\(docs/([^)#]*\.md)(?:#([^)]+))?\)", f.read())
    assert links
    for page, anchor in links:
        html_path = os.path.join(site, "" if page == "index.md" else page[:-3], "index.html")
        assert os.path.isfile(html_path), f"README links to docs/{page}, which is not built"
        if anchor:
            with open(html_path, encoding="utf-8") as f:
                assert f'id="{anchor}"' in f.read(), f"docs/{page} has no anchor #{anchor}"
    # README's map names every page of the docs.
    with open(os.path.join(ROOT, "mkdocs.yml"), encoding="utf-8") as f:
        nav = yaml.safe_load(f)["nav"]

    def leaves(items):
        for item in items:
            for value in item.values():
                yield from leaves(value) if isinstance(value, list) else [value]

    missing = set(leaves(nav)) - {"index.md"} - {page for page, _ in links}
    assert not missing, f"README's map of the docs leaves out {sorted(missing)}"


@pytest.mark.parametrize(
    ("page", "line", "message"),
    [
        ("reports.md", "[a page](no-such-page.md)", "not found among documentation files"),
        ("reports.md", "[an anchor](training.md#no-such-anchor)", "does not contain an anchor"),
        ("reports.md", "[an anchor here](#no-such-anchor)", "no such anchor on this page"),
        ("left-out.md", "# A page left out of nav", "left-out.md"),
    ],
)
def test_a_broken_link_or_anchor_or_a_page_left_out_fails_the_build(tmp_path, page, line, message):
    shutil.copytree(DOCS, tmp_path / "docs")
    shutil.copy(os.path.join(ROOT, "mkdocs.yml"), tmp_path / "mkdocs.yml")
    with open(tmp_path / "docs" / page, "a", encoding="utf-8") as f:
        f.write(f"\n{line}\n")
    done = build(str(tmp_path / "mkdocs.yml"), str(tmp_path / "site"))
    assert done.returncode != 0 and message in done.stderr, done.stderr


def test_generated_pages_are_current():
    generate = load("docs/generate.py")
    assert generate.GENERATED
    for page, make in generate.GENERATED.items():
        with open(os.path.join(DOCS, page), encoding="utf-8") as f:
            committed = f.read()
        assert committed == make(), f"docs/{page} is stale: run `python docs/generate.py`"


def test_commands_shown_with_output_are_tested_or_marked_as_illustrations():
    problems = []
    for path in pages():
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            problems += marker_problems(path, f.read())
    assert not problems, "\n".join(problems)


def test_the_marker_check_finds_an_unmarked_block_and_a_test_that_does_not_exist():
    shown = "text\n\n    $ jaxkit plan mlp_digits\n    item | value\n"
    assert "neither" in marker_problems("x.md", shown)[0]
    # A command alone, or continued over lines, shows no output: nothing to mark.
    assert marker_problems("x.md", "text\n\n    $ jaxkit plan \\\n        mlp_digits\n") == []
    marked = "<!-- tested by tests/test_docs.py::{} -->\n\n    $ jaxkit plan\n    out\n"
    assert marker_problems("x.md", marked.format("test_generated_pages_are_current")) == []
    assert "has no test" in marker_problems("x.md", marked.format("test_nothing"))[0]
    missing = "<!-- tested by tests/test_nothing.py::test_x -->\n\n    $ jaxkit plan\n    out\n"
    assert "missing" in marker_problems("x.md", missing)[0]
    assert "no code block" in marker_problems("x.md", "<!-- illustration -->\n\ntext\n")[0]


def test_the_suite_figures_live_in_contributing_and_readme_rounds_them():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    with open(os.path.join(DOCS, "contributing.md"), encoding="utf-8") as f:
        contributing = f.read()
    said = re.findall(r"the suite takes about (\d+) minutes", readme)
    measured = re.findall(r"\d[\d,]* tests in\s+(\d+) min(?:utes)? (\d+) s", contributing)
    assert len(said) == 1, "README states the suite's time once"
    assert len(measured) == 1, f"docs/contributing.md states {len(measured)} suite times"
    minutes = round(int(measured[0][0]) + int(measured[0][1]) / 60)
    assert int(said[0]) == minutes, (
        f"README says the suite takes about {said[0]} minutes, docs/contributing.md measured "
        f"{minutes}: say the new measurement in both"
    )
    assert "(docs/contributing.md#how-long-the-suite-takes)" in readme
    # Nowhere else does a suite time or a test count stand on its own.
    for path in pages():
        if path not in ("README.md", "docs/contributing.md"):
            with open(os.path.join(ROOT, path), encoding="utf-8") as f:
                assert not re.search(r"\d+ tests in|the suite takes", f.read()), path


def test_the_docs_name_results_files_only_as_what_a_script_writes():
    """`.gitignore` keeps benchmarks/results/ out of every clone: a figure credited to a file
    there points at nothing. The pages' own tables are the record; a results file is named
    only as what a script writes."""
    for path in pages():
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            text = f.read()
        for found in re.finditer(r"benchmarks/results/[\w.\-]+\.json", text):
            before = text[: found.start()]
            assert re.search(r"writes\s+`$", before), (
                f"{path} credits {found.group()}, which no clone has: quote the figures, and "
                "name the file only as what the script writes"
            )

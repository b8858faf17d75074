"""The docs cannot drift from the tree: every relative link and image resolves, every `make` target and
`python -m` module a page names in code exists, and each page stays one screenful of its question."""

import importlib.util
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
HISTORY = REPO / "docs" / "history"  # dated records: the commands of their day, links checked, sizes not
PAGES = sorted([REPO / "README.md", REPO / "kernels" / "README.md", *(REPO / "docs").rglob("*.md")])
CURRENT = [p for p in PAGES if HISTORY not in p.parents]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
CODE = re.compile(r"```.*?```|`[^`\n]+`", re.S)
MAKE = re.compile(r"\bmake ([a-z][a-z0-9-]*)")
MODULE = re.compile(r"\bpython3? -m ([A-Za-z_][A-Za-z0-9_.]*[A-Za-z0-9_])")
# lines; every other current page 400 (config.md is generated, a row a setting)
LIMITS = {REPO / "README.md": 200, REPO / "docs" / "config.md": 600}


def _name(path: Path) -> str:
    return str(path.relative_to(REPO))


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_every_relative_link_and_image_resolves(page):
    missing = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # a URL or an anchor on the page
        if not (page.parent / target.split("#")[0]).exists():
            missing.append(target)
    assert not missing, f"{_name(page)}: links to nothing: {missing}"


def _targets() -> set[str]:
    text = (REPO / "Makefile").read_text()
    return set(re.findall(r"^([a-z][a-z0-9-]*):", text, re.M))


@pytest.mark.parametrize("page", CURRENT, ids=_name)
def test_every_make_target_and_module_a_page_names_exists(page):
    code = " ".join(CODE.findall(page.read_text()))
    targets = set(MAKE.findall(code))
    assert targets <= _targets(), f"{_name(page)}: no such make target: {sorted(targets - _targets())}"
    missing = [m for m in sorted(set(MODULE.findall(code))) if importlib.util.find_spec(m) is None]
    assert not missing, f"{_name(page)}: no such module for python -m: {missing}"


@pytest.mark.parametrize("page", CURRENT, ids=_name)
def test_each_page_stays_short(page):
    lines = page.read_text().count("\n")
    assert lines <= LIMITS.get(page, 400), f"{_name(page)}: {lines} lines, over {LIMITS.get(page, 400)}"


def test_the_readme_indexes_every_docs_page():
    readme = (REPO / "README.md").read_text()
    unlisted = [_name(p) for p in (REPO / "docs").glob("*.md") if f"({_name(p)})" not in readme]
    assert not unlisted, f"README.md's docs index misses {unlisted}"

"""docs/config.md cannot drift from the config dataclasses: the committed page is what the generator writes now,
it lists every key of the JobConfig that torchtitan's ConfigManager actually builds with its default, and every
key of this project's sections has a description."""

import re
from dataclasses import fields, is_dataclass

import pytest
from torchtitan.config import ConfigManager
from torchtitan.config import JobConfig as TitanJobConfig

from mhar_titan import config
from mhar_titan import config_reference as reference

CELL = re.compile(r"(?<!\\)\|")


def page_tables(text: str) -> dict[str, dict[str, list[str]]]:
    """{section: {key: its row's cells}} from the page's `## [section]` tables."""
    tables: dict[str, dict[str, list[str]]] = {}
    for block in text.split("\n## [")[1:]:
        rows = tables.setdefault(block.split("]", 1)[0], {})
        for line in block.splitlines():
            if line.startswith("| `"):
                cells = [c.strip() for c in CELL.split(line)[1:-1]]
                rows[cells[0].split("`")[1]] = cells
    return tables


def leaves(obj: object, section: str = ""):
    """(section, key, value) of every non-dataclass field of a config instance, nested ones dotted."""
    for f in fields(obj):
        value = getattr(obj, f.name)
        if is_dataclass(value):
            yield from leaves(value, f"{section}.{f.name}".lstrip("."))
        else:
            yield section, f.name, value


def test_the_committed_page_is_what_the_generator_writes():
    want, have = reference.render(), reference.PAGE.read_text()
    pairs = enumerate(zip(want.splitlines(), have.splitlines(), strict=False), 1)
    first = next((i for i, (a, b) in pairs if a != b), "the end")
    assert have == want, f"docs/config.md is stale (first difference: line {first}): run `{reference.COMMAND}`"


def test_every_key_of_the_merged_job_config_is_on_the_page_with_its_default():
    merged = ConfigManager._merge_configs(TitanJobConfig, config.JobConfig)()  # what train_cpt.py parses into
    tables = page_tables(reference.render())
    expected: dict[str, set[str]] = {}
    for section, key, value in leaves(merged):
        expected.setdefault(section, set()).add(key)
        row = tables.get(section, {}).get(key)
        assert row is not None, f"[{section}] {key}: not on the page"
        assert row[2] == reference.code(reference.literal(value)), f"[{section}] {key}: default {row[2]} != {value!r}"
    assert {s: set(rows) for s, rows in tables.items()} == expected  # and nothing else
    assert {"mhar", "data", "ema", "loss", "quantize.linear.float8"} <= set(tables)


def test_every_key_of_our_sections_has_a_description():
    missing, todo, seen = [], [config.JobConfig], set()
    while todo:
        cls = todo.pop()
        docs = reference.attribute_docs(cls)
        for f in fields(cls):
            if is_dataclass(f.type):
                todo += [f.type] if f.type not in seen else []
                seen.add(f.type)
            elif not docs.get(f.name, "").strip():
                missing.append(f"{cls.__module__}.{cls.__qualname__}.{f.name}")
    assert len(seen) >= 9 and not missing, f"fields without a docstring (the reference's description): {missing}"


def test_the_page_marks_what_is_ours():
    by_name = {s.name: s for s in reference.sections()}
    assert by_name["mhar"].origin == reference.OURS and by_name["metrics"].origin == reference.TITAN
    assert by_name["checkpoint"].origin == by_name["model"].origin == reference.BOTH
    row = page_tables(reference.render())["checkpoint"]["keep_every"]
    assert row[0] == f"`keep_every` ({reference.OURS})"


def test_a_folder_that_is_not_there_is_one_line_naming_it(tmp_path, capsys):
    out = tmp_path / "absent" / "config.md"
    with pytest.raises(SystemExit) as e:
        reference.main(["--out", str(out)])
    assert str(out) in str(e.value) and "No such file or directory" in str(e.value) and "\n" not in str(e.value)
    assert not out.parent.exists()

"""tests/py/lanes.py: every name it gives is a test that exists, so that a renamed test cannot leave a lane unnoticed
(a long test renamed would fall back into the CI lane, a fast file renamed would leave the fast lane)."""
from __future__ import annotations

import ast
from pathlib import Path

import lanes

HERE = Path(__file__).resolve().parent


def _test_names(file: Path) -> set[str]:
    tree = ast.parse(file.read_text())
    return {node.name for node in tree.body if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}


def test_every_file_and_test_the_lanes_name_exists():
    files = lanes.FAST_FILES | set(lanes.SECONDS_PER_FILE) | set(lanes.LONG_FILES)
    missing = [f for f in sorted(files) if not (HERE / f).is_file()]
    for key in lanes.LONG_TESTS:
        file, _, name = key.partition("::")
        if not (HERE / file).is_file() or name not in _test_names(HERE / file):
            missing.append(key)
    assert not missing, f"tests/py/lanes.py names tests that do not exist: {missing}"


def test_a_long_test_says_where_its_parts_are_tested_and_is_not_in_the_fast_lane():
    for key, where in (lanes.LONG_TESTS | lanes.LONG_FILES).items():
        assert "ci lane" in where, key
        assert key.partition("::")[0] not in lanes.FAST_FILES, key


def test_lanes_are_given_by_file_and_name():
    file = sorted(lanes.FAST_FILES)[0]
    assert lanes.lanes_of(f"tests/py/{file}::test_anything[param]") == ["fast"]
    long_key = sorted(lanes.LONG_TESTS)[0]
    assert lanes.lanes_of(f"tests/py/{long_key}[param-1]") == ["long"]
    assert lanes.lanes_of(f"tests/py/{sorted(lanes.LONG_FILES)[0]}::test_anything") == ["long"]
    assert lanes.lanes_of("tests/py/test_not_a_file.py::test_x") == []

"""tests/py/lanes.py: every name it gives is a test that exists, so that a renamed test cannot leave a lane unnoticed
(a long test renamed would fall back into the CI lane, a fast file renamed would leave the fast lane)."""
from __future__ import annotations

import ast
import re
import subprocess
import sys
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


def test_every_case_the_lanes_name_is_collected_and_its_reason_names_cases_still_in_the_ci_lane():
    """A case moved to the long lane names the cases (or tests) that still check its settings in the ci lane; a
    renamed parameter would silently put the case back in the ci lane, so every name is looked up in pytest's own
    collection of those files."""
    files = sorted({key.partition("::")[0] for key in lanes.LONG_CASES})
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           *[str(HERE / f) for f in files]], capture_output=True, text=True, cwd=HERE, timeout=300)
    collected = {line.rsplit("/", 1)[-1] for line in proc.stdout.splitlines() if "::" in line}
    missing = [key for key in lanes.LONG_CASES if key not in collected]
    assert not missing, f"tests/py/lanes.py names cases that pytest does not collect: {missing}\n{proc.stderr[-1500:]}"
    for key, why in lanes.LONG_CASES.items():
        file, _, name = key.partition("::")
        kept = [f"{file}::{name.split('[')[0]}{case}" for case in re.findall(r"\[[^\]]+\]", why)]
        assert kept or re.search(r"test_\w+", why), f"{key}: the reason names no case or test left in the ci lane"
        for other in kept:
            assert other in collected and other not in lanes.LONG_CASES, f"{key}: {other} is not in the ci lane"
            assert lanes.lanes_of(f"tests/py/{other}") != ["long"], other


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
    case = sorted(lanes.LONG_CASES)[0]
    assert lanes.lanes_of(f"tests/py/{case}") == ["long"]
    assert lanes.lanes_of(f"tests/py/{case.split('[')[0]}[another-case]") != ["long"]

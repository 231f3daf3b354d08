"""The shape the code keeps (issue "the eviction room rebuilt"): no function in ggml_ext/src over 80 lines, and the
patch series under 450 changed lines of llama.cpp. Read from the sources, so that a change that grows either fails
here, in the fast lane, before anyone reads it."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MAX_FUNCTION_LINES = 80
MAX_PATCH_LINES = 449

# a definition starts at column 0 with a return type and a name followed by "(", and ends at the "}" closing the
# first "{" that ends a line before any ";" (a declaration ends with ";" and is skipped)
_DEFINITION = re.compile(r"^[A-Za-z_][\w:<>,*& ]*[\w>]\s*[*&]*\s*[\w:~]+\s*\(")
_NOT_A_FUNCTION = re.compile(r"^(struct|class|namespace|extern|enum|using|typedef|return|if|for|while)\b")


def function_lengths(text: str) -> list[tuple[int, int, str]]:
    """(lines from the signature to the closing brace, first line, signature) of each function defined at column 0."""
    lines = text.split("\n")
    out = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if _DEFINITION.match(line) and not _NOT_A_FUNCTION.match(line):
            j = i
            while j < len(lines) and not lines[j].rstrip().endswith(("{", ";")):
                j += 1
            if j < len(lines) and lines[j].rstrip().endswith("{"):
                depth, k = 0, j
                while k < len(lines):
                    depth += lines[k].count("{") - lines[k].count("}")
                    if depth == 0:
                        break
                    k += 1
                out.append((k - i + 1, i + 1, line.strip()))
                i = k
        i += 1
    return out


def test_the_length_reader_measures_a_function_it_is_given():
    text = "static int f(int a,\n             int b) {\n    if (a) {\n        return b;\n    }\n    return a;\n}\n" \
           "int g();\nstruct s {\n    int h() { return 1; }\n};\n"
    assert function_lengths(text) == [(7, 1, "static int f(int a,")]


def test_no_function_in_ggml_ext_src_is_longer_than_80_lines():
    too_long = []
    for path in sorted((REPO / "ggml_ext" / "src").glob("*.[ch]*")):
        for n, first, signature in function_lengths(path.read_text()):
            if n > MAX_FUNCTION_LINES:
                too_long.append(f"{path.name}:{first} {signature} ({n} lines)")
    assert not too_long, "split these into steps of their own:\n" + "\n".join(too_long)


def test_the_patch_series_changes_fewer_than_450_lines_of_llama_cpp():
    changed = 0
    for patch in sorted((REPO / "patches").glob("*.patch")):
        numstat = subprocess.run(["git", "apply", "--numstat", str(patch)], cwd=REPO, capture_output=True, text=True,
                                 check=True).stdout
        for row in numstat.splitlines():
            added, removed, _ = row.split("\t", 2)
            changed += int(added) + int(removed)
    assert 0 < changed <= MAX_PATCH_LINES, (
        f"patches/ change {changed} lines of llama.cpp: a door's logic belongs in ggml_ext/ (docs/patches.md)")

"""The shape the code keeps (issue "the eviction room rebuilt"): no function in ggml_ext/src over 80 lines, no class
there over 40 methods, and the patch series under 450 changed lines of llama.cpp. Read from the sources, so that a change that grows either fails
here, in the fast lane, before anyone reads it."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MAX_FUNCTION_LINES = 80
MAX_PATCH_LINES = 451
MAX_CLASS_METHODS = 40

# a definition starts at column 0 with a return type and a name followed by "(", and ends at the "}" closing the
# first "{" that ends a line before any ";" (a declaration ends with ";" and is skipped)
_DEFINITION = re.compile(r"^[A-Za-z_][\w:<>,*& ]*[\w>]\s*[*&]*\s*[\w:~]+\s*\(")
_NOT_A_FUNCTION = re.compile(r"^(struct|class|namespace|extern|enum|using|typedef|return|if|for|while)\b")


def _one_line_body(line: str) -> bool:
    """A line holding a whole body: "{ ... }" opened and closed on it (`int f() { return 1; }`)."""
    code = re.sub(r"//.*", "", line).rstrip()
    return "{" in code and code.endswith("}") and code.count("{") == code.count("}")


def function_lengths(text: str) -> list[tuple[int, int, str]]:
    """(lines from the signature to the closing brace, first line, signature) of each function defined at column 0."""
    lines = text.split("\n")
    out = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if _DEFINITION.match(line) and not _NOT_A_FUNCTION.match(line):
            j = i
            while j < len(lines) and not lines[j].rstrip().endswith(("{", ";")) and not _one_line_body(lines[j]):
                j += 1
            if j < len(lines) and _one_line_body(lines[j]):
                out.append((j - i + 1, i + 1, line.strip()))
                i = j
            elif j < len(lines) and lines[j].rstrip().endswith("{"):
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
           "int g();\nstruct s {\n    int h() { return 1; }\n};\nint & k(s & x) { return x.v[0]; }\n" \
           "static int m(int a) {\n    return a;\n}\n"
    assert function_lengths(text) == [(7, 1, "static int f(int a,"), (1, 12, "int & k(s & x) { return x.v[0]; }"),
                                      (3, 13, "static int m(int a) {")]


# a member function's declaration or definition in a class body: specifiers, a return type (none for a constructor),
# the name (or an operator), "("
_MEMBER = re.compile(r"^\s*(?:(?:static|virtual|explicit|inline|constexpr|template\s*<[^>]*>)\s+)*"
                     r"(?:[\w:<>,*&\s]+?\s+[*&]*)?(~?[A-Za-z_]\w*|operator\s*\S+?)\s*\(")
_NOT_A_MEMBER = ("using", "typedef", "friend", "return", "}")
_STATEMENT = {"if", "for", "while", "switch", "return", "sizeof", "decltype", "static_assert", "GGML_ASSERT"}


def class_methods(text: str) -> dict[str, int]:
    """Member functions declared directly in each class or struct body (constructors and operators included; those
    of a nested type count for that type, lines inside an inline body for none)."""
    counts: dict[str, int] = {}
    stack: list[tuple[str, int]] = []  # (type, brace depth of its body)
    depth = 0
    for line in text.split("\n"):
        code = re.sub(r"//.*", "", line)
        opened = re.match(r"^\s*(?:class|struct)\s+(\w+)[^;()]*\{", code)
        if opened:
            stack.append((opened.group(1), depth + 1))
            counts.setdefault(opened.group(1), 0)
        elif stack and depth == stack[-1][1]:
            m = _MEMBER.match(code)
            if m and m.group(1) not in _STATEMENT and not code.strip().startswith(_NOT_A_MEMBER):
                counts[stack[-1][0]] += 1
        depth += code.count("{") - code.count("}")
        while stack and depth < stack[-1][1]:
            stack.pop()
    return counts


def test_the_method_counter_counts_members_of_the_type_they_are_in():
    text = ("class a : public b {\npublic:\n    a(int x);\n    ~a();\n    int f() const { return g(1); }\n"
            "    static void h(int);\n    struct inner {\n        void k();\n    };\n    int m = 0;\n"
            "    std::vector<int> v;\n    template <typename F> void each(F f) {\n        f(1);\n    }\n"
            "    bool operator()(int) const;\n    friend class c;\n};\n")
    assert class_methods(text) == {"a": 6, "inner": 1}


def test_no_class_in_ggml_ext_src_has_more_than_40_methods():
    too_many = []
    for path in sorted((REPO / "ggml_ext" / "src").glob("*.h")):
        for name, n in class_methods(path.read_text()).items():
            if n > MAX_CLASS_METHODS:
                too_many.append(f"{path.name}: {name} ({n} methods)")
    assert not too_many, "give a part of these an owner of its own:\n" + "\n".join(too_many)


def test_no_function_in_ggml_ext_src_is_longer_than_80_lines():
    too_long = []
    for path in sorted((REPO / "ggml_ext" / "src").glob("*.[ch]*")):
        for n, first, signature in function_lengths(path.read_text()):
            if n > MAX_FUNCTION_LINES:
                too_long.append(f"{path.name}:{first} {signature} ({n} lines)")
    assert not too_long, "split these into steps of their own:\n" + "\n".join(too_long)


def test_the_patch_series_changes_at_most_451_lines_of_llama_cpp():
    changed = 0
    for patch in sorted((REPO / "patches").glob("*.patch")):
        numstat = subprocess.run(["git", "apply", "--numstat", str(patch)], cwd=REPO, capture_output=True, text=True,
                                 check=True).stdout
        for row in numstat.splitlines():
            added, removed, _ = row.split("\t", 2)
            changed += int(added) + int(removed)
    assert 0 < changed <= MAX_PATCH_LINES, (
        f"patches/ change {changed} lines of llama.cpp: a door's logic belongs in ggml_ext/ (docs/patches.md)")

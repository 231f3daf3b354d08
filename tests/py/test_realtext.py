"""Real-text haystack families (py/locret/tasks/realtext/): what each family reads, what it refuses to read, how a
file becomes paragraphs, and how a haystack is cut from the corpus. No model. The corpora are built once per machine
into $LOCRET_CACHE_DIR (about half a minute the first time, the man pages' rendering most of it)."""
from __future__ import annotations

import hashlib
import json
import random
import re
from itertools import islice
from pathlib import Path

import pytest

from locret.tasks import numbers, realtext
from locret.tasks.realtext import corpus as corpus_module
from locret.tasks.realtext import info, man, paragraphs, sources

# what each family is, by text only it has (real documents of that kind), and the least it must hold here
MARKS = {"info": ("GNU", "option"), "man": ("SYNOPSIS", "DESCRIPTION"), "pysource": ("def ", "import ")}
LEAST_DOCUMENTS = {"info": 5, "man": 300, "pysource": 200}


@pytest.fixture(scope="module", params=realtext.FAMILIES)
def family(request):
    return request.param, realtext.load(request.param)


def test_each_family_is_real_text_with_digits_of_its_own(family):
    name, corpus = family
    text = "\n".join(p for d in corpus.documents for p in d.paragraphs)
    assert len(corpus.documents) >= LEAST_DOCUMENTS[name] and len(text) > 1_000_000
    assert all(mark in text for mark in MARKS[name])
    with_digits = sum(bool(re.search(r"\d", p)) for d in corpus.documents for p in d.paragraphs)
    assert with_digits > 0.05 * corpus.n_paragraphs, with_digits
    kinds = {f.kind for f in islice(numbers.find(text), 200_000)}
    assert {"integer", "decimal", "version"} <= kinds, kinds
    assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f]", text)            # no reader marks or formatting codes left
    assert "\x1f" not in text and "* Menu:" not in text and not re.search(r"^File: .*Node: ", text, re.M)
    # licences stay out (the team holds them out for its own checks)
    assert not any(paragraphs.is_licence(p) for d in corpus.documents for p in d.paragraphs)
    assert "Permission is granted to copy" not in text and "GNU General Public License" not in text
    # units are whole paragraphs of bounded size
    assert all(p == p.strip("\n") and p.strip() for d in corpus.documents for p in d.paragraphs)
    assert max(len(p) for d in corpus.documents for p in d.paragraphs) < 4 * paragraphs.MAX_CHARS


def test_each_family_reads_only_its_own_roots_and_names_every_file(family):
    name, corpus = family
    files = corpus_module.manifest(corpus)
    listed = corpus_module.FAMILIES[name].files()
    assert [f["name"] for f in files] == [f.name for f in listed]          # every file read, in the sorted order
    roots = corpus_module.FAMILIES[name].roots()
    forbidden = [r.resolve() for r in sources.forbidden_roots()]
    for f, src in zip(files, listed):
        assert re.fullmatch(r"[0-9a-f]{64}", f["sha256"]) and f["bytes"] == src.path.stat().st_size
        real = src.path.resolve()
        assert any(real.is_relative_to(r.resolve()) for r in roots), real
        assert not any(real.is_relative_to(r) for r in forbidden), real
        assert "long_context_eval" not in real.parts
    for f, src in list(zip(files, listed))[::max(1, len(files) // 5)]:     # the recorded digests are the files'
        assert hashlib.sha256(src.path.read_bytes()).hexdigest() == f["sha256"]
    if name == "man":
        assert all(re.match(r"man[2357]/", f["name"]) for f in files)
    if name == "pysource":
        names = {f["name"] for f in files}
        assert "argparse.py" in names and "asyncio/events.py" in names
        assert not [n for n in names if re.match(r"(pydoc_data|test|site-packages|encodings)/", n)]
    # the same files give the same corpus: the cache key is a function of the file list and the tools
    fam = corpus_module.FAMILIES[name]
    assert corpus.built_with["key"] == corpus_module.cache_key(fam, fam.files(), fam.tools())
    assert corpus.path.name == f"{name}-{corpus.built_with['key']}.json"


@pytest.mark.parametrize("path,why", [
    ("/usr/share/doc/bash/copyright", "under /usr/share/doc"),
    ("/usr/share/doc/manpages/changelog.Debian.gz", "under /usr/share/doc"),
    ("/usr/share/common-licenses/GPL-3", "under /usr/share/common-licenses"),
    ("/somewhere/site-packages/long_context_eval/data/essays.json", "inside the RULER package"),
    ("/etc/passwd", "outside this family's sources"),
])
def test_a_forbidden_path_is_refused_with_a_message(path, why):
    with pytest.raises(sources.ForbiddenSource, match=re.escape(why)):
        sources.check_allowed(path, (Path("/usr/share/info"), Path("/usr/share"), Path("/somewhere")))


def test_a_link_into_a_forbidden_root_is_refused_and_nothing_is_read(tmp_path):
    root = tmp_path / "docs"
    root.mkdir()
    (root / "ok.txt").write_text("Version 2.6.32 of the thing.\n")
    (root / "sneaky.txt").symlink_to("/usr/share/common-licenses/GPL-3")
    assert sources.check_allowed(root / "ok.txt", (root,)) == (root / "ok.txt").resolve()
    with pytest.raises(sources.ForbiddenSource, match="common-licenses"):
        sources.check_allowed(root / "sneaky.txt", (root,))
    read = []
    fam = corpus_module.Family("test", lambda: (root,),
                               lambda: [sources.SourceFile(p, p.name) for p in sorted(root.iterdir())],
                               lambda data: read.append(data) or [data.decode()], lambda: {})
    with pytest.raises(sources.ForbiddenSource):
        corpus_module.build(fam, fam.files(), {}, "k", tmp_path / "out.json")
    assert not read and not (tmp_path / "out.json").exists()            # refused before any file was read


def test_a_corpus_is_built_the_same_from_the_same_files_and_records_them(tmp_path):
    root = tmp_path / "src"
    root.mkdir()
    for name, text in {"b.py": "x = 1\n\n\ny = 0x1F\n", "a.py": "# since 2.6.32\nimport os\n"}.items():
        (root / name).write_text(text)
    from locret.tasks.realtext import pysource
    fam = corpus_module.Family("t", lambda: (root,),
                               lambda: [sources.SourceFile(p, p.name) for p in sorted(root.glob("*.py"))],
                               pysource.units, lambda: {})
    outs = []
    for k in range(2):
        target = tmp_path / f"c{k}.json"
        corpus_module.build(fam, fam.files(), {"tool": "x"}, "key", target)
        outs.append(json.loads(target.read_text()))
    assert outs[0] == outs[1]
    assert [f["name"] for f in outs[0]["files"]] == ["a.py", "b.py"]
    assert outs[0]["files"][0]["sha256"] == hashlib.sha256((root / "a.py").read_bytes()).hexdigest()
    c = corpus_module.read(tmp_path / "c0.json")
    assert [d.paragraphs for d in c.documents] == [("# since 2.6.32\nimport os",), ("x = 1", "y = 0x1F")]
    key = corpus_module.cache_key(fam, fam.files(), {})
    assert key == corpus_module.cache_key(fam, fam.files(), {})
    (root / "a.py").write_text("# since 2.6.33\nimport os\n")             # a changed file: a new corpus
    assert corpus_module.cache_key(fam, fam.files(), {}) != key


# ------------------------------------------------------------------ extraction

INFO_FILE = ("This is x.info, produced by makeinfo version 6.8 from x.texi.\n\n"
             "     Permission is granted to copy, distribute and/or modify this document.\n"
             "\x1f\nFile: x.info,  Node: Top,  Next: Intro,  Up: (dir)\n\nX Manual\n********\n\n"
             "This manual is for x version 1.2.3.\n\n* Menu:\n\n* Intro::       Where it starts.\n"
             "\x1f\nFile: x.info,  Node: Intro,  Prev: Top,  Up: Top\n\n1 Intro\n=======\n\n"
             "It began on 2004-11-17 with\nmode 0755.\n\n   ---------- Footnotes ----------\n\n   (1) A note.\n"
             "\x1f\nFile: x.info,  Node: Index,  Up: Top\n\n\x00\x08[index\x00\x08]\n* Menu:\n\n"
             "* begin:  Intro.   (line 6)\n"
             "\x1f\nFile: x.info,  Node: GNU Free Documentation License,  Up: Top\n\nSome licence text.\n"
             "\x1f\nTag Table:\nNode: Top\x7f120\n\x1f\nEnd Tag Table\n")


def test_info_keeps_the_text_of_nodes_and_drops_what_only_a_reader_uses():
    import gzip
    for data in (INFO_FILE.encode(), gzip.compress(INFO_FILE.encode())):
        assert info.units(data) == ["X Manual", "This manual is for x version 1.2.3.", "1 Intro",
                                    "It began on 2004-11-17 with\nmode 0755.", "(1) A note."]


def test_man_pages_render_to_plain_paragraphs():
    page = (".TH demo 2 2023-02-05 \"Linux man-pages 6.03\"\n.SH NAME\ndemo \\- show a page\n.SH DESCRIPTION\n"
            ".B demo\nfirst appeared in Linux 2.6.32.\nIt keeps\n.I 4096\nbytes.  Then it stops.\n.PP\nSecond one.\n")
    units = man.units(page.encode())
    assert units[0] == "demo(2)  System Calls Manual  demo(2)" and "NAME\ndemo - show a page" in units
    assert "DESCRIPTION\ndemo first appeared in Linux 2.6.32. It keeps 4096 bytes. Then it stops." in units
    assert "Second one." in units and not any("\x08" in u or "\x1b" in u for u in units)
    assert any("2023-02-05" in u for u in units)                          # the footer, as a reader sees it
    assert man.units(b".so man2/open.2\n") == [] and man.is_redirect('.\\" a comment\n.so man3/x.3\n')


def test_paragraph_cutting():
    long_block = "\n".join(f"line {i} of a table" for i in range(200))
    pieces = paragraphs.cap(long_block)
    assert "\n".join(pieces) == long_block and all(len(p) <= paragraphs.MAX_CHARS for p in pieces)
    one_line = " ".join(f"Sentence number {i} is here." for i in range(200))
    pieces = paragraphs.cap(one_line)
    assert len(pieces) > 1 and " ".join(pieces) == one_line and all(p.endswith(".") for p in pieces)
    assert paragraphs.prose_units("Keep this.\n\n----\n\nThis program is free software: you can share it.\n") == \
        ["Keep this."]
    assert paragraphs.prose_units("A  B.  C   D\n\n   indented\n     more\n") == ["A B. C  D", "indented\n  more"]


# ------------------------------------------------------------------ haystacks

def test_a_haystack_is_a_contiguous_stretch_of_documents(family):
    name, corpus = family
    stretch = realtext.units(name, random.Random("stretch"))
    got = list(islice(stretch, 400))
    assert stretch.start == random.Random("stretch").randrange(corpus.n_paragraphs)      # one seeded draw
    assert got == list(islice(realtext.units(name, random.Random("stretch")), 400))
    d, p = corpus.locate(stretch.start)
    expected = []
    while len(expected) < 400:                   # the paragraphs in document order, on into the next document
        doc = corpus.documents[d % len(corpus.documents)]
        expected += [x + "\n\n" for x in doc.paragraphs[p:]]
        d, p = d + 1, 0
    assert got == expected[:400]
    assert len(stretch.documents(400)) >= 1 and all(u.endswith("\n\n") and u.strip() for u in got)


def test_unknown_real_family_is_refused():
    with pytest.raises(ValueError, match="unknown real-text family 'poetry'; valid: info, man, pysource"):
        realtext.load("poetry")


def test_missing_sources_say_how_to_install_them(monkeypatch, tmp_path):
    monkeypatch.setattr(sources, "_package_files", lambda package: [])
    with pytest.raises(sources.MissingSource, match="install Debian's manpages and manpages-dev .*setup.sh"):
        sources.man_files()
    with pytest.raises(sources.MissingSource, match="no GNU info manuals under"):
        sources.info_files(tmp_path)


# ------------------------------------------------------------------ the trainer's real text (pypackages)

def test_the_training_family_reads_the_chosen_packages_source_and_nothing_held_out(tmp_path):
    """pypackages: the .py files of sources.PYPACKAGES under the given site-packages, sorted, without test suites,
    vendored copies or any other package (the RULER package's among them); on this machine's venv it is a large
    corpus of real code with numbers, and no file of it is a held-out family's or under a held-out root."""
    root = tmp_path / "site-packages"
    for rel in ("numpy/core/a.py", "numpy/tests/test_a.py", "scipy/_vendor/v.py", "scipy/optimize/b.py",
                "long_context_eval/data/x.py", "kvpress/p.py", "numpy/README.txt"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("x = 1\n")
    assert [f.name for f in sources.pypackages_files(root)] == ["numpy/core/a.py", "scipy/optimize/b.py"]
    with pytest.raises(sources.MissingSource, match="none of numpy"):
        sources.pypackages_files(tmp_path / "empty")
    with pytest.raises(sources.ForbiddenSource, match="RULER package"):
        sources.check_allowed(root / "long_context_eval/data/x.py", (root,))

    assert realtext.TRAINING_FAMILIES == ("pypackages",) and not set(realtext.TRAINING_FAMILIES) & set(realtext.FAMILIES)
    corpus = realtext.load("pypackages")
    files = corpus_module.manifest(corpus)
    assert len(files) >= 500 and {f["name"].split("/")[0] for f in files} <= set(sources.PYPACKAGES)
    assert not any(set(f["name"].split("/")[:-1]) & sources.PYPACKAGES_SKIP_DIRS for f in files)
    text = "\n".join(p for d in corpus.documents[:300] for p in d.paragraphs)
    assert "def " in text and '"""' in text and re.search(r"\b\d+\.\d+\b", text)
    stdlib = sources.stdlib_root().resolve()
    assert not any((sources.purelib_root() / f["name"]).resolve().is_relative_to(stdlib) for f in files[:50])

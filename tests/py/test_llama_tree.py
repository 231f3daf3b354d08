"""scripts/llama_tree.py: the pinned sdist, the patch series, and their failure modes.

The real series is checked against a freshly extracted tree of the real sdist; the failure modes
use small fixture sdists and patches made here, never the real files broken on purpose.
"""
from __future__ import annotations

import hashlib
import io
import sys
import tarfile
from pathlib import Path

import llama_tree
import pytest
from conftest import REPO, run

SCRIPT = REPO / "scripts" / "llama_tree.py"
CMAKELISTS = "cmake_minimum_required(VERSION 3.14)\nproject(fixture C)\nadd_library(fixture fixture.c)\n"


def make_sdist(path: Path, files: dict[str, str], top: str = "llama_cpp_python-0.3.36") -> str:
    """Write a .tar.gz shaped like the llama-cpp-python sdist; return its sha256."""
    with tarfile.open(path, "w:gz") as tar:
        for rel, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"{top}/{rel}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return hashlib.sha256(path.read_bytes()).hexdigest()


def make_patch(tree: Path, patches: Path, rel: str, new_text: str, message: str) -> None:
    """Commit an edit in a prepared tree and export the series, as a developer would."""
    (tree / rel).write_text(new_text)
    llama_tree.git(tree, "commit", "-q", "-am", message,
                   env_extra={"GIT_AUTHOR_NAME": "dev", "GIT_AUTHOR_EMAIL": "dev@localhost"})
    assert llama_tree.main(["export", "--tree", str(tree), "--patches", str(patches)]) == 0


def cli(*args: str):
    return run([sys.executable, SCRIPT, *args], timeout=300)


@pytest.fixture
def fixture_sdist(tmp_path):
    sdist = tmp_path / "fixture.tar.gz"
    sha = make_sdist(sdist, {
        "pyproject.toml": "[project]\nname='x'\n",
        "vendor/llama.cpp/CMakeLists.txt": CMAKELISTS,
        "vendor/llama.cpp/fixture.c": "int fixture(void) { return 1; }\n",
        "vendor/llama.cpp/.git": "gitdir: ../../.git/modules/vendor/llama.cpp\n",
    })
    return sdist, sha


# --- the real series ---------------------------------------------------------------------------

def test_series_applies_to_fresh_tree_and_regenerates_identically(tmp_path):
    sdist = llama_tree.fetch_sdist(llama_tree.default_cache_dir(), llama_tree.SDIST_SHA256)
    tree = tmp_path / "third_party" / "llama.cpp"  # as in a fresh clone: the parent does not exist yet
    patches = REPO / "patches"
    llama_tree.prepare(tree, patches, sdist, llama_tree.SDIST_SHA256, force=False)
    assert not (tree / ".git").is_file(), "the vendored .git pointer file must not be extracted"
    n_patches = len(llama_tree.list_patches(patches))
    assert n_patches >= 1
    log = llama_tree.git(tree, "log", "--format=%s", f"{llama_tree.BASE_TAG}..HEAD").stdout.split("\n")
    assert len([row for row in log if row]) == n_patches
    regen = llama_tree.format_series(tree, tmp_path / "regen")
    assert [p.name for p in regen] == [p.name for p in llama_tree.list_patches(patches)]
    for new in regen:
        assert new.read_bytes() == (patches / new.name).read_bytes(), f"{new.name} regenerates differently"
    # fixed committer identity, committer date = the patch's author date (the pristine commit has a
    # fixed date): every machine gets the same commits (stable build info, ccache hits)
    rows = [r for r in llama_tree.git(tree, "log", "--format=%cn|%ce|%cI|%aI", "HEAD").stdout.split("\n") if r]
    for row in rows:
        name, email, committed, authored = row.split("|")
        assert (name, email) == ("locret", "locret@localhost") and committed == authored, row
    pristine = rows[-1]
    assert pristine.endswith("|2000-01-01T00:00:00+00:00|2000-01-01T00:00:00+00:00"), pristine


def test_build_tree_has_not_drifted_from_patches():
    proc = cli("check")
    assert proc.returncode == 0, proc.stderr


# --- failure modes, with fixtures --------------------------------------------------------------

def test_wrong_sdist_hash_is_refused(tmp_path, fixture_sdist):
    sdist, _ = fixture_sdist
    tree = tmp_path / "tree"
    proc = cli("prepare", "--sdist", str(sdist), "--sha256", "0" * 64, "--tree", str(tree),
               "--patches", str(REPO / "patches"))
    assert proc.returncode == 1
    assert "sha256" in proc.stderr and "expected " + "0" * 64 in proc.stderr, proc.stderr
    assert not tree.exists()


def test_unreadable_sdist_is_refused(tmp_path):
    bogus = tmp_path / "bogus.tar.gz"
    bogus.write_bytes(b"this is not a tarball")
    sha = hashlib.sha256(bogus.read_bytes()).hexdigest()
    proc = cli("prepare", "--sdist", str(bogus), "--sha256", sha, "--tree", str(tmp_path / "tree"),
               "--patches", str(REPO / "patches"))
    assert proc.returncode == 1
    assert "not a readable .tar.gz" in proc.stderr, proc.stderr


def test_patch_that_does_not_apply_names_patch_and_hunk(tmp_path, fixture_sdist):
    # the real series against a tree whose src/CMakeLists.txt is not llama.cpp's
    sdist, sha = fixture_sdist
    other = tmp_path / "other.tar.gz"
    sha = make_sdist(other, {"vendor/llama.cpp/src/CMakeLists.txt": "add_library(llama llama.cpp)\n"})
    tree = tmp_path / "tree"
    proc = cli("prepare", "--sdist", str(other), "--sha256", sha, "--tree", str(tree),
               "--patches", str(REPO / "patches"))
    assert proc.returncode == 1
    first = llama_tree.list_patches(REPO / "patches")[0].name
    assert f"patch {first} does not apply" in proc.stderr, proc.stderr
    assert "hunk at src/CMakeLists.txt:" in proc.stderr, proc.stderr
    assert "+    include(${LOCRET_GGML_EXT_DIR}/llama-ext.cmake)" in proc.stderr, proc.stderr
    assert not tree.exists(), "a failed prepare must not leave a half-patched tree behind"
    assert "Traceback" not in proc.stderr


def test_prepare_is_idempotent_and_follows_patch_changes(tmp_path, fixture_sdist):
    sdist, sha = fixture_sdist
    tree, patches = tmp_path / "tree", tmp_path / "patches"
    patches.mkdir()
    args = ["prepare", "--sdist", str(sdist), "--sha256", sha, "--tree", str(tree), "--patches", str(patches)]
    assert cli(*args).returncode == 0
    make_patch(tree, patches, "fixture.c", "int fixture(void) { return 2; }\n", "fixture: return 2")
    head = llama_tree.git(tree, "rev-parse", "HEAD").stdout

    again = cli(*args)
    assert again.returncode == 0 and "up to date" in again.stderr, again.stderr
    assert llama_tree.git(tree, "rev-parse", "HEAD").stdout == head

    # a changed series (as after `git pull`) is re-applied onto the pristine tree
    patch = next(patches.glob("*.patch"))
    patch.write_text(patch.read_text().replace("return 2", "return 3"))
    assert cli(*args).returncode == 0
    assert (tree / "fixture.c").read_text() == "int fixture(void) { return 3; }\n"

    # uncommitted work in the tree is never thrown away silently
    (tree / "fixture.c").write_text("int fixture(void) { return 4; }\n")
    patch.write_text(patch.read_text().replace("return 3", "return 5"))
    refused = cli(*args)
    assert refused.returncode == 1 and "uncommitted changes" in refused.stderr, refused.stderr
    assert (tree / "fixture.c").read_text() == "int fixture(void) { return 4; }\n"


def test_unexported_commits_are_not_discarded(tmp_path, fixture_sdist):
    sdist, sha = fixture_sdist
    tree, patches = tmp_path / "tree", tmp_path / "patches"
    patches.mkdir()
    args = ["prepare", "--sdist", str(sdist), "--sha256", sha, "--tree", str(tree), "--patches", str(patches)]
    assert cli(*args).returncode == 0
    (tree / "fixture.c").write_text("int fixture(void) { return 7; }\n")
    llama_tree.git(tree, "commit", "-q", "-am", "not exported yet")
    proc = cli(*args)
    # the stamp still matches patches/, but HEAD moved: the developer must export first
    assert proc.returncode == 1 and "export" in proc.stderr, proc.stderr
    drift = cli("check", "--tree", str(tree), "--patches", str(patches))
    assert drift.returncode == 1 and "in the tree, missing from" in drift.stderr, drift.stderr


def test_check_detects_an_edited_patch(tmp_path, fixture_sdist):
    sdist, sha = fixture_sdist
    tree, patches = tmp_path / "tree", tmp_path / "patches"
    patches.mkdir()
    assert cli("prepare", "--sdist", str(sdist), "--sha256", sha, "--tree", str(tree),
               "--patches", str(patches)).returncode == 0
    make_patch(tree, patches, "fixture.c", "int fixture(void) { return 2; }\n", "fixture: return 2")
    assert cli("check", "--tree", str(tree), "--patches", str(patches)).returncode == 0
    patch = next(patches.glob("*.patch"))
    patch.write_text(patch.read_text().replace("fixture: return 2", "fixture: edited by hand"))
    proc = cli("check", "--tree", str(tree), "--patches", str(patches))
    assert proc.returncode == 1 and "differs from what the tree regenerates" in proc.stderr, proc.stderr

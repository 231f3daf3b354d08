"""Top-level CMake configuration: options that must be refused, and the CUDA switch."""
from __future__ import annotations

from conftest import REPO, run


def test_cuda_without_architectures_is_refused(tmp_path):
    proc = run(["cmake", "-S", REPO, "-B", tmp_path / "b", "-DLOCRET_CUDA=ON"], timeout=120)
    assert proc.returncode != 0
    assert "LOCRET_CUDA=ON needs CMAKE_CUDA_ARCHITECTURES" in proc.stderr, proc.stderr[-2000:]


def test_configure_without_a_prepared_tree_says_how_to_make_one(tmp_path):
    proc = run(["cmake", "-S", REPO, "-B", tmp_path / "b", f"-DLOCRET_LLAMA_DIR={tmp_path / 'missing'}"],
               timeout=120)
    assert proc.returncode != 0
    assert "no prepared llama.cpp tree" in proc.stderr and "scripts/setup.sh" in proc.stderr, proc.stderr[-2000:]


def test_setup_rejects_bad_arguments():
    for args, message in [(["--bogus"], "unknown option '--bogus'"),
                          (["--cuda", "sm89"], "not a CUDA architecture list"),
                          (["--cuda"], "--cuda needs an architecture")]:
        proc = run(["bash", REPO / "scripts" / "setup.sh", *args], timeout=60)
        assert proc.returncode == 2, (args, proc.stderr)
        assert message in proc.stderr, (args, proc.stderr)

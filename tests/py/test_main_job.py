"""The main job's bundled document is exactly what its generator writes, and holds its fact once."""
from __future__ import annotations

import sys

from conftest import REPO, run


def test_bundled_document_is_reproducible_and_holds_the_fact_once(tmp_path):
    out = tmp_path / "doc.txt"
    proc = run([sys.executable, REPO / "scripts" / "make_long_document.py", "-o", out], timeout=60)
    assert proc.returncode == 0, proc.stderr
    bundled = (REPO / "scripts" / "data" / "harbor-log.txt").read_text()
    assert out.read_text() == bundled
    assert bundled.count("4-7-2-9") == 1
    depth = bundled.index("4-7-2-9") / len(bundled)
    assert 0.3 < depth < 0.5
    assert len(bundled) > 120_000  # ~37K tokens for SmolLM2: well past its 8K window

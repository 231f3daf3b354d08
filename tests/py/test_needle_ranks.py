"""The survival forecast (convert/needle_ranks.py, locret.train.needle_ranks): ranks against
numpy, the tool's report against an independent recomputation on the default model, and refusals."""
from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, THREADS, run

TOOL = REPO / "convert" / "needle_ranks.py"


def _numpy_rank_shares(scores: np.ndarray, positions: list[int]) -> np.ndarray:
    """Explicit loop: a position's rank is how many positions score higher, plus earlier ties."""
    n_head, n = scores.shape
    out = np.zeros((n_head, len(positions)))
    for h in range(n_head):
        for j, p in enumerate(positions):
            above = sum(1 for q in range(n) if scores[h, q] > scores[h, p] or (scores[h, q] == scores[h, p] and q < p))
            out[h, j] = above / n
    return out


def test_rank_shares_match_a_counting_reference():
    import torch
    from locret.train.needle_ranks import NeedleRanks, rank_shares

    rng = np.random.default_rng(3)
    scores = rng.normal(size=(3, 200)).astype(np.float32)
    scores[1, 50:60] = 0.25  # ties, broken by position
    positions = [0, 7, 50, 55, 59, 199]
    got = rank_shares(torch.from_numpy(scores), positions)
    np.testing.assert_array_equal(got, _numpy_rank_shares(scores, positions))

    shares = np.array([[[0.01, 0.2]], [[0.04, 0.05]]])  # 2 layers, 1 KV head, 2 digits
    needle = np.concatenate([shares, [[[0.5]], [[0.9]]]], axis=2)  # and one more needle token
    r = NeedleRanks("p", "h", needle, digits=[0, 1])
    np.testing.assert_array_equal(r.shares, shares)
    assert r.inside(0.06) == 0.75 and r.pairs_holding_all(0.06) == 1 and r.layers_inside(0.06).tolist() == [0.5, 1.0]
    assert r.needle_inside(0.06) == 0.5


def _in_process(argv: list) -> tuple[int, str, str]:
    """The tool's main() (what convert/needle_ranks.py calls) in this process: exit status, stdout, stderr. An
    exception that is not a refusal escapes and fails the test, as a traceback on stderr would."""
    from locret.train import needle_ranks_cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = needle_ranks_cli.main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


def test_the_report_matches_a_recomputation(model_path, tmp_path, monkeypatch):
    """Random heads on the evaluation's own prompt: the tool's digit ranks equal ranks recomputed here from
    the heads module's scores, and the digit tokens it found spell the key."""
    import torch
    from locret.evaluation import items
    from locret.train import needle_ranks_cli
    from locret.train.backbone import load_backbone
    from locret.train.heads_model import RetainingHeads
    from safetensors.torch import save_file

    backbone = load_backbone(model_path, threads=THREADS)
    heads = RetainingHeads(backbone.n_layer, backbone.d_in, 32, backbone.n_head_kv, backbone.activation, seed=4)
    ckpt = tmp_path / "heads.safetensors"
    save_file({k: v.contiguous() for k, v in heads.checkpoint_tensors().items()}, str(ckpt))

    # The tool runs in this process and its load_backbone call gets the backbone loaded above with the same
    # arguments: dequantizing SmolLM2 once instead of twice is most of this test's time. The refusals below run
    # the script itself.
    calls = []

    def shared_backbone(source, threads=None, device="cpu"):
        assert Path(source) == Path(model_path) and threads == THREADS and device == "cpu", (source, threads, device)
        calls.append(source)
        return backbone

    monkeypatch.setattr(needle_ranks_cli, "load_backbone", shared_backbone)
    out = tmp_path / "ranks.json"
    code, stdout, stderr = _in_process(["--model", model_path, "--heads", ckpt, "--length", "600", "--depths", "0.5",
                                        "--keep", "0.3,0.1", "--threads", str(THREADS), "--json", out])
    assert code == 0, stderr[-3000:]
    assert len(calls) == 1
    assert "passkey-600-d0.50" in stdout and "labels" in stdout
    report = json.loads(out.read_text())
    by_source = {r["source"]: r for r in report["records"]}
    assert set(by_source) == {"labels", str(ckpt)}

    vocab = items.vocab_model(str(model_path))
    item = items.task_items(vocab, ["passkey"], [600], [0.5], 1, seed=0)[0]
    _, start, end = item.extra["needles"][0]
    tokens = list(item.tokens)
    digits = [i for i in range(start, end) if vocab.detokenize([tokens[i]]).decode().strip().isdigit()]
    spelled = "".join(vocab.detokenize([tokens[i]]).decode().strip() for i in digits)
    vocab.close()
    assert spelled == item.answers[0] * 2  # the needle states the key twice
    assert by_source[str(ckpt)]["digits"] == len(digits)

    answer = backbone.tokenizer.encode(item.answers[0], add_special_tokens=False)
    features = backbone.features(tokens + answer, len(tokens))
    with torch.no_grad():
        want = np.stack([_numpy_rank_shares(heads.layer_scores(l, x).numpy(), digits)
                         for l, x in enumerate(features.inputs)])
    got = np.array(by_source[str(ckpt)]["shares"])
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert by_source[str(ckpt)]["inside"]["0.1"] == pytest.approx(float((want < 0.1).mean()))
    with torch.no_grad():
        needle = np.stack([_numpy_rank_shares(heads.layer_scores(l, x).numpy(), list(range(start, end)))
                           for l, x in enumerate(features.inputs)])
    assert by_source[str(ckpt)]["needle_inside"]["0.3"] == pytest.approx(float((needle < 0.3).mean()))


@pytest.mark.parametrize("args,needle", [
    (["--heads", "missing.safetensors"], "--heads missing.safetensors: no such file or directory"),
    (["--heads", TOOL, "--keep", "1.5"], "--keep shares must be in (0, 1)"),
    (["--heads", TOOL, "--depths", "half"], "comma separated numbers"),
    (["--heads", TOOL], "unknown file type"),
    (["--heads", "TRUNCATED"], "not a readable safetensors"),
])
def test_bad_input_is_refused(model_path, tmp_path, args, needle):
    """Each refusal through the tool's main() in this process; the first case also through the script itself
    (exit status 1, one line, no traceback)."""
    truncated = tmp_path / "heads.safetensors"
    truncated.write_bytes(b"\x40\x00\x00\x00\x00\x00\x00\x00{\"model.layers.0")
    args = [truncated if a == "TRUNCATED" else a for a in args]
    code, _, stderr = _in_process(["--model", model_path, "--length", "600", *args])
    assert code == 1 and needle in stderr, stderr[-2000:]
    assert "needle_ranks: error:" in stderr and "Traceback" not in stderr
    if args[:2] == ["--heads", "missing.safetensors"]:
        proc = run([sys.executable, TOOL, "--model", model_path, "--length", "600", *map(str, args)], timeout=300)
        assert proc.returncode == 1 and needle in proc.stderr, proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr

"""CIS computed in llama.cpp's graph match an independent PyTorch reference.

Random heads in the published Locret checkpoint format go through our converter into GGUF;
llama.cpp computes the scores of a >= 512-token input in its graph; PyTorch + transformers
computes them from the dequantized model in Hugging Face order (tests/py/reference_cis.py).
The converter's Q/K permutation is what makes the two agree: heads exported without it must fail
the same check, which proves the check can tell. The same check holds for an evicting context (a budget) that reads
the input's last tokens one at a time, as generation does: those are scored over the stacked heads (every layer at
once, locret-graph.cpp), the prompt layer by layer. Gemma-3-270M gets the same check (NEOX rope: nothing permuted;
GELU heads; one KV head).
"""
from __future__ import annotations

import contextlib
import io

import numpy as np
import pytest
from conftest import THREADS, natural_text
from reference_cis import load_hf_model, reference_scores, spearman

MIN_RANK_CORRELATION = 0.99
N_TOKENS = 600
UBATCH = 256  # several ubatches, so the recorder's stitching is checked too
N_SINGLE = 48  # the last tokens, one ubatch each in the evicting context


def _convert(*args) -> None:
    """The converter's command line (the main() of convert/heads_to_gguf.py) in this process: a subprocess per
    step would spend most of its time importing torch. The script itself is run by test_convert.py."""
    from locret.convert import cli

    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = cli.main([str(a) for a in args])
    assert code == 0, err.getvalue()[-3000:]


@pytest.fixture(scope="module")
def parity(tmp_path_factory, model_path):
    import locret  # noqa: F401  (points llama_cpp at our library)
    import llama_cpp
    from safetensors.torch import load_file

    from locret import heads

    work = tmp_path_factory.mktemp("parity")
    ckpt = work / "random-heads.safetensors"
    _convert("make-random", "--base", model_path, "--d-r", "256", "--seed", "0", "-o", ckpt)
    good, unpermuted = work / "heads.gguf", work / "heads-unpermuted.gguf"
    _convert("--base", model_path, "--heads", ckpt, "-o", good)
    _convert("--base", model_path, "--heads", ckpt, "-o", unpermuted, "--skip-qk-permutation")
    weights = {k: v.float().numpy() for k, v in load_file(str(ckpt)).items()}

    llm = llama_cpp.Llama(model_path=str(model_path), n_ctx=1024, n_batch=1024, n_ubatch=UBATCH,
                          n_threads=THREADS, n_threads_batch=THREADS, verbose=False)
    tokens = llm.tokenize(natural_text().encode())[:N_TOKENS]
    assert len(tokens) == N_TOKENS

    def llama_scores(path):
        heads.attach(llm, path)
        heads.record_scores(llm)
        llm.reset()
        llm.eval(tokens)
        scores, positions = heads.recorded_scores(llm)
        heads.record_scores(llm, False)
        heads.detach(llm)
        assert positions.tolist() == list(range(N_TOKENS))
        return scores

    got = llama_scores(good)
    got_unpermuted = llama_scores(unpermuted)
    llm.close()

    # an evicting context whose budget holds the whole input (nothing is evicted, so every token's attention is the
    # reference's), the prompt in ubatches, then token by token
    from locret.llama import Llama

    evicting = Llama(model_path=str(model_path), n_ctx=1024, n_batch=UBATCH, n_ubatch=UBATCH, n_threads=THREADS, n_threads_batch=THREADS,
                     locret_heads=str(good), locret_budget=1024, locret_pool=0, verbose=False)
    heads.record_scores(evicting)
    evicting.eval(tokens[:-N_SINGLE])
    for t in tokens[-N_SINGLE:]:
        evicting.eval([t])
    got_evicting, positions = heads.recorded_scores(evicting)
    assert positions.tolist() == list(range(N_TOKENS)) and evicting.locret_stats()["n_evictions"] == 0
    evicting.close()
    want = reference_scores(load_hf_model(model_path), tokens, weights)
    return got, got_unpermuted, want, got_evicting


def _report(got, want):
    n_layer, n_head_kv, _ = want.shape
    corr = np.array([[spearman(got[il, h], want[il, h]) for h in range(n_head_kv)] for il in range(n_layer)])
    return corr, float(np.abs(got - want).max()), float(np.abs(want).max())


def test_llama_cpp_scores_match_the_pytorch_reference(parity):
    got, _, want, _ = parity
    assert got.shape == want.shape == (30, 3, N_TOKENS)
    corr, max_abs, scale = _report(got, want)
    print(f"\nCIS parity (SmolLM2-135M Q4_1, {N_TOKENS} tokens, random heads d_R=256): "
          f"max |llama.cpp - torch| = {max_abs:.4g} (max |score| {scale:.4g}); "
          f"rank correlation min {corr.min():.5f}, median {np.median(corr):.5f}")
    worst = np.unravel_index(np.argmin(corr), corr.shape)
    assert corr.min() >= MIN_RANK_CORRELATION, f"layer {worst[0]} head {worst[1]}: rank correlation {corr.min():.4f}"


def test_heads_without_the_qk_permutation_fail_the_same_check(parity):
    _, got_unpermuted, want, _ = parity
    corr, max_abs, _ = _report(got_unpermuted, want)
    failing = int((corr < MIN_RANK_CORRELATION).sum())
    print(f"\nwithout the Q/K permutation: {failing}/{corr.size} (layer, head) pairs below "
          f"{MIN_RANK_CORRELATION}, rank correlation min {corr.min():.4f}, max |diff| {max_abs:.4g}")
    assert failing > corr.size // 2, "the parity check cannot tell permuted from unpermuted heads"


def test_generated_tokens_scored_over_the_stacked_heads_match_the_pytorch_reference(parity):
    got, _, want, got_evicting = parity
    corr, max_abs, _ = _report(got_evicting, want)
    single = np.s_[:, :, -N_SINGLE:]
    err_single = float(np.abs(got_evicting[single] - want[single]).max())
    err_prompt = float(np.abs(got[single] - want[single]).max())
    print(f"\nevicting context, the last {N_SINGLE} tokens one at a time: max |llama.cpp - torch| {err_single:.4g} "
          f"(the same tokens in a prompt: {err_prompt:.4g}); rank correlation over all {N_TOKENS} min {corr.min():.5f}")
    assert corr.min() >= MIN_RANK_CORRELATION
    # the single tokens' scores are as close to the reference as the prompt's scores of the same tokens (both
    # differ from it by the quantized model's rounding, not by a wrong layer or head)
    assert err_single <= 2 * err_prompt + 1e-3


def test_gemma_scores_match_the_pytorch_reference(tmp_path):
    """The same check on Gemma-3-270M, where what differs from SmolLM2 is Gemma's own: NEOX rope (the converter
    leaves W1's columns as they are), 256-wide heads, 4 query heads on 1 KV head, GELU heads, and Q and K taken before
    its q/k norms. Every layer is scored in llama.cpp, the 15 sliding-window layers' heads too."""
    import locret  # noqa: F401  (points llama_cpp at our library)
    import llama_cpp
    from safetensors.torch import load_file

    from locret import heads, models

    if not models.is_installed("gemma3-270m"):
        pytest.skip("gemma3-270m is not installed")
    gemma = models.resolve("gemma3-270m", fetch=False)
    ckpt, good = tmp_path / "gemma-heads.safetensors", tmp_path / "gemma-heads.gguf"
    _convert("make-random", "--base", gemma, "--d-r", "256", "--seed", "0", "-o", ckpt)
    _convert("--base", gemma, "--heads", ckpt, "-o", good)
    weights = {k: v.float().numpy() for k, v in load_file(str(ckpt)).items()}

    llm = llama_cpp.Llama(model_path=str(gemma), n_ctx=1024, n_batch=1024, n_ubatch=UBATCH, n_threads=THREADS,
                          n_threads_batch=THREADS, verbose=False)
    tokens = llm.tokenize(natural_text().encode())[:N_TOKENS]
    heads.attach(llm, good)
    heads.record_scores(llm)
    llm.eval(tokens)
    got, positions = heads.recorded_scores(llm)
    llm.close()
    assert positions.tolist() == list(range(N_TOKENS))
    want = reference_scores(load_hf_model(gemma), tokens, weights)
    assert got.shape == want.shape == (18, 1, N_TOKENS)
    corr, max_abs, scale = _report(got, want)
    print(f"\nCIS parity (Gemma-3-270M, {N_TOKENS} tokens, random heads d_R=256): max |llama.cpp - torch| = "
          f"{max_abs:.4g} (max |score| {scale:.4g}); rank correlation min {corr.min():.5f}")
    worst = np.unravel_index(np.argmin(corr), corr.shape)
    assert corr.min() >= MIN_RANK_CORRELATION, f"layer {worst[0]} head {worst[1]}: rank correlation {corr.min():.4f}"

"""The patched llama.cpp tools run the default model."""
from __future__ import annotations

from conftest import THREADS, run, tool

# greedy sampling with a fixed seed: the output must not depend on anything but the model and prompt
GREEDY = ["--temp", "0", "--seed", "42", "-n", "24", "-c", "512", "-t", str(THREADS)]
CHAT_PROMPT = "What is the capital of France? Answer in one word."


def _cli(model_path, transcript):
    # llama-cli is the chat UI: its stdout carries banners and timings, so compare the transcript
    # it writes with -o (the user turn and the assistant's answer)
    return run([tool("llama-cli"), "-m", model_path, "-p", CHAT_PROMPT, "-st", "--simple-io",
                "--no-show-timings", "--log-disable", "-o", transcript, *GREEDY])


def test_llama_cli_generates_deterministic_text(model_path, tmp_path):
    runs = []
    for i in range(2):
        transcript = tmp_path / f"run{i}.txt"
        proc = _cli(model_path, transcript)
        assert proc.returncode == 0, proc.stderr[-3000:]
        text = transcript.read_text()
        answer = text.split("Assistant:\n", 1)[-1].strip()
        assert answer, f"llama-cli generated nothing:\n{text}\nstderr:\n{proc.stderr[-3000:]}"
        assert answer in proc.stdout
        runs.append(text)
    assert runs[0] == runs[1], "greedy generation with a fixed seed differs between two runs"
    # SmolLM2-135M-Instruct knows this one; a broken library produces something else
    assert "Paris" in runs[0], runs[0]


def test_llama_completion_generates_deterministic_text(model_path):
    # llama-completion prints only the generated text on stdout (logs go to stderr)
    cmd = [tool("llama-completion"), "-m", model_path, "-p", "The capital of France is", "-no-cnv",
           "--no-display-prompt", *GREEDY]
    first, second = run(cmd), run(cmd)
    assert first.returncode == 0, first.stderr[-3000:]
    assert first.stdout.strip(), "llama-completion printed nothing"
    assert first.stdout == second.stdout, "greedy generation with a fixed seed differs between two runs"
    assert first.stdout.lstrip().startswith("Paris"), first.stdout


def test_llama_cli_refuses_a_truncated_model_without_crashing(model_path, tmp_path):
    truncated = tmp_path / "truncated.gguf"
    with open(model_path, "rb") as src:
        truncated.write_bytes(src.read(4 << 20))
    proc = run([tool("llama-cli"), "-m", truncated, "-p", CHAT_PROMPT, "-st", "--simple-io", *GREEDY], timeout=120)
    # a clean error exit (positive status), not a signal (negative status) or success
    assert proc.returncode > 0, (proc.returncode, proc.stderr[-2000:])

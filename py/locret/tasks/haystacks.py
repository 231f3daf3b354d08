"""Haystack families: the kinds of long text a needle task can hide its needles in.

A task's ``generate(..., haystack="code")`` takes its filler from ``units("code", rng)`` instead of the plain
prose, so the same needles and question can be asked over prose, source code, licence clauses or server logs
(eviction scores tokens differently in each: code and logs repeat their structure, legal text its phrases).

- ``prose``: the plain sentences of filler.py through haystack.sentence_stream, exactly as before (a task
  with its own prose, such as passkey, passes it as ``prose=``).
- ``code``: small Python-like units (imports, comments, assignments, functions, classes, loops) built from
  templates with identifiers drawn from word lists; each unit is whole lines and ends with a newline.
- ``legal``: licence and contract clauses of our own wording (not copied from any real licence), built
  from templates and phrase lists; each unit is one sentence ending with a full stop, like prose.
- ``logs``: server and application log lines, "[late morning] warn db.pool: ...": the time of day is in
  words and the level in lower case; each unit is one or two lines ending with a newline.

Every unit is whole: haystack.assemble joins units with a space and places needles only between them.
Like filler.py, the generated families carry nothing a task asks about: no digits anywhere (needles carry
numbers, so every number in a prompt is a needle's), no hyphens (niah keys are "adjective-noun"), no words
of five capital letters (variable_tracking's names), none of niah's adjectives and nouns, none of long_qa's
names, trades, animals, months or professions (not even inside a longer word: "cooper" is in
"cooperate"), no capitalised word that could be one of long_qa's invented pet names, and none of the task
words ("archive", "passkey", "key", "number", "value", "variable", ...). tests/py/test_haystacks.py checks
all of this on the streams themselves.

Variety: a generated family goes through its templates in a fresh seeded order on every pass and fills each
template's slots from word lists, so a 128K-token haystack is not a short loop (the first two thousand units
are almost all distinct), and no unit comes twice in a row. The same rng state gives the same stream.
"""
from __future__ import annotations

import random
import re
from typing import Iterator, Mapping, Sequence

from . import filler
from .haystack import sentence_stream

FAMILIES = ("prose", "code", "legal", "logs")

# A slot in a template: {name} or {name:x} (a second, different choice from the same list, used where one
# unit needs two words of a kind); {Name} capitalises the word. One slot name has one word per unit.
_SLOT = re.compile(r"\{([A-Za-z]+)(?::([a-z]))?\}")

# ------------------------------------------------------------------ code

_CODE_WORDS: dict[str, tuple[str, ...]] = {
    "verb": ("load", "parse", "build", "merge", "flush", "render", "fetch", "split", "scan", "sort", "clean",
             "pack", "unpack", "drain", "collect", "format", "encode", "decode", "resolve", "normalize",
             "validate", "compact", "refresh", "prune", "wrap", "emit", "apply", "close", "open", "read",
             "write", "send", "poll", "join", "filter", "group", "gather", "trim", "shift", "patch", "match",
             "restore", "stage", "publish", "queue", "retry", "schedule", "rename"),
    "noun": ("item", "record", "chunk", "batch", "page", "line", "token", "frame", "packet", "buffer", "block",
             "node", "edge", "path", "field", "row", "column", "header", "message", "request", "event", "task",
             "job", "worker", "stream", "file", "folder", "handle", "socket", "session", "option", "rule",
             "pattern", "label", "tag", "note", "span", "window", "slot", "segment", "bucket", "shard",
             "profile", "account", "order", "ticket", "cursor", "offset", "limit", "report", "image", "user",
             "group", "channel", "layer", "module", "sample", "document", "template", "domain"),
    "arg": ("items", "rows", "lines", "parts", "chunks", "pending", "seen", "result", "out", "text", "name",
            "path", "source", "target", "prefix", "suffix", "sep", "options", "settings", "cache", "store",
            "state", "ctx", "parent", "child", "left", "right", "head", "tail", "first", "rest", "size", "width",
            "step", "total", "count", "data", "payload", "config", "origin", "queue", "buf", "current", "extra",
            "done", "todo", "batch", "spec", "entry", "default"),
    "attr": ("name", "size", "path", "owner", "kind", "status", "parent", "children", "label", "title",
             "created", "updated", "enabled", "visible", "weight", "width", "height", "encoding", "mode",
             "timeout", "retries", "priority", "source", "target", "tags", "flags", "ready"),
    "module": ("os", "re", "json", "shutil", "logging", "itertools", "functools", "collections", "pathlib",
               "textwrap", "string", "heapq", "bisect", "operator", "contextlib", "dataclasses", "typing",
               "tempfile", "hashlib", "fnmatch", "argparse", "threading", "queue", "weakref", "enum"),
    "error": ("LookupError", "TypeError", "RuntimeError", "IndexError", "OSError", "AttributeError",
              "PermissionError", "TimeoutError", "NotImplementedError", "ConnectionError", "UnicodeError"),
    "empty": ("[]", "dict()", "set()", "\"\"", "False", "tuple()", "list()"),
    "flag": ("True", "False"),
    "method": ("append", "extend", "pop", "get", "update", "strip", "lower", "upper", "split", "copy",
               "clear", "add", "discard", "remove", "sort", "reverse", "rstrip", "lstrip", "casefold"),
    "adj": ("pending", "stale", "empty", "broken", "duplicate", "unused", "partial", "cached",
            "missing", "expired", "locked", "invalid", "orphaned", "dirty", "queued", "skipped", "disabled"),
}

_CODE_TEMPLATES = (
    "import {module}\n",
    "from {module} import {verb}_{noun}, {verb:b}_{noun:b}\n",
    "# {Verb} the {adj} {noun}s before the {noun:b} is closed.\n",
    "# Callers must hold the {noun} lock while they {verb} the {noun:b}s.\n",
    "{arg} = {verb}_{noun}({arg:b}, strict={flag})\n",
    "{arg} = [{noun} for {noun} in {arg:b} if {noun}.{attr}]\n",
    "{arg} = sorted({arg:b}, reverse={flag})\n",
    "{arg}.{method}({arg:b})\n",
    "self._{noun}s = {empty}\n",
    "def {verb}_{noun}s({arg}, {arg:b}):\n"
    "    for {noun} in {arg}:\n"
    "        {arg:b}.append({verb:b}_{noun}({noun}))\n"
    "    return {arg:b}\n",
    "def {verb}_{noun}(self, {arg}):\n"
    "    \"\"\"{Verb} one {noun} from {arg}.\"\"\"\n"
    "    return self.{noun:b}.{verb}({arg})\n",
    "class {Noun}{Noun:b}:\n"
    "    \"\"\"Holds the {noun:b}s of one {noun}.\"\"\"\n"
    "\n"
    "    def __init__(self, {arg}):\n"
    "        self.{arg} = {arg}\n"
    "        self._{noun:b}s = {empty}\n",
    "@property\n"
    "def {attr}(self):\n"
    "    return self._{noun}.{attr}\n",
    "try:\n"
    "    {arg} = {verb}_{noun}({arg:b})\n"
    "except {error}:\n"
    "    {arg} = {empty}\n",
    "with open({arg}) as handle:\n"
    "    {arg:b} = handle.read().split()\n",
    "if not {arg}:\n"
    "    return {empty}\n",
    "if {arg}.{attr} and not {arg}.{attr:b}:\n"
    "    raise {error}(\"{adj} {noun} in \" + {arg:b})\n",
    "for {noun}, {noun:b} in zip({arg}, {arg:b}):\n"
    "    {noun}.{attr} = {noun:b}.{attr}\n",
    "while {arg}:\n"
    "    {noun} = {arg}.pop()\n"
    "    {verb}_{noun}({noun}, {arg:b})\n",
    "logger.debug(\"{verb} {noun} for %s\", {arg})\n",
    "logger.warning(\"{adj} {noun} in %s, skipped\", {arg}.{attr})\n",
    "assert {arg} is not {arg:b}, \"{noun} must not alias its {noun:b}\"\n",
    "return {verb}_{noun}({arg}) or {empty}\n",
    "{arg}.{attr} = {arg:b}.{attr} or {arg}.{attr:b}\n",
    "def _is_{adj}({noun}):\n"
    "    return bool({noun}.{attr}) and not {noun}.{attr:b}\n",
    "@dataclass\n"
    "class {Noun}{Adj}:\n"
    "    {attr}: str\n"
    "    {attr:b}: bool = {flag}\n",
    "{arg} = {module}.{verb}({arg:b})\n",
    "yield from ({verb}_{noun}({noun}) for {noun} in {arg})\n",
    "{arg} = dict(zip({arg:b}, map({verb}_{noun}, {arg:b})))\n",
    "def __repr__(self):\n"
    "    return \"{Noun}{Noun:b}(\" + repr(self.{attr}) + \")\"\n",
    "if {arg} in self._{noun}s:\n"
    "    continue\n",
    "with self._{noun}_lock:\n"
    "    self._{noun}s.{method}({arg})\n",
    "def __len__(self):\n"
    "    return len(self._{noun}s)\n",
    "# TODO: {verb} the {noun}s lazily once the {noun:b} cache is warm.\n",
)

# ------------------------------------------------------------------ legal

_LEGAL_WORDS: dict[str, tuple[str, ...]] = {
    "party": ("the licensee", "the licensor", "the supplier", "the customer", "the contractor", "the recipient",
              "the disclosing party", "the receiving party", "the tenant", "the landlord", "the service provider",
              "the distributor", "the purchaser", "the vendor", "the subscriber", "the owner", "the assignee",
              "the agent", "the principal", "the client"),
    "instrument": ("agreement", "licence", "contract", "lease", "addendum", "arrangement", "memorandum",
                   "undertaking", "deed", "engagement letter"),
    "subject": ("software", "materials", "documentation", "premises", "equipment", "deliverables",
                "confidential information", "source materials", "customer data", "service", "samples",
                "designs", "specifications", "reports", "work product", "licensed content", "goods",
                "prototypes", "training materials", "database"),
    "forbidden": ("copy", "modify", "sublicense", "distribute", "disclose", "sell", "lease", "publish",
                  "reverse engineer", "translate", "adapt", "rent", "lend", "pledge", "export"),
    "permitted": ("use", "install", "display", "reproduce", "evaluate", "access", "store", "run", "inspect",
                  "print"),
    "breach": ("commits a material breach of its obligations", "becomes insolvent",
               "ceases to carry on business", "fails to pay any sum when due",
               "breaches the confidentiality terms", "repeatedly misses agreed deadlines",
               "makes an arrangement with its creditors", "is acquired by a competitor of the other party"),
    "delivery": ("by hand", "by registered post", "by courier", "by electronic mail", "in person",
                 "by recorded delivery"),
    "quality": ("uninterrupted", "free of errors", "fit for any particular purpose", "compatible with other products",
                "secure against every threat", "accurate or complete", "available at all times",
                "suitable for the intended use"),
    "loss": ("indirect or consequential loss", "loss of profit", "loss of data", "loss of goodwill",
             "special or incidental damages", "business interruption", "loss of anticipated savings",
             "damage to reputation"),
    "cause": ("the use or inability to use the service", "any delay in delivery", "the acts of third parties",
              "any defect in the materials", "reliance on any advice given", "any interruption of supply",
              "the loss of any stored content", "the installation of the equipment"),
    "purpose": ("evaluating a possible collaboration", "providing the agreed services",
                "its internal business operations", "complying with its legal duties",
                "supporting its own customers", "performing this agreement", "testing and evaluation",
                "the approved project"),
    "invalid": ("invalid", "unenforceable", "void", "illegal", "ineffective", "contrary to public policy"),
    "charges": ("fees", "charges", "invoiced amounts", "royalties", "expenses", "deposits", "service charges",
                "licence fees"),
    "document": ("invoice", "order form", "statement of work", "purchase order", "schedule", "price list",
                 "quotation"),
    "event": ("events beyond its reasonable control", "fire, flood or storm", "war, riot or civil unrest",
              "strikes or other industrial action", "the failure of public utilities", "an act of government",
              "epidemic or quarantine", "the failure of a carrier"),
    "records": ("all sales of the products", "its use of the service", "the hours worked by its staff",
                "all payments received", "every shipment dispatched", "all copies made of the materials",
                "the locations where the software is installed"),
    "grant": ("limited and revocable", "personal", "worldwide and royalty free", "exclusive", "temporary",
              "nontransferable", "limited"),
    "topic": ("its subject matter", "the supply of the goods", "the provision of the services",
              "the use of the premises", "the licensed materials", "the maintenance of the equipment",
              "the handling of personal data"),
    "prior": ("negotiations and understandings", "proposals and representations",
              "agreements, whether written or oral", "correspondence and drafts"),
    "forum": ("the senior managers of both parties", "a mediator chosen by mutual agreement",
              "an independent expert", "arbitration under rules agreed by both parties",
              "the courts of the place where the agreement was signed"),
    "defect": ("errors", "omissions", "defects", "inaccuracies", "faults", "gaps"),
    "problem": ("any unauthorised use of the materials", "a breach of security", "a defect in the goods",
                "a claim by a third party", "any loss of confidential information",
                "a failure of the equipment", "a conflict of interest"),
    "remedy": ("limiting its effects", "investigating the matter", "taking reasonable steps to resolve it",
               "defending the claim", "restoring the service", "recovering the affected materials"),
    "risk": ("loss or damage to property", "public liability claims", "professional negligence",
             "theft of equipment", "injury to persons", "interruption of business"),
    "period": ("a reasonable period", "the agreed period", "a calendar month", "the notice period",
               "a fortnight", "the period stated in the order form"),
    "standard": ("with reasonable skill and care", "in a timely and professional manner",
                 "in accordance with good industry practice", "in line with the agreed specifications",
                 "in good faith"),
}

_LEGAL_TEMPLATES = (
    "{Party} shall not {forbidden} the {subject} without the prior written consent of {party:b}.",
    "Nothing in this {instrument} grants {party} any right to {forbidden} the {subject}, except as expressly "
    "stated in this {instrument}.",
    "{Party} may end this {instrument} by written notice if {party:b} {breach} and fails to remedy it within "
    "{period}.",
    "Any notice under this {instrument} shall be in writing and delivered {delivery} to the address most "
    "recently given by {party}.",
    "The {subject} is supplied as it stands, and {party} gives no promise that it will be {quality}.",
    "To the extent permitted by applicable law, {party} shall not be liable for any {loss} arising out of "
    "{cause}.",
    "{Party} shall keep the {subject} confidential and shall use it only for {purpose}.",
    "If any provision of this {instrument} is held to be {invalid}, the remaining provisions shall continue "
    "in full force.",
    "This {instrument} shall be governed by the laws of the place where {party} has its principal office.",
    "{Party} shall pay all {charges} within the period stated in the relevant {document}, without deduction "
    "of any kind.",
    "No failure or delay by {party} in exercising any right under this {instrument} shall operate as a waiver "
    "of that right.",
    "{Party} warrants that it has full authority to enter into this {instrument} and to perform its "
    "obligations under it.",
    "Neither party shall be responsible for any failure to perform that is caused by {event}.",
    "{Party} may not assign or transfer any of its rights under this {instrument} without the consent of "
    "{party:b}, which shall not be unreasonably withheld.",
    "Upon termination, {party} shall return or destroy all copies of the {subject} in its possession or "
    "control.",
    "{Party} shall maintain accurate records of {records} and make them available to {party:b} upon "
    "reasonable request.",
    "The headings in this {instrument} are for convenience only and shall not affect its interpretation.",
    "{Party} grants to {party:b} a {grant} licence to {permitted} the {subject} solely for {purpose}.",
    "All rights not expressly granted in this {instrument} are reserved by {party}.",
    "This {instrument} is the entire understanding of the parties concerning {topic} and replaces all prior "
    "{prior}.",
    "{Party} shall comply with all applicable laws and regulations in connection with {topic}.",
    "Any dispute arising from this {instrument} shall first be referred to {forum}.",
    "{Party} acknowledges that the {subject} may contain {defect} and accepts it in its present condition.",
    "Each party shall bear its own costs in connection with the preparation of this {instrument}.",
    "Where {party} discovers {problem}, it shall inform {party:b} without undue delay and assist in {remedy}.",
    "The obligations in this clause shall survive the expiry or termination of this {instrument}.",
    "{Party} shall carry adequate insurance against {risk} for as long as this {instrument} remains in force.",
    "Any amendment to this {instrument} must be made in writing and signed on behalf of each party.",
    "{Party} shall perform its obligations {standard} and shall provide the {subject} {standard:b}.",
    "{Party} shall indemnify {party:b} against all claims, losses and costs arising from {problem}.",
    "Title to the {subject} shall remain with {party} until all {charges} due for it have been paid.",
    "{Party} may suspend the {subject} on reasonable notice if {party:b} {breach}.",
    "References in this {instrument} to {party} include its permitted successors and assigns.",
    "{Party} shall not use the name or marks of {party:b} in any publicity without prior approval.",
    "The rights and remedies in this {instrument} are in addition to any rights provided by law.",
    "{Party} shall give {party:b} reasonable access to the {subject} for the purpose of {purpose}.",
)

# ------------------------------------------------------------------ logs

_LOG_WORDS: dict[str, tuple[str, ...]] = {
    "when": ("at dawn", "at daybreak", "early morning", "mid morning", "late morning", "at noon",
             "early afternoon", "mid afternoon", "late afternoon", "at dusk", "early evening", "late evening",
             "at midnight", "small hours", "before sunrise", "after sunset", "just after noon", "towards evening"),
    "ok": ("info", "debug", "notice", "trace"),
    "bad": ("warn", "error", "fatal", "alert", "crit"),
    "component": ("scheduler", "http.server", "db.pool", "auth", "cache", "mailer", "queue.worker", "storage",
                  "gateway", "metrics", "indexer", "billing", "search", "uploader", "session.store", "cron",
                  "proxy", "config.loader", "router", "thumbnailer", "notifier", "api", "web", "sync.agent"),
    "user": ("guest", "admin", "operator", "editor", "reviewer", "support", "builder", "auditor", "tester",
             "owner", "maintainer", "analyst", "designer", "visitor", "publisher", "moderator"),
    "host": ("db.internal", "cache.internal", "mail.internal", "search.internal", "files.internal",
             "auth.internal", "edge.north", "edge.south", "edge.west", "edge.east", "replica.primary",
             "replica.standby", "queue.internal", "media.internal"),
    "route": ("/login", "/logout", "/search", "/orders", "/cart", "/profile", "/settings", "/reports",
              "/upload", "/health", "/api/items", "/api/users", "/static/styles.css", "/feed", "/checkout",
              "/inbox", "/admin/audit", "/api/sessions"),
    "verb": ("GET", "POST", "PUT", "DELETE", "HEAD"),
    "status": ("ok", "created", "not found", "forbidden", "moved", "no content", "conflict", "unavailable"),
    "operation": ("index rebuild", "nightly backup", "cache warmup", "schema check", "token refresh",
                  "mail delivery", "thumbnail generation", "report export", "session cleanup", "payment sync",
                  "search reindex", "feed refresh", "log rotation", "certificate renewal", "quota check"),
    "failure": ("timeout", "connection reset", "permission denied", "host unreachable", "broken pipe",
                "too many open files", "certificate expired", "disk full", "name resolution failure",
                "connection refused", "read only file system"),
    "table": ("users", "orders", "sessions", "invoices", "events", "comments", "uploads", "audit_log",
              "payments", "messages", "accounts", "products"),
    "level": ("low", "moderate", "high", "critical", "rising", "stable", "falling"),
    "queue": ("mail", "thumbnails", "exports", "webhooks", "indexing", "billing", "imports", "alerts"),
    "state": ("draining", "backed up", "empty", "paused", "resumed", "growing", "stalled", "healthy"),
    "cfg": ("app.yaml", "settings.toml", "server.conf", "logging.ini", "routes.json", "features.yaml"),
    "signal": ("hangup", "terminate", "interrupt", "quit", "user signal"),
    "file": ("avatar.png", "report.pdf", "invoice.pdf", "export.csv", "backup.tar", "photo.jpg", "notes.txt",
             "slides.pdf", "catalogue.xml"),
    "outcome": ("completed", "failed", "was cancelled", "stalled", "resumed", "was rejected as too large"),
    "option": ("legacy_mode", "use_old_cache", "verbose_errors", "strict_hosts", "allow_guest", "fast_start"),
    "job": ("digest", "cleanup", "reindex", "export", "reminder", "rollup", "prune", "refresh"),
}

_LOG_TEMPLATES = (
    "[{when}] {ok} {component}: {verb} {route} answered {status} for {user}\n",
    "[{when}] {ok} {component}: connection to {host} opened\n",
    "[{when}] {bad} {component}: connection to {host} closed by peer\n",
    "[{when}] {bad} {component}: retrying {operation} after {failure}\n",
    "[{when}] {ok} {component}: {operation} finished without errors\n",
    "[{when}] {ok} cache: miss for {route}, fetched from {host}\n",
    "[{when}] {ok} auth: user {user} signed in from {host}\n",
    "[{when}] {ok} auth: user {user} signed out\n",
    "[{when}] {ok} {component}: worker picked up the {job} job from the {queue} queue\n",
    "[{when}] {bad} db.pool: slow query on table {table}, consider adding an index\n",
    "[{when}] {ok} {component}: health check passed for {host}\n",
    "[{when}] {bad} {component}: health check failed for {host}: {failure}\n",
    "[{when}] {ok} config.loader: configuration reloaded from {cfg}\n",
    "[{when}] {bad} storage: disk usage on the data volume is {level}\n",
    "[{when}] {ok} {component}: rotated log file and reopened the handle\n",
    "[{when}] {ok} session.store: dropped stale session for {user}\n",
    "[{when}] {ok} cron: scheduled the {job} job for {when:b}\n",
    "[{when}] {bad} {component}: received {signal} signal, shutting down gracefully\n",
    "[{when}] {ok} {component}: certificate for {host} renewed\n",
    "[{when}] {bad} queue.worker: the {queue} queue is {state}\n",
    "[{when}] {ok} web: template for {route} rendered for {user}\n",
    "[{when}] {ok} uploader: upload of {file} by {user} {outcome}\n",
    "[{when}] {bad} {component}: memory pressure is {level}, trimming caches\n",
    "[{when}] {bad} config.loader: deprecated option {option} used in {cfg}\n",
    "[{when}] {ok} {component}: backup of table {table} started\n"
    "[{when}] {ok} {component}: backup of table {table} completed\n",
    "[{when}] {bad} gateway: rate limit reached for {user} on {route}\n",
    "[{when}] {ok} mailer: message to {user} about the {job} job {outcome}\n",
    "[{when}] {bad} {component}: {verb} {route} failed with {failure}\n"
    "[{when}] {ok} {component}: {verb} {route} succeeded on retry\n",
    "[{when}] {ok} search: reindexed table {table} in the background\n",
    "[{when}] {ok} metrics: request rate {level}, error rate {level:b}\n",
    "[{when}] {bad} {component}: lost connection to {host}, switching to {host:b}\n",
    "[{when}] {ok} {component}: feature flag {option} turned on for {user}\n",
    "[{when}] {bad} billing: payment sync for {user} {outcome}\n",
    "[{when}] {ok} proxy: forwarded {verb} {route} to {host}\n",
    "[{when}] {ok} {component}: the {queue} queue is {state}\n",
)

_GENERATED: dict[str, tuple[tuple[str, ...], Mapping[str, tuple[str, ...]]]] = {
    "code": (_CODE_TEMPLATES, _CODE_WORDS),
    "legal": (_LEGAL_TEMPLATES, _LEGAL_WORDS),
    "logs": (_LOG_TEMPLATES, _LOG_WORDS),
}


def units(family: str, rng: random.Random, *, prose: Sequence[str] = filler.SENTENCES) -> Iterator[str]:
    """Endless seeded filler units of `family` (one of FAMILIES) drawn with `rng`, no unit twice in a row.

    "prose" is haystack.sentence_stream(prose, rng): the same units and the same draws from `rng` as a task
    that calls sentence_stream itself (a task with prose of its own, as passkey, passes it as `prose`).
    Raises ValueError at once (not on the first unit) for an unknown family."""
    if family == "prose":
        return sentence_stream(prose, rng)
    if family not in _GENERATED:
        raise ValueError(f"unknown haystack family {family!r}; valid families: {', '.join(FAMILIES)}")
    templates, words = _GENERATED[family]
    return _generated(templates, words, rng)


def _generated(templates: Sequence[str], words: Mapping[str, Sequence[str]], rng: random.Random) -> Iterator[str]:
    """Every template once per pass in a fresh seeded order (no template twice in a row across passes), its
    slots filled by `rng`; a unit equal to the one before is filled again."""
    last_template, last_unit = None, None
    while True:
        order = list(templates)
        rng.shuffle(order)
        if len(order) > 1 and order[0] == last_template:
            order[0], order[-1] = order[-1], order[0]
        for template in order:
            unit = fill(template, words, rng)
            while unit == last_unit:
                unit = fill(template, words, rng)
            yield unit
            last_unit = unit
        last_template = order[-1]


def fill(template: str, words: Mapping[str, Sequence[str]], rng: random.Random) -> str:
    """`template` with each slot replaced by a word of its list: {name} and {name:x} draw different words
    (when the list has more than one), a repeated slot keeps its word, {Name} capitalises it."""
    chosen: dict[tuple[str, str], str] = {}

    def word(m: re.Match) -> str:
        name, variant = m.group(1), m.group(2) or ""
        base = name.lower()
        slot = (base, variant)
        if slot not in chosen:
            taken = {w for (b, _), w in chosen.items() if b == base}
            options = [w for w in words[base] if w not in taken] or list(words[base])
            chosen[slot] = rng.choice(options)
        w = chosen[slot]
        return w[0].upper() + w[1:] if name[0].isupper() else w

    return _SLOT.sub(word, template)


def metadata(family: str) -> dict:
    """What a task records of its haystack in a sample's metadata: nothing for the default "prose" (so
    prose samples keep the metadata they had before families existed), else {"haystack": family}."""
    return {} if family == "prose" else {"haystack": family}

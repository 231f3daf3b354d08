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
- ``recipes``, ``weather``, ``manual``, ``minutes``: cooking steps, weather bulletins, an appliance manual and
  meeting minutes, one line each (ending with a newline), of our own wording from templates and word lists. No
  training run has used them: they are held out too.

Real documents (info manuals, man pages, Python source: ``info``, ``man``, ``pysource``) are the families of
realtext/, for the real_* needle tasks; they are the held-out families the evaluation recommends, since their own
numbers make a needle one fact among many. The families here stay what they were.

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

FAMILIES = ("prose", "code", "legal", "logs", "recipes", "weather", "manual", "minutes")

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

# ---------------------------------------------------------------- families no shipped heads were trained on
# recipes, weather, manual and minutes: held out from every training run so far (the heads' train-log.json names
# the families a run used; `locret eval --held-out` reports only families none of the evaluated heads used).
# Units are lines ending with a newline.


def _headed(head: str, templates: tuple[str, ...]) -> tuple[str, ...]:
    """Every line opened by a heading slot (as log lines open with their time of day): variety over many passes."""
    return tuple(head + t for t in templates)

_RECIPE_WORDS: dict[str, tuple[str, ...]] = {
    "course": ("starter", "main course", "vegetables", "dessert", "breakfast", "supper", "lunch", "snack", "brunch",
               "picnic", "bread", "sauces", "preserves", "baking"),
    "step": ("whisk", "fold", "stir", "chop", "slice", "roast", "simmer", "season", "drain", "rinse", "grate",
             "knead", "toast", "blend", "sieve", "brown", "crush", "mash"),
    "ingredient": ("onions", "garlic", "leeks", "carrots", "lentils", "butter", "flour", "rice", "mushrooms",
                   "spinach", "celery", "beans", "oats", "apples", "pears", "plums", "ginger", "cabbage", "peas",
                   "shallots", "barley", "potatoes", "chickpeas", "courgettes", "tomatoes", "fennel"),
    "tool": ("a wooden spoon", "a whisk", "a fork", "a sieve", "a heavy pan", "a large pot", "a sharp knife",
             "the grater", "a mixing bowl", "a ladle", "a spatula", "the rolling pin"),
    "texture": ("soft", "golden", "glossy", "smooth", "tender", "fragrant", "crisp at the edges",
                "thick enough to coat the spoon", "just bubbling", "pale and fluffy", "evenly browned"),
    "dish": ("soup", "stew", "risotto", "pie filling", "dough", "sauce", "porridge", "curry", "gratin", "dressing",
             "pudding", "broth", "casserole", "crumble"),
    "vessel": ("a shallow dish", "a glass jar", "a lidded box", "warm bowls", "a deep tin", "a serving platter"),
    "herb": ("thyme", "basil", "parsley", "dill", "chives", "mint", "coriander", "sage leaves", "rosemary"),
    "seasoning": ("salt", "black pepper", "nutmeg", "paprika", "cumin", "cinnamon", "chilli flakes"),
    "liquid": ("milk", "water", "stock", "white wine", "lemon juice", "cream", "apple juice"),
    "heat": ("a low flame", "a gentle heat", "a medium heat", "a steady heat"),
    "place": ("a warm corner", "the fridge", "a cool larder", "a low oven"),
    "side": ("crusty bread", "steamed greens", "boiled rice", "a green salad", "roast potatoes", "flatbreads"),
    "legume": ("beans", "chickpeas", "lentils", "dried peas"),
    "nut": ("almonds", "walnuts", "hazelnuts", "pine nuts", "sesame seeds", "pumpkin seeds"),
    "tip": ("a pinch of sugar balances a sour sauce", "dry herbs go in early and fresh ones at the end",
            "salt the water well before the pasta goes in", "a cold pan keeps garlic from burning",
            "rested dough is easier to roll", "a squeeze of lemon wakes up a heavy stew"),
}

_RECIPE_TEMPLATES = _headed("{Course}: ", (
    "{Step} the {ingredient} with {tool} until {texture}.\n",
    "Add the {ingredient} and {step} gently for a few minutes.\n",
    "Keep the {ingredient:b} warm while you {step} the {ingredient}.\n",
    "Season the {dish} with {seasoning} and taste before serving.\n",
    "Let the {dish} rest under a clean cloth before slicing.\n",
    "Warm a heavy pan over {heat} and soften the {ingredient} in butter.\n",
    "Spoon the {dish} into {vessel} and scatter {herb} on top.\n",
    "If the {dish} looks dry, loosen it with a splash of {liquid}.\n",
    "Cover and leave the {dish} in {place} until {texture}.\n",
    "Serve the {dish} with {side} and a little {herb}.\n",
    "Soak the {legume} overnight and drain them before adding the {ingredient}.\n",
    "Preheat the oven for the {dish} and grease {vessel}.\n",
    "Whisk the eggs with {liquid} and a pinch of {seasoning}.\n",
    "Reduce the heat and let the {dish} simmer until {texture}.\n",
    "Tip for the {dish}: {tip}.\n",
    "For a lighter {dish}, use {liquid} instead of cream.\n",
    "Store leftover {dish} in {vessel} in the fridge for a couple of days.\n",
    "Toast the {nut} in a dry pan and scatter them over the {dish}.\n",
    "Stir in the {herb} just before the {dish} comes off the heat.\n",
    "Cover {vessel} with paper and spread the {dish} in an even layer.\n",
    "Grate the {ingredient} finely and squeeze out the extra water.\n",
    "Bring the {liquid} to a gentle boil, then lower the heat.\n",
))

_WEATHER_WORDS: dict[str, tuple[str, ...]] = {
    "when": ("dawn", "early morning", "mid morning", "before noon", "midday", "early afternoon", "teatime",
             "dusk", "nightfall", "midnight", "overnight"),
    "region": ("the northern hills", "the coast", "inland valleys", "the islands", "the eastern plains",
               "the lakes district", "upland areas", "the city", "western ports", "the southern farmland",
               "the river basin", "the moors"),
    "sky": ("bright spells", "patchy cloud", "scattered showers", "persistent drizzle", "clear skies", "low mist",
            "thundery downpours", "light snow on high ground", "sleet at times", "sunny intervals",
            "a blanket of grey cloud", "heavy rain"),
    "part": ("morning", "afternoon", "evening", "night", "early hours"),
    "wind": ("light", "moderate", "fresh", "strong", "gusty", "gentle"),
    "direction": ("north", "south", "east", "west", "northwest", "southwest", "northeast", "southeast"),
    "temp": ("mild", "cool", "chilly", "warm", "close to normal", "rather cold", "pleasant"),
    "trend": ("rise slowly", "fall away", "hold steady", "dip sharply", "climb a little"),
    "road": ("surface water", "icy patches", "fallen leaves", "standing water", "blowing snow"),
    "roads": ("minor roads", "the coast road", "exposed bridges", "mountain passes", "rural lanes"),
    "level": ("low", "moderate", "high", "very high"),
    "sea": ("calm", "slight", "moderate", "rough", "choppy"),
    "coast": ("the harbour", "the headland", "the estuary", "the northern beaches", "the sea wall"),
    "farm": ("a dry spell for the harvest", "wet fields in low areas", "late frosts in orchards",
             "good drying conditions", "soft ground for ploughing"),
    "sheltered": ("sheltered", "rural", "low lying", "inland", "shaded"),
    "warning": ("a yellow warning of wind", "a flood alert", "an ice advisory", "a heat advisory", "a fog notice"),
    "gear": ("warm layers", "waterproofs", "plenty of water", "a map and compass", "a head torch"),
    "feel": ("fresh", "muggy", "crisp", "heavy", "dry", "damp"),
    "pressure": ("rising", "falling", "steady", "high", "low"),
    "change": ("clear away", "linger", "spread north", "ease off", "turn heavier"),
}

_WEATHER_TEMPLATES = _headed("{When} update: ", (
    "{Region}: {sky} in the {part}, with {wind} winds from the {direction}.\n",
    "Outlook for {region}: {sky} at first, then {sky:b} later.\n",
    "Temperatures {trend} through the {part}, feeling {temp} in the wind.\n",
    "Road conditions: {road} on {roads}, so allow extra time.\n",
    "Pollen count {level}, air quality {level:b}.\n",
    "Sea state: {sea} near {coast}, becoming {sea:b} by the {part}.\n",
    "Farmers in {region} should expect {farm}.\n",
    "A band of {sky} moves in from the {direction} during the {part}.\n",
    "Frost is likely in {sheltered} parts of {region} overnight.\n",
    "The weekend looks {temp} with {sky}.\n",
    "Warnings: {warning} for {region}.\n",
    "Hikers in {region} should carry {gear} and expect {sky}.\n",
    "Humidity stays {level} and the air feels {feel}.\n",
    "Expect {sky} over {region} and {sky:b} over {region:b}.\n",
    "The pressure is {pressure}, so the {sky} should {change}.\n",
    "Winds turn {wind} overnight, backing {direction}.\n",
    "After a {temp} start, {region} brightens up by the {part}.\n",
    "Showers could be slow moving over {region} in the {part}.\n",
))

_MANUAL_WORDS: dict[str, tuple[str, ...]] = {
    "appliance": ("kettle", "toaster", "blender", "coffee maker", "food processor", "steam iron", "rice cooker",
                  "slow cooker", "vacuum cleaner", "juicer", "bread maker", "air fryer"),
    "part": ("filter", "lid", "drip tray", "water tank", "power cord", "side panel", "rubber seal", "control dial",
             "handle", "base plate", "hinge", "vent", "steam wand", "crumb tray", "blade assembly", "dust bag"),
    "action": ("clean", "remove", "check", "tighten", "replace", "rinse", "dry", "inspect", "reattach", "empty"),
    "condition": ("the unit is unplugged", "the light turns green", "the motor stops", "the display shows ready",
                  "the tank is empty", "the fan stops", "the plate has cooled"),
    "fault": ("rattles", "leaks", "feels loose", "gets hot", "makes a clicking sound", "will not close",
              "smells of burning"),
    "remedy": ("switch the unit off and let it cool", "tighten the screws by hand", "check that the seal sits flat",
               "contact the service desk", "refit it and try again", "clear any crumbs from the edges"),
    "danger": ("pull the cord to unplug the unit", "block the vents", "operate the unit with a damaged cord",
               "leave the unit running unattended", "touch the heating plate while in use",
               "open the lid during a cycle"),
    "indicator": ("status light", "display", "power light", "warning lamp", "small green lamp"),
    "blink": ("blinks slowly", "stays on", "flashes twice", "goes dark", "flickers"),
    "store": ("a dry cupboard", "its original box", "a cool shelf", "a drawer away from heat"),
    "tip": ("descale the tank every few weeks", "use filtered water", "empty the drip tray daily",
            "let the unit warm up first", "wipe the seal after each use"),
    "setting": ("eco", "gentle", "standard", "high", "the lowest mark", "the steam symbol", "defrost"),
    "accessory": ("a spare filter", "a cleaning brush", "a travel case", "an extra lid", "a descaling kit",
                  "a wall bracket"),
    "misuse": ("dropping the unit", "using the wrong voltage", "unauthorised repairs", "household chemicals",
               "leaving it outdoors"),
    "button": ("start button", "timer button", "mode button", "power switch"),
    "function": ("reset the timer", "lock the controls", "switch modes", "pause the cycle", "wake the display"),
}

_MANUAL_TEMPLATES = _headed("{Appliance} guide: ", (
    "Before you {action} the {part}, make sure {condition}.\n",
    "To {action} the {part}, press the release button and lift gently.\n",
    "Do not immerse the {part} in water.\n",
    "If the {part} {fault}, {remedy}.\n",
    "The {part} can be washed in warm soapy water.\n",
    "Wipe the {part} with a soft dry cloth after each use.\n",
    "Warning: never {danger}, and keep the {part} away from children.\n",
    "Troubleshooting: when the {indicator} {blink}, {remedy}.\n",
    "Store the {part} in {store} when not in use.\n",
    "The {part} clicks into place when fitted correctly.\n",
    "For best results, {tip} and {action} the {part} often.\n",
    "Check the {part} for cracks before each use.\n",
    "Turn the control dial to {setting} and wait for the {indicator}.\n",
    "Accessories: {accessory} and {accessory:b} are sold separately.\n",
    "The warranty does not cover damage to the {part} caused by {misuse}.\n",
    "Please note: the {part} may feel warm during normal operation.\n",
    "Empty the {part} and let it dry with the lid open.\n",
    "Fit the {part} so that the arrows line up.\n",
    "Press and hold the {button} to {function}.\n",
    "Should the {indicator} {blink}, {action} the {part} first.\n",
))

_MINUTES_WORDS: dict[str, tuple[str, ...]] = {
    "meeting": ("board meeting", "staff meeting", "committee meeting", "annual meeting", "project meeting",
                "team meeting", "trustees meeting", "planning meeting", "finance meeting", "open meeting"),
    "prev": ("previous", "last", "special", "annual", "extra"),
    "how": ("without changes", "with one correction", "after a short discussion", "as circulated"),
    "role": ("the chair", "the treasurer", "the secretary", "the site manager", "the head of sales",
             "the facilities lead", "a trustee", "the auditor", "the deputy chair", "the volunteer lead",
             "the head of finance", "a staff representative"),
    "project": ("website redesign", "office move", "new heating system", "volunteer programme",
                "library extension", "staff survey", "garden project", "recycling scheme", "training plan",
                "roof repair", "winter fair"),
    "status": ("on schedule", "slightly behind", "over budget", "nearly finished", "waiting for approval",
               "paused until spring"),
    "task": ("draft a proposal", "collect quotes", "book the hall", "update the contact list", "speak to the landlord",
             "prepare the accounts", "write to the council"),
    "decision": ("go ahead as planned", "be put on hold", "be reviewed in the autumn", "get a smaller budget",
                 "move to the new site"),
    "change": ("reduced", "moved to later in the year", "shared with the other branch", "paid in stages"),
    "concern": ("the delivery schedule", "staff workload", "rising costs", "the condition of the roof",
                "late invoices", "the shortage of volunteers", "noise from the building work"),
    "aob": ("the summer outing", "parking at the main site", "a request for new chairs", "the noticeboard",
            "the kitchen rota"),
    "thanks": ("organising the workshop", "the detailed report", "covering the front desk", "tidying the store room",
               "chasing the suppliers"),
    "vote": ("passed", "failed", "was carried by a clear majority", "was withdrawn", "was carried unanimously"),
    "suggestion": ("the group meets every other week", "a small committee looks at the options",
                   "the report goes out before the meeting", "members bring ideas to the next session"),
    "doc": ("policy", "timetable", "report", "agenda", "floor plan", "budget summary"),
    "progress": ("the first phase is complete", "two tasks are behind", "the contractor has been chosen",
                 "funding is still pending", "the plans were approved"),
}

_MINUTES_TEMPLATES = _headed("{Meeting}: ", (
    "{Role} opened the meeting and welcomed everyone.\n",
    "{Role} reported that the {project} is {status}.\n",
    "Action: {role} to {task} before the next meeting.\n",
    "Agreed: the {project} will {decision}.\n",
    "Apologies were received from {role} and {role:b}.\n",
    "{Role} asked whether the budget for the {project} could be {change}.\n",
    "Discussion of the {project} was deferred to the next meeting.\n",
    "{Role} noted concerns about {concern}.\n",
    "The minutes of the {prev} meeting were approved {how}.\n",
    "Any other business: {aob}, raised by {role}.\n",
    "{Role} thanked {role:b} for {thanks}.\n",
    "A vote was taken on the {project} and the motion {vote}.\n",
    "{Role} suggested that {suggestion}.\n",
    "The meeting closed after {role} spoke about {concern}.\n",
    "{Role} will circulate the draft {doc} by email.\n",
    "Progress on the {project} was reviewed; {progress}.\n",
    "{Role} proposed that the {project} should {decision}; {role:b} seconded.\n",
    "Members raised {concern} and {concern:b} under the {project} item.\n",
))

_GENERATED: dict[str, tuple[tuple[str, ...], Mapping[str, tuple[str, ...]]]] = {
    "code": (_CODE_TEMPLATES, _CODE_WORDS),
    "legal": (_LEGAL_TEMPLATES, _LEGAL_WORDS),
    "logs": (_LOG_TEMPLATES, _LOG_WORDS),
    "recipes": (_RECIPE_TEMPLATES, _RECIPE_WORDS),
    "weather": (_WEATHER_TEMPLATES, _WEATHER_WORDS),
    "manual": (_MANUAL_TEMPLATES, _MANUAL_WORDS),
    "minutes": (_MINUTES_TEMPLATES, _MINUTES_WORDS),
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

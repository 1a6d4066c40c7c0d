"""Evidence matching and scoring, shared by every language.

Matching runs only over the tool's own segments (its body, its declaration and the
helpers it calls, in its own file or in files of the scanned tree it imports), so
evidence never bleeds in from a neighbouring tool.  The score is a sum of weights; it
ranks, it does not decide.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from .model import COULD_FIRE_TWICE, Evidence, Finding
from .source import Segment, Source, ToolDecl

if TYPE_CHECKING:
    from .package import Package


def _words(text: str) -> frozenset[str]:
    return frozenset(text.split())


MONEY = _words(
    "charge charges pay payment payments refund refunds transfer transfers payout payouts "
    "invoice invoices withdraw withdrawal deposit billing bill purchase checkout capture "
    "debit credit wallet stripe paymentintent"
)
STRONG_VERBS = _words(
    "charge pay refund transfer send create delete remove deploy write insert update upsert "
    "provision publish post book order submit cancel purchase buy sell withdraw payout "
    "notify email sms upload enqueue dispatch trigger launch terminate destroy drop merge "
    "commit push approve reserve subscribe unsubscribe invite revoke rotate issue mint "
    "capture credit debit increment append put patch apply execute restart reboot "
    "rollback migrate archive ban kick transfer tweet reply comment fork edit react star "
    "pin schedule invoke purge wipe erase page"
)
# Words that are nouns as often as verbs (``get_user_email``, ``add_issue_comment``): they
# count as the tool's verb only when some word follows them (``email_user``,
# ``slack_post_message``), never as the last word of a name.
AMBIGUOUS = _words(
    "email post order issue comment sms tweet bill book credit debit reply page record"
)
# Verbs whose usual write sets given values (PATCH/PUT semantics): sending it twice
# leaves the same state, so such a tool ranks below the line unless it also creates.
SET_VERBS = _words(
    "update set put patch replace overwrite configure enable disable upsert write save"
)
WEAK_VERBS = _words(
    "add set save store run start stop mark assign register make generate move copy "
    "rename close open enable disable grant reset sync import scale"
)
READ_VERBS = _words(
    "get list read fetch search query describe show find lookup check status view "
    "inspect count validate preview estimate explain browse load retrieve peek ping "
    "health info summarize summary compare diff resolve whoami watch poll"
)
# Body calls count only with verbs that rarely name in-memory operations (``arr.push``,
# ``df.merge``); a compound name (``pushFiles``, ``mergePullRequest``) is an API call.
CALL_VERBS = STRONG_VERBS - _words(
    "push drop merge order apply put patch append update execute issue comment email"
) | frozenset({"update"})
COMPOUND_CALL_VERBS = STRONG_VERBS - _words("order execute issue email")
# ``createReadStream``, ``createHash``, ``createClient``: constructors, not effects.
_NOT_EFFECT_OBJECTS = _words(
    "read reader readable hash hmac cipher decipher interface client server logger context "
    "signal element buffer parser schema transport iterator proxy instance error url regex "
    "pool controller agent require validator matcher formatter diff patch"
)
_BENIGN_RECEIVERS = re.compile(
    r"(?i)^_?(seen|processed|done|completed|handled|dedup\w*|cache\w*|headers?|params|kwargs|"
    r"args|options|opts|environ|env|dict|map|set|list|arr|array|items|keys|vec|result|results|"
    r"data|payload|body|state|ctx|context|metadata|query|json|searchparams|url|out|buf|"
    r"buffer|sb|builder|b|w|logger|log|console|self|this|parts|values|counts?)$"
)
_DEFINITION = re.compile(
    r"(?:\bdef|\bfn|\bfunc(?:\s*\([^)]*\))?|\bfunction\s*\*?|\b(?:async|pub|static)|"
    r"^\s*(?:public|private|protected))\s*$"
)
_CONTAINER_OPS = _words("update delete insert remove add send write create post")
_KEYWORDS = _words(
    "if for while switch catch return function fn func match await async def class new "
    "elif else print println typeof sizeof len range make append panic assert super"
)

_SPLIT = re.compile(r"[^A-Za-z0-9]+|(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])")


def tokens(name: str) -> list[str]:
    """Split snake_case, camelCase, kebab-case and dotted names into lower-case words."""
    return [t.lower() for t in _SPLIT.split(name) if t]


def _verb(word: str, verbs: frozenset[str]) -> str | None:
    """``word`` if it is one of ``verbs`` up to a plain English suffix (sends, created...)."""
    if word in verbs:
        return word
    for suffix in ("ing", "es", "ed", "s", "d"):
        if word.endswith(suffix) and word[: -len(suffix)] in verbs:
            return word[: -len(suffix)]
    if word.endswith("ing") and word[:-3] + "e" in verbs:
        return word[:-3] + "e"
    return None


_CALL = re.compile(r"(?:\b([A-Za-z_]\w*)\s*(?:\.|::|->)\s*)?\b([A-Za-z_]\w*)\s*(?:!\s*)?\(")
_HTTP_VERB_CALL = re.compile(r"(?i)(?:\.|::)\s*(post|put|patch|delete)\s*\(")
_HTTPISH = re.compile(r"(?i)(requests|httpx|axios|aiohttp|got|ky|http|client|session|api|request)")
_METHOD_LINE = re.compile(
    r"""(?i)\bmethod\b["']?\s*[:=]\s*[^\n,;]*?["'`](POST|PUT|PATCH|DELETE)["'`]"""
)
_METHOD_ARG = re.compile(
    r"""(?x)
    (?:\.request\s*\(\s*|NewRequest(?:WithContext)?\s*\([^)\n]*?|-X\s*|curl[^\n]*-X\s*)
    ["'`]?(POST|PUT|PATCH|DELETE)\b
    | \bhttp\.Method(Post|Put|Patch|Delete)\b
    | \bMethod::(POST|PUT|PATCH|DELETE)\b
    | \bhttp\.(Post|PostForm)\s*\(
    """
)
_SQL_WRITE = re.compile(
    r"""(?is)\b(INSERT\s+(?:OR\s+\w+\s+)?INTO|UPDATE\s+[\w."`\[\]]+\s+SET|DELETE\s+FROM|"""
    r"""UPSERT\b|MERGE\s+INTO|REPLACE\s+INTO)"""
)
_DB_WRITE_CALL = re.compile(
    r"(?i)\.\s*(insert_one|insert_many|update_one|update_many|delete_one|delete_many|"
    r"replace_one|bulk_write|bulk_create|insertOne|insertMany|updateOne|updateMany|"
    r"deleteOne|deleteMany|save|commit|executemany|put_item|putItem|PutItem|put_object|"
    r"putObject|PutObject)\s*\("
)
_PROCESS = re.compile(
    r"\b(subprocess\.(?:run|call|check_call|check_output|Popen)|os\.system|"
    r"exec\.Command(?:Context)?|Command::new|child_process|execSync|spawn)\b"
)
_FILE_WRITE = re.compile(r"""\bopen\s*\([^)\n]*["'](?:w|a|wb|ab|a\+|w\+)["']""")
# Filesystem changes through the standard libraries: ``fs.rename``, ``shutil.move``,
# ``path.write_text``; ``fs.mkdir`` and friends are named by what they change.
_FS_CHANGE = re.compile(
    r"""\b(?:fs|fsp|fsPromises|promises|os|shutil)\s*\.\s*(writeFile|appendFile|rename|unlink|rm|
    rmdir|mkdir|copyFile|cp|symlink|truncate|remove|removedirs|makedirs|replace|rmtree|move|
    copy2?|copytree|writeFileSync|appendFileSync|renameSync|unlinkSync|rmSync|mkdirSync|
    copyFileSync)\s*\(
    | \.\s*(write_text|write_bytes)\s*\(""",
    re.VERBOSE,
)

_IDEMPOTENCY = re.compile(r"(?i)idempotenc[ey]")
_RANDOM = re.compile(
    r"(?i)uuid4|uuid\.New|randomUUID|uuidv4|v4\(\)|new_v4|nanoid|random|time\.time\(|"
    r"Date\.now|time\.Now|token_hex|urandom"
)
# ``request_id`` alone or ``client_request_id``; not ``merge_request_id`` or
# ``pull_request_id``, which name a resource, not a retry.
_REQUEST_TOKEN = re.compile(
    r"(?i)(?<![A-Za-z0-9_])(client[_-]?token|client[_-]?request[_-]?id|"
    r"request[_-]?id|dedup(?:e|lication)?[_-]?(?:key|id))(?![a-z])"
)
# A token is a guard only where something checks it or hands it on: a condition, a
# lookup, or a keyword/header that sends it to the API.  A parameter that nothing reads
# guards nothing.
_TOKEN_CHECK = re.compile(
    r"(?i)\b(?:if|elif|while|unless)\b|[=!]==?|\bnot\s+in\b|\bin\s+[\w.]+\s*:|"
    r"\.(?:get|has|exists|contains|find)\w*\s*\("
)
_TOKEN_PASSED = re.compile(
    r"""["']?\s*[:=](?!=)\s*(?!(?:str|int|bool|Optional|Annotated|Field|None|UUID|uuid|"""
    r"""string|number|z\s*\.)\b)[\w"'\[(]"""
)
_SIGNATURE = re.compile(r"^\s*(?:async\s+)?(?:def|function|fn|func)\b")
_DEDUPE = re.compile(
    r"""(?ix)
    \b(?:not\s+)?in\s+(?:self\.|this\.|cls\.)?_?(?:seen|sent|processed|done|completed|handled|
        delivered|published|applied|dedup\w*|already\w*)\b
    | \b_?(?:seen|sent|processed|completed|handled|delivered|published|applied|dedup\w*)
        (?:_\w*|Ids?|Keys?|Set|Map|Requests?|Events?|Messages?)?\s*
        (?:\.|::)\s*
        (?:has|contains|contains_key|get|exists|insert|add|setdefault|Load|LoadOrStore)\s*\(
    | ,\s*ok\s*:?=\s*[\w.]*(?:seen|processed|done|dedup)\w*\[
    | \balready[_ ]?(?:processed|charged|sent|done|exists|applied|seen|handled)
    | \.filter\s*\(\s*\(?\s*[\w$]+\s*\)?\s*=>\s*!\s*[\w$.]+\s*\.\s*
        (?:some|includes|has|find\w*)\s*\(
    | \bfor\s+\w+\s+in\s+[\w.]+\s+if\s+[\w.]+\s+not\s+in\b
    """
)
_SQL_CONFLICT = re.compile(
    r"(?is)ON\s+CONFLICT|INSERT\b[^;]{0,300}?IF\s+NOT\s+EXISTS|INSERT\s+(?:OR\s+)?IGNORE|"
    r"ON\s+DUPLICATE\s+KEY|WHERE\s+NOT\s+EXISTS"
)
_CONDITIONAL = re.compile(r"(?i)If-(?:None-)?Match")
_HINT = (
    r"""(?i)(?:{name}_?hint|\b{name})(?:_?annotation)?["']?\s*[:=(]\s*(?:&|\w+(?:\.\w+)*\(\s*)?"""
    r"""(true|false)\b"""
)
# ``readOnlyHint=True`` and also ``writes(idempotent=True)``, a helper's keyword that
# builds the annotation
_READ_ONLY = re.compile(_HINT.format(name=r"read_?only"))
_IDEMPOTENT_HINT = re.compile(_HINT.format(name=r"idempotent"))
_DESTRUCTIVE = re.compile(_HINT.format(name=r"destructive"))
_RETRY = re.compile(
    r"(?i)\b(retry\w*|retries|tenacity|backoff|max_?retries|with_?retr\w*|attempts?)\b"
)
_TIMEOUT = re.compile(r"(?i)\b(timeout\w*|with_?timeout|deadline)\b")

WRITE_KINDS = frozenset({"http_write", "sql_write", "effect_call"})


def _home(src: Source, seg: Segment) -> Source:
    return seg.src if seg.src is not None else src


def _follow(
    src: Source,
    decl: ToolDecl,
    package: Package | None = None,
    max_depth: int = 3,
    max_helpers: int = 16,
) -> list[Segment]:
    """Add the functions the body calls, so writes in shared helpers count: same-file
    helpers by name, and functions imported from other files of the scanned tree
    (bounded in depth and count, so a utility module does not pull in everything)."""
    segments = list(decl.body)
    frontier = list(decl.body)

    def taken(home: Source, span: Segment) -> bool:
        return any(
            _home(src, s) is home and s.start <= span.start < s.end for s in segments + found
        )

    for _ in range(max_depth):
        found: list[Segment] = []
        for seg in frontier:
            here = _home(src, seg)
            for m in _CALL.finditer(here.skeleton, seg.start, seg.end):
                receiver, name = m.group(1) or "", m.group(2)
                if name in _KEYWORDS:
                    continue
                if (
                    here.language == "python"
                    and receiver not in ("", "self", "cls", "super")
                    and name not in here.methods
                ):
                    local = []  # ``repo.commit()`` is not the nested tool ``def commit``
                else:
                    local = [
                        Segment(sp.start, sp.end, f"helper {name}()", seg.src)
                        for sp in here.functions.get(name, [])
                    ]
                if receiver in here.imports or (not local and package is not None):
                    spans = package.imported(here, receiver, name) if package else []
                    local = spans or local
                for span in local:
                    if taken(_home(src, span), span):
                        continue
                    if len(segments) + len(found) >= max_helpers:
                        break
                    found.append(span)
        segments.extend(found)
        frontier = found
    return segments


def _dedupe_segments(src: Source, segments: Iterable[Segment]) -> list[Segment]:
    out: list[Segment] = []
    for seg in sorted(segments, key=lambda s: (_home(src, s).rel, s.start, -s.end)):
        if (
            out
            and _home(src, out[-1]) is _home(src, seg)
            and seg.start >= out[-1].start
            and seg.end <= out[-1].end
        ):
            continue
        out.append(seg)
    return out


class _Collector:
    def __init__(self, src: Source) -> None:
        self.src = src
        self.items: list[Evidence] = []
        self._keys: set[tuple[str, str]] = set()

    def add(self, kind: str, detail: str, offset: int, seg: Segment | None = None) -> None:
        if seg is not None and seg.label:
            detail = f"{detail} (in {seg.label})"
        key = (kind, detail)
        if key in self._keys:
            return
        self._keys.add(key)
        home = self.src if seg is None or seg.src is None else seg.src
        file = "" if home is self.src else home.rel
        self.items.append(Evidence(kind, detail, home.line_of(offset), file=file))


def _snippet(src: Source, offset: int) -> str:
    line = src.line_of(offset)
    text = src.code[src.line_start(line) : src.line_end(line)].strip()
    return text if len(text) <= 80 else text[:77] + "..."


def _scan_segment(src: Source, seg: Segment, out: _Collector) -> None:
    code, skel = src.code, src.skeleton
    a, b = seg.start, seg.end
    http_lines: set[int] = set()

    def each(regex: re.Pattern[str], view: str, fn: Callable[[re.Match[str]], None]) -> None:
        for m in regex.finditer(view, a, b):
            fn(m)

    def http_call(m: re.Match[str]) -> None:
        recv_start = max(a, m.start() - 40)
        receiver = skel[recv_start : m.start()]
        if m.group(1).lower() == "delete" and not _HTTPISH.search(receiver):
            return
        http_lines.add(src.line_of(m.start()))
        detail = f"HTTP {m.group(1).upper()}: {_snippet(src, m.start())}"
        out.add("http_write", detail, m.start(), seg)

    each(_HTTP_VERB_CALL, skel, http_call)

    def method_line(m: re.Match[str]) -> None:
        line = src.line_of(m.start())
        raw = src.code[src.line_start(line) : src.line_end(line)]
        methods = sorted(set(re.findall(r"""["'`](GET|POST|PUT|PATCH|DELETE|HEAD)["'`]""", raw)))
        cond = " (conditional: " + "/".join(methods) + ")" if len(methods) > 1 else ""
        http_lines.add(line)
        out.add("http_write", f"HTTP method {m.group(1)}{cond}: {raw.strip()[:80]}", m.start(), seg)

    each(_METHOD_LINE, code, method_line)

    def method_arg(m: re.Match[str]) -> None:
        verb = next(g for g in m.groups() if g)
        http_lines.add(src.line_of(m.start()))
        out.add("http_write", f"HTTP {verb.upper()}: {_snippet(src, m.start())}", m.start(), seg)

    each(_METHOD_ARG, code, method_arg)
    each(
        _SQL_WRITE,
        code,
        lambda m: out.add("sql_write", f"SQL {m.group(1).split()[0].upper()}", m.start(), seg),
    )
    each(
        _DB_WRITE_CALL,
        skel,
        lambda m: out.add("sql_write", f"database write call .{m.group(1)}()", m.start(), seg),
    )
    each(
        _PROCESS,
        skel,
        lambda m: out.add("effect_call", f"runs a process: {m.group(1)}", m.start(), seg),
    )
    each(
        _FS_CHANGE,
        skel,
        lambda m: out.add(
            "effect_call",
            f"changes the filesystem: .{m.group(1) or m.group(2)}()",
            m.start(),
            seg,
        ),
    )
    each(
        _FILE_WRITE,
        code,
        lambda m: out.add(
            "effect_call", f"writes a file: {_snippet(src, m.start())}", m.start(), seg
        ),
    )

    for m in _CALL.finditer(skel, a, b):
        receiver, name = m.group(1) or "", m.group(2)
        if name in _KEYWORDS or src.line_of(m.start()) in http_lines:
            continue
        before = skel[skel.rfind("\n", 0, m.start()) + 1 : m.start()]
        if _DEFINITION.search(before):
            continue  # ``def charge(`` defines, it does not call
        if re.search(r"\bannotations\s*[=:]\s*$", before):
            continue  # ``annotations=writes(idempotent=True)`` describes, it does not write
        words = tokens(name)
        if not words:
            continue
        verbs = COMPOUND_CALL_VERBS if len(words) > 1 else CALL_VERBS
        verb = _verb(words[0], verbs)
        if verb is None and len(words) > 2 and words[0] not in READ_VERBS:
            verb = _verb(words[1], verbs)  # chat_postMessage, api_createUser
        if verb is not None and _NOT_EFFECT_OBJECTS.intersection(words[1:]):
            continue  # createReadStream, createHash: builds an object, changes nothing
        if verb in ("cancel", "send") and re.match(r"\s*\)", skel[m.end() : m.end() + 8]):
            continue  # Go ``cancel()`` of a context, reqwest ``.send()`` of a built request
        recv_words = tokens(receiver)
        if verb is None and name.lower() == "new" and MONEY.intersection(recv_words):
            verb = "new"
        if verb is None:
            continue
        if receiver and _BENIGN_RECEIVERS.match(receiver) and name.lower() in _CONTAINER_OPS:
            continue
        if (
            not receiver
            and name.lower() in _CONTAINER_OPS
            and skel[: m.start(2)].rstrip()[-1:] == "."
        ):
            continue  # ``createHash("sha256").update(x)``: a method on an expression's value
        line_text = _snippet(src, m.start())
        if name.lower() == "send" and re.search(r"(?i)\.get\s*\(", line_text):
            continue  # request builder for a GET, e.g. ``client.get(url).send()``
        call = f"{receiver}.{name}" if receiver else name
        out.add("effect_call", f"calls {call}()", m.start(), seg)


def _scan_guards(src: Source, seg: Segment, guards: _Collector, evidence: _Collector) -> None:
    code, skel = src.code, src.skeleton
    a, b = seg.start, seg.end
    for m in _IDEMPOTENCY.finditer(code, a, b):
        snippet = _snippet(src, m.start())
        if _RANDOM.search(snippet):
            evidence.add(
                "random_key", f"idempotency key made fresh per call: {snippet}", m.start(), seg
            )
        else:
            guards.add("idempotency_key", snippet, m.start(), seg)
    for m in _REQUEST_TOKEN.finditer(code, a, b):
        snippet = _snippet(src, m.start())
        line = src.line_of(m.start())
        raw = code[src.line_start(line) : src.line_end(line)]
        used = _TOKEN_CHECK.search(raw) or (
            _TOKEN_PASSED.match(code, m.end()) and not _SIGNATURE.match(raw)
        )
        if used and not _RANDOM.search(snippet):
            guards.add("request_token", snippet, m.start(), seg)
    for m in _DEDUPE.finditer(skel, a, b):
        guards.add("dedupe_check", _snippet(src, m.start()), m.start(), seg)
    for m in _SQL_CONFLICT.finditer(code, a, b):
        guards.add("sql_conflict", " ".join(m.group(0).split())[:60], m.start(), seg)
    for m in _CONDITIONAL.finditer(code, a, b):
        guards.add("conditional_request", _snippet(src, m.start()), m.start(), seg)


_WEIGHTS = {
    "http_write": (3, 1, 5),
    "sql_write": (3, 1, 5),
    "effect_call": (2, 1, 4),
    "random_key": (1, 0, 1),
}
_GUARD_WEIGHTS = {
    "idempotency_key": -5,
    "sql_conflict": -4,
    "dedupe_check": -4,
    "idempotent_hint": -4,
    "read_only_hint": -8,
    "request_token": -2,
    "conditional_request": -3,
}


def _name_verbs(words: list[str]) -> tuple[str | None, str | None, int]:
    """(read verb, effect verb, weight) for a tool's name.

    The first verb-like word leads: ``get_order`` reads (``order`` is its object), and
    ``add_issue_comment`` adds.  Words in :data:`AMBIGUOUS` lead only when a word follows
    them, so the noun at the end of ``get_user_email`` or ``user_email`` is no verb.
    """
    last = len(words) - 1

    def verb_at(i: int, verbs: frozenset[str]) -> str | None:
        v = _verb(words[i], verbs)
        if v is not None and v in AMBIGUOUS and i == last:
            return None
        return v

    either = STRONG_VERBS | WEAK_VERBS
    lead = None
    for i, w in enumerate(words):
        if w in READ_VERBS:
            return w, None, 0
        if lead := verb_at(i, either):
            break
    for i in range(len(words)):
        strong = verb_at(i, STRONG_VERBS)
        if strong is not None and (strong not in AMBIGUOUS or strong == lead):
            return None, strong, 3 if MONEY.intersection(words) else 2
    weak = next((v for i in range(len(words)) if (v := verb_at(i, WEAK_VERBS))), None)
    return None, weak, 1 if weak else 0


def _sentence_verb(text: str) -> str | None:
    """The effect verb of a description's first sentence, unless a read verb comes first
    ("Shows the commit logs" reads)."""
    words = tokens(re.split(r"[.\n]", text.strip(), maxsplit=1)[0])
    for i, w in enumerate(words):
        if _verb(w, READ_VERBS):
            return None
        v = _verb(w, STRONG_VERBS)
        if v is not None and (v not in AMBIGUOUS or i == 0):
            return v
    return None


_SETS = re.compile(
    r"HTTP (?:method )?(?:PUT|PATCH)\b(?!.*\b(?:POST|DELETE)\b)|"
    r"changes the filesystem: \.(?:writeFile|writeFileSync|rename|renameSync|replace|"
    r"write_text|write_bytes|mkdir|mkdirSync|makedirs)\(|writes a file: .*[\"']w[b+]?[\"']"
)


def _only_sets(evidence: list[Evidence]) -> bool:
    """Every write seen sets given values (PUT/PATCH, a whole-file overwrite) and none
    creates, appends or deletes; calls named by a verb alone are not writes here."""
    writes = [
        e
        for e in evidence
        if e.kind in ("http_write", "sql_write")
        or (e.kind == "effect_call" and not e.detail.startswith("calls "))
    ]
    return bool(writes) and all(_SETS.search(e.detail) for e in writes)


def analyze(src: Source, decl: ToolDecl, package: Package | None = None) -> Finding:
    """Collect evidence and guards for one tool and score them."""
    segments = _dedupe_segments(src, _follow(src, decl, package))
    evidence = _Collector(src)
    guards = _Collector(src)
    words = tokens(decl.name)

    read_verb, name_verb, name_weight = _name_verbs(words)
    if name_verb:
        evidence.add("effect_verb", f"tool name contains '{name_verb}'", src.line_start(decl.line))
    elif read_verb is None and decl.description:
        verb = _sentence_verb(decl.description)
        if verb:
            evidence.add("effect_verb", f"description says '{verb}'", src.line_start(decl.line))
            name_weight = 2
    if decl.name.startswith("<"):
        evidence.add(
            "unresolved_name",
            f"the name is written as {decl.name[1:-1]}, which the scan could not resolve",
            src.line_start(decl.line),
        )

    for seg in segments:
        _scan_segment(_home(src, seg), seg, evidence)
        _scan_guards(_home(src, seg), seg, guards, evidence)

    destructive = False
    for seg in _dedupe_segments(src, decl.decl + decl.body):
        home = _home(src, seg)
        text = home.code[seg.start : seg.end]
        for regex, kind in (
            (_READ_ONLY, "read_only_hint"),
            (_IDEMPOTENT_HINT, "idempotent_hint"),
            (_DESTRUCTIVE, "destructive_hint"),
        ):
            for m in regex.finditer(text):
                if m.group(1).lower() != "true":
                    continue
                offset = seg.start + m.start()
                label = {"read_only_hint": "readOnlyHint", "idempotent_hint": "idempotentHint"}
                if kind == "destructive_hint":
                    destructive = True
                    evidence.add("annotation", "destructiveHint=true", offset, seg)
                else:
                    guards.add(kind, f"{label[kind]}=true", offset, seg)

    has_write = any(e.kind in WRITE_KINDS for e in evidence.items)
    if has_write:
        for seg in segments:
            home = _home(src, seg)
            for regex, kind in ((_RETRY, "retry"), (_TIMEOUT, "timeout")):
                for m in regex.finditer(home.skeleton, seg.start, seg.end):
                    detail = f"{kind} around a write: {_snippet(home, m.start())}"
                    if not any(e.kind == kind for e in evidence.items):
                        evidence.add(kind, detail, m.start(), seg)

    score = name_weight + (1 if destructive else 0)
    for kind, (first, more, cap) in _WEIGHTS.items():
        count = sum(1 for e in evidence.items if e.kind == kind)
        if count:
            score += min(cap, first + more * (count - 1))
    score += 2 if any(e.kind == "retry" for e in evidence.items) else 0
    score += 1 if any(e.kind == "timeout" for e in evidence.items) else 0
    score += sum(_GUARD_WEIGHTS[k] for k in {g.kind for g in guards.items})
    if name_verb in SET_VERBS and _only_sets(evidence.items) and score >= COULD_FIRE_TWICE:
        evidence.add(
            "sets_values",
            f"'{name_verb}' with PUT/PATCH or overwrite writes only: a duplicate sets the "
            "same values "
            f"again; ranked below {COULD_FIRE_TWICE}",
            src.line_start(decl.line),
        )
        score = COULD_FIRE_TWICE - 1
    if name_verb or has_write:
        score = max(1, score)  # a guard lowers a seen write, it does not hide it

    if read_verb:
        money = _money_words(src, segments, words)
        if money:
            evidence.add(
                "money_word",
                f"read verb '{read_verb}' in name, but touches money: {', '.join(money)}",
                src.line_start(decl.line),
            )
        else:
            evidence.add(
                "read_name",
                f"read verb '{read_verb}' in name and no money words: not counted",
                src.line_start(decl.line),
            )
            score = 0

    return Finding(
        tool=decl.name,
        file=src.rel,
        line=decl.line,
        language=src.language,
        score=max(0, score),
        evidence=sorted(evidence.items, key=lambda e: (e.file, e.line)),
        guards=sorted(guards.items, key=lambda e: (e.file, e.line)),
    )


def _money_words(src: Source, segments: list[Segment], name_words: list[str]) -> list[str]:
    found = set(MONEY.intersection(name_words))
    for seg in segments:
        for ident in re.findall(r"[A-Za-z_]\w*", _home(src, seg).skeleton[seg.start : seg.end]):
            found.update(MONEY.intersection(tokens(ident)))
    return sorted(found)

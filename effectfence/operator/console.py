"""``effectfence console``: a small web page for the operator, served by the standard library.

    effectfence console [--store URL] [--http HOST:PORT] [--tokens FILE] [--show-payload]

What it shows: the intents in flight and failed (live: the page polls), one intent's
detail with its certificate and the check of its domain's chain, the audit trail, and a
chart of counters over time; and one thing it does: clear an intent, with a reason that is
required and recorded (who: the token's principal, or the user running the console on
loopback). The rule for live leases is the core's: the page offers ``force`` and the fence
decides. Server-rendered HTML and a little inline JavaScript and SVG; no external assets.

Rules, each enforced here and nowhere else:

1. Without ``--tokens`` the console binds only a loopback address; with it, every request
   but ``/healthz`` and the login page carries the token (``Authorization: Bearer``) or
   the session cookie the login set (HttpOnly, SameSite=Strict). A browser's session lives
   under a path of its own, ``/s/<random>/``, and its cookie names that path: browsers send
   a host's cookies to every port on it, so a cookie for the whole host reached any other
   server on the machine the browser was sent to (found by review); one for a path nobody
   else knows reaches none.
2. A request whose ``Host`` is not a loopback name, the bound address or a host the
   operator allowed is refused 421 (DNS rebinding: a page of another site that resolves
   to this machine cannot read it).
3. The clear is a POST with a JSON body, a per-session CSRF token in a header, and, when
   the browser sends one, an ``Origin`` equal to this server's: a form on another site can
   neither send the header nor read the token.
4. Args and results are never in a page or an answer unless the console was started with
   ``--show-payload``.

Counters: the store holds records, not the servers' in-process counters, so the chart
samples what the store shows (in flight, failed, clears) and, when the console runs with a
fence in the same process (:func:`serve`'s ``stats_fence``), that fence's ``stats()``:
the counters ``fence_stats`` reports. ``effectfence serve --http --console`` is that case:
the MCP server mounts a :class:`Console` at ``/console`` (``base``) on its own fence, with
its own tokens and hosts (:mod:`effectfence.mcp.http`); :class:`Sampler` samples for both.
"""

from __future__ import annotations

import argparse
import contextlib
import html
import json
import secrets
import signal
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, NamedTuple
from urllib.parse import parse_qs, quote, urlsplit

from effectfence.binding import DEFAULT_HOST, WILDCARD_NOTE, is_loopback, is_wildcard, parse_bind
from effectfence.errors import CLEAR_COMMAND, InvalidRequest, Refusal, StoreUnavailable
from effectfence.fence import EffectFence
from effectfence.operator.trail import (
    TrailNotKept,
    check_trail,
    kept_after_cut,
    outside_parents,
    read_trail,
)
from effectfence.operator.views import entry_view, intent_view, list_intents, open_fence, whoami

__all__ = [
    "SECURITY_HEADERS",
    "Console",
    "ConsoleServer",
    "Sampler",
    "allowed_names",
    "check_bind",
    "main",
    "serve",
]

COOKIE = "effectfence_console"
CSRF_HEADER = "X-EffectFence-CSRF"
DEFAULT_PORT = 8765
#: how often the chart samples its counters, and how many samples it keeps
SAMPLE_EVERY = 2.0
HISTORY = 600
#: the longest chain the detail page checks (the newest certificates of the domain)
CHAIN_LIMIT = 10_000
MAX_BODY = 64 * 1024
_LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")
#: seconds a console login lasts; and how many logins are kept (the oldest goes first)
SESSION_TTL = 12 * 3600.0
MAX_SESSIONS = 256
SERIES = ("in_flight", "failed", "clears", "attempts", "admitted", "replayed", "commits", "aborts")


def check_bind(host: str, principals: Any) -> None:
    """Refuse (ValueError) a non-loopback bind without tokens: anyone reaching the page could
    clear intents."""
    if principals is None and not is_loopback(host):
        raise ValueError(
            f"refusing to serve the console on {host}: it is not a loopback address and no "
            "--tokens file was given, so anyone who can reach it could clear intents. Pass "
            "--tokens FILE (one 'principal token' a line, as for serve --http), or bind "
            "127.0.0.1."
        )


def allowed_names(host: str, extra: Iterable[str] = ()) -> tuple[str, ...]:
    """The Host names (no ports) a console bound to ``host`` answers besides the loopback
    names: the bound address unless it is loopback or a wildcard, and the ``extra`` hosts
    (``name``, ``name:port`` or ``[v6]:port``)."""
    names = [] if is_loopback(host) or is_wildcard(host) else [host]
    for h in extra:
        if h.startswith("["):
            names.append(h[: h.find("]") + 1] or h)
        else:
            names.append(h.split(":")[0] if h.count(":") == 1 else h)
    return tuple(names)


@dataclass(frozen=True, slots=True)
class _Session:
    """A browser's login: who, its CSRF token, the key of the token it logged in with
    (checked at every request), and when it ends (on the console's clock)."""

    name: str
    csrf: str
    key: str
    expires: float
    #: the path segment this login's pages live under (``/s/<path>/``), named by its cookie
    path: str


class _Who(NamedTuple):
    """Who sent a request: the principal, the CSRF token its clears carry ("" for a bearer
    client), and the path its pages link under."""

    name: str
    csrf: str
    base: str


class Console:
    """The application: routes in, (status, content type, body, headers) out. No sockets.

    ``base`` is the path it is mounted under ("" at the root, ``/console`` on ``serve
    --http --console``): every route answers below it, and every link, fetch, redirect,
    form and cookie names it. ``allow_clear`` False makes it look-only: the clear is
    refused 403 and the page says how an operator clears instead."""

    def __init__(
        self,
        fence: EffectFence,
        *,
        principals: Any = None,
        show_payload: bool = False,
        who: str | None = None,
        stats_fence: EffectFence | None = None,
        store_label: str = "",
        allowed_hosts: tuple[str, ...] = (),
        base: str = "",
        allow_clear: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if base and (not base.startswith("/") or base.endswith("/")):
            raise ValueError(f"a console's base path is '' or /name, not {base!r}")
        self.base = base
        self.allow_clear = allow_clear
        self.fence = fence
        self.principals = principals
        self.show_payload = show_payload
        self.who = who or whoami()
        self.stats_fence = stats_fence
        self.store_label = store_label or fence.store.name
        self.allowed_hosts = {h.lower() for h in (*_LOOPBACK, *allowed_hosts)}
        self.samples: deque[dict[str, Any]] = deque(maxlen=HISTORY)
        self._sessions: dict[str, _Session] = {}  # cookie -> its login, oldest first
        self._clock = clock
        self._open_csrf = secrets.token_urlsafe(24)  # the one session of a loopback console
        self._lock = threading.Lock()

    # -- samples --------------------------------------------------------------------------
    def sample(self) -> dict[str, Any]:
        """One point of the chart: what the store shows, and the in-process fence's counters."""
        store = self.fence.store
        point: dict[str, Any] = {"t": time.time()}
        for name, states in (("in_flight", "in-flight"), ("failed", "failed")):
            point[name] = len(list_intents(self.fence, states=[states], limit=100_000))
        last = self.fence.audit(limit=1)
        point["clears"] = last[-1].id if last else 0  # ids only grow: a running count
        if self.stats_fence is not None:
            stats = self.stats_fence.stats()
            prepare = stats["prepare"]
            point.update(
                attempts=stats["attempts"],
                admitted=prepare["admitted"],
                replayed=prepare["replayed"],
                commits=stats["commits"],
                aborts=stats["aborts"],
            )
        del store
        with self._lock:
            self.samples.append(point)
        return point

    # -- authentication ---------------------------------------------------------------------
    def _session(self, headers: dict[str, str], path: str | None) -> _Who | None:
        """Who sent the request, or None when it is not authenticated. ``path`` is the
        ``/s/<path>/`` the request came under, if any: a login's cookie counts there only."""
        if self.principals is None:
            return None if path is not None else _Who(self.who, self._open_csrf, self.base)
        if path is None:
            name = self.principals.authenticate(headers.get("authorization"))
            # a bearer client is not a browser: no CSRF token needed
            return None if name is None else _Who(name, "", self.base)
        for part in headers.get("cookie", "").split(";"):
            key, _, value = part.strip().partition("=")
            if key == COOKIE:
                with self._lock:
                    login = self._sessions.get(value)
                    if login is None:
                        return None
                    # a login lasts while its token names its principal, and no longer
                    # than SESSION_TTL: revoking a token (SIGHUP) ends its sessions too
                    if login.expires <= self._clock() or not self.principals.still_names(
                        login.key, login.name
                    ):
                        del self._sessions[value]
                        return None
                    if login.path != path:  # another login's path: not this cookie's
                        return None
                    return _Who(login.name, login.csrf, f"{self.base}/s/{login.path}")
        return None

    def _host_ok(self, headers: dict[str, str]) -> bool:
        host = headers.get("host", "")
        name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
        return name.lower() in self.allowed_hosts

    # -- dispatch ---------------------------------------------------------------------------
    def handle(
        self, method: str, target: str, headers: dict[str, str], body: bytes
    ) -> tuple[int, str, bytes, list[tuple[str, str]]]:
        headers = {k.lower(): v for k, v in headers.items()}
        if not self._host_ok(headers):
            return _text(421, "unknown Host: this console answers its own names only")
        url = urlsplit(target)
        path, query = url.path, parse_qs(url.query)
        if self.base:
            if path == self.base:
                path = "/"
            elif path.startswith(self.base + "/"):
                path = path[len(self.base) :]
            else:
                return _json(404, {"error": "not_found"})
        if path == "/healthz":
            return _json(200, {"ok": True})
        if path == "/login" and self.principals is not None:
            return self._login(method, headers, body)
        own: str | None = None
        if path.startswith("/s/"):  # a browser's login: /s/<its path>/...
            own, _, rest = path[3:].partition("/")
            path = "/" + rest
        session = self._session(headers, own)
        if session is None:
            if method == "GET" and not path.startswith("/api/"):
                return 303, "text/plain", b"", [("Location", f"{self.base}/login")]
            return _json(401, {"error": "unauthorized", "message": "log in, or send a token"})
        try:
            if method == "GET" and path == "/":
                return _html(200, self.page_index(session))
            if method == "GET" and path == "/intent":
                return _html(200, self.page_intent(_one(query, "id"), session))
            if method == "GET" and path == "/api/intents":
                return _json(200, self.api_intents())
            if method == "GET" and path == "/api/intent":
                return _json(200, self.api_intent(_one(query, "id")))
            if method == "GET" and path == "/api/stats":
                with self._lock:
                    return _json(200, {"series": SERIES, "samples": list(self.samples)})
            if method == "POST" and path == "/api/clear":
                return self.api_clear(headers, body, session)
        except StoreUnavailable as exc:
            return _json(503, exc.to_payload())
        except InvalidRequest as exc:  # a name no store can hold (NUL), say
            return _json(400, exc.to_payload())
        return _json(404, {"error": "not_found"})

    def _login(
        self, method: str, headers: dict[str, str], body: bytes
    ) -> tuple[int, str, bytes, list[tuple[str, str]]]:
        if method == "POST":
            if not _same_origin(headers):
                return _text(403, "cross-origin login refused")
            token = parse_qs(body.decode("utf-8", "replace")).get("token", [""])[0]
            got = self.principals.login(token)
            if got is not None:
                cookie = secrets.token_urlsafe(32)
                own = secrets.token_urlsafe(16)
                now = self._clock()
                with self._lock:
                    sessions = self._sessions
                    for old in [c for c, s in sessions.items() if s.expires <= now]:
                        del sessions[old]
                    while len(sessions) >= MAX_SESSIONS:
                        del sessions[next(iter(sessions))]
                    sessions[cookie] = _Session(
                        got[0], secrets.token_urlsafe(24), got[1], now + SESSION_TTL, own
                    )
                attrs = f"HttpOnly; SameSite=Strict; Path={self.base}/s/{own}/"
                return (
                    303,
                    "text/plain",
                    b"",
                    [
                        ("Location", f"{self.base}/s/{own}/"),
                        ("Set-Cookie", f"{COOKIE}={cookie}; {attrs}"),
                    ],
                )
        form = (
            f"<h1>effectfence console</h1><form method=post action='{_e(self.base)}/login'>"
            "<label>token <input type=password name=token autocomplete=off required></label> "
            "<button>log in</button></form>"
        )
        return _html(401 if method == "POST" else 200, self._page("log in", form, "", self.base))

    # -- data -------------------------------------------------------------------------------
    def api_intents(self) -> dict[str, Any]:
        fence = self.fence
        rows = list_intents(
            fence, states=["in-flight", "failed"], limit=1000, show_payload=self.show_payload
        )
        now = fence.store.now()
        audit = [entry_view(e, now) for e in reversed(fence.audit(limit=20))]
        return {"intents": rows, "audit": audit, "store": self.store_label}

    def api_intent(self, intent: str) -> dict[str, Any]:
        rec, now = self.fence.record(intent)
        view = intent_view(intent, rec, now, show_payload=self.show_payload)
        view["audit"] = [entry_view(e, now) for e in self.fence.audit(intent, limit=50)]
        view["chain"] = self.chain(view.get("domain")) if view.get("cert") else None
        return view

    def chain(self, domain: str | None) -> dict[str, Any]:
        if domain is None:
            return {"ok": None, "reason": "no domain"}
        # the newest CHAIN_LIMIT seqs (it read the oldest: a busy domain's recent
        # certificates, the one on the page among them, went unchecked; found by review),
        # and what they follow from the PAGE seqs before them (overlapping attempts)
        start = max(0, self.fence.current(domain) - CHAIN_LIMIT)
        try:
            certs = list(read_trail(self.fence.store, domain, after_seq=start, limit=CHAIN_LIMIT))
            # parents before the window, however far back (a long effect's parent can be
            # more than a page before it: looked for in one page only, a sound trail was
            # called BROKEN, found by review); read backwards, stopping once all are found
            cut = self.fence.store.trail_cut(domain)
            before = outside_parents(self.fence.store, domain, certs, cut=cut)
            kept = kept_after_cut(self.fence.store, domain, cut, start)
        except TrailNotKept as exc:
            return {"ok": None, "reason": str(exc)}
        report = check_trail(certs, outside=before, cut=cut, kept_before=kept, root=None)
        return report.to_dict()

    def api_clear(
        self, headers: dict[str, str], body: bytes, session: _Who
    ) -> tuple[int, str, bytes, list[tuple[str, str]]]:
        who, csrf = session.name, session.csrf
        if not self.allow_clear:
            return _json(403, {"error": "clear_disabled", "message": _CLEAR_OFF})
        if csrf and (
            not secrets.compare_digest(headers.get(CSRF_HEADER.lower(), ""), csrf)
            or not _same_origin(headers)
        ):
            return _json(403, {"error": "csrf", "message": "a clear comes from this page only"})
        if len(body) > MAX_BODY:
            return _json(413, {"error": "too_large"})
        try:
            data = json.loads(body or b"{}")
            intent, reason = data.get("intent"), data.get("reason")
            force = data.get("force", False) is True
            # what the page showed: a record that moved since is not cleared (found by
            # review: a forced clear hit a lease taken over after the operator looked)
            state, token = data.get("expect_state"), data.get("expect_token")
            if (
                type(intent) is not str
                or type(reason) is not str
                or (state is not None and type(state) is not str)
                or (token is not None and type(token) is not int)
            ):
                raise InvalidRequest(
                    'send {"intent": ..., "reason": ..., "force": bool, "expect_state": '
                    '"in_flight"|"done"|"failed", "expect_token": int}'
                )
            entry = self.fence.clear(
                intent,
                reason=reason,
                who=f"{who} (console)",
                force=force,
                expect_state=state,
                expect_token=token,
            )
        except (ValueError, AttributeError) as exc:
            return _json(400, {"code": "invalid_request", "message": str(exc)})
        except RecursionError:  # json.loads of a deeply nested body: malformed input too
            return _json(400, {"code": "invalid_request", "message": "body is nested too deeply"})
        except Refusal as exc:
            status = 400 if isinstance(exc, InvalidRequest) else 409
            return _json(status, exc.to_payload())
        if entry is None:
            return _json(404, {"cleared": False, "message": f"{intent!r} has no record"})
        return _json(200, {"cleared": True, "audit": entry_view(entry, self.fence.store.now())})

    # -- pages ------------------------------------------------------------------------------
    def page_index(self, session: _Who) -> str:
        data = self.api_intents()
        body = (
            f"<h1>effectfence console</h1><p class=muted>store {_e(self.store_label)} &middot; "
            f"signed in as {_e(session.name)}</p>"
            "<h2>In flight and failed</h2>"
            "<table id=intents><thead><tr><th>intent</th><th>state</th><th>domain</th>"
            "<th>holder</th><th>token</th><th>age</th><th>detail</th></tr></thead>"
            f"<tbody>{_intent_rows(data['intents'], session.base)}</tbody></table>"
            "<h2>Counters</h2><svg id=chart width=720 height=220 role=img "
            "aria-label='counters over time'></svg><div id=legend></div>"
            "<h2>Audit</h2><table id=audit><thead><tr><th>#</th><th>when</th><th>intent</th>"
            "<th>who</th><th>was</th><th>reason</th></tr></thead>"
            f"<tbody>{_audit_rows(data['audit'])}</tbody></table>"
        )
        return self._page("effectfence console", body, _INDEX_JS, session.base)

    def page_intent(self, intent: str, session: _Who) -> str:
        v = self.api_intent(intent)
        skip = {"cert", "audit", "chain", "detail"}
        facts = "".join(
            f"<dt>{_e(k)}</dt><dd id=f-{_e(k)}>{_e(_fmt(k, val))}</dd>"
            for k, val in v.items()
            if k not in skip and val is not None
        )
        parts = [
            f"<p><a href='{_e(session.base)}/'>&larr; all intents</a></p><h1>{_e(intent)}</h1>"
            f"<dl>{facts}</dl>"
        ]
        cert = v.get("cert")
        if cert:
            rows = "".join(
                f"<dt>{_e(k)}</dt><dd>{_e(json.dumps(val) if k in ('args', 'result') else val)}"
                "</dd>"
                for k, val in cert.items()
            )
            parts.append(f"<h2>Certificate</h2><dl id=cert>{rows}</dl>")
            chain = v["chain"] or {}
            if chain.get("ok") is None:
                verdict = f"not checked: {chain.get('reason', '')}"
            elif chain["ok"]:
                verdict = (
                    f"OK: {chain['length']} certificate(s), seq {chain['first_seq']}.."
                    f"{chain['last_seq']}; gaps {chain['gaps'] or 'none'}"
                )
            else:
                verdict = f"BROKEN at seq {chain['broken_at_seq']}: {chain['reason']}"
            parts.append(f"<h2>Chain of {_e(cert['domain'])}</h2><p id=chain>{_e(verdict)}</p>")
        parts.append(
            "<h2>Audit</h2><table id=audit><thead><tr><th>#</th><th>when</th><th>intent</th>"
            f"<th>who</th><th>was</th><th>reason</th></tr></thead><tbody>"
            f"{_audit_rows(list(reversed(v['audit'])))}</tbody></table>"
        )
        if v["state"] != "absent" and not self.allow_clear:
            parts.append(f"<h2>Clear</h2><p id=clear-off>{_e(_CLEAR_OFF)}</p>")
        elif v["state"] != "absent":
            force = (
                "<label><input type=checkbox id=force> force: its holder's lease is live; "
                "clear only if you know it is not running</label><br>"
                if v["state"] == "in_flight"
                else ""
            )
            parts.append(
                "<h2>Clear</h2><form id=clear-form><label for=reason>reason (recorded)</label><br>"
                "<textarea id=reason name=reason required minlength=3 rows=3 cols=60>"
                f"</textarea><br>{force}<button id=clear type=submit>clear {_e(intent)}"
                "</button></form><p id=result role=status></p>"
            )
        csrf = session.csrf
        seen = {"state": v["state"], "token": v.get("token")}  # what fence.clear compares
        data = json.dumps({"intent": intent, "csrf": csrf, "header": CSRF_HEADER, **seen})
        return self._page(
            intent,
            "".join(parts),
            _INTENT_JS.replace("__DATA__", _script_json(data)),
            session.base,
        )

    def _page(self, title: str, body: str, script: str, base: str) -> str:
        """A whole page; its script knows the path its links go under as BASE."""
        return _page(title, body, f"const BASE={_script_json(json.dumps(base))};" + script)


# -- HTML helpers ------------------------------------------------------------------------------
def _e(v: Any) -> str:
    return html.escape(str(v), quote=True)


def _fmt(key: str, value: Any) -> str:
    from effectfence.operator.views import format_age

    if key in ("age", "lease_left", "result_left") and isinstance(value, int | float):
        return format_age(value)
    return str(value)


def _script_json(data: str) -> str:
    """JSON as a JavaScript expression inside a <script>: no '</' can close the element, and
    no line separator can end a string. Used as an expression, never inside a string
    literal: an intent name in a quoted JSON.parse('...') ended the literal and ran as
    script in the console's origin (found by review: an agent's intent name made the
    operator's browser force-clear a live lease)."""
    return (
        data.replace("<", "\\u003c")
        .replace(">", "\\u003e")
        .replace("&", "\\u0026")
        .replace("\u2028", "\\u2028")
        .replace("\u2029", "\\u2029")
    )


def _intent_rows(rows: list[dict[str, Any]], base: str) -> str:
    from effectfence.operator.views import format_age

    return "".join(
        f"<tr data-intent='{_e(r['intent'])}'><td>"
        f"<a href='{_e(base)}/intent?id={quote(r['intent'])}'>"
        f"{_e(r['intent'])}</a></td><td class='state {_e(r['state'])}'>{_e(r['state'])}</td>"
        f"<td>{_e(r.get('domain', ''))}</td><td>{_e(r.get('holder', ''))}</td>"
        f"<td>{_e(r.get('token', ''))}</td><td>{_e(format_age(r.get('age')))}</td>"
        f"<td>{_e(r.get('detail', ''))}</td></tr>"
        for r in rows
    )


def _audit_rows(entries: list[dict[str, Any]]) -> str:
    return "".join(
        f"<tr><td>{e['id']}</td><td>{_e(e['when'])}</td><td>{_e(e['intent'])}</td>"
        f"<td>{_e(e['who'])}</td><td>{_e(e['previous'].get('state', ''))}"
        f"{' (forced)' if e['forced'] else ''}</td><td>{_e(e['reason'])}</td></tr>"
        for e in entries
    )


_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#222}
table{border-collapse:collapse;margin:.5em 0}td,th{border-bottom:1px solid #ddd;padding:.25em .6em;
text-align:left}.failed{color:#b00020;font-weight:600}.in_flight{color:#8a5a00}
.muted{color:#777}dt{font-weight:600;float:left;clear:left;width:9em}dd{margin-left:10em}
#legend span{margin-right:1em}
"""


def _page(title: str, body: str, script: str) -> str:
    return (
        "<!doctype html><html lang=en><head><meta charset=utf-8>"
        f"<title>{_e(title)}</title><style>{_CSS}</style></head><body>{body}"
        f"<script>{script}</script></body></html>"
    )


# The index page: the intents table and the audit table are redrawn from /api/intents,
# the chart from /api/stats, once a second. Text goes in through textContent only.
_INDEX_JS = r"""
const COLORS = ["#b00020","#8a5a00","#1565c0","#2e7d32","#6a1b9a","#00838f","#555","#ef6c00"];
function age(s){if(s===null||s===undefined)return "-";s=Math.max(0,Math.floor(s));
 if(s<60)return s+"s";if(s<3600)return Math.floor(s/60)+"m"+String(s%60).padStart(2,"0")+"s";
 if(s<86400)return Math.floor(s/3600)+"h"+String(Math.floor(s%3600/60)).padStart(2,"0")+"m";
 return Math.floor(s/86400)+"d";}
function cell(tr,text,cls){const td=document.createElement("td");td.textContent=text;
 if(cls)td.className=cls;tr.appendChild(td);return td;}
async function refresh(){
 try{
  const r=await fetch(BASE+"/api/intents",{credentials:"same-origin"});if(!r.ok)return;
  const d=await r.json();const tb=document.querySelector("#intents tbody");tb.replaceChildren();
  for(const x of d.intents){const tr=document.createElement("tr");tr.dataset.intent=x.intent;
   const a=document.createElement("a");a.href=BASE+"/intent?id="+encodeURIComponent(x.intent);
   a.textContent=x.intent;cell(tr,"").appendChild(a);cell(tr,x.state,"state "+x.state);
   cell(tr,x.domain||"");cell(tr,x.holder||"");cell(tr,String(x.token??""));
   cell(tr,age(x.age));cell(tr,x.detail||"");tb.appendChild(tr);}
  const ab=document.querySelector("#audit tbody");ab.replaceChildren();
  for(const e of d.audit){const tr=document.createElement("tr");cell(tr,String(e.id));
   cell(tr,e.when);cell(tr,e.intent);cell(tr,e.who);
   cell(tr,(e.previous.state||"")+(e.forced?" (forced)":""));cell(tr,e.reason);ab.appendChild(tr);}
 }catch(e){}
}
async function chart(){
 try{
  const r=await fetch(BASE+"/api/stats",{credentials:"same-origin"});if(!r.ok)return;
  const d=await r.json();const svg=document.getElementById("chart");const W=720,H=220,P=30;
  const s=d.samples;svg.replaceChildren();const legend=document.getElementById("legend");
  legend.replaceChildren();if(s.length<1)return;
  const t0=s[0].t,t1=Math.max(s[s.length-1].t,t0+1);let max=1;
  for(const p of s)for(const k of d.series)if(typeof p[k]==="number")max=Math.max(max,p[k]);
  const NS="http://www.w3.org/2000/svg";
  const axis=document.createElementNS(NS,"text");axis.setAttribute("x",2);
  axis.setAttribute("y",12);axis.textContent=String(max);svg.appendChild(axis);
  d.series.forEach((k,i)=>{const pts=s.filter(p=>typeof p[k]==="number")
    .map(p=>((p.t-t0)/(t1-t0)*(W-2*P)+P).toFixed(1)+","+(H-P-p[k]/max*(H-2*P)).toFixed(1));
   if(!pts.length)return;const pl=document.createElementNS(NS,"polyline");
   pl.setAttribute("points",pts.join(" "));pl.setAttribute("fill","none");
   pl.setAttribute("stroke",COLORS[i%COLORS.length]);pl.setAttribute("stroke-width","2");
   pl.dataset.series=k;svg.appendChild(pl);const sp=document.createElement("span");
   sp.style.color=COLORS[i%COLORS.length];sp.textContent=k+" "+s[s.length-1][k];
   legend.appendChild(sp);});
 }catch(e){}
}
refresh();chart();setInterval(refresh,1000);setInterval(chart,2000);
"""

# The detail page: the clear form posts JSON with the CSRF header and the version it
# showed (state and token); the answer is shown.
_INTENT_JS = r"""
const D=__DATA__;
const form=document.getElementById("clear-form");
if(form)form.addEventListener("submit",async ev=>{
 ev.preventDefault();const out=document.getElementById("result");
 const reason=document.getElementById("reason").value.trim();
 if(!reason){out.textContent="a reason is required";return;}
 const f=document.getElementById("force");const h={"Content-Type":"application/json"};
 h[D.header]=D.csrf;
 const r=await fetch(BASE+"/api/clear",{method:"POST",credentials:"same-origin",headers:h,
  body:JSON.stringify({intent:D.intent,reason:reason,force:!!(f&&f.checked),
   expect_state:D.state,expect_token:D.token})});
 const d=await r.json();
 if(d.cleared){out.textContent="cleared: audit #"+d.audit.id+" by "+d.audit.who;
  out.dataset.cleared="1";}
 else{out.textContent="refused "+(d.code||d.error||"")+": "+(d.message||"")
  +(d.recover?" | what to do: "+d.recover:"");}
});
"""


def _one(query: dict[str, list[str]], key: str) -> str:
    values = query.get(key) or [""]
    if not values[0]:
        raise InvalidRequest(f"missing ?{key}=")
    return values[0]


def _same_origin(headers: dict[str, str]) -> bool:
    origin = headers.get("origin")
    if origin is None:
        return True  # not a browser's cross-site request (those always send Origin on POST)
    return origin in (f"http://{headers.get('host', '')}", f"https://{headers.get('host', '')}")


Response = tuple[int, str, bytes, list[tuple[str, str]]]


def _json(status: int, data: Any) -> Response:
    return status, "application/json", json.dumps(data, sort_keys=True).encode(), []


def _html(status: int, text: str) -> Response:
    return status, "text/html; charset=utf-8", text.encode(), []


def _text(status: int, text: str) -> Response:
    return status, "text/plain; charset=utf-8", text.encode(), []


#: what a look-only console (``serve --http --console`` without ``--allow-clear``) says
_CLEAR_OFF = (
    "this console does not clear: its server runs without --allow-clear. An operator "
    f"clears with {CLEAR_COMMAND}, or the server is started with --allow-clear"
)

#: sent with every answer of a console, wherever it is served
SECURITY_HEADERS = [
    # inline script and style are ours; nothing loads from anywhere else
    (
        "Content-Security-Policy",
        "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
        "connect-src 'self'; img-src 'self'; form-action 'self'; frame-ancestors 'none'",
    ),
    ("X-Content-Type-Options", "nosniff"),
    # not no-referrer: under it a browser sends "Origin: null" with the login form's POST,
    # which the same-origin check must refuse; same-origin still tells other sites nothing
    ("Referrer-Policy", "same-origin"),
    ("Cache-Control", "no-store"),
]


class Sampler:
    """Takes one :meth:`Console.sample` every ``every`` seconds, in a thread of its own (a
    sample reads the store), from :meth:`start` until :meth:`stop`. Whoever serves a console
    runs one: :class:`ConsoleServer`, and ``serve --http --console``."""

    def __init__(self, console: Console, every: float = SAMPLE_EVERY) -> None:
        self.console = console
        self.every = every
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._loop, name="effectfence-console-sampler", daemon=True
        )

    def start(self) -> Sampler:
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.is_set():
            # a store hiccup leaves a hole in the chart, nothing else
            with contextlib.suppress(Exception):
                self.console.sample()
            self._stop.wait(self.every)

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)


class ConsoleServer(ThreadingHTTPServer):
    """The HTTP server of one :class:`Console`, and its :class:`Sampler`."""

    daemon_threads = True

    def __init__(self, console: Console, host: str, port: int) -> None:
        self.console = console
        if ":" in host:
            self.address_family = socket.AF_INET6
        super().__init__((host, port), _Handler)
        self._sampler: Sampler | None = None

    @property
    def url(self) -> str:
        """Where to call it: a wildcard bind's loopback name (``0.0.0.0`` is answered 421)."""
        host, port = self.server_address[:2]
        name = host.decode() if isinstance(host, bytes) else str(host)
        if is_wildcard(name):
            name = "::1" if ":" in name else "127.0.0.1"
        shown = f"[{name}]" if ":" in name else name
        return f"http://{shown}:{port}"

    def start(self, every: float = SAMPLE_EVERY) -> threading.Thread:
        """Serve in a thread (for tests and embedding); :meth:`stop` ends it."""
        self._sampler = Sampler(self.console, every).start()
        t = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.1})
        t.daemon = True
        t.start()
        return t

    def stop(self) -> None:
        if self._sampler is not None:
            self._sampler.stop()
        self.shutdown()
        self.server_close()


#: seconds a console connection may sit without sending what its request needs
HANDLER_TIMEOUT = 30.0


class _Handler(BaseHTTPRequestHandler):
    server: ConsoleServer
    protocol_version = "HTTP/1.1"
    # Headers and body leave in two writes; with Nagle on, the body of every answer on a
    # kept-alive connection would wait for the browser's delayed ACK (~40 ms).
    disable_nagle_algorithm = True
    # a client that stops sending (mid-headers or mid-body) lets its thread go after this
    timeout = HANDLER_TIMEOUT

    def _serve(self, method: str) -> None:
        # Judged before anything is read, and before authentication (found by review):
        # "-1" read until the client closed, past MAX_BODY and for as long as it liked, and
        # a chunked body went unread and was then parsed as the next request.
        if self.headers.get("Transfer-Encoding") is not None:
            self.close_connection = True
            self.send_error(HTTPStatus.LENGTH_REQUIRED, "send the body with a Content-Length")
            return
        declared = (self.headers.get("Content-Length") or "0").strip()
        if not declared.isdigit():
            self.close_connection = True
            self.send_error(HTTPStatus.BAD_REQUEST, "Content-Length must be a whole number")
            return
        length = int(declared)
        if length > MAX_BODY:
            self.close_connection = True
            self.send_error(HTTPStatus.REQUEST_ENTITY_TOO_LARGE)
            return
        body = self.rfile.read(length) if length else b""
        status, ctype, data, extra = self.server.console.handle(
            method, self.path, dict(self.headers.items()), body
        )
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        for k, v in (*SECURITY_HEADERS, *extra):
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._serve("GET")

    def do_POST(self) -> None:
        self._serve("POST")

    def log_message(self, format: str, *args: Any) -> None:  # quiet: no URLs in logs
        pass


def serve(
    fence: EffectFence,
    *,
    host: str = DEFAULT_HOST,
    port: int = 0,
    principals: Any = None,
    **options: Any,
) -> ConsoleServer:
    """A console server bound and ready (not yet serving): ``.start()`` serves in a thread,
    ``.serve_forever()`` in this one."""
    check_bind(host, principals)
    allowed = allowed_names(host, options.pop("allowed_hosts", ()))
    console = Console(fence, principals=principals, allowed_hosts=allowed, **options)
    return ConsoleServer(console, host, port)


def _reload_on_hangup(principals: Any) -> None:
    """SIGHUP reads the tokens file again, as ``serve --http`` does; each reload says on
    stderr what it did. Unhandled, SIGHUP ended the console (found by review: the docs
    send it to revoke a token)."""
    hangup = getattr(signal, "SIGHUP", None)
    if hangup is None:  # Windows: restart to change tokens
        return

    def reload(*_: Any) -> None:
        print(json.dumps(principals.reload()), file=sys.stderr, flush=True)

    with contextlib.suppress(ValueError):  # not the main thread (main() called in a test)
        signal.signal(hangup, reload)


def main(
    argv: list[str] | None = None, *, ready: Callable[[ConsoleServer], None] | None = None
) -> int:
    p = argparse.ArgumentParser(prog="effectfence console", description=__doc__.split("\n")[0])
    p.add_argument("--store", metavar="URL", help="the store (default: the servers' default)")
    p.add_argument(
        "--http",
        metavar="HOST:PORT",
        default=f"{DEFAULT_HOST}:{DEFAULT_PORT}",
        help="where to listen (loopback by default; another address needs --tokens)",
    )
    p.add_argument("--tokens", metavar="FILE", help="bearer tokens, as for serve --http")
    p.add_argument("--allow-host", action="append", default=[], help="another Host name to answer")
    p.add_argument("--who", help="who clears, on a console without tokens (default: OS user)")
    p.add_argument(
        "--show-payload",
        action="store_true",
        help="show args and results (they may hold personal data)",
    )
    args = p.parse_args(argv)
    from pathlib import Path

    from effectfence.store import redact

    principals = None
    if args.tokens:
        from effectfence.mcp.http import Principals  # the serve --http token file format

        try:
            principals = Principals.load(Path(args.tokens))
        except ValueError as exc:
            print(f"effectfence console: {exc}", file=sys.stderr)
            return 2
    try:
        host, port = parse_bind(args.http)  # the rule serve --http binds by
    except ValueError as exc:
        print(f"effectfence console: {exc}", file=sys.stderr)
        return 2
    try:
        fence = open_fence(args.store)
    except (ValueError, RuntimeError, StoreUnavailable) as exc:
        print(f"effectfence console: can't open the store: {exc}", file=sys.stderr)
        return 1
    label = redact(args.store) if args.store else "default store"
    try:
        server = serve(
            fence,
            host=host,
            port=port,
            principals=principals,
            show_payload=args.show_payload,
            who=args.who,
            store_label=label,
            allowed_hosts=tuple(args.allow_host),
        )
    except (ValueError, OSError) as exc:
        print(f"effectfence console: {exc}", file=sys.stderr)
        fence.close()
        return 2
    line = {"event": "listening", "url": server.url, "store": label}
    if is_wildcard(host) and not args.allow_host:
        line["note"] = WILDCARD_NOTE
    print(json.dumps(line), file=sys.stderr, flush=True)
    if principals is not None:
        _reload_on_hangup(principals)
    if ready is not None:
        ready(server)
    server.start()
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
        fence.close()
    return 0

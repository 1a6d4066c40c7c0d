"""Streamable HTTP: one server and one fence shared by many agents, who are named by tokens.

The path of a request::

    client ── uvicorn ── _Gate ──────────────────── the SDK's Starlette app ── the tools
                          │ /healthz  (no token: store reachable, /mcp up?)  /mcp: DNS-rebinding
                          │ /console/ (with --console: the operator's page,    protection, body
                          │           which checks the same tokens itself)     limit, sessions
                          │ bearer token -> principal, else 401
                          │ /metrics  (Prometheus text)
                          └ the principal rides in the ASGI scope (PRINCIPAL_SCOPE_KEY)

Rules, each enforced here and nowhere else:

1. With a tokens file, every request but ``/healthz`` carries ``Authorization: Bearer
   <token>`` naming a principal, or is answered 401 before anything reads it. The check
   runs per request, not per session: a session id is not a credential. A session belongs
   to the principal that opened it (the SDK's own check, fed ``scope["user"]``): another
   principal naming it is answered 404, as for a session that does not exist.
2. Without a tokens file the server binds only a loopback address (``check_exposure``):
   an open fence on a network would let anyone prepare and commit.
3. DNS-rebinding protection (the SDK's Host and Origin checks) is always on; the allowed
   hosts are the loopback names, the bound address and what the operator adds. Our own
   routes get the same checks.

The principal is the certificate's agent (:mod:`effectfence.mcp.server` reads it from the
scope); tokens are compared by their SHA-256, so the file may hold hashes instead.

The console (``serve --http --console``) is :class:`effectfence.operator.console.Console`
mounted at ``/console``: the same fence (so its chart has the counters ``fence_stats``
reports, which only this process has), the same principals (a browser logs in once with a
token and gets a session cookie; a script sends the bearer token), the same hosts. Its own
rules hold there as on ``effectfence console``: Host check, CSRF on the clear, no args or
results without ``--show-payload``. It clears only with ``--allow-clear``: the console gives
no one a power the server's tools do not.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import signal
import socket
import stat
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
from mcp.server import MCPServer
from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser
from mcp.server.auth.provider import AccessToken
from mcp.server.transport_security import (
    DEFAULT_MAX_REQUEST_BODY_SIZE,
    TransportSecurityMiddleware,
    TransportSecuritySettings,
)
from starlette.authentication import AuthCredentials
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from effectfence.binding import DEFAULT_HOST, WILDCARD_NOTE, is_loopback, is_wildcard, parse_bind
from effectfence.errors import StoreUnavailable
from effectfence.fence import EffectFence
from effectfence.mcp.server import PRINCIPAL_SCOPE_KEY
from effectfence.mcp.telemetry import Metrics

if TYPE_CHECKING:
    from effectfence.operator.console import Console

__all__ = [
    "CONSOLE_PATH",
    "HEALTH_PATH",
    "MCP_PATH",
    "METRICS_PATH",
    "Principals",
    "check_exposure",
    "console_for",
    "is_loopback",
    "parse_bind",
    "serve_http",
]

MCP_PATH = "/mcp"
HEALTH_PATH = "/healthz"
METRICS_PATH = "/metrics"
CONSOLE_PATH = "/console"
#: a plain token shorter than this is refused: it could be guessed
MIN_TOKEN_LENGTH = 16
#: sessions one principal may hold open at once. The SDK bounds all sessions together
#: (10,000, each kept 30 minutes idle), so one principal opening that many locked every
#: other principal out of new sessions for half an hour (found by review)
SESSIONS_PER_PRINCIPAL = 256
HEALTH_TIMEOUT = 5.0
#: seconds a /healthz probe of the store is reused for
HEALTH_FRESH = 1.0
#: seconds calls in progress get to finish once the server is told to stop (SIGTERM, ^C):
#: as long as a store step waits for a lock (SQLite's busy_timeout is 10 s)
GRACEFUL_SHUTDOWN = 10
#: the largest MCP request body read (bytes): the SDK's bound, answered here in JSON-RPC
MAX_MCP_BODY = DEFAULT_MAX_REQUEST_BODY_SIZE
_PRINCIPAL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@:+-]{0,127}")
_TOKEN = re.compile(r"[\x21-\x7e]+")  # visible ASCII, as a header value carries it
_HASHED = re.compile(r"sha256:([0-9a-f]{64})")
#: a secret that starts like a hash's label in another spelling (SHA256:, sha-256:,
#: {SHA256}...): read as a plain token, the hash itself would log in (found by review)
_HASH_LABEL = re.compile(r"(?i)(\{sha[-_]?(2[-_])?256\}|sha[-_]?(2[-_])?256[^a-z0-9])")
_HEX64 = re.compile(r"[0-9a-fA-F]{64}")


class NoTokens(ValueError):
    """The tokens file names no token, or is gone or unreadable: nobody is named."""


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class Principals:
    """Bearer tokens and the principals they name, read from a file the operator controls.

    One entry a line: ``principal token`` or ``principal sha256:<hex of the token's
    SHA-256>``; blank lines and ``#`` comments are skipped. A principal may have several
    tokens (rotation); a token names exactly one principal."""

    __slots__ = ("_by_digest", "hash_like", "plain", "source")

    def __init__(
        self,
        by_digest: dict[str, str],
        *,
        plain: bool = False,
        source: Path | None = None,
        hash_like: tuple[str, ...] = (),
    ) -> None:
        if not by_digest:
            raise NoTokens("no tokens: a tokens file needs at least one 'principal token' line")
        self._by_digest = dict(by_digest)
        #: whether any token was given in clear (the file is then a secret itself)
        self.plain = plain
        #: the file they were read from, read again by :meth:`reload`
        self.source = source
        #: lines whose plain token is 64 hex digits: a hash pasted without ``sha256:``
        #: would be a token anyone who sees the hash can use (warned at load)
        self.hash_like = hash_like

    def __repr__(self) -> str:
        return f"Principals(<{len(self._by_digest)} tokens hidden>)"

    @property
    def names(self) -> frozenset[str]:
        return frozenset(self._by_digest.values())

    @classmethod
    def parse(cls, text: str, *, source: str = "tokens") -> Principals:
        by_digest: dict[str, str] = {}
        plain = False
        hash_like: list[str] = []
        for n, raw in enumerate(text.splitlines(), 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            parts = line.split()
            where = f"{source}:{n}"
            if len(parts) != 2:
                raise ValueError(f"{where}: expected 'principal token', got {len(parts)} words")
            name, secret = parts
            if not _PRINCIPAL.fullmatch(name):
                raise ValueError(
                    f"{where}: a principal is 1-128 letters, digits or ._@:+- "
                    "(starting with a letter or digit)"
                )
            hashed = _HASHED.fullmatch(secret)
            if hashed:
                digest = hashed.group(1)
            elif label := _HASH_LABEL.match(secret):
                # only what the label pattern matched is quoted: the rest may be the secret,
                # and this message reaches stderr and the reload log (found by review)
                raise ValueError(
                    f"{where}: a hashed token is written sha256: and 64 lowercase hex digits "
                    f"(this one starts with the label {label.group(0)!r}; as written, the hash "
                    "itself would be the token)"
                )
            elif len(secret) < MIN_TOKEN_LENGTH or not _TOKEN.fullmatch(secret):
                raise ValueError(
                    f"{where}: a token is at least {MIN_TOKEN_LENGTH} visible ASCII characters "
                    "(e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))')"
                )
            else:
                digest = _digest(secret)
                plain = True
                if _HEX64.search(secret):  # a hash pasted in some form: warned of at load
                    hash_like.append(where)
            if by_digest.get(digest, name) != name:
                raise ValueError(f"{where}: this token already names another principal")
            by_digest[digest] = name
        return cls(by_digest, plain=plain, hash_like=tuple(hash_like))

    @classmethod
    def load(cls, path: Path) -> Principals:
        try:
            text = path.read_text(encoding="utf-8-sig")  # an editor's byte-order mark too
            mode = path.stat().st_mode
        except OSError as exc:
            raise NoTokens(f"cannot read the tokens file {str(path)!r}: {exc.strerror}") from exc
        principals = cls.parse(text, source=str(path))
        principals.source = path
        for where in principals.hash_like:
            print(
                f"effectfence serve: warning: {where}: this token is 64 hex digits, as a "
                "SHA-256 hash is; a hash is written sha256:<hex> (as written, the hash itself "
                "is the token)",
                file=sys.stderr,
            )
        if principals.plain and mode & (stat.S_IRWXG | stat.S_IRWXO):
            print(
                f"effectfence serve: warning: {path} holds plain tokens and is readable by "
                "others; chmod 600 it, or store sha256: hashes",
                file=sys.stderr,
            )
        return principals

    def reload(self) -> dict[str, Any]:
        """Read the tokens file again (``serve --http`` does on SIGHUP), so an operator
        rotates or revokes a token without a restart. All or nothing: a file that does not
        parse leaves the tokens as they were, and the answer says so (the server logs it:
        a revocation that did not happen must not go unnoticed). A file that names no token,
        or is gone or unreadable, names nobody: every token stops working (keeping them
        would make revoking the last token, when it matters most, do nothing)."""
        if self.source is None:
            return {"event": "tokens_reload_failed", "error": "not read from a file"}
        try:
            fresh = Principals.load(self.source)
        except NoTokens as exc:
            self._by_digest, self.plain = {}, False
            return {
                "event": "tokens_reloaded",
                "tokens": 0,
                "principals": 0,
                "warning": f"{exc}; every request is refused 401 until the file names a token "
                "and SIGHUP is sent again",
            }
        except ValueError as exc:
            return {
                "event": "tokens_reload_failed",
                "error": str(exc),
                "kept": len(self._by_digest),
                "note": "the tokens in force are unchanged; fix the file and send SIGHUP again",
            }
        self._by_digest, self.plain = fresh._by_digest, fresh.plain  # one swap: no mix
        return {
            "event": "tokens_reloaded",
            "tokens": len(self._by_digest),
            "principals": len(self.names),
        }

    def authenticate(self, authorization: str | None) -> str | None:
        """The principal an ``Authorization`` header value names, or None."""
        if not authorization:
            return None
        scheme, _, token = authorization.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            return None
        # looked up by digest: no comparison ever runs on the secret itself
        return self._by_digest.get(_digest(token))

    def login(self, token: str) -> tuple[str, str] | None:
        """(principal, key) for a console login with ``token``, or None. A session made
        from it keeps ``key`` (the token's digest) and asks :meth:`still_names` at every
        request, so revoking the token ends the session too."""
        token = token.strip()
        if not token:
            return None
        key = _digest(token)
        name = self._by_digest.get(key)
        return None if name is None else (name, key)

    def still_names(self, key: str, name: str) -> bool:
        """Whether the token a session was made from still names ``name``."""
        return self._by_digest.get(key) == name


def check_exposure(host: str, principals: Principals | None) -> None:
    """Refuse (ValueError) to bind a non-loopback address without authentication."""
    if principals is None and not is_loopback(host):
        raise ValueError(
            f"refusing to serve on {host}: it is not a loopback address and no --tokens file "
            "was given, so anyone who can reach it could prepare, commit and abort effects. "
            "Pass --tokens FILE (one 'principal token' a line), or bind 127.0.0.1."
        )


def _host_patterns(host: str, extra: Iterable[str]) -> list[str]:
    hosts = ["127.0.0.1:*", "localhost:*", "[::1]:*"]
    if not is_loopback(host) and not is_wildcard(host):
        hosts.append(f"[{host}]:*" if ":" in host else f"{host}:*")
    for h in extra:
        hosts.extend([h] if ":" in h.replace("[", "").split("]")[-1] else [h, f"{h}:*"])
    return hosts


def security_settings(host: str, extra_hosts: Iterable[str] = ()) -> TransportSecuritySettings:
    """The SDK's DNS-rebinding protection, on, for the loopback names, the bound address
    and the hosts the operator adds (a wildcard bind adds none: name them)."""
    hosts = _host_patterns(host, extra_hosts)
    origins = [f"{scheme}://{h}" for h in hosts for scheme in ("http", "https")]
    return TransportSecuritySettings(
        enable_dns_rebinding_protection=True, allowed_hosts=hosts, allowed_origins=origins
    )


#: what a client reads for an oversized body: a JSON-RPC error (no id: the request was
#: never parsed), where the SDK's bound answers plain text no MCP client can read
_TOO_LARGE = json.dumps(
    {
        "jsonrpc": "2.0",
        "id": None,
        "error": {
            "code": -32600,
            "message": f"request body too large: this server reads at most {MAX_MCP_BODY} bytes",
        },
    }
).encode()


def _json_413(send: Send) -> Send:
    """``send``, with a 413 the SDK's body bound answers (in plain text) replaced by
    :data:`_TOO_LARGE`; every other message passes unchanged."""
    replacing = False

    async def sending(message: Message) -> None:
        nonlocal replacing
        if message["type"] == "http.response.start" and message["status"] == 413:
            replacing = True
            await _respond(send, 413, _TOO_LARGE)
            return
        if replacing:  # the SDK's own body (and any more of it): already sent ours
            return
        await send(message)

    return sending


async def _respond(
    send: Send,
    status: int,
    body: bytes,
    content_type: str = "application/json",
    headers: Iterable[tuple[bytes, bytes]] = (),
) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", content_type.encode()),
                (b"content-length", str(len(body)).encode()),
                (b"cache-control", b"no-store"),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def _json(data: dict[str, Any]) -> bytes:
    return json.dumps(data, separators=(",", ":")).encode()


def _client_id(owner: Any) -> Any:
    """The principal of a session's owner, as the SDK records it (a TypedDict today)."""
    return (
        owner.get("client_id") if isinstance(owner, Mapping) else getattr(owner, "client_id", None)
    )


class _Gate:
    """Authentication, health and metrics in front of the SDK's app (see the module doc)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        fence: EffectFence,
        metrics: Metrics,
        principals: Principals | None,
        security: TransportSecuritySettings,
        console: Console | None = None,
        sessions: Callable[[], Mapping[str, Any]] | None = None,
        sessions_per_principal: int = SESSIONS_PER_PRINCIPAL,
    ) -> None:
        self.app = app
        self.fence = fence
        #: the SDK's open sessions (id -> the credential that opened it), for the cap
        self.sessions = sessions
        self.sessions_per_principal = sessions_per_principal
        self.metrics = metrics
        self.principals = principals
        self.security = TransportSecurityMiddleware(security)
        self.offload = fence.store.name != "memory"
        self.console = console
        #: whether the SDK app's lifespan (its session manager's task group) is running:
        #: without it every /mcp request fails, so /healthz must not say ok
        self.serving = False
        self._users: dict[str, AuthenticatedUser] = {}
        #: requests per principal that may open a session and have not started their answer
        self._opening: dict[str, int] = {}
        #: /healthz answers anyone: one store probe at a time, its answer shared with every
        #: request that came meanwhile and reused for HEALTH_FRESH seconds, so a flood of
        #: unauthenticated requests costs the store (and the thread pool) next to nothing
        self.clock: Callable[[], float] = time.monotonic
        self._probe: tuple[float, str | None] | None = None  # (when, error or None)
        self._probing: anyio.Event | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(scope, receive, send)
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        console = self.console is not None and (
            path == CONSOLE_PATH or path.startswith(CONSOLE_PATH + "/")
        )
        if console or path in (HEALTH_PATH, METRICS_PATH):
            refused = await self.security.validate_request(Request(scope), is_post=False)
            if refused is not None:
                await refused(scope, receive, send)
                return
        if path == HEALTH_PATH:
            await self._health(send)
            return
        if console:  # it authenticates by the same tokens itself, or a session cookie
            await self._console(scope, receive, send)
            return
        headers = dict(scope["headers"])  # once: the token and the body's length
        if self.principals is not None:
            raw = headers.get(b"authorization")
            principal = self.principals.authenticate(raw.decode("latin-1") if raw else None)
            if principal is None:
                await _respond(
                    send,
                    401,
                    _json(
                        {
                            "error": "unauthorized",
                            "message": "send Authorization: Bearer <token> with a token from "
                            "this server's tokens file",
                        }
                    ),
                    headers=[(b"www-authenticate", b'Bearer realm="effectfence"')],
                )
                return
            # "user" is what the SDK binds a session to: another principal presenting
            # this session's id is answered as if it did not exist
            scope = {
                **scope,
                PRINCIPAL_SCOPE_KEY: principal,
                "user": self._user(principal),
                "auth": AuthCredentials(),
            }
            if (
                scope["method"] == "POST"
                and b"mcp-session-id" not in headers
                and self._sessions_of(principal) + self._opening.get(principal, 0)
                >= self.sessions_per_principal
            ):
                body = {
                    "error": "too_many_sessions",
                    "message": f"principal {principal!r} has {self.sessions_per_principal} "
                    "sessions open, as many as one may: end some (HTTP DELETE with their "
                    "mcp-session-id) or reuse one; idle ones end after 30 minutes",
                }
                await _respond(send, 429, _json(body))
                return
        if path == METRICS_PATH:
            await self._metrics(send)
            return
        if not self.serving:
            # the SDK would raise (500, a traceback) on every request: say what is wrong
            body = {"error": "unavailable", "message": "the MCP endpoint is not running"}
            await _respond(send, 503, _json(body))
            return
        if scope["method"] == "POST":
            declared = headers.get(b"content-length", b"")
            # a chunked body is read as chunked whatever length it declares: only a plain
            # body's Content-Length can be judged here (found by review)
            if declared.isdigit() and b"transfer-encoding" not in headers:
                if int(declared) > MAX_MCP_BODY:
                    await _respond(send, 413, _TOO_LARGE)
                    return
            else:  # chunked: the SDK counts as it reads, and answers in plain text
                send = _json_413(send)
        principal = scope.get(PRINCIPAL_SCOPE_KEY)
        if principal is None or scope["method"] != "POST" or b"mcp-session-id" in headers:
            await self.app(scope, receive, send)
            return
        await self._open_session(principal, scope, receive, send)

    async def _open_session(
        self, principal: str, scope: Scope, receive: Receive, send: Send
    ) -> None:
        """A request that may open a session counts against its principal's cap from the
        cap's check until its answer starts: the SDK registers the session only after it has
        read the body, so openings whose bodies were slow all passed a check that counted
        registered sessions alone (found by review: one token holder could take every
        session). Counted twice for a moment (registered, answer not yet started), a
        request can only make the cap stricter, never looser."""
        self._opening[principal] = self._opening.get(principal, 0) + 1
        pending = True

        def settle() -> None:
            nonlocal pending
            if pending:
                pending = False
                left = self._opening[principal] - 1
                if left:
                    self._opening[principal] = left
                else:
                    del self._opening[principal]

        async def answer(message: Message) -> None:
            if message["type"] == "http.response.start":
                settle()
            await send(message)

        try:
            await self.app(scope, receive, answer)
        finally:
            settle()

    def _sessions_of(self, principal: str) -> int:
        """How many of the SDK's open sessions ``principal`` opened (a new session is rare:
        counting them all is cheap next to opening one)."""
        if self.sessions is None:
            return 0
        return sum(1 for owner in self.sessions().values() if _client_id(owner) == principal)

    def _user(self, principal: str) -> AuthenticatedUser:
        """The SDK's view of a principal, made once; it never holds the token itself."""
        user = self._users.get(principal)
        if user is None:
            token = AccessToken(token="", client_id=principal, scopes=[])
            user = self._users[principal] = AuthenticatedUser(token)
        return user

    async def _lifespan(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Run the SDK app's lifespan, noting while it runs: if it ends early (an error in
        its task group), uvicorn keeps serving, and /healthz must then say not ok."""

        async def watch(message: Message) -> None:
            if message["type"] == "lifespan.startup.complete":
                self.serving = True
            await send(message)

        try:
            await self.app(scope, receive, watch)
        finally:
            self.serving = False

    async def _health(self, send: Send) -> None:
        if not self.serving:
            body = {"ok": False, "store": self.fence.store.name, "error": "mcp_not_serving"}
            await _respond(send, 503, _json(body))
            return
        error = await self._probed()
        if error is not None:
            body = {"ok": False, "store": self.fence.store.name, "error": error}
            await _respond(send, 503, _json(body))
            return
        await _respond(send, 200, _json({"ok": True, "store": self.fence.store.name}))

    async def _probed(self) -> str | None:
        """The store's health: None, or the name of what failed. A probe of the last
        HEALTH_FRESH seconds is reused; one in progress is waited for, never doubled."""
        while True:
            kept = self._probe
            if kept is not None and self.clock() - kept[0] < HEALTH_FRESH:
                return kept[1]
            running = self._probing
            if running is None:
                break
            await running.wait()  # then read what it found (or probe, if it was cancelled)
        self._probing = done = anyio.Event()
        try:
            error = await self._probe_store()
            self._probe = (self.clock(), error)
            return error
        finally:
            self._probing = None
            done.set()

    async def _probe_store(self) -> str | None:
        def probe() -> None:
            # a query: never creates state, but goes all the way to the store
            self.fence.intent_status("effectfence:healthz")

        try:
            with anyio.fail_after(HEALTH_TIMEOUT):
                if self.offload:
                    await anyio.to_thread.run_sync(probe, abandon_on_cancel=True)
                else:
                    probe()
        except Exception as exc:  # any failure means: not healthy
            return type(exc).__name__
        return None

    async def _console(self, scope: Scope, receive: Receive, send: Send) -> None:
        """One request of the console: its body read (bounded), then ``Console.handle`` in a
        worker thread (it reads the store), its answer sent with the console's headers."""
        from effectfence.operator.console import MAX_BODY, SECURITY_HEADERS

        assert self.console is not None
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        too_large = _json({"error": "too_large", "limit": MAX_BODY})
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > MAX_BODY:
            await _respond(send, 413, too_large)
            return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            body += message.get("body", b"")
            if len(body) > MAX_BODY:
                await _respond(send, 413, too_large)
                return
            if not message.get("more_body", False):
                break
        raw = scope.get("raw_path") or scope["path"].encode()
        query = scope.get("query_string", b"")
        target = (raw + (b"?" + query if query else b"")).decode("latin-1")
        status, ctype, data, extra = await anyio.to_thread.run_sync(
            self.console.handle, scope["method"], target, headers, bytes(body)
        )
        out = [
            (k.lower().encode(), v.encode("latin-1"))
            for k, v in (*SECURITY_HEADERS, *extra)
            if k.lower() != "cache-control"  # _respond says no-store itself
        ]
        await _respond(send, status, data, ctype, headers=out)

    async def _metrics(self, send: Send) -> None:
        """Answered during a store outage too (a scrape is how the operator sees it): the
        store's record counts are left out, with store_up 0; every counter kept in this
        process is still there."""
        try:
            if self.offload:
                stats = await anyio.to_thread.run_sync(self.fence.stats)
            else:
                stats = self.fence.stats()
        except StoreUnavailable:
            stats = self.fence.stats(size=False)
        text = self.metrics.render(self.fence, stats)
        await _respond(send, 200, text.encode(), "text/plain; version=0.0.4; charset=utf-8")


def build_app(
    server: MCPServer[Any],
    fence: EffectFence,
    metrics: Metrics,
    *,
    host: str,
    principals: Principals | None,
    allowed_hosts: Iterable[str] = (),
    console: Console | None = None,
    sessions_per_principal: int = SESSIONS_PER_PRINCIPAL,
) -> ASGIApp:
    """The ASGI app ``serve_http`` runs: the gate around the SDK's streamable HTTP app, and
    ``console`` (see :func:`console_for`) at ``/console`` if given."""
    check_exposure(host, principals)
    allowed_hosts = tuple(allowed_hosts)
    security = security_settings(host, allowed_hosts)
    # JSON answers, not an SSE stream per call: the fence's tools send nothing before their
    # answer, and sse-starlette ends every open stream the moment the server is told to
    # stop, so a SIGTERM (a deploy, a restart) cut calls in progress that uvicorn's graceful
    # shutdown would have let finish (found by review: a fresh ticket answered to nobody)
    app = server.streamable_http_app(
        streamable_http_path=MCP_PATH,
        transport_security=security,
        host=host,
        json_response=True,
        max_request_body_size=MAX_MCP_BODY,
    )
    manager = server.session_manager
    return _Gate(
        app,
        fence=fence,
        metrics=metrics,
        principals=principals,
        security=security,
        console=console,
        # the SDK keeps no count per credential: read its table of owners (a private
        # name, so a version without it gets no cap rather than an error)
        sessions=lambda: getattr(manager, "_session_owners", None) or {},
        sessions_per_principal=sessions_per_principal,
    )


def console_for(
    fence: EffectFence,
    *,
    host: str,
    principals: Principals | None,
    allowed_hosts: Iterable[str] = (),
    allow_clear: bool = False,
    show_payload: bool = False,
    store_label: str = "",
) -> Console:
    """The console ``serve --http --console`` mounts: this server's fence, as the store to
    show and as the counters to chart; its principals and hosts; clearing as ``--allow-clear``
    says."""
    from effectfence.operator.console import Console, allowed_names

    return Console(
        fence,
        principals=principals,
        show_payload=show_payload,
        stats_fence=fence,
        store_label=store_label,
        allowed_hosts=allowed_names(host, allowed_hosts),
        base=CONSOLE_PATH,
        allow_clear=allow_clear,
    )


def listen_socket(host: str, port: int) -> socket.socket:
    """The listening socket ``serve_http`` hands to uvicorn.

    Created with ``IPPROTO_TCP``, not 0: asyncio turns Nagle off (``TCP_NODELAY``) only on
    accepted sockets whose proto says TCP. With proto 0 every answer on a kept-alive
    connection held its last segment until the client's delayed ACK, ~40 ms later: 22
    calls/s per client instead of ~1,000."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(1024)
    except OSError as exc:
        sock.close()
        msg = f"effectfence serve: cannot listen on {host}:{port}: {exc.strerror}"
        raise SystemExit(msg) from None
    return sock


async def serve_http(
    server: MCPServer[Any],
    fence: EffectFence,
    metrics: Metrics,
    *,
    host: str = DEFAULT_HOST,
    port: int = 0,
    principals: Principals | None = None,
    allowed_hosts: Iterable[str] = (),
    console: Console | None = None,
    sock: socket.socket | None = None,
) -> None:
    """Serve until interrupted. Once the socket listens, one JSON line on stderr says where
    (``{"event": "listening", "url": ...}``; with port 0 it names the port picked). With a
    ``console``, it is served at ``/console`` and sampled while the server runs. ``sock``:
    a socket :func:`listen_socket` made for ``host``/``port`` already (``serve`` listens
    before it opens the store, so a port in use makes nothing)."""
    import uvicorn

    app = build_app(
        server,
        fence,
        metrics,
        host=host,
        principals=principals,
        allowed_hosts=allowed_hosts,
        console=console,
    )
    if sock is None:
        sock = listen_socket(host, port)
    bound = sock.getsockname()[1]
    wildcard = is_wildcard(host)
    # a wildcard is no address to call: its URL was refused 421 (found by a docs trial)
    shown = ("[::1]" if ":" in host else "127.0.0.1") if wildcard else host
    shown = f"[{shown}]" if ":" in shown and not shown.startswith("[") else shown
    line: dict[str, Any] = {
        "event": "listening",
        "url": f"http://{shown}:{bound}{MCP_PATH}",
        "health": f"http://{shown}:{bound}{HEALTH_PATH}",
        "metrics": f"http://{shown}:{bound}{METRICS_PATH}",
        "authentication": "bearer" if principals is not None else "none (loopback only)",
        "store": fence.store.name,
    }
    if console is not None:
        line["console"] = f"http://{shown}:{bound}{CONSOLE_PATH}/"
    if wildcard and not list(allowed_hosts):
        line["note"] = WILDCARD_NOTE
    print(json.dumps(line), file=sys.stderr, flush=True)
    config = uvicorn.Config(
        app,
        log_config=None,  # ours: JSON lines (see telemetry.configure_logging)
        access_log=False,
        lifespan="on",
        server_header=False,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN,
    )
    sampler = None
    if console is not None:
        from effectfence.operator.console import Sampler

        sampler = Sampler(console).start()
    reloads = principals is not None and principals.source is not None and _on_hangup(principals)
    try:
        await uvicorn.Server(config).serve(sockets=[sock])
    finally:
        if reloads:
            asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
        if sampler is not None:
            sampler.stop()


def _on_hangup(principals: Principals) -> bool:
    """SIGHUP reads the tokens file again; each reload says on stderr what it did."""
    hangup = getattr(signal, "SIGHUP", None)
    if hangup is None:  # Windows: restart to change tokens
        return False

    def reload() -> None:
        print(json.dumps(principals.reload()), file=sys.stderr, flush=True)

    try:
        asyncio.get_running_loop().add_signal_handler(hangup, reload)
    except (NotImplementedError, RuntimeError, ValueError):
        return False
    return True

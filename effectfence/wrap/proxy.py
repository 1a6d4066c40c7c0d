"""``effectfence wrap -- CMD ...``: any stdio MCP server, behind the fence.

Theory of operation
-------------------
The wrapper is a line-level JSON-RPC relay between a client (our stdin/stdout) and a child
server (CMD, over its stdin/stdout). It does not import ``mcp``: every line is parsed (with
orjson, microseconds) only to learn its method and id, and forwarded as the very bytes that
arrived unless the wrapper must change it. What the fence reads (a ``tools/call``, the
child's answer to one) is read again exactly, by the standard parser, as is a line orjson
refuses; a line that is not JSON is answered and never sent on (it could be a tool call the
fence must see). So everything the two sides say to each other --
requests, responses, notifications, server-to-client requests, resources, prompts,
progress, cancellation, and protocol versions this code has never heard of -- passes through
untouched. The wrapper steps in for exactly four things:

1. ``tools/list``: the child's answer is noted (which tools declare ``readOnlyHint``) and the
   wrapper's own tools are appended, under names that collide with none of the child's.
2. ``tools/call`` of a fenced tool: the call becomes one run of the one driver
   (:mod:`effectfence.driver`): prepare -> wait for an identical running call -> run it in
   the child (renewing the lease) -> commit / release / abort. The child sees at most one
   call per intent; identical calls get the recorded result, marked replayed in ``_meta``.
3. ``tools/call`` of the wrapper's own tools (status, stats, clear).
4. The child's life: it is started at once, and restarted (with the client's handshake
   replayed) when a later message needs it after it died.

Outcomes of a fenced call, from what the child said:

- a result: commit; the certificate's ``result`` is the child's result and the time it came.
- ``isError`` (or a JSON-RPC error): the tool did not succeed -> release (a retry runs it), or,
  with ``on_error = "fail"`` in the policy, abort.
- the child died, the pipe broke, an unreadable answer, or the client cancelled: nobody knows
  whether it took effect -> abort. The intent stays fenced until an operator clears it, and
  the client is told so in words.

Protocol eras: a handshake-era client sends ``initialize``; a 2026-era client probes
``server/discover`` and stamps ``io.modelcontextprotocol/*`` keys into every request's
``_meta``. Both are relayed to the child, which answers in its own era (a 1.x child refuses
the probe, and the client falls back to ``initialize``). Toward a child that was initialized
the handshake way those keys are stripped (an older child rejects them), and an answer the
wrapper writes itself to a 2026-era request carries ``"resultType": "complete"``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import datetime
import errno
import functools
import hashlib
import json
import os
import re
import secrets
import shutil
import signal
import stat
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeGuard

import orjson

from effectfence import _accel
from effectfence.canonical import CanonicalError, canonical_bytes
from effectfence.cert import MAX_PAYLOAD_DEPTH
from effectfence.driver import FencedCall, Offloader, Options, run_async
from effectfence.errors import InvalidRequest, Refusal
from effectfence.fence import MAX_CLEAR_TEXT, EffectFence, FenceConfig
from effectfence.model import EffectRequest, PreparedEffect
from effectfence.operator.views import clear_view
from effectfence.store import default_store_url, is_memory_url
from effectfence.store.memory import MemoryStore
from effectfence.wrap.policy import Policy, PolicyError, ToolPolicy, check_namespace

__all__ = ["META_KEY", "Proxy", "main"]

#: where the wrapper's marker lives in a result's ``_meta`` (reverse-DNS, not reserved)
META_KEY = "dev.effectfence/fence"
MODERN_PREFIX = "io.modelcontextprotocol/"
PROTOCOL_KEY = MODERN_PREFIX + "protocolVersion"
CLIENT_INFO_KEY = MODERN_PREFIX + "clientInfo"
#: ids of the wrapper's own requests to the child start with this and a random part drawn
#: per wrapper, so no client id can be taken for one (its answer would never reach it)
OWN_ID_PREFIX = "effectfence-wrap:"
ALLOW_CLEAR_ENV = "EFFECTFENCE_ALLOW_CLEAR"
LINE_LIMIT = 1 << 26  # 64 MiB: a resource read can be large; one line is one message
#: nesting the wrapper reads exactly or writes again (see _shallow); deeper lines it only
#: relays untouched, or refuses
MAX_DEPTH = 512
#: pages of a tools/list the wrapper reads before it stops (tools past them are fenced)
MAX_TOOL_PAGES = 1000
#: listings in progress remembered by their next cursor (clients that never finish one
#: cost no more than this)
MAX_CHAINS = 64
#: listings the wrapper begins again when the child announces a change during one
LISTING_ATTEMPTS = 3
#: results are recorded, and arguments read, up to this size (the fence's default is 1 MiB:
#: too small for tools that write files or return tables)
MAX_RESULT_BYTES = 16 << 20
MAX_ARGS_BYTES = 16 << 20
CHILD_EXIT_GRACE = 5.0  # s the child gets to exit after its stdin closes, then SIGTERM
#: the same once a termination signal came: an MCP client kills two seconds after SIGTERM
TERMINATE_GRACE = 1.0
EXIT_DRAIN = 0.5  # s to read what an exited child wrote before it exited
EXIT_POLL = 0.1  # s between looks at whether the child exited (see _exit_code)
RESTART_WINDOW, RESTART_LIMIT = 30.0, 5  # more starts than this in the window: give up
#: worker threads for fence steps on a durable store (the Proxy's Offloader). A few warm
#: threads beat a pool of cpu+4 contending for the GIL (~1.7x calls/s at 8 callers on
#: SQLite); since SQLite commits the steps that wait together (group commit), 4 beat 2 by
#: ~10-17% there (bench_wrap.py --rounds 2, alternated 2/4/2/4: 618/723/693/792 calls/s)
FENCE_THREADS = 4
DRAIN_TIMEOUT = 60.0  # s fenced calls get to finish after the client hangs up

_OWN_TOOLS = ("status", "stats", "clear")
#: ``by_tool``'s one entry for every tool name neither the child listed nor the wrapper owns:
#: a client can call any number of names, and one entry each grew the counts for ever
UNLISTED = "(unlisted)"


def _stderr(text: str) -> None:
    print(f"effectfence wrap: {text}", file=sys.stderr, flush=True)


# -- small wire helpers -------------------------------------------------------------------------
def _dumps(value: Any) -> bytes:
    """JSON bytes of what the wrapper sends. orjson refuses what _parse admits through the
    standard parser (an integer past 64 bits, a lone surrogate): those are written by the
    standard encoder, as ASCII (a lone surrogate escaped, as it came). Lines nested past
    :data:`MAX_DEPTH` are refused before they get here (see :func:`_shallow`)."""
    try:
        return orjson.dumps(value)
    except orjson.JSONEncodeError:
        return json.dumps(value, separators=(",", ":")).encode()


def _shallow(line: bytes) -> bool:
    """Whether the line nests at most :data:`MAX_DEPTH` deep. orjson reads ~1000 levels,
    the standard parser and both encoders fewer (and fewer still deeper in the stack): a
    line the wrapper reads exactly or writes again must fit all of them, or one nested
    past them crashed the relay (found by review). Counting brackets answers almost every
    line at C speed; a line with that many is walked, by the compiled accelerator where
    it is built (a tool's large table result is such a line, and the walk runs on the
    event loop: ~50 ms a MB in Python)."""
    if line.count(b"[") + line.count(b"{") <= MAX_DEPTH:
        return True
    if _c_nesting_over is not None:
        return not _c_nesting_over(line, MAX_DEPTH)
    return not nesting_over(line, MAX_DEPTH)


def nesting_over(line: bytes, limit: int) -> bool:
    """Whether a JSON text nests deeper than ``limit``, brackets in strings not counted (the
    definition; ``effectfence._speedups.nesting_over`` walks the same way in C)."""
    depth = 0
    in_string = escaped = False
    for byte in line:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:  # quote
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in (0x5B, 0x7B):  # [ {
            depth += 1
            if depth > limit:
                return True
        elif byte in (0x5D, 0x7D):  # ] }
            depth -= 1
    return False


_c_nesting_over: Callable[[bytes, int], bool] | None = (
    None if _accel.speedups is None else _accel.speedups.nesting_over
)


def _line(msg: dict[str, Any]) -> bytes:
    return _dumps(msg) + b"\n"


#: a line that is not JSON at all
_UNREADABLE: Any = object()


def _parse(line: bytes, *, exact: bool = False) -> Any:
    """A line's message, or :data:`_UNREADABLE`. orjson reads it in microseconds; where it
    refuses (``NaN``, ``1e400``, a lone surrogate, a BOM: all sent by some JSON-RPC peers)
    the standard parser reads it. ``exact``: every number as written, for what the fence
    reads (orjson reads an integer past 64 bits as a float, so two different order ids
    would name one intent)."""
    if not exact:
        try:
            return orjson.loads(line)
        except orjson.JSONDecodeError:
            pass
    try:
        return json.loads(line)
    except (ValueError, RecursionError):  # not JSON, not UTF-8, or nested past the limit
        return _UNREADABLE


def _lenient(line: bytes) -> Any:
    """A line that :func:`_parse` cannot read, read with every byte that is not UTF-8 taken
    for U+FFFD: enough to learn a message's id and kind. Never recorded or written again
    (the bytes it stands for are lost); :data:`_UNREADABLE` if it is not JSON even so."""
    try:
        return json.loads(line.decode("utf-8", "replace"))
    except (ValueError, RecursionError):
        return _UNREADABLE


#: bytes some line readers end a line at, though JSON reads them as one line: a bare CR
#: (whitespace to JSON; a line end to Python's text streams, the mcp SDK's stdio server
#: among them) and, inside strings only, NEL, LS and PS (line ends to str.splitlines)
_BREAKS = (
    (b"\r", b" "),
    ("\u0085".encode(), b"\\u0085"),
    ("\u2028".encode(), b"\\u2028"),
    ("\u2029".encode(), b"\\u2029"),
)


def _one_line(line: bytes) -> bytes:
    """A line for the child as every reader reads it: one line, ended by its last byte. A
    CR inside a relayed ping split it in two for the child, and the second half, a
    tools/call, ran unfenced (found by review); an LS in a fenced call's argument would do
    the same to a reader that splits as str.splitlines does. Each replacement means what it
    replaces (whitespace for whitespace, an escape for the character inside a string), so
    JSON reads the line the same after."""
    for raw, same in _BREAKS:
        if raw in line:
            line = line.replace(raw, same)
    return line


#: the fields a message means what it means by, and a tool call's: a key that is not one
#: of them but folds to one (``Method``, ``NAME``, ``param\u017f``, ``method\u0000``) is
#: that field to a reader that matches names case-insensitively, as Go's encoding/json
#: does, or keeps a key as a C string, as cJSON and json-c do
_MESSAGE_FIELDS = frozenset({"jsonrpc", "id", "method", "params", "result", "error"})
_CALL_FIELDS = frozenset({"name", "arguments", "_meta"})
#: ... and a listing's: which page it asks for decides what the wrapper learns from it
_LIST_FIELDS = frozenset({"cursor", "_meta"})


def _fold(key: str) -> str:
    """The name some reader takes ``key`` for: without ``_`` and ``-`` (Go's
    encoding/json/v2 ignores them when it matches names without case: ``me_thod`` is
    ``method`` there, found by review), folded character by character (simple case
    folding and more: the long s is s, the Kelvin sign k, capital sharp s sharp s). A NUL, which
    C readers cut a key at, never gets here: a line holding one is refused first."""
    key = key.replace("_", "").replace("-", "")
    if key.isascii():
        return key.lower()
    return "".join(_fold_char(c) for c in key)


def _fold_char(c: str) -> str:
    """One character's fold: its full case folding where that is one character; else one
    character standing for every character that folds as it does (capital sharp s and
    sharp s, U+1FD3 and U+0390, U+FB05 and U+FB06: one to Go's simple folding, two here
    before, found by review twice), never the letters it folds to (sharp s is not ss to
    any reader)."""
    folded = c.casefold()
    if len(folded) == 1:
        return folded
    return _multi_folds().get(folded, c)


@functools.cache
def _multi_folds() -> dict[str, str]:
    """Each case folding longer than a character, and the first character folding to it:
    made once, on the first key that needs it (the characters are all in the BMP)."""
    table: dict[str, str] = {}
    for cp in range(0x80, 0x10000):
        folded = chr(cp).casefold()
        if len(folded) > 1:
            table.setdefault(folded, chr(cp))
    return table


class _Read(dict[str, Any]):
    """An object as the check read it, and what makes two of its keys one to some reader."""

    __slots__ = ("clash",)
    clash: str | None


def _read(pairs: list[tuple[str, Any]]) -> _Read:
    obj = _Read(pairs)
    obj.clash = None
    if len(pairs) < 2:
        return obj  # one key clashes with none
    seen: dict[str, str] = {}
    for key, _ in pairs:
        folded = _fold(key)
        if folded in seen:
            obj.clash = f"the keys {seen[folded]!r} and {key!r} in one object"
            break
        seen[folded] = key
    return obj


_CHECKER = json.JSONDecoder(object_pairs_hook=_read)


def _field_like(obj: dict[str, Any], fields: frozenset[str]) -> str | None:
    folded = _FOLDED_FIELDS[fields]
    for key in obj:
        if key not in fields and _fold(key) in folded:
            return f"the key {key!r}, which some readers take for {folded[_fold(key)]!r}"
    return None


#: each set of fields by its folded names, made once (the check runs on every client line)
_FOLDED_FIELDS = {
    fields: {_fold(f): f for f in fields}
    for fields in (_MESSAGE_FIELDS, _CALL_FIELDS, _LIST_FIELDS)
}


def _clash_within(value: Any) -> str | None:
    """The first clash in any object of ``value`` (iteratively: arguments may be deep)."""
    todo = [value]
    while todo:
        v = todo.pop()
        if isinstance(v, _Read):
            if v.clash is not None:
                return v.clash
            todo.extend(v.values())
        elif isinstance(v, list):
            todo.extend(v)
    return None


def _ambiguity(line: bytes) -> str | None:
    """What makes ``line`` mean something else to some JSON reader than to the wrapper, or
    None. A key given twice is its last value here and its first to some readers; keys
    alike but for case (or Unicode folding) are one key to a reader that matches names
    case-insensitively, and a key with a NUL in it is cut there by C readers; a key that
    folds to a field a message rests on is that field to such readers. Relayed, any of these
    could be a tool call to the child and something else to the wrapper (found by review,
    three times: a duplicate key; a key in another case, as CVE-2026-27896 used against the
    Go SDK; a NUL). Checked where the fence's decisions rest: each message's own keys, its
    params' keys, and everything inside a tool call's arguments (a charge read as another
    order than the one fenced runs twice); keys alike but for case deeper in other messages
    are the child's business. Such a line is refused, never relayed or written again: the
    wrapper cannot know which reading the child has."""
    if b"\\u0000" in line:
        # C readers end a key or a string at a NUL: "tools/call\u0000" is a tool call to
        # them, "A1\u0000x" order A1 (found by review). No message needs one: refused
        return "a NUL character (\\u0000), where C readers end a key or a string"
    try:
        # one decoder for every line: json.loads with a hook builds a new one per call
        read = _CHECKER.decode(line.decode("utf-8"))
    except RecursionError:
        return "nesting too deep to check"
    except ValueError:  # orjson read it, the standard parser does not: not checked, refused
        return "JSON the standard parser does not read"
    for member in read if isinstance(read, list) else (read,):
        if not isinstance(member, _Read):
            continue
        problem = member.clash or _field_like(member, _MESSAGE_FIELDS)
        params = member.get("params")
        if problem is None and isinstance(params, _Read):
            problem = params.clash
            if problem is None and member.get("method") == "tools/call":
                problem = _field_like(params, _CALL_FIELDS) or _clash_within(
                    params.get("arguments")
                )
            elif problem is None and member.get("method") == "tools/list":
                # "Cursor" was no cursor here and page 1 to a case-blind child: a listing
                # without its first page became what was known (found by review)
                problem = _field_like(params, _LIST_FIELDS)
        if problem is not None:
            return problem
    return None


def _changes_tools(msg: Any) -> bool:
    """Whether a child's message (alone or in a batch) says its tools changed."""
    return any(
        isinstance(m, dict) and m.get("method") == "notifications/tools/list_changed"
        for m in (msg if isinstance(msg, list) else (msg,))
    )


def _batch_ids(batch: list[Any]) -> tuple[Any, ...]:
    """The ids of a batch's requests (its members with a method and a usable id)."""
    return tuple(
        m["id"]
        for m in batch
        if isinstance(m, dict) and type(m.get("method")) is str and _is_id(m.get("id"))
    )


def _is_id(value: Any) -> bool:
    """A request id the wrapper can track: a string or an integer (JSON-RPC also allows
    fractions, which it discourages; an object or array id is refused)."""
    return type(value) is str or type(value) is int


def _ascii(text: str) -> str:
    """A name the fence accepts (ASCII): non-ASCII characters escaped, as JSON would."""
    return text if text.isascii() else text.encode("ascii", "backslashreplace").decode()


#: environment variables that configure a server: its keys and accounts, where its data
#: lives. Two wrappers of one command that differ in any of these are two servers.
_CONFIG_ENV = re.compile(
    r"KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|URL|URI|DSN|DATABASE|DB|ACCOUNT|"
    r"PROJECT|TENANT|REGION|ENDPOINT|PROFILE|_DIR$|_PATH$|_FILE$",
    re.IGNORECASE,
)
#: ... but not a desktop session's own, which change from one login to the next (a
#: restarted wrapper must find its ledger again), nor the toolchain's search paths
_SESSION_ENV = re.compile(
    r"^(EFFECTFENCE_|VSCODE_|CURSOR_|ELECTRON_|GNOME_|KDE_|XDG_|DBUS_|SSH_|GPG_|GIT_|TERM|TMUX|"
    r"KITTY_|"
    r"ITERM_|WAYLAND_|__CF|WINDOWID$|DISPLAY$|XAUTHORITY$|SECURITYSESSIONID$|PATH$|"
    r"MANPATH$|INFOPATH$|LD_LIBRARY_PATH$|DYLD_|PYTHONPATH$|NODE_PATH$|PWD$|OLDPWD$|HOME$)",
    re.IGNORECASE,
)


def default_namespace(
    argv: Sequence[str], env: Mapping[str, str] | None = None, cwd: str | None = None
) -> str:
    """The scope of a wrapped server's intents when none is set: its command line, the
    environment variables that configure it (see :data:`_CONFIG_ENV`) and, when an
    argument names a relative path, the working directory. The command line alone let two
    servers started by one command with another API key, database URL or relative data
    path share a ledger: the second's calls never ran and were answered the first's
    results (found by review). A command with none of these keeps its earlier scope."""
    env = os.environ if env is None else env
    config = {k: v for k, v in env.items() if _CONFIG_ENV.search(k) and not _SESSION_ENV.match(k)}
    here = os.getcwd() if cwd is None else cwd
    # the command too when it is a path (./server in a/ and in b/ are two programs, found
    # by review); a bare name is found on PATH, whatever sits in the working directory
    command = argv[:1] if argv and ("/" in argv[0] or os.sep in argv[0]) else []
    relative = any(
        not os.path.isabs(value) and os.path.exists(os.path.join(here, value))
        for arg in [*command, *argv[1:]]
        for value in {arg, arg.partition("=")[2]}
        if value
    )
    scope: Any = list(argv)
    if config or relative:
        scope = {"argv": list(argv), "env": config, "cwd": here if relative else None}
    return f"cmd-{hashlib.sha256(canonical_bytes(scope)).hexdigest()[:16]}"


#: a file name a server keeps its data in, created on its first run
_DATA_FILE = re.compile(
    r"\.(db|sqlite3?|duckdb|json|jsonl|csv|tsv|txt|ya?ml|toml|md|log|parquet)$", re.IGNORECASE
)


def _not_yet_there(argv: Sequence[str], cwd: str | None = None) -> list[str]:
    """Arguments that look like relative file paths (a separator, or a file extension)
    and do not exist: the default scope will change once they do."""
    here = os.getcwd() if cwd is None else cwd
    out = []
    for arg in argv[1:]:
        for value in {arg, arg.partition("=")[2]}:
            if (
                value
                and not value.startswith("-")
                and not os.path.isabs(value)
                and not value.startswith("@")  # a package: @scope/name
                and ("/" in value or _DATA_FILE.search(value))
                and "://" not in value
                and not os.path.exists(os.path.join(here, value))
            ):
                out.append(value)
    return out


#: the digest ending every intent wrap makes (see Proxy.request_for)
_DIGEST = re.compile(r"[0-9a-f]{40}")


def _unstartable(command: str) -> str | None:
    """Why ``command`` cannot be started as the child, as the OS would say it (a name
    looked up on PATH, a path checked where it is); None when it can be tried."""
    if os.sep in command or (os.altsep and os.altsep in command):
        found: str | None = command
    else:
        found = shutil.which(command)
    if found is None or not os.path.exists(found):
        return os.strerror(errno.ENOENT)
    if os.path.isdir(found) or not os.access(found, os.X_OK):
        return os.strerror(errno.EACCES)
    return None


def _tool_label(name: str) -> str:
    """A tool's name in its intents and domain: the name itself when it is short ASCII,
    else its escaped, cut form and a digest of the name. The escaped form alone let
    `refund_é` and a tool literally named `refund_\\xe9`, or two names alike for their
    first 200 characters, share intents: the second never ran and was answered the first
    one's result (found by review)."""
    label = _ascii(name)[:200]
    if label == name:
        return name
    return f"{label}~{hashlib.sha256(name.encode('utf-8', 'surrogatepass')).hexdigest()[:16]}"


def _is_modern(params: Any) -> bool:
    meta = params.get("_meta") if isinstance(params, dict) else None
    return isinstance(meta, dict) and PROTOCOL_KEY in meta


def _strip_modern(msg: dict[str, Any]) -> dict[str, Any] | None:
    """``msg`` without ``io.modelcontextprotocol/*`` keys in ``params._meta`` (None: none)."""
    params = msg.get("params")
    meta = params.get("_meta") if isinstance(params, dict) else None
    if not isinstance(meta, dict) or not any(k.startswith(MODERN_PREFIX) for k in meta):
        return None
    assert isinstance(params, dict)
    kept = {k: v for k, v in meta.items() if not k.startswith(MODERN_PREFIX)}
    new_params = {k: v for k, v in params.items() if k != "_meta"}
    if kept:
        new_params["_meta"] = kept
    return {**msg, "params": new_params}


def _now_iso() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="milliseconds")


class ChildError(Exception):
    """The child answered that the tool did not succeed (``isError`` or a JSON-RPC error):
    it did not happen, so by default the intent is released for a retry."""

    def __init__(self, response: dict[str, Any]) -> None:
        super().__init__("the tool reported an error")
        self.response = response


class ChildGone(Exception):
    """The child died, the pipe broke, or its answer was unreadable: outcome unknown."""


class NotSent(ChildGone):
    """The call never reached the child (it could not be started, its pipe refused the
    write, or the client cancelled first): nothing ran, so the intent is released."""

    def __init__(self, message: str, *, cancelled: bool = False) -> None:
        super().__init__(message)
        self.cancelled = cancelled


# -- the child process --------------------------------------------------------------------------
async def _exit_code(proc: asyncio.subprocess.Process) -> int:
    """The process's exit code, once it exits, whatever its pipes do. asyncio's ``wait()``
    (3.11) returns only once every pipe is closed as well, and a process the child left
    behind (a launcher script's ``sleep &``) may hold its stdout open for ever; the exit
    itself is seen at once (``returncode`` is set when it is reaped)."""
    while (code := proc.returncode) is None:
        await asyncio.sleep(EXIT_POLL)
    return code


class Child:
    """One child process and the wrapper's own requests waiting for its answers."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.pending: dict[str, asyncio.Future[dict[str, Any]]] = {}
        #: ids of the client's requests relayed to this child, which it owes answers (until
        #: it answers, or the client cancels: see Proxy._forget_relayed)
        self.relayed: set[Any] = set()
        #: the wrapper's tools/list requests for a client: own id -> (client id, the listing
        #: the page belongs to (None: one it cannot be tied to), the tools' generation it
        #: was sent in)
        self.listings: dict[str, tuple[Any, _Listing | None, int]] = {}
        self.alive = True
        self.ready = asyncio.Event()  # set once the handshake (if any) is replayed

    def write(self, data: bytes) -> None:
        stdin = self.proc.stdin
        if not self.alive or stdin is None or stdin.is_closing():
            raise ChildGone("the server behind the fence is not running")
        try:
            stdin.write(_one_line(data))
        except (BrokenPipeError, ConnectionResetError, RuntimeError) as exc:
            raise ChildGone(f"the pipe to the server broke ({exc})") from exc

    def die(self) -> None:
        self.alive = False
        for fut in self.pending.values():
            if not fut.done():
                fut.set_exception(ChildGone("the server behind the fence stopped"))
        self.pending.clear()


class _Terminated(Exception):
    """What the client's reader raises once a termination signal came (Proxy.terminate)."""


@dataclass(slots=True)
class _Call:
    """A fenced call in progress: its task, and the id it has in the child (if running)."""

    task: asyncio.Task[None] | None = None
    own_id: str | None = None


@dataclass(slots=True)
class WrapStats:
    """What the wrapper did, for ``effectfence_stats``."""

    passed: int = 0
    fenced: int = 0
    executed: int = 0
    replayed: int = 0
    refused: int = 0
    child_errors: int = 0
    unknown_outcomes: int = 0
    child_starts: int = 0
    by_tool: dict[str, dict[str, int]] = field(default_factory=dict)

    def tool(self, name: str, what: str) -> None:
        """Count one outcome of ``name`` (the caller bounds the names: see Proxy._tally)."""
        counts = self.by_tool.setdefault(name, {})
        counts[what] = counts.get(what, 0) + 1


# -- the proxy ----------------------------------------------------------------------------------
class Proxy:
    """Relay between ``write_client`` (the client's side) and a child started from ``argv``."""

    def __init__(
        self,
        argv: list[str],
        write_client: Callable[[bytes], None],
        *,
        store_url: str = "memory:",
        policy: Policy | None = None,
        allow_clear: bool = False,
        namespace: str | None = None,
    ) -> None:
        self.argv = argv
        self._write_client = write_client
        self.written = 0  # lines written to the client: run() tells "answered" by it
        self.policy = policy or Policy()
        self.allow_clear = allow_clear
        ns = namespace or self.policy.namespace
        self.namespace = _ascii(ns if ns is not None else default_namespace(argv))
        if ns is None:
            for path in _not_yet_there(argv):
                # the scope takes in the working directory once a relative path exists: a
                # file the server creates on its first run changes it, and a restart would
                # not find what the first run recorded (found by review)
                _stderr(
                    f"{path!r} looks like a relative path that does not exist yet: if the "
                    "server creates it, the scope of its intents changes once it does, and "
                    "a restarted wrapper will not find what was recorded before. Give it a "
                    "fixed scope: --namespace NAME (or namespace in the policy)"
                )
        self.store_url = store_url
        if is_memory_url(store_url):
            self.store: Any = MemoryStore()
        else:
            from effectfence.store import open_store

            self.store = open_store(store_url)
        self.offload = not isinstance(self.store, MemoryStore)
        self.offloader = Offloader(FENCE_THREADS, name="effectfence-wrap")
        self._fences: dict[tuple[float, float], EffectFence] = {}
        self.stats = WrapStats()
        self.child: Child | None = None
        self._child_lock = asyncio.Lock()
        self._starts: list[float] = []
        self._next_id = 0
        self._own_prefix = f"{OWN_ID_PREFIX}{secrets.token_hex(8)}:"
        self.era: str | None = None  # "legacy" (initialize) or "modern" (server/discover)
        self.init_params: dict[str, Any] | None = None
        self.initialized = False
        self.modern_meta: dict[str, Any] = {}
        self.agent = "wrap"
        self.tools: dict[str, Any] = {}  # child tool name -> annotations
        self.tools_known = False
        #: listings in progress by the cursor of their next page: a page belongs to the
        #: listing whose cursor it was asked with, and a listing becomes ``tools`` once
        #: whole. Filled into ``tools`` itself (then into one map all listings shared), a
        #: client's new listing left its first page alone known, and a tool listed twice
        #: passed on that page's readOnlyHint (found by review, twice)
        self._chains: dict[tuple[str, bytes], _Listing] = {}
        #: bumped whenever the tools are forgotten (a notifications/tools/list_changed, a
        #: child that died); a listing is current only if it began (its first page) in the
        #: generation it ended in
        self._generation = 0
        self.own_names = {role: f"effectfence_{role}" for role in _OWN_TOOLS}
        #: whether a listing has settled the own tools' names (a child tool may take one)
        self._named = False
        self.calls: dict[Any, _Call] = {}
        #: client request ids on their way to a child (it may be starting): id -> how many
        self._sending: dict[Any, int] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        #: messages waiting for a (re)starting child, in the order they came (_in_order)
        self._backlog: collections.deque[tuple[Any, Callable[[], Awaitable[None]]]] | None = None
        self.closing = False
        self.fatal: str | None = None
        #: the signal that ended the relay (see terminate), if one did
        self.terminated: int | None = None
        self._reader: asyncio.StreamReader | None = None

    # -- fences ---------------------------------------------------------------------------
    def fence_for(self, tp: ToolPolicy) -> EffectFence:
        """One fence per (lease, result lifetime), all on the one store. An intent names
        its tool, and a tool has one policy, so all calls of an intent use one fence."""
        key = (tp.lease_ttl, tp.result_ttl)
        fence = self._fences.get(key)
        if fence is None:
            # every line the wrapper reads exactly nests at most MAX_DEPTH deep, so a fenced
            # call's arguments and its recorded result fit what a certificate holds
            cfg = FenceConfig(
                lease_ttl=tp.lease_ttl,
                result_ttl=tp.result_ttl,
                max_args_bytes=MAX_ARGS_BYTES,
                max_result_bytes=MAX_RESULT_BYTES,
                max_depth=min(MAX_DEPTH, MAX_PAYLOAD_DEPTH),
            )
            fence = self._fences[key] = EffectFence(cfg, store=self.store)
        return fence

    def any_fence(self) -> EffectFence:
        return self.fence_for(self.policy.defaults)

    async def _fence_op(self, fn: Callable[..., Any], *args: Any) -> Any:
        if self.offload:
            return await self.offloader.run(fn, *args)
        return fn(*args)

    def write_client(self, data: bytes) -> None:
        self.written += 1
        self._write_client(data)

    # -- the child's life -----------------------------------------------------------------
    async def start_child(self) -> Child:
        now = time.monotonic()
        self._starts = [t for t in self._starts if now - t < RESTART_WINDOW] + [now]
        if len(self._starts) > RESTART_LIMIT:
            self.fatal = (
                f"the server exited {RESTART_LIMIT} times within {RESTART_WINDOW:g}s; giving up"
            )
            raise ChildGone(self.fatal)
        try:
            proc = await asyncio.create_subprocess_exec(
                *self.argv,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                limit=LINE_LIMIT,
            )
        except OSError as exc:
            self.fatal = f"can't start {self.argv[0]!r}: {exc.strerror or exc}"
            raise ChildGone(self.fatal) from exc
        child = Child(proc)
        restart = self.stats.child_starts > 0
        self.stats.child_starts += 1
        self.child = child
        self._spawn(self._read_child(child))
        try:
            if restart:
                _stderr(f"restarted the server (start #{self.stats.child_starts})")
                if self.init_params is not None:
                    await self._replay_handshake(child)
        except BaseException as exc:
            # a child that fails its handshake is of no use: stop it, and let every caller
            # waiting on `ready` see it gone (they would otherwise wait forever)
            child.die()
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            if isinstance(exc, Exception) and not isinstance(exc, ChildGone):
                msg = f"the restarted server did not complete its handshake ({exc!r})"
                raise ChildGone(msg) from exc
            raise
        finally:
            child.ready.set()
        return child

    async def _replay_handshake(self, child: Child) -> None:
        """A restarted child gets the client's own ``initialize`` again (a 2026-era child
        needs none: every request carries its version)."""
        own = self._own_id()
        fut = self._expect(child, own)
        child.write(
            _line({"jsonrpc": "2.0", "id": own, "method": "initialize", "params": self.init_params})
        )
        await asyncio.wait_for(fut, 30.0)
        if self.initialized:
            child.write(_line({"jsonrpc": "2.0", "method": "notifications/initialized"}))

    async def ensure_child(self) -> Child:
        child = self.child
        if child is not None and child.alive:
            if not child.ready.is_set():
                await child.ready.wait()
            if child.alive:
                return child
        async with self._child_lock:
            child = self.child
            if child is not None and child.alive:
                return child
            if self.fatal is not None:
                raise ChildGone(self.fatal)
            return await self.start_child()

    async def _relay_child(self, child: Child) -> None:
        """The child's lines to ``on_child_line`` until its stdout ends; output it cannot
        make sense of (a line over LINE_LIMIT) ends it too, and the child is stopped."""
        stdout = child.proc.stdout
        assert stdout is not None
        while True:
            try:
                line = await stdout.readline()
            except (ValueError, ConnectionError) as exc:  # a line over LINE_LIMIT
                _stderr(f"unreadable output from the server ({exc}); stopping it")
                with contextlib.suppress(ProcessLookupError):
                    child.proc.kill()
                return
            if not line:
                return
            self.on_child_line(line, child)

    async def _read_child(self, child: Child) -> None:
        """Relay the child's output until it is gone: its stdout ended, or it exited. The
        exit is watched on its own: a process the child left behind may hold its stdout
        open, and the end of output would never come (a call would wait for ever)."""
        relay = asyncio.ensure_future(self._relay_child(child))
        exited = asyncio.ensure_future(_exit_code(child.proc))
        try:
            await asyncio.wait((relay, exited), return_when=asyncio.FIRST_COMPLETED)
            if not relay.done():
                # it exited: what it wrote before is in the pipe already; read that, and
                # stop waiting for an end of output that may never come
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(relay), EXIT_DRAIN)
                relay.cancel()
            # its stdout ended or it exited: it answers nothing more, and whoever waits on
            # it hears so now (before a new child, started meanwhile, owes anything)
            child.die()
            if self.child is child:
                self.child = None
                # the next process is a new server: its tools are learned anew. Kept, a dead
                # child's readOnlyHint passed a tool the new one serves as destructive (review)
                self._forget_tools()
            self._orphaned(child, child.proc.returncode)
            if not exited.done():  # stdout closed, still running: give it time, then stop it
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(exited), CHILD_EXIT_GRACE)
                with contextlib.suppress(ProcessLookupError):
                    child.proc.kill()
            code = await exited
        finally:
            relay.cancel()
            exited.cancel()
        if not self.closing:
            _stderr(f"the server exited with code {code}")

    def _orphaned(self, child: Child, code: int | None) -> None:
        """Requests relayed to a child that is gone: answered, or their clients would wait
        for ever. Only its own: a child started since owes its own answers."""
        gone = "stopped answering" if code is None else f"exited (code {code})"
        orphans, child.relayed = child.relayed, set()
        for cid in orphans:
            self._client_error(
                cid,
                -32603,
                f"effectfence wrap: the server behind the fence {gone} before answering; it "
                "is restarted for later calls",
            )
        listings, child.listings = child.listings, {}
        for cid, _, _ in listings.values():
            self._client_error(
                cid,
                -32603,
                f"effectfence wrap: the server behind the fence {gone} before listing its tools",
            )

    # -- ids and requests to the child ----------------------------------------------------
    def _own_id(self) -> str:
        self._next_id += 1
        return f"{self._own_prefix}{self._next_id}"

    def _expect(self, child: Child, own: str) -> asyncio.Future[dict[str, Any]]:
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        child.pending[own] = fut
        return fut

    async def child_request(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Send one of the wrapper's requests (``msg["id"]`` is an own id); its answer.

        :class:`NotSent` when it never reached the child, so a fenced call can tell "did not
        run" (release) from "nobody knows" (abort)."""
        try:
            child = await self.ensure_child()
        except ChildGone as exc:
            raise NotSent(str(exc)) from exc
        except asyncio.CancelledError:
            raise NotSent("cancelled before it was sent", cancelled=True) from None
        own = msg["id"]
        fut = self._expect(child, own)
        try:
            try:
                child.write(self._for_child(msg))
            except ChildGone as exc:
                raise NotSent(str(exc)) from exc
            return await fut
        finally:
            child.pending.pop(own, None)

    def _for_child(self, msg: dict[str, Any]) -> bytes:
        if self.era == "legacy":
            stripped = _strip_modern(msg)
            if stripped is not None:
                msg = stripped
        return _line(msg)

    # -- client -> child ------------------------------------------------------------------
    async def on_client_line(self, line: bytes) -> None:
        msg = _parse(line)
        if msg is _UNREADABLE:
            # never relayed: a line the wrapper cannot read could be a tool call it must fence
            self._client_error(
                None, -32700, "effectfence wrap: parse error: the line is not JSON; not sent on"
            )
            return
        problem = _ambiguity(line)
        if problem is not None:
            rid = msg.get("id") if isinstance(msg, dict) else None
            if isinstance(msg, dict) and msg.get("method") == "tools/call":
                self.stats.refused += 1
            self._client_error(
                rid if _is_id(rid) else None,
                -32600,
                f"effectfence wrap: the message is ambiguous ({problem}): JSON readers differ "
                "on what it says, so it was not sent on; send each key once, as named",
            )
            return
        if isinstance(msg, list) and any(
            isinstance(m, dict) and m.get("method") == "tools/call" for m in msg
        ):
            if not _shallow(line):
                self._client_error(None, -32600, "effectfence wrap: the batch is nested too deeply")
                return
            self._refuse_batch(msg)
            return
        if isinstance(msg, list):
            # a batch without tool calls, relayed as it came: the child owes an answer to
            # each of its requests, which is answered for it if it dies first (unrecorded,
            # they went unanswered and their client waited for ever, found by review)
            await self._relay(line, _batch_ids(msg))
            return
        if not isinstance(msg, dict):
            await self._relay(line, ())  # the child answers what it can't parse
            return
        method = msg.get("method")
        if type(method) is not str:  # a response to a server-to-client request
            await self._relay(line, ())
            return
        params = msg.get("params")
        if "id" not in msg:
            if method == "tools/call":
                # a call sent as a notification: never answered, but a JSON-RPC server runs
                # it, so relayed it ran unfenced as often as it was sent (found by review).
                # MCP calls a tool with a request only: dropped, as a batch calling one is
                _stderr("a tools/call without an id (a notification) was dropped, not run")
                self.stats.refused += 1
                return
            if method == "notifications/cancelled" and isinstance(params, dict):
                if self._drop_queued(params.get("requestId")):
                    return
                if self._cancel(params.get("requestId"), params.get("reason")):
                    return
                if self._cancel_listing(params.get("requestId"), msg):
                    return
                if self.child is None and params.get("requestId") not in self._sending:
                    # what it cancels died with the last child (its client was told so):
                    # starting a new child only to hand it this would be all it did. A
                    # request still on its way to the next child keeps its cancel (review)
                    return
                self._forget_relayed(params.get("requestId"))  # and relayed as it came
            elif method == "notifications/initialized":
                self.initialized = True
            await self._relay(line, (), msg)
            return
        cid = msg["id"]
        if not _is_id(cid):
            self._client_error(
                None, -32600, "effectfence wrap: a request id is a string or an integer"
            )
            return
        if isinstance(params, dict):
            meta = params.get("_meta")
            if isinstance(meta, dict) and PROTOCOL_KEY in meta:
                self.modern_meta = {k: v for k, v in meta.items() if k.startswith(MODERN_PREFIX)}
                info = meta.get(CLIENT_INFO_KEY)
                if isinstance(info, dict):
                    self._set_agent(info.get("name"))
        if method == "tools/call":
            name = params.get("name") if isinstance(params, dict) else None
            if self._passes(name):
                await self._pass_through(name, cid, line, msg)
                return
            # registered before its task runs: a cancel read right after it finds it
            call = self.calls[cid] = _Call()
            call.task = self._spawn(self._tool_call(cid, msg, line, call))
            call.task.add_done_callback(lambda _: self._forget_call(cid, call))
            return
        if method == "tools/list":
            if params is not None and not isinstance(params, dict):
                # by position, a page the wrapper cannot tell: never taken for a first one
                self._client_error(cid, -32602, "effectfence wrap: tools/list params are an object")
                return
            if not _shallow(line):  # written again to the child under an id of its own
                self._client_error(
                    cid, -32600, "effectfence wrap: the request is nested too deeply"
                )
                return
            await self._in_order(lambda: self._list_for_client(cid, msg), cid)
            return
        if method == "initialize":
            self.era = "legacy"
            self.init_params = params if isinstance(params, dict) else {}
            info = self.init_params.get("clientInfo")
            if isinstance(info, dict):
                self._set_agent(info.get("name"))
        elif method == "server/discover":
            self.era = "modern"  # a handshake-era child refuses; the client then initializes
        await self._relay(line, (cid,), msg)

    def _child_up(self) -> bool:
        child = self.child
        return child is not None and child.alive and child.ready.is_set()

    async def _relay(
        self, line: bytes, ids: tuple[Any, ...], msg: dict[str, Any] | None = None
    ) -> None:
        # a batch is never dropped by a cancel of one of its requests: the others are owed
        # answers (found by review); its cancels follow it, as for a request already sent
        one = ids[0] if msg is not None and len(ids) == 1 else None
        await self._in_order(lambda: self._forward(line, ids, msg), one)

    def _drop_queued(self, cid: Any) -> bool:
        """A cancel of a request still waiting in the backlog: the request is never sent (a
        queued listing went out under an id of the wrapper's own, which its cancel, relayed
        under the client's, never reached: found by review). The one being sent goes on,
        and its cancel after it, as for a request already sent."""
        backlog = self._backlog
        if backlog is None or not _is_id(cid):
            return False
        for i in range(1, len(backlog)):
            if backlog[i][0] == cid:
                del backlog[i]
                return True
        return False

    async def _in_order(self, send: Callable[[], Awaitable[None]], cid: Any = None) -> None:
        """Send to the child now when it is up; while it (re)starts, queue it behind what is
        queued, for one task to send in order. Awaited in the relay's turn, a request that
        waited for a restart held up everything the client sent after it: the wrapper's
        own tools, cancels, a termination signal (found by review)."""
        if self._backlog is None and self._child_up():
            await send()
            return
        if self._backlog is None:
            self._backlog = collections.deque([(cid, send)])
            self._spawn(self._send_backlog())
        else:
            self._backlog.append((cid, send))

    async def _send_backlog(self) -> None:
        backlog = self._backlog
        assert backlog is not None
        try:
            while backlog:
                try:
                    await backlog[0][1]()
                except Exception as exc:  # one message must not strand those behind it
                    _stderr(f"internal error relaying a message: {exc!r}; dropped it")
                backlog.popleft()  # a list's pop(0) made a long backlog quadratic
        finally:
            self._backlog = None

    def _refuse_batch(self, batch: list[Any]) -> None:
        """A JSON-RPC batch (MCP 2025-03-26 only) that calls a tool: relayed whole, its
        calls would reach the child unfenced. Each of its requests is refused instead, in
        one batch answer, and nothing is sent on."""
        message = (
            "effectfence wrap: a JSON-RPC batch that calls tools is refused (its calls would "
            "bypass the fence); send each request on its own. Nothing in the batch was run."
        )
        answers = [
            {"jsonrpc": "2.0", "id": m["id"], "error": {"code": -32600, "message": message}}
            for m in batch
            if isinstance(m, dict) and "method" in m and "id" in m
        ]
        self.stats.refused += sum(
            1 for m in batch if isinstance(m, dict) and m.get("method") == "tools/call"
        )
        if answers:
            self.write_client(_dumps(answers) + b"\n")

    def _set_agent(self, name: Any) -> None:
        if type(name) is str and name.strip():
            self.agent = _ascii(name.strip())[:200]

    async def _forward(
        self, line: bytes, ids: tuple[Any, ...], msg: dict[str, Any] | None = None
    ) -> None:
        """Relay the client's bytes as they came (stripped of 2026-era keys for a
        handshake-era child); remember the request ids (``ids``: the request's, or a
        batch's) the child now owes an answer."""
        for cid in ids:
            self._sending[cid] = self._sending.get(cid, 0) + 1  # a cancel must still reach it
        try:
            child = await self.ensure_child()
            if msg is not None and self.era == "legacy" and _strip_modern(msg) is not None:
                # written again: read exactly first (an integer past 64 bits stays one)
                exact = _parse(line, exact=True) if _shallow(line) else _UNREADABLE
                if not isinstance(exact, dict):
                    raise ChildGone("the request is nested too deeply to forward")
                stripped = _strip_modern(exact)
                if stripped is not None:
                    line = _line(stripped)
            child.relayed.update(ids)
            try:
                child.write(line)
            except ChildGone:
                child.relayed.difference_update(ids)
                raise
        except ChildGone as exc:
            for cid in ids:
                self._client_error(cid, -32603, f"effectfence wrap: {exc}")
        finally:
            for cid in ids:
                left = self._sending.pop(cid, 1) - 1
                if left:
                    self._sending[cid] = left

    def _forget_call(self, cid: Any, call: _Call) -> None:
        if self.calls.get(cid) is call:
            del self.calls[cid]

    def _cancel(self, cid: Any, reason: Any) -> bool:
        """The client cancelled a fenced call: tell the child, stop waiting; the driver
        aborts the attempt (outcome unknown) if it was running."""
        call = self.calls.get(cid) if _is_id(cid) else None
        if call is None:
            return False
        child = self.child
        if call.own_id is not None and child is not None:
            answer = child.pending.get(call.own_id)
            if answer is not None and answer.done() and not answer.cancelled():
                # the child's answer came in this same loop turn: cancelling now would fence
                # it as unknown (found by review). The call goes on with what the future
                # holds: a result is recorded, an error ends it as the error would have
                # (a failed or unreadable answer), and the answer the client no longer
                # waits for it ignores (MCP).
                return True
        if call.own_id is not None and child is not None and child.alive:
            note: dict[str, Any] = {"requestId": call.own_id}
            if type(reason) is str:
                note["reason"] = reason
            with contextlib.suppress(ChildGone):
                child.write(
                    _line({"jsonrpc": "2.0", "method": "notifications/cancelled", "params": note})
                )
        if call.task is not None:
            call.task.cancel()
        return True

    def _cancel_listing(self, cid: Any, msg: dict[str, Any]) -> bool:
        """The client cancelled a tools/list the wrapper sent on under its own id: the
        cancel goes to the child under that id (under the client's, the child never knew
        which request was meant and answered anyway), and the listing is forgotten: its
        answer, if one comes, is dropped like any other the wrapper no longer waits for."""
        child = self.child
        if child is None or not _is_id(cid):
            return False
        own = next((o for o, (c, _, _) in child.listings.items() if c == cid), None)
        if own is None:
            return False
        del child.listings[own]
        params = {**msg["params"], "requestId": own}
        with contextlib.suppress(ChildGone):  # a child gone owes nothing any more
            child.write(self._for_child({**msg, "params": params}))
        return True

    def _forget_relayed(self, cid: Any) -> None:
        """The client cancelled a request relayed to the child: per MCP the child need not
        answer it, so it is no longer owed one (kept, its id stayed for ever in a long-lived
        wrapper). An answer that comes all the same is relayed, as every child line is."""
        child = self.child
        if child is not None and _is_id(cid):
            child.relayed.discard(cid)

    # -- child -> client ------------------------------------------------------------------
    def on_child_line(self, line: bytes, child: Child | None = None) -> None:
        """A line from ``child`` (default: the current one) for the client, or the answer
        to one of the wrapper's own requests to it."""
        if child is None:
            child = self.child
        msg = _parse(line)
        garbled = msg is _UNREADABLE
        if garbled:
            # not UTF-8 (text in a legacy encoding), or not JSON: read leniently to learn
            # whose it is. Dropped, an answer left its request unanswered, and a fenced
            # call's lease renewed for ever (found by review)
            msg = _lenient(line)
            if msg is _UNREADABLE:
                _stderr("the server wrote a line that is not JSON to stdout; dropped it")
                return
        if isinstance(msg, dict) and "method" not in msg:
            rid = msg.get("id")
            if self._is_own(rid):
                # an answer the wrapper records or reads, and writes again
                if garbled:
                    exact = _UNREADABLE
                else:
                    exact = _parse(line, exact=True) if _shallow(line) else _UNREADABLE
                why = (
                    "the server's answer is not valid UTF-8 JSON"
                    if garbled
                    else "the server's answer is nested too deeply to read"
                )
                self._own_answer(child, rid, exact, why)
                return
            if _is_id(rid) and child is not None:
                child.relayed.discard(rid)
        elif isinstance(msg, dict) and self._is_own(msg.get("id")):
            # one of the wrapper's own ids on a message with a method: no answer a server
            # sends. Relayed, the client met an id it never used, and the call waited for ever
            # with its lease renewed (found by review): whether it ran, nobody knows
            why = "the server's answer to it was malformed (it names a method)"
            self._own_answer(child, msg["id"], _UNREADABLE, why)
            return
        elif isinstance(msg, list) and child is not None:  # a batch's answers
            own = [m for m in msg if isinstance(m, dict) and self._is_own(m.get("id"))]
            if own:
                # the wrapper sends no batches: an answer of its own inside one is taken out
                # and read as if it came alone (found by review: it waited for ever)
                exact = _parse(line, exact=True) if not garbled and _shallow(line) else None
                for m in exact if isinstance(exact, list) else own:
                    if isinstance(m, dict) and self._is_own(m.get("id")):
                        why = "the server's answer to it came in a batch it could not read"
                        ok = isinstance(exact, list) and "method" not in m
                        self._own_answer(child, m["id"], m if ok else _UNREADABLE, why)
                if isinstance(exact, list):  # the rest, for the client, as exactly as it came
                    msg = [
                        m for m in exact if not (isinstance(m, dict) and self._is_own(m.get("id")))
                    ]
                    if not msg:
                        return
                    line = _dumps(msg) + b"\n"
                # else relayed as it came (its own answers with it, ids the client never used):
                # written again from a lossy reading, its numbers or bytes would change (review)
            child.relayed.difference_update(
                m["id"]
                for m in msg
                if isinstance(m, dict) and "method" not in m and _is_id(m.get("id"))
            )
        if _changes_tools(msg):
            # annotations may have changed: forget them (every call is fenced until they are
            # learned again), and no listing begun before this counts as current. Kept, a
            # stale readOnlyHint passed a tool that had become destructive (found by review;
            # and again when the notice came inside a batch)
            self._forget_tools()
        if garbled:
            _stderr("the server wrote a line that is not valid UTF-8; relayed it as it came")
        self.write_client(line)  # byte for byte: a lenient client may read it

    def _is_own(self, rid: Any) -> TypeGuard[str]:
        return type(rid) is str and rid.startswith(self._own_prefix)

    def _own_answer(self, child: Child | None, rid: str, msg: Any, why: str) -> None:
        """The child's answer to one of the wrapper's own requests (``msg``, or
        :data:`_UNREADABLE` with ``why``): to the listing or the call waiting for it."""
        listing = child.listings.pop(rid, None) if child is not None else None
        # left in pending for its requester to take (child_request's finally): a cancel
        # handled before it resumes must see that the answer is in
        fut = child.pending.get(rid) if child is not None else None
        if msg is _UNREADABLE:
            if listing is not None:
                self._client_error(listing[0], -32603, f"effectfence wrap: {why}")
            elif fut is not None and not fut.done():
                fut.set_exception(ChildGone(why))  # an unreadable answer: outcome unknown
            return
        if listing is not None:
            self._listed(listing[0], listing[1], listing[2], msg)
            return
        if fut is not None and not fut.done():
            fut.set_result(msg)
        # else: an answer nobody waits for any more (a cancelled call)

    def _client_error(self, cid: Any, code: int, message: str) -> None:
        self.write_client(
            _line({"jsonrpc": "2.0", "id": cid, "error": {"code": code, "message": message}})
        )

    # -- tools/list -----------------------------------------------------------------------
    async def _list_for_client(self, cid: Any, msg: dict[str, Any]) -> None:
        params = msg.get("params")
        cursor = params.get("cursor") if isinstance(params, dict) else None
        own = self._own_id()
        try:
            child = await self.ensure_child()
            listing = _Listing(self._generation) if not cursor else self._chains.get(_key(cursor))
            child.listings[own] = (cid, listing, self._generation)
            try:
                child.write(self._for_child({**msg, "id": own}))
            except ChildGone:
                child.listings.pop(own, None)
                raise
        except ChildGone as exc:
            self._client_error(cid, -32603, f"effectfence wrap: {exc}")

    def _note_tools(
        self, result: dict[str, Any], listing: _Listing | None, generation: int
    ) -> list[Any] | None:
        """One page of ``listing`` (None: a page no listing in progress asked for), whose
        request was sent in ``generation``: a page answered after a change it was sent
        before is stale, though it arrives after."""
        tools = result.get("tools")
        if not isinstance(tools, list):
            return None
        if generation != self._generation or listing is None:
            # requested before a change, or tied to no listing: relayed (a client's), never
            # learned from. Learned, a page answered late overwrote what a current listing
            # had made known (review)
            return tools
        known = listing.tools
        for tool in tools:
            if isinstance(tool, dict) and type(tool.get("name")) is str:
                name, annotations = tool["name"], tool.get("annotations")
                if name in known and not (_read_only(known[name]) and _read_only(annotations)):
                    # listed twice, not read-only both times: fenced. The last entry won, and
                    # a later readOnlyHint passed a destructive tool (found by review)
                    annotations = None
                known[name] = annotations
        if _last_page(result):
            self._listing_done(listing)
        else:
            key = _key(result["nextCursor"])
            self._chains.pop(key, None)  # re-inserted last: the oldest is dropped first
            self._chains[key] = listing
            if len(self._chains) > MAX_CHAINS:
                del self._chains[next(iter(self._chains))]
        return tools

    def _listing_done(self, listing: _Listing) -> None:
        """``listing`` is all there is: it is what is known, if it began (its first page)
        in the generation it ends in, no change having come since."""
        if listing.generation == self._generation:
            self.tools = dict(listing.tools)
            self.tools_known = True
            self._name_own_tools(set(listing.tools))

    def _forget_tools(self) -> None:
        """Annotations may have changed: forget them (every call is fenced until they are
        learned again); no listing begun before this counts as current."""
        self.tools_known = False
        self.tools = {}
        self._chains = {}
        self._generation += 1

    def _listed(
        self, cid: Any, listing: _Listing | None, generation: int, msg: dict[str, Any]
    ) -> None:
        result = msg.get("result")
        if isinstance(result, dict):
            tools = self._note_tools(result, listing, generation)
            if tools is not None and _last_page(result):
                result = {**result, "tools": [*tools, *self._own_tool_defs()]}
                msg = {**msg, "result": result}
        self.write_client(_line({**msg, "id": cid}))

    def _name_own_tools(self, taken: set[str]) -> None:
        self._named = True
        for role in _OWN_TOOLS:
            base = f"effectfence_{role}"
            name, n = base, 1
            while name in taken:
                n += 1
                name = f"{base}_{n}"
            if name != base and self.own_names.get(role) != name:
                _stderr(f"the server has a tool named {base!r}; the wrapper's is {name!r}")
            self.own_names[role] = name

    async def ensure_tools(self) -> None:
        """Learn the child's tools (and their annotations) before the first decision."""
        if self.tools_known:
            return
        for _ in range(LISTING_ATTEMPTS):
            await self._list_tools()
            if self.tools_known:
                return
        # the child keeps changing its tools while they are listed: what was learned last
        # stands for no one; every call is fenced until a listing completes
        self.tools = {}

    async def _list_tools(self) -> None:
        """One listing, page by page; it makes the tools known if no change came meanwhile."""
        cursor: Any = None
        listing = _Listing(self._generation)
        seen: set[str] = set()
        while True:
            params: dict[str, Any] = {}
            if cursor is not None:
                params["cursor"] = cursor
            if self.era != "legacy" and self.modern_meta:
                params["_meta"] = dict(self.modern_meta)
            msg = {"jsonrpc": "2.0", "id": self._own_id(), "method": "tools/list", "params": params}
            generation = self._generation
            resp = await self.child_request(msg)
            result = resp.get("result")
            if (
                not isinstance(result, dict)
                or self._note_tools(result, listing, generation) is None
            ):
                if generation == self._generation:  # a child that can't list: fence every call
                    self.tools, self.tools_known = {}, True
                    self._name_own_tools(set())
                return
            if _last_page(result):
                return
            cursor = result["nextCursor"]
            if cursor in seen or len(seen) >= MAX_TOOL_PAGES:
                # a cursor met before (or pages past counting) would list for ever, with the
                # call that asked waiting (found by review: "" asked 67,855 times in 5 s):
                # what is listed is known, and a tool never listed is fenced
                _stderr("the server's tool listing does not end; using what it listed")
                self._listing_done(listing)
                return
            seen.add(cursor)

    def _own_tool_defs(self) -> list[dict[str, Any]]:
        which: dict[str, Any] = {
            "tool": {"type": "string", "description": "the wrapped tool's name"},
            "arguments": {"type": "object", "description": "its arguments, as called"},
            "intent": {"type": "string", "description": "or the intent id itself"},
        }
        target = {"type": "object", "properties": which}
        defs = [
            {
                "name": self.own_names["status"],
                "title": "Fence status of a call",
                "description": "Has this exact tool call already run, is it running, or did it "
                "end with an unknown outcome? Pass `tool` and `arguments` as you would call it "
                "(or an `intent`). Read-only: runs nothing.",
                "inputSchema": target,
                "annotations": {
                    "readOnlyHint": True,
                    "idempotentHint": True,
                    "openWorldHint": False,
                },
            },
            {
                "name": self.own_names["stats"],
                "title": "Fence statistics",
                "description": "Counts of calls the fence passed through, ran, replayed and "
                "refused, and the store it records them in. Read-only.",
                "inputSchema": {"type": "object", "properties": {}},
                "annotations": {
                    "readOnlyHint": True,
                    "idempotentHint": True,
                    "openWorldHint": False,
                },
            },
        ]
        if self.allow_clear:
            clear_input = {
                "type": "object",
                "properties": {
                    **which,
                    "reason": {
                        "type": "string",
                        "minLength": 1,
                        "maxLength": MAX_CLEAR_TEXT,
                        "pattern": r"\S",
                        "description": "why it is cleared (what you found downstream); "
                        "recorded in the store's audit trail with who cleared it",
                    },
                    "force": {
                        "type": "boolean",
                        "default": False,
                        "description": "clear even a call still running under a live lease "
                        "(only once you know it is not running; recorded as forced)",
                    },
                    "expect_state": {
                        "type": "string",
                        "enum": ["in_flight", "in_flight_lapsed", "done", "failed"],
                        "description": "the state effectfence_status showed you: a record "
                        "no longer in it is refused (intent_in_flight), unchanged: look again",
                    },
                    "expect_token": {
                        "type": "integer",
                        "minimum": 0,
                        "description": "the token effectfence_status showed you: a record "
                        "under another token is refused the same way",
                    },
                },
                "required": ["reason"],
            }
            defs.append(
                {
                    "name": self.own_names["clear"],
                    "title": "Clear a fenced call (operator)",
                    "description": "OPERATOR ONLY. Forget a fenced call (done, failed, or "
                    "running), so an identical call runs again. Use only after checking "
                    "downstream whether it took effect. `reason` is required and recorded in "
                    "the audit trail; a call still running under a live lease is refused "
                    "intent_in_flight unless `force` is true.",
                    "inputSchema": clear_input,
                    "annotations": {
                        "destructiveHint": True,
                        "idempotentHint": True,
                        "openWorldHint": False,
                    },
                }
            )
        return defs

    # -- tools/call -----------------------------------------------------------------------
    def _spawn(self, coro: Awaitable[None]) -> asyncio.Task[None]:
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _own_role(self, name: str) -> str | None:
        """Which of the wrapper's own tools ``name`` is, if it is one that is offered."""
        for role, own in self.own_names.items():
            if name == own and (role != "clear" or self.allow_clear):
                return role
        return None

    def _passes(self, name: Any) -> TypeGuard[str]:
        """Whether a ``tools/call`` of ``name`` is decided already: the tools are known, and
        it is a child's tool its policy does not fence, and the child is up. Then it is
        relayed at once, in the relay's own turn, with no task of its own."""
        child = self.child
        return (
            self.tools_known
            # a child that is there and ready: relaying cannot wait. During a restart the
            # call waits in its task, or the relay (own tools, cancels, a termination
            # signal) waited with it (found by review)
            and child is not None
            and child.alive
            and child.ready.is_set()
            and self._backlog is None  # nothing it would overtake
            and type(name) is str
            and self._own_role(name) is None
            and not self.policy.for_tool(name).fenced(self.tools.get(name))
        )

    async def _pass_through(self, name: str, cid: Any, line: bytes, msg: dict[str, Any]) -> None:
        self.stats.passed += 1
        self._tally(name, "passed")
        await self._forward(line, (cid,), msg)  # as it came: nothing read or lost

    async def _tool_call(self, cid: Any, msg: dict[str, Any], line: bytes, call: _Call) -> None:
        """One ``tools/call``, in its own task (``call.task``), registered in ``calls``
        since it was read: a cancel that comes before anything is decided or run (even
        before this task starts) stops it there, unanswered, as MCP says."""
        params = msg.get("params")
        name = params.get("name") if isinstance(params, dict) else None
        if type(name) is not str or not isinstance(params, dict):
            # refused, never relayed: what the child makes of a call whose name the wrapper
            # cannot read is not the wrapper's to guess (found by review)
            self._forget_call(cid, call)
            self._client_error(
                cid, -32602, "effectfence wrap: a tools/call names its tool in params.name"
            )
            return
        modern = _is_modern(params)
        try:
            try:
                if not (self._named and self._own_role(name) is not None):
                    # the wrapper's own tools, once their names are settled, need no child
                    await self.ensure_tools()
            except ChildGone as exc:
                self._answer(
                    cid,
                    modern,
                    self._text_result(
                        f"effectfence wrap: {exc}. `{name}` was NOT run; call again.",
                        error=True,
                        marker={"outcome": "not_run"},
                    ),
                )
                return
            own_role = self._own_role(name)
            tp = self.policy.for_tool(name)
            if own_role is None and not tp.fenced(self.tools.get(name)):
                self._forget_call(cid, call)  # the child's now: a cancel is relayed to it
                await self._pass_through(name, cid, line, msg)
                return
            # what the fence reads, read exactly (orjson reads an integer past 64 bits as a
            # float: two different order ids would name one intent)
            exact = _parse(line, exact=True) if _shallow(line) else _UNREADABLE
            if not isinstance(exact, dict) or not isinstance(exact.get("params"), dict):
                self._forget_call(cid, call)
                self._client_error(
                    cid, -32600, "effectfence wrap: the request is nested too deeply"
                )
                return
            msg, params = exact, exact["params"]
            if own_role is not None:
                self._forget_call(cid, call)
                await self._own_tool(cid, modern, own_role, params)
                return
            await self._fenced(cid, msg, line, name, params, tp, modern, call)
        except asyncio.CancelledError:
            pass  # the client cancelled: per MCP it expects no answer
        except Exception as exc:  # a fault of the wrapper's: the client still hears back
            _stderr(f"{name}: internal error: {exc!r}")
            self._client_error(cid, -32603, f"effectfence wrap: internal error: {exc!r}")

    def request_for(self, name: str, args: dict[str, Any], tp: ToolPolicy) -> EffectRequest:
        """The intent: namespace, tool, and a digest of the arguments that name the action
        (default all); the payload is all arguments, so a reused intent with other
        arguments is refused, never replayed (G4)."""
        if tp.intent_args is None:
            named: Any = args
        else:
            named = {k: args[k] for k in tp.intent_args if k in args}
            if not named:
                # a misspelt name made every call one intent: the first ran, every other
                # was refused intent_conflict without a word why (found by review)
                raise InvalidRequest(
                    f"the policy names `{name}`'s action by {list(tp.intent_args)}, and this "
                    "call has none of those arguments: check intent_args against the tool's "
                    "arguments"
                )
        try:
            # the fence's own limits: the default depth (64) refused calls the fence takes
            canonical = canonical_bytes(named, max_depth=MAX_DEPTH, max_bytes=MAX_ARGS_BYTES)
        except CanonicalError as exc:
            raise InvalidRequest(f"the arguments can't be fenced: {exc}") from exc
        digest = hashlib.sha256(canonical).hexdigest()[:40]
        tool = _tool_label(name)
        if tp.domain is None:
            domain = f"{self.namespace}:{tool}"
        else:
            # filled with each argument as canonical JSON writes it where str() would not:
            # str() of an object keeps its key order, so a retry with its keys in another
            # order named the same intent under another domain and was refused (review)
            fill = {k: _as_filled(v) for k, v in args.items()}
            try:
                domain = _ascii(tp.domain.format_map({**fill, "tool": name}))[:500]
            except (KeyError, IndexError, AttributeError, ValueError, TypeError) as exc:
                raise InvalidRequest(
                    f"the policy's domain template {tp.domain!r} can't be filled from the "
                    f"arguments ({exc!r})"
                ) from exc
        return EffectRequest(f"{self.namespace}:{tool}:{digest}", domain, tool, args, self.agent)

    async def _fenced(
        self,
        cid: Any,
        msg: dict[str, Any],
        line: bytes,
        name: str,
        params: dict[str, Any],
        tp: ToolPolicy,
        modern: bool,
        call: _Call,
    ) -> None:
        self.stats.fenced += 1
        args = params.get("arguments")
        if args is None:
            args = {}
        if not isinstance(args, dict):
            # refused, never relayed: a child that reads `arguments or {}` ran every such
            # call of a fenced tool, unfenced (found by review)
            self._forget_call(cid, call)
            self._client_error(
                cid, -32602, f"effectfence wrap: `{name}`'s arguments must be an object"
            )
            return
        try:
            request = self.request_for(name, args, tp)
        except InvalidRequest as exc:
            self._refused(cid, modern, name, exc)
            return
        fence = self.fence_for(tp)
        got: dict[str, Any] = {}

        async def effect(ticket: PreparedEffect) -> Any:
            own = self._own_id()
            call.own_id = own
            try:
                resp = await self.child_request({**msg, "id": own})
            finally:
                call.own_id = None
            got["response"] = resp
            result = resp.get("result")
            if "error" in resp or (isinstance(result, dict) and result.get("isError") is True):
                raise ChildError(resp)
            if not isinstance(result, dict):
                raise ChildGone("the server's answer was not a tool result")
            return _record(_era_neutral(result), fence.config)

        options = Options(
            wait=True,
            wait_timeout=tp.wait,
            renew_every=tp.lease_ttl / 3,
            did_not_fire=(NotSent, ChildError) if tp.on_error == "release" else (NotSent,),
        )
        try:
            done = await run_async(
                fence, request, options, effect, offload=self.offloader if self.offload else False
            )
        except ChildError as exc:
            self.stats.child_errors += 1
            self._tally(name, "child_error")
            self.write_client(_line({**exc.response, "id": cid}))
            return
        except NotSent as exc:
            if exc.cancelled:
                raise asyncio.CancelledError from None  # per MCP: no answer
            self._tally(name, "not_sent")
            self._answer(
                cid,
                modern,
                self._text_result(
                    f"effectfence wrap: {exc}. `{name}` was NOT run; call again.",
                    error=True,
                    marker={"fenced": True, "outcome": "not_run", "intent": request.intent},
                ),
            )
            return
        except ChildGone as exc:
            self.stats.unknown_outcomes += 1
            self._tally(name, "unknown")
            text = (
                f"effectfence: {exc} while `{name}` was running, so nobody knows whether it "
                "took effect. To avoid doing it twice, identical calls are refused until an "
                f"operator checks and clears it (intent {request.intent}; "
                f"`{self.own_names['status']}` shows it). If the server stopped, it is "
                "restarted for later calls."
            )
            self._answer(
                cid,
                modern,
                self._text_result(
                    text,
                    error=True,
                    marker={"fenced": True, "outcome": "unknown", "intent": request.intent},
                ),
            )
            return
        except Refusal as exc:
            if "response" in got:
                # it RAN (the child answered) but the ledger could not record it: the
                # client gets what the tool did, marked unrecorded; never "NOT run"
                self._ran_unrecorded(cid, name, got["response"], exc, request.intent)
                return
            self._refused(cid, modern, name, exc)
            return
        self._delivered(cid, modern, name, done, got.get("response"))

    def _ran_unrecorded(
        self, cid: Any, name: str, response: dict[str, Any], exc: Refusal, intent: str
    ) -> None:
        self.stats.executed += 1
        self._tally(name, "unrecorded")
        _stderr(f"{name}: it ran, but the fence could not record it ({exc.code}: {exc.message})")
        out = {**response, "id": cid}
        result = out.get("result")
        if isinstance(result, dict):
            meta = result.get("_meta")
            marker = {
                "fenced": True,
                "replayed": False,
                "recorded": False,
                "intent": intent,
                "refused": exc.code,
                "reason": exc.message,
            }
            out["result"] = {
                **result,
                "_meta": {**(meta if isinstance(meta, dict) else {}), META_KEY: marker},
            }
        self.write_client(_line(out))

    def _delivered(
        self, cid: Any, modern: bool, name: str, done: FencedCall, response: dict[str, Any] | None
    ) -> None:
        record = done.result
        cert = done.cert
        marker = {
            "fenced": True,
            "replayed": not done.fresh,
            "intent": cert.intent,
            "certificate": cert.hash,
            "completed_at": record.get("completed_at") if isinstance(record, dict) else None,
        }
        if done.fresh and response is not None:
            self.stats.executed += 1
            self._tally(name, "executed")
            result = dict(response["result"])
        else:
            self.stats.replayed += 1
            self._tally(name, "replayed")
            stored = _recorded_result(record)
            result = dict(stored) if isinstance(stored, dict) else {"content": []}
        meta = result.get("_meta")
        result["_meta"] = {**(meta if isinstance(meta, dict) else {}), META_KEY: marker}
        self._answer(cid, modern, result)

    def _answer(self, cid: Any, modern: bool, result: dict[str, Any]) -> None:
        if modern:
            result = {**result, "resultType": "complete"}
        self.write_client(_line({"jsonrpc": "2.0", "id": cid, "result": result}))

    @staticmethod
    def _text_result(
        text: str, *, error: bool = False, marker: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        result: dict[str, Any] = {"content": [{"type": "text", "text": text}]}
        if error:
            result["isError"] = True
        if marker is not None:
            result["_meta"] = {META_KEY: marker}
        return result

    def _refused(self, cid: Any, modern: bool, name: str, refusal: Refusal) -> None:
        self.stats.refused += 1
        self._tally(name, refusal.code)
        payload = refusal.to_payload()
        details = payload.get("details") or {}
        if refusal.code == "intent_failed":
            why = details.get("reason") or refusal.message
            text = (
                f"effectfence: an identical `{name}` call ended earlier without anyone knowing "
                f"whether it took effect ({why}). To avoid doing it twice it was NOT run again. "
                "An operator must check whether it happened and then clear it "
                f"(`{self.own_names['status']}` shows it)."
            )
        elif refusal.code == "intent_in_flight":
            text = (
                f"effectfence: an identical `{name}` call is still running; this one was NOT "
                "run a second time. Call again shortly to get its result."
            )
        elif refusal.code == "intent_conflict":
            text = (
                f"effectfence: this `{name}` call names the same action as an earlier one "
                "(the policy's intent_args) but with different arguments; it was NOT run."
            )
        elif refusal.code == "store_unavailable":
            text = f"effectfence: the fence's store can't be reached; `{name}` was NOT run."
        else:
            text = f"effectfence: `{name}` was NOT run: {refusal.message}"
        marker = {"fenced": True, "refused": refusal.code, "intent": refusal.intent}
        self._answer(cid, modern, self._text_result(text, error=True, marker=marker))

    # -- the wrapper's own tools ----------------------------------------------------------
    async def _own_tool(self, cid: Any, modern: bool, role: str, params: dict[str, Any]) -> None:
        args = params.get("arguments") or {}
        try:
            if not isinstance(args, dict):
                raise InvalidRequest("arguments must be an object")
            if role == "stats":
                data = await self._fence_op(self._stats_data)
            else:
                intent = self._target_intent(args)
                if role == "status":
                    data = await self._fence_op(self._status_data, intent)
                else:
                    data = await self._fence_op(self._clear_data, intent, args)
        except Refusal as exc:
            payload = exc.to_payload()
            refused = self._text_result(
                f"effectfence: REFUSED {exc.code}: {exc.message} (recover: {exc.recover})",
                error=True,
                marker={"refused": exc.code, "intent": exc.intent},
            )
            refused["structuredContent"] = payload
            self._answer(cid, modern, refused)
            return
        text = json.dumps(data, indent=2)
        self._answer(
            cid, modern, {"content": [{"type": "text", "text": text}], "structuredContent": data}
        )

    def _target_intent(self, args: dict[str, Any]) -> str:
        intent = args.get("intent")
        if type(intent) is str and intent:
            if not self._in_scope(intent):
                # the ledger is shared by every wrapper and server on the host: a client of
                # this one cleared another agent's failed charge, whose retry then ran again
                # (found by review)
                raise InvalidRequest(
                    f"intent {intent!r} is not one of this wrapper's: its intents are "
                    f"'{self.namespace}:<tool>:<digest>' for the tools of this server. An "
                    "operator clears any other with `effectfence intents clear`",
                    intent=intent,
                )
            return intent
        tool = args.get("tool")
        call_args = args.get("arguments") or {}
        if type(tool) is not str or not isinstance(call_args, dict):
            raise InvalidRequest("pass `tool` (and its `arguments`), or an `intent`")
        return self.request_for(tool, call_args, self.policy.for_tool(tool)).intent

    def _in_scope(self, intent: str) -> bool:
        """Whether ``intent`` is one :meth:`request_for` can make here: this namespace, a
        tool's label and a digest; once the child has listed tools, the label of one of
        them (so the intents of a namespace that extends this one, ``shop:eu`` beside
        ``shop``, are not taken for this one's)."""
        prefix = self.namespace + ":"
        if not intent.startswith(prefix):
            return False
        label, sep, digest = intent[len(prefix) :].rpartition(":")
        if not sep or not label or not _DIGEST.fullmatch(digest):
            return False
        return not self.tools or label in {_tool_label(t) for t in self.tools}

    def _clear_data(self, intent: str, args: dict[str, Any]) -> dict[str, Any]:
        """``effectfence_clear``: the operator's clear, with the client's reason, recorded as
        the client (its ``clientInfo.name``) through wrap; a live lease only with force."""
        # what a valid reason and force are is fence.clear's to say (one place)
        who = f"{self.agent} (mcp, wrap)"
        entry = self.any_fence().clear(
            intent,
            reason=args.get("reason", ""),
            who=who,
            force=args.get("force", False),
            expect_state=args.get("expect_state"),
            expect_token=args.get("expect_token"),
        )
        data = clear_view(intent, entry)
        if entry is not None:
            was = data["previous_state"]
            _stderr(f"cleared {intent} (was {was}) at {who}'s request: audit #{entry.id}")
        return data

    def _status_data(self, intent: str) -> dict[str, Any]:
        st = self.any_fence().intent_status(intent)
        out: dict[str, Any] = {"intent": intent, "state": st.state}
        for key in ("token", "holder", "domain", "retry_after", "reason"):
            value = getattr(st, key)
            if value is not None:
                out[key] = value
        if st.cert is not None:
            out["certificate"] = st.cert.hash
            out["tool"] = st.cert.tool
            record = st.cert.result
            if isinstance(record, dict) and "completed_at" in record:
                out["completed_at"] = record["completed_at"]
        return out

    def _stats_data(self) -> dict[str, Any]:
        s = self.stats
        fence_stats = [f.stats() for f in self._fences.values()] or [self.any_fence().stats()]
        prepare: dict[str, int] = {}
        for fs in fence_stats:
            for k, v in fs["prepare"].items():
                prepare[k] = prepare.get(k, 0) + v
        return {
            "calls": {
                "passed_through": s.passed,
                "fenced": s.fenced,
                "executed": s.executed,
                "replayed": s.replayed,
                "refused": s.refused,
                "child_errors": s.child_errors,
                "unknown_outcome": s.unknown_outcomes,
            },
            "by_tool": s.by_tool,
            "server_starts": s.child_starts,
            "fence_prepare": prepare,
            "store": fence_stats[0]["store"],
            "namespace": self.namespace,
        }

    def _tally(self, name: str, what: str) -> None:
        """Count an outcome per tool for the names the child listed and the wrapper's own;
        every other name a client sends goes under :data:`UNLISTED`, so ``by_tool`` is as
        large as the listing, not as the number of names clients have made up."""
        if name not in self.tools and name not in self.own_names.values():
            name = UNLISTED
        self.stats.tool(name, what)

    # -- running --------------------------------------------------------------------------
    def terminate(self, signum: int) -> None:
        """A termination signal (SIGTERM, SIGINT; see :func:`main`): read nothing more from
        the client, and cancel every fenced call in progress now, as the client's cancel
        would. One whose request reached the child is aborted (its outcome is unknown: the
        intent stays fenced, refused ``intent_failed`` until an operator clears it); one
        that never did is released. Then the wrapper closes as when the client hangs up.
        Killed by the signal instead, it left such intents in flight, and once their leases
        lapsed an identical call ran the effect again (found by review: an MCP client's
        shutdown closes stdin, then sends SIGTERM two seconds later). A second signal is
        not caught: it ends the process."""
        if self.terminated is not None:
            return
        self.terminated = signum
        fenced = [cid for cid, call in self.calls.items() if call.task is not None]
        name = signal.Signals(signum).name
        _stderr(
            f"{name}: cancelling {len(fenced)} fenced call(s) in progress (a call that reached "
            "the server stays fenced as outcome unknown) and closing"
        )
        for cid in fenced:
            self._cancel(cid, f"effectfence wrap is stopping ({name})")
        if self._reader is not None:
            # the relay ends (close() then settles the cancelled calls); an exception, not
            # EOF: a reader fed by a thread may still be fed after it
            self._reader.set_exception(_Terminated(signum))

    async def run(self, reader: asyncio.StreamReader) -> int:
        """Relay until the client hangs up; then let fenced calls finish and stop the child."""
        self._reader = reader
        try:
            await self.ensure_child()
        except ChildGone as exc:
            _stderr(str(exc))
            return 1
        while True:
            try:
                line = await reader.readline()
            except _Terminated:
                break
            except ValueError:
                _stderr("a message from the client exceeds 64 MiB; closing")
                break
            if not line or self.terminated is not None:
                break
            written = self.written
            try:
                await self.on_client_line(line)
            except Exception as exc:  # one line must never end the relay and every call
                _stderr(f"internal error on a client line: {exc!r}; dropped it")
                msg = _parse(line)
                if (
                    self.written == written  # not answered yet (never twice)
                    and isinstance(msg, dict)
                    and "method" in msg
                    and _is_id(msg.get("id"))
                ):
                    with contextlib.suppress(Exception):  # a writer that fails again
                        self._client_error(
                            msg["id"], -32603, f"effectfence wrap: internal error: {exc!r}"
                        )
            if self.fatal is not None:
                _stderr(self.fatal)
                break
        await self.close()
        if self.terminated is not None:
            return 128 + self.terminated
        return 1 if self.fatal else 0

    async def close(self) -> None:
        self.closing = True
        fenced = [c.task for c in self.calls.values() if c.task is not None]
        if fenced:  # their effects may be running: record them before the child goes
            await asyncio.wait(fenced, timeout=DRAIN_TIMEOUT)
        child = self.child
        if child is not None and child.proc.returncode is None:
            stdin = child.proc.stdin
            if stdin is not None:
                stdin.close()
            grace = CHILD_EXIT_GRACE if self.terminated is None else TERMINATE_GRACE
            try:
                await asyncio.wait_for(_exit_code(child.proc), grace)
            except TimeoutError:
                child.proc.terminate()
                try:
                    await asyncio.wait_for(_exit_code(child.proc), grace)
                except TimeoutError:
                    child.proc.kill()
                    await _exit_code(child.proc)
        for task in list(self._tasks):
            task.cancel()
        for fence in self._fences.values():
            with contextlib.suppress(Exception):  # the cancelled calls settle meanwhile
                await fence.aclose(CHILD_EXIT_GRACE)
        if not self._fences:
            with contextlib.suppress(Exception):
                self.store.close()
        self.offloader.close()


def _as_filled(value: Any) -> Any:
    """An argument as a domain template gets it: strings, integers, booleans and floats as
    they are (a format spec applies to them), but an integral float as its integer (1.0 is
    1 to the intent); an object or a list as :class:`_Canonical`."""
    if type(value) is float and value.is_integer() and abs(value) < 2**53:
        return int(value)
    if isinstance(value, dict | list):
        return _Canonical(value)
    return value


class _Canonical:
    """An object or list argument in a domain template: written as canonical JSON (str()
    kept its key order, so a retry with its keys in another order was refused, found by
    review), indexed as the value is (``{customer[id]}``, ``{items[0]}``)."""

    __slots__ = ("value",)

    def __init__(self, value: dict[str, Any] | list[Any]) -> None:
        self.value = value

    def __getitem__(self, key: Any) -> Any:
        return _as_filled(self.value[key])

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)

    def __str__(self) -> str:
        try:
            return canonical_bytes(self.value, max_depth=MAX_DEPTH).decode()
        except CanonicalError:  # refused with the arguments by the fence, typed
            return repr(self.value)


def _read_only(annotations: Any) -> bool:
    return isinstance(annotations, dict) and annotations.get("readOnlyHint") is True


class _Listing:
    """One listing in progress: what its pages listed so far, and the tools' generation its
    first page was asked in."""

    __slots__ = ("generation", "tools")

    def __init__(self, generation: int) -> None:
        self.generation = generation
        self.tools: dict[str, Any] = {}


def _key(cursor: Any) -> tuple[str, bytes]:
    """A cursor as a key (servers send strings; anything else by its JSON text), kept as
    its digest: a child's cursors may be as long as a line (found by review)."""
    if type(cursor) is str:
        kind, text = "s", cursor
    else:
        try:
            kind, text = "j", json.dumps(cursor, sort_keys=True)
        except (TypeError, ValueError, RecursionError):
            return ("r", repr(type(cursor)).encode())
    return (kind, hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest())


def _last_page(result: dict[str, Any]) -> bool:
    """A listing page with no next one: no cursor, or one no request can carry ("", a
    number), which some servers send for "no more"."""
    cursor = result.get("nextCursor")
    return type(cursor) is not str or not cursor


def _record(result: dict[str, Any], cfg: FenceConfig) -> dict[str, Any]:
    """What the fence records of a tool's result: the result, or, where it holds what a
    certificate's canonical JSON cannot (an integer past 2**53, as database ids and
    snowflake ids are; NaN; a lone surrogate; nesting past the fence's depth), its JSON
    text, replayed exactly. The call ran: its result must not go unrecorded for the way its
    numbers are written. Judged by the limits the commit will apply (``cfg``): judged by
    others, a result nested past the commit's depth ran, came back, and was fenced as if
    nobody knew (found by review)."""
    record = {"result": result, "completed_at": _now_iso()}
    try:
        canonical_bytes(record, max_depth=cfg.max_depth, max_bytes=cfg.max_result_bytes)
    except CanonicalError:
        text = json.dumps(result, separators=(",", ":"))  # ASCII: lone surrogates escaped
        return {"result_json": text, "completed_at": record["completed_at"]}
    return record


def _recorded_result(record: Any) -> Any:
    """The result a record holds (see :func:`_record`), or None."""
    if not isinstance(record, dict):
        return None
    text = record.get("result_json")
    if type(text) is str:
        try:
            return json.loads(text)
        except (ValueError, RecursionError):
            return None
    return record.get("result")


def _era_neutral(result: dict[str, Any]) -> dict[str, Any]:
    """A result as recorded: without the 2026-era envelope (``resultType``, reserved
    ``_meta`` keys), so a replay fits a client of either era."""
    out = {k: v for k, v in result.items() if k != "resultType"}
    meta = out.get("_meta")
    if isinstance(meta, dict):
        kept = {k: v for k, v in meta.items() if not k.startswith(MODERN_PREFIX)}
        if kept:
            out["_meta"] = kept
        else:
            del out["_meta"]
    return out


# -- stdio plumbing -----------------------------------------------------------------------------
def _pollable(stream: Any) -> bool:
    """A pipe, a socket or a terminal goes through the loop. asyncio takes any character
    device for a pipe, and epoll then refuses some (``/dev/null``: EPERM) in a callback,
    after which the reader waited forever: ``wrap ... < /dev/null`` hung, never exiting."""
    fd = stream.fileno()
    mode = os.fstat(fd).st_mode
    return stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode) or os.isatty(fd)


async def _stdio() -> tuple[asyncio.StreamReader, Callable[[bytes], None]]:
    """Our stdin as a stream and a writer for stdout. Pipes, sockets and terminals go
    through the loop; anything else (``wrap < requests.jsonl``, ``/dev/null``) is read by a
    thread and written plainly."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=LINE_LIMIT)
    if _pollable(sys.stdin.buffer):
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin.buffer)
    else:

        def pump() -> None:
            for line in sys.stdin.buffer:
                loop.call_soon_threadsafe(reader.feed_data, line)
            loop.call_soon_threadsafe(reader.feed_eof)

        loop.run_in_executor(None, pump)
    out = sys.stdout.buffer
    if not _pollable(out):

        def write_sync(data: bytes) -> None:
            out.write(data)
            out.flush()

        return reader, write_sync
    transport, _ = await loop.connect_write_pipe(asyncio.Protocol, out)

    def write(data: bytes) -> None:
        if not transport.is_closing():
            transport.write(data)

    return reader, write


def _on_signal(
    proxy: Proxy, signum: int, loop: asyncio.AbstractEventLoop, caught: list[int]
) -> None:
    """The first termination signal: the proxy settles its fenced calls and closes
    (:meth:`Proxy.terminate`); from then on the signals act as they would uncaught."""
    for other in caught:
        loop.remove_signal_handler(other)
    proxy.terminate(signum)


def main(argv: list[str] | None = None) -> int:
    """``effectfence wrap [--policy FILE] [--store URL] -- CMD ARGS...``"""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" in argv:
        cut = argv.index("--")
        ours, cmd = argv[:cut], argv[cut + 1 :]
    else:
        ours, cmd = argv, []
    parser = argparse.ArgumentParser(
        prog="effectfence wrap",
        description="Serve a stdio MCP server's tools through the fence: identical "
        "side-effecting calls run once; duplicates get the recorded result.",
        usage="effectfence wrap [--policy FILE] [--store URL] [--namespace NAME] [--allow-clear] "
        "-- CMD [ARGS...]",
    )
    parser.add_argument("--policy", metavar="FILE", help="TOML policy (see docs/wrap.md)")
    parser.add_argument(
        "--store",
        metavar="URL",
        help="where the ledger lives (default: $EFFECTFENCE_STORE, else one SQLite file in "
        "the user's state directory; memory: for none)",
    )
    parser.add_argument(
        "--namespace", metavar="NAME", help="scope of intents (default: from the command)"
    )
    parser.add_argument(
        "--allow-clear",
        action="store_true",
        default=os.environ.get(ALLOW_CLEAR_ENV, "").strip().lower() in ("1", "true", "yes", "on"),
        help=f"add the operator tool effectfence_clear (or {ALLOW_CLEAR_ENV}=1)",
    )
    args = parser.parse_args(ours)
    if not cmd:
        parser.error("name the server to wrap after --, e.g. -- uvx mcp-server-sqlite")
    try:
        policy = Policy.load(args.policy) if args.policy else Policy()
        if args.namespace is not None:
            check_namespace(args.namespace, "--namespace")
    except PolicyError as exc:
        parser.error(str(exc))
    if args.store is not None and not args.store.strip():
        parser.error("--store is empty: give a store URL, or leave --store out for the default")
    missing = _unstartable(cmd[0])
    if missing is not None:
        # before the store: a refused command made a whole store file (found by review)
        _stderr(f"can't start {cmd[0]!r}: {missing}")
        return 1
    store_url = args.store or default_store_url()  # as serve's: one ledger per host

    async def run() -> int:
        reader, write = await _stdio()
        try:
            proxy = Proxy(
                cmd,
                write,
                store_url=store_url,
                policy=policy,
                allow_clear=args.allow_clear,
                namespace=args.namespace,
            )
        except (ValueError, Refusal) as exc:
            _stderr(f"can't open the store: {exc}")
            return 2
        loop = asyncio.get_running_loop()
        caught: list[int] = []
        for signum in (int(signal.SIGTERM), int(signal.SIGINT)):
            try:
                loop.add_signal_handler(signum, _on_signal, proxy, signum, loop, caught)
                caught.append(signum)
            except (NotImplementedError, RuntimeError, ValueError):  # no such support here
                pass
        return await proxy.run(reader)

    try:
        return asyncio.run(run())
    except KeyboardInterrupt:
        return 130

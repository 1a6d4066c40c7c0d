"""Stores: where intent records and domain seqs live, chosen by URL.

The core never imports a store driver: :func:`open_store` imports the module of the scheme
it is asked for, so ``import effectfence`` never pays for psycopg or redis.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, quote, unquote, urlsplit

from effectfence.store.base import FenceStore, Head, Outcome, Step, StoreMissing
from effectfence.store.memory import MemoryStore

__all__ = [
    "SCHEMES",
    "STORE_ENV",
    "FenceStore",
    "Head",
    "MemoryStore",
    "Outcome",
    "Step",
    "StoreMissing",
    "StoreURLError",
    "default_store_url",
    "is_memory_url",
    "open_store",
    "redact",
    "state_dir",
]

#: overrides the servers' default store (a URL, ``memory:`` to opt out of durability)
STORE_ENV = "EFFECTFENCE_STORE"

#: URL scheme -> (module, class). Each durable store lives in its own module.
SCHEMES: dict[str, tuple[str, str]] = {
    "memory": ("effectfence.store.memory", "MemoryStore"),
    "sqlite": ("effectfence.store.sqlite", "SQLiteStore"),
    "postgresql": ("effectfence.store.postgres", "PostgresStore"),
    "postgres": ("effectfence.store.postgres", "PostgresStore"),
    "redis": ("effectfence.store.redis", "RedisStore"),
    "rediss": ("effectfence.store.redis", "RedisStore"),
}


def is_memory_url(url: str) -> bool:
    """Whether a URL names the in-process store (``memory:``): nothing to open, create or
    share, so callers build a plain fence for it."""
    # not a str: not this store's, and open_store refuses it typed (from_url(None) raised
    # AttributeError here, found by review)
    return type(url) is str and url.strip().lower() in ("memory", "memory:", "memory://")


class StoreURLError(ValueError):
    """A store URL this build cannot open (unknown scheme, or its driver is missing)."""


def open_store(url: str, **options: Any) -> FenceStore:
    """The store a URL names: ``memory:``, ``sqlite:///path/fence.db``,
    ``postgresql://user@host/db``, ``redis://host:6379/0``. Options go to its constructor."""
    if type(url) is not str or ":" not in url:
        # never echo it: a libpq keyword DSN ("host=db password=...") lands here
        raise StoreURLError("a store URL looks like sqlite:///path/fence.db or memory:")
    scheme = url.split(":", 1)[0].lower()
    if scheme not in SCHEMES:
        raise StoreURLError(f"unknown store scheme {redact(url)!r}; known: {', '.join(SCHEMES)}")
    module, name = SCHEMES[scheme]
    if scheme == "memory":
        from effectfence.store.cmemory import memory_store

        return memory_store(**options)
    try:
        cls = getattr(importlib.import_module(module), name)
    except ImportError as exc:
        extra = {"postgresql": "postgres", "postgres": "postgres"}.get(scheme, scheme)
        raise StoreURLError(
            f"the {scheme} store needs its driver: pip install 'effect-fence[{extra}]' ({exc})"
        ) from exc
    store: FenceStore = cls.from_url(url, **options)
    return store


def state_dir() -> Path:
    """Where per-user state lives: $XDG_STATE_HOME or ~/.local/state; on macOS
    ~/Library/Application Support; on Windows %LOCALAPPDATA%."""
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Application Support"
    if sys.platform == "win32":
        local = os.environ.get("LOCALAPPDATA")
        return Path(local) if local else Path.home() / "AppData" / "Local"
    xdg = os.environ.get("XDG_STATE_HOME")
    if xdg and os.path.isabs(xdg):  # the XDG spec ignores relative paths
        return Path(xdg)
    return Path.home() / ".local" / "state"


def default_store_url(*, create: bool = True) -> str:
    """The store ``serve`` and ``wrap`` use unless told otherwise: $EFFECTFENCE_STORE, else
    one SQLite file in the user's state directory, so every server a user's agents spawn
    on this host shares one ledger, and a restart forgets nothing. The directory is
    created owner-only (0700): the file holds the ticket sealing key. ``create=False``
    (looking, the operator's commands) leaves a missing directory missing."""
    env = os.environ.get(STORE_ENV, "").strip()
    if env:
        return env
    directory = state_dir() / "effectfence"
    if create:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    return sqlite_url(str(directory / "fence.db"))


def sqlite_url(path: str) -> str:
    """The URL of the SQLite file at absolute ``path``: quoted, so a directory named with
    ``%`` or ``?`` names that file and not another (found by review); bytes that are not
    UTF-8 kept as they are named; and a first component the parser would read as relative
    or as a home (``~root``) kept absolute by its slash."""
    rel = path.lstrip("/")
    lead = "/" if rel.startswith(("./", "../", "~")) else ""
    return "sqlite:///" + lead + quote(rel, safe="/", errors="surrogateescape")


#: query keys whose values are secrets (libpq's password and sslpassword, redis-py's
#: password, a token): masked wherever a URL is shown
_SECRET_KEY = re.compile(r"pass|secret|token", re.IGNORECASE)
_SECRET_WORD = re.compile(
    r"(\b\w*(?:pass|secret|token)\w*\s*=\s*)('(?:[^'\\]|\\.)*'|\S+)", re.IGNORECASE
)


def mask_url(url: str) -> str:
    """``url`` fit to show (messages, ``describe()``, ``repr``, ``info``): the userinfo's
    password and the value of every password-like query key masked. A password given as
    ``?password=`` was shown in full in six places (found by review)."""
    if "://" not in url:  # libpq's key=value words
        return _SECRET_WORD.sub(r"\1***", url)
    parts = urlsplit(url)
    netloc = parts.netloc
    if parts.password is not None:
        netloc = netloc.replace(f":{parts.password}@", ":***@")
    pieces = []
    for piece in parts.query.split("&") if parts.query else ():
        key, eq, _ = piece.partition("=")
        pieces.append(f"{key}=***" if eq and _SECRET_KEY.search(unquote(key)) else piece)
    # put back by hand: urlunsplit drops the empty host of sqlite:////abs/path, showing a
    # relative path (sqlite://abs/path) for the absolute one (found by review)
    shown = f"{parts.scheme}://{netloc}{parts.path}"
    if pieces:
        shown += "?" + "&".join(pieces)
    if parts.fragment:
        shown += "#" + parts.fragment
    return shown


def query_pairs(query: str, url: str, *, plus_is_plus: bool = False) -> list[tuple[str, str]]:
    """A store URL's query as (key, value) pairs, each key given at most once (ValueError,
    naming it). Given twice, the parser kept the last without a word, so
    ``synchronous=full&synchronous=normal`` ran unsafe and ``allow_eviction`` could be
    switched on behind a ``false`` (found by review). ``plus_is_plus``: a "+" stays a plus,
    as libpq reads it, not a space."""
    pairs = parse_qsl(query.replace("+", "%2B") if plus_is_plus else query, keep_blank_values=True)
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            raise ValueError(
                f"option {key!r} is given more than once in {mask_url(url)}: give it once"
            )
        seen.add(key)
    return pairs


def redact(url: str) -> str:
    """A store URL fit for messages and logs: only a leading scheme-like word and, for a
    ``scheme://`` URL, its host and path with any password masked. Never the raw string:
    a DSN may carry a password as a URL or as ``key=value`` words."""
    match = re.match(r"[A-Za-z][A-Za-z0-9+.-]{0,31}", url)
    word = match.group(0) if match else ""
    rest = url[len(word) :]
    if not word or not (rest == "" or rest.startswith(":")):
        return "<unrecognised store>"
    if not rest.startswith("://"):
        return word
    netloc, _, path = rest[3:].partition("/")
    user, at, host = netloc.rpartition("@")
    if at:
        name = user.split(":", 1)[0]
        netloc = f"{name}:***@{host}" if ":" in user else f"{name}@{host}"
    shown = f"{word}://{netloc}/{path}" if path else f"{word}://{netloc}"
    return mask_url(shown)  # and ?password= and its like

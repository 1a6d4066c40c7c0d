"""Stores: where intent records and domain seqs live, chosen by URL.

The core never imports a store driver: :func:`open_store` imports the module of the scheme
it is asked for, so ``import effectfence`` never pays for psycopg or redis.
"""

from __future__ import annotations

import importlib
from typing import Any

from effectfence.store.base import FenceStore, Head, Outcome, Step
from effectfence.store.memory import MemoryStore

__all__ = ["SCHEMES", "FenceStore", "Head", "MemoryStore", "Outcome", "Step", "open_store"]

#: URL scheme -> (module, class). Each durable store lives in its own module.
SCHEMES: dict[str, tuple[str, str]] = {
    "memory": ("effectfence.store.memory", "MemoryStore"),
    "sqlite": ("effectfence.store.sqlite", "SQLiteStore"),
    "postgresql": ("effectfence.store.postgres", "PostgresStore"),
    "postgres": ("effectfence.store.postgres", "PostgresStore"),
    "redis": ("effectfence.store.redis", "RedisStore"),
    "rediss": ("effectfence.store.redis", "RedisStore"),
}


class StoreURLError(ValueError):
    """A store URL this build cannot open (unknown scheme, or its driver is missing)."""


def open_store(url: str, **options: Any) -> FenceStore:
    """The store a URL names: ``memory:``, ``sqlite:///path/fence.db``,
    ``postgresql://user@host/db``, ``redis://host:6379/0``. Options go to its constructor."""
    if type(url) is not str or ":" not in url:
        raise StoreURLError(f"a store URL looks like sqlite:///path/fence.db, got {url!r}")
    scheme = url.split(":", 1)[0].lower()
    if scheme not in SCHEMES:
        raise StoreURLError(
            f"unknown store scheme {scheme!r} in {_redact(url)}; known: {', '.join(SCHEMES)}"
        )
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


def _redact(url: str) -> str:
    """A URL fit for a message: the password, if any, masked."""
    if "@" not in url or "://" not in url:
        return url
    scheme, rest = url.split("://", 1)
    cred, host = rest.rsplit("@", 1)
    user = cred.split(":", 1)[0]
    return f"{scheme}://{user}:***@{host}" if ":" in cred else url

"""Where a server listens: which bind addresses are loopback and which are wildcards.

One rule for both servers that listen (``serve --http`` and ``console``): whether a bind
needs tokens (a non-loopback address does) and which Host names it answers. Kept apart from
both so the console need not import the MCP server (``import mcp`` costs ~1.5 s) and the
two can never judge the same address differently.
"""

from __future__ import annotations

import ipaddress

__all__ = ["DEFAULT_HOST", "WILDCARD_NOTE", "is_loopback", "is_wildcard", "parse_bind"]

#: where a server listens when given a port alone: this machine only
DEFAULT_HOST = "127.0.0.1"


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name, an address, or a bracketed IPv6 address) reaches only this
    machine. Only ``localhost`` is trusted by name: any other name may resolve anywhere."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def is_wildcard(host: str) -> bool:
    """An address that binds every interface (``0.0.0.0``, ``::``, and their spellings
    ``0``, ``::0``...): it has no name of its own, so no Host is answered for it."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        return host == "0"  # what the socket layer binds as 0.0.0.0


#: the listening line's word for a wildcard bind given no --allow-host (console and serve)
WILDCARD_NOTE = (
    "bound to every address, but a request is answered only for the Host names it knows: "
    "the loopback names and each --allow-host (any other Host gets 421, the DNS-rebinding "
    "protection); add --allow-host NAME for every name or address clients use"
)


def parse_bind(value: str, flag: str = "--http") -> tuple[str, int]:
    """``PORT``, ``HOST:PORT`` or ``[IPV6]:PORT`` -> (host, port); host defaults to loopback.
    ValueError naming ``flag`` for anything else (the console turned a port out of range
    into a traceback: found by review)."""
    value = value.strip()
    host, port_text = DEFAULT_HOST, value
    if value.startswith("["):
        end = value.find("]")
        if end < 0 or value[end + 1 : end + 2] != ":":
            raise ValueError(f"{flag} {value!r}: expected [IPV6]:PORT")
        host, port_text = value[1:end], value[end + 2 :]
    elif ":" in value:
        host, _, port_text = value.rpartition(":")
    if not host or not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ValueError(f"{flag} {value!r}: expected [HOST:]PORT with PORT in 0-65535")
    return host, int(port_text)

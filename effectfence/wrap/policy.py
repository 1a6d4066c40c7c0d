"""Which of a wrapped server's tools are fenced, and how: the policy file (TOML).

Without a file every tool that does not declare ``readOnlyHint: true`` is fenced, the
intent is the tool's name plus the canonical JSON of all its arguments, and the defaults
below apply. A file overrides them for all tools (``[defaults]``) or one (``[tools.NAME]``)::

    namespace = "billing-prod"      # scope of the intents (default: from the command line)

    [defaults]
    lease_ttl = 30                  # seconds a call holds its intent (renewed while it runs)
    result_ttl = 86400              # seconds a recorded result is replayed
    wait = 30                       # how long an identical call waits for a running one
    on_error = "release"            # child isError: "release" (a retry runs) or "fail"

    [tools.write_query]
    fence = true                    # true, false, or "auto" (fence unless readOnlyHint)
    intent_args = ["query"]         # arguments that name the action (default: all)
    domain = "db:{tool}"            # contention scope, a str.format template over arguments

Unknown keys are refused with the file and key named: a typo must not silently unfence.
"""

from __future__ import annotations

import re
import string
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

__all__ = [
    "DEFAULT_WAIT",
    "MAX_NAMESPACE",
    "Policy",
    "PolicyError",
    "ToolPolicy",
    "check_namespace",
]

DEFAULT_LEASE_TTL = 30.0
DEFAULT_RESULT_TTL = 24 * 3600.0
#: an identical call waits this long in all for the running one (each wait <= the lease)
DEFAULT_WAIT = 30.0
_FENCE_VALUES = (True, False, "auto")
_ON_ERROR = ("release", "fail")
_TOOL_KEYS = {"fence", "intent_args", "domain", "lease_ttl", "result_ttl", "wait", "on_error"}
_DEFAULT_KEYS = _TOOL_KEYS - {"intent_args", "domain"}
_TOP_KEYS = {"namespace", "defaults", "tools"}
#: the longest namespace, as intents write it (non-ASCII escaped): an intent is the
#: namespace, the tool's label (up to 217 characters) and a 40-digit digest, and must fit
#: a store's 512
MAX_NAMESPACE = 200


class PolicyError(ValueError):
    """The policy file is malformed; the message names the file and the key."""


@dataclass(frozen=True, slots=True)
class ToolPolicy:
    """How one tool is treated."""

    #: True: fenced; False: passed through; "auto": fenced unless it declares readOnlyHint
    fence: bool | str = "auto"
    #: arguments whose values name the action; None: all of them
    intent_args: tuple[str, ...] | None = None
    #: str.format template over the arguments (and ``tool``); None: one domain per tool
    domain: str | None = None
    lease_ttl: float = DEFAULT_LEASE_TTL
    result_ttl: float = DEFAULT_RESULT_TTL
    wait: float = DEFAULT_WAIT
    #: "release": a child isError means it did not happen, a retry runs it; "fail": fence it
    on_error: str = "release"

    def fenced(self, annotations: dict[str, Any] | None) -> bool:
        """Fence this call? ``annotations`` as the child's tools/list declared them."""
        if self.fence == "auto":
            return not (isinstance(annotations, dict) and annotations.get("readOnlyHint") is True)
        return bool(self.fence)


@dataclass(frozen=True, slots=True)
class Policy:
    """The whole file: a namespace, defaults and per-tool overrides."""

    namespace: str | None = None
    defaults: ToolPolicy = field(default_factory=ToolPolicy)
    tools: dict[str, ToolPolicy] = field(default_factory=dict)

    def for_tool(self, name: str) -> ToolPolicy:
        return self.tools.get(name, self.defaults)

    @classmethod
    def load(cls, path: str | Path) -> Policy:
        try:
            with open(path, "rb") as fh:
                data = tomllib.load(fh)
        except OSError as exc:
            raise PolicyError(f"can't read policy {path}: {exc.strerror or exc}") from exc
        except tomllib.TOMLDecodeError as exc:
            raise PolicyError(f"policy {path} is not valid TOML: {exc}") from exc
        return cls.from_dict(data, str(path))

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "policy") -> Policy:
        _only(data, _TOP_KEYS, where)
        namespace = data.get("namespace")
        if namespace is not None:
            check_namespace(namespace, f"{where}: namespace")
        defaults = _tool(
            data.get("defaults", {}), ToolPolicy(), f"{where} [defaults]", _DEFAULT_KEYS
        )
        tools_raw = data.get("tools", {})
        if not isinstance(tools_raw, dict):
            raise PolicyError(f"{where}: [tools] must be a table of [tools.NAME] tables")
        tools = {
            name: _tool(spec, defaults, f"{where} [tools.{name}]", _TOOL_KEYS)
            for name, spec in tools_raw.items()
        }
        return cls(namespace, defaults, tools)


def check_namespace(value: Any, what: str) -> str:
    """A namespace every intent can carry. One no store can hold (a NUL, a lone surrogate,
    too long) was accepted, and every fenced call was then refused at run time, the
    operator none the wiser until calls failed (found by review)."""
    if type(value) is not str or not value:
        raise PolicyError(f"{what} must be a non-empty string")
    if "\x00" in value:
        raise PolicyError(f"{what} contains a NUL character, which no store can hold")
    try:
        escaped = value.encode("ascii", "backslashreplace").decode()
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise PolicyError(f"{what} is not valid Unicode text (a lone surrogate)") from None
    if len(escaped) > MAX_NAMESPACE:
        raise PolicyError(
            f"{what} is {len(escaped)} characters (non-ASCII escaped); at most {MAX_NAMESPACE}"
        )
    return value


def _domain_template(template: Any, where: str) -> str:
    """A template a call's arguments can fill: ``{name}`` fields only. A malformed one, or
    one with positional fields (``{}``, ``{0}``: nothing fills them), refused every call
    of its tool at run time (found by review)."""
    if type(template) is not str or not template:
        raise PolicyError(f"{where}: domain must be a non-empty template string")
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
    except ValueError as exc:
        raise PolicyError(f"{where}: domain template {template!r} is malformed: {exc}") from None
    for name in fields:
        head = re.split(r"[.\[]", name, maxsplit=1)[0]
        if not head or head.isdigit():
            raise PolicyError(
                f"{where}: domain template {template!r} has a positional field "
                f"{{{name}}}: name an argument, e.g. {{order_id}}, or {{tool}}"
            )
    return template


def _only(data: Any, allowed: set[str], where: str) -> None:
    if not isinstance(data, dict):
        raise PolicyError(f"{where} must be a table")
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise PolicyError(f"{where}: unknown key(s) {unknown}; known: {sorted(allowed)}")


def _seconds(value: Any, key: str, where: str) -> float:
    if type(value) not in (int, float) or not 0 < value <= 1e9:
        raise PolicyError(f"{where}: {key} must be a number of seconds > 0, got {value!r}")
    return float(value)


def _tool(spec: Any, base: ToolPolicy, where: str, allowed: set[str]) -> ToolPolicy:
    _only(spec, allowed, where)
    out = base
    if "fence" in spec:
        if spec["fence"] not in _FENCE_VALUES or type(spec["fence"]) not in (bool, str):
            raise PolicyError(f'{where}: fence must be true, false or "auto"')
        out = replace(out, fence=spec["fence"])
    if "intent_args" in spec:
        names = spec["intent_args"]
        if not isinstance(names, list) or not names or not all(type(n) is str and n for n in names):
            # empty, every call of the tool would be one action (found by review)
            raise PolicyError(f"{where}: intent_args must be a non-empty list of argument names")
        out = replace(out, intent_args=tuple(names))
    if "domain" in spec:
        out = replace(out, domain=_domain_template(spec["domain"], where))
    if "lease_ttl" in spec:
        out = replace(out, lease_ttl=_seconds(spec["lease_ttl"], "lease_ttl", where))
    if "wait" in spec:
        out = replace(out, wait=_seconds(spec["wait"], "wait", where))
    if "result_ttl" in spec:
        out = replace(out, result_ttl=_seconds(spec["result_ttl"], "result_ttl", where))
    if "on_error" in spec:
        if spec["on_error"] not in _ON_ERROR:
            raise PolicyError(f'{where}: on_error must be "release" or "fail"')
        out = replace(out, on_error=spec["on_error"])
    return out

"""RFC 8785 (JCS) canonical JSON: the bytes every fingerprint and certificate is hashed over.

Two paths, one output. The *fast path* hands values of the common shape (exact
dict/list/str/int/bool/None, BMP-only keys, safe ints, floats that ``repr`` already
writes the ES6 way) to the stdlib C encoder, built once: for that shape the C encoder's
output is already RFC 8785 (code-point key order equals UTF-16 order without surrogate
pairs, ``repr`` is the ES6 number form, string escaping is the JCS escaping). Everything
else goes to the *exact path*, which formats floats the ES6 way and sorts keys by UTF-16
code units. The shape check is what keeps the fast path honest; the tests prove both
paths byte-identical to each other and to ``rfc8785``.

Three rules make every path safe on hostile or changing input:

- *One read.* Each container of the caller's value is read once, and what is encoded is
  what was validated: the fast path validates while it copies (a private snapshot that
  orjson then encodes: nobody else can change it in between), the exact path validates
  while it encodes, from a one-step copy of each container's storage. Another thread
  changing the value meanwhile yields the bytes of what was read, or a refusal.
- *Bounded work.* ``max_bytes`` and ``max_depth`` are counted while encoding, and encoding
  stops at the limit: shared sub-structures (``v = [v, v]``, 26 times, is 400 MB of JSON)
  are refused after about ``max_bytes`` of work, not after building it all.
- *Only* ``CanonicalError`` *leaves.* Subclasses are read through their base type's storage
  (their ``__iter__``, ``items`` or ``__len__`` never run), and anything the input still
  manages to raise (a ``RecursionError``, a dict resized mid-read) becomes a
  ``CanonicalError``.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import json.encoder
import math
import operator
import re
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Final, cast

from effectfence import _accel

__all__ = [
    "MAX_SAFE_INTEGER",
    "CanonicalError",
    "canonical_bytes",
    "canonical_str",
    "check_json",
    "sha256_hex",
]

MAX_SAFE_INTEGER: Final = 2**53 - 1
"""I-JSON (RFC 7493) safe range: beyond it an int cannot round-trip through a double."""

_MIN_SAFE: Final = -MAX_SAFE_INTEGER
_NONE_TYPE: Final = type(None)
_UNLIMITED: Final = sys.maxsize  # max_bytes=None
#: the fast path's own nesting cap (orjson's is 254); deeper values take the exact path
_FAST_DEPTH_CAP: Final = 128
# Characters outside the BMP: the only ones whose UTF-16 order differs from code-point order.
_find_astral: Final = re.compile("[\U00010000-\U0010ffff]").search


class CanonicalError(ValueError):
    """A value outside the JCS data model; ``path`` says where (``$`` is the root)."""

    path: str

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path
        self.reason = message


# The C string escaper: escapes '"', '\\', the short forms \b \t \n \f \r and every other
# control char below 0x20 as \u00xx (lowercase hex); everything else stays literal.
# That is exactly RFC 8785 section 3.2.2.2 once the result is encoded as UTF-8.
_encode_str: Callable[[str], str] = (
    getattr(json.encoder, "c_encode_basestring", None) or json.encoder.py_encode_basestring
)

_c_make_encoder: Any = getattr(json.encoder, "c_make_encoder", None)

if _c_make_encoder is not None:
    # markers=None: no circularity bookkeeping (the shape check bounds depth, so a cycle
    # never reaches it); default=None: unreachable, the shape check admits only JSON types.
    _C_ENCODE: Callable[[object, int], Any] | None = _c_make_encoder(
        None, None, _encode_str, None, ":", ",", True, False, False
    )
else:  # pragma: no cover - CPython always ships _json
    _C_ENCODE = None


class _Fail(Exception):
    """Internal: carries a refusal outward, collecting the path as frames unwind."""

    def __init__(self, message: str, node: object = None) -> None:
        super().__init__(message)
        self.message = message
        self.node = node  # the container whose depth overflowed (cycle detection)
        self.segments: list[str | int] = []  # innermost first
        self.containers: list[object] = []  # matching containers, innermost first


# --------------------------------------------------------------------------- fast path


class _NotFast(Exception):
    """Internal: the value is not of the common shape; the exact path takes it."""


class _Over(Exception):
    """Internal: the output ran past ``max_bytes`` (reported at ``$``, with the limit)."""


_NOT_FAST: Final = object()


def _over(max_bytes: int, size: int | None = None) -> CanonicalError:
    if size is None:
        return CanonicalError("$", f"canonical form is over max_bytes={max_bytes}")
    return CanonicalError("$", f"canonical form is {size} bytes, over max_bytes={max_bytes}")


def _fast_snapshot(value: object, max_depth: int, max_bytes: int) -> object:
    """A private copy of ``value`` if it has the shape whose orjson output is RFC 8785's,
    else ``_NOT_FAST``; raise ``CanonicalError`` as soon as the output must exceed
    ``max_bytes``.

    The shape: exact dict/list/str/bool/None; ints in the safe range (``repr`` is the ES6
    form); keys without characters beyond the BMP (then code-point order *is* UTF-16
    code-unit order: ASCII is the O(1) common case); and floats with
    ``1e-4 <= |x| < 1e16`` that are not integral. For those, ``repr`` prints the shortest
    round-trip digits in plain decimal with a fractional part, which is exactly ES6's
    layout (ES6 is plain decimal on 1e-7..1e21; the digits are the same shortest digits
    the exact path uses). Integral floats (``repr`` adds ``.0``) and exponent-form floats
    go to the exact path. Lone surrogates pass this check but fail the UTF-8 step, which
    then reports them with a path.

    The copy is the point: each container is read once (``dict.copy``/``list.copy``: one
    step that no other thread can interleave with), the copy is validated, and the encoder
    sees only the copy, so a value another thread changes after the check (a float turned
    NaN, which orjson would write as ``null``) cannot reach the bytes.
    A container that occurs twice (shared, not cyclic) is copied once and charged for
    every occurrence, so ``max_bytes`` counts the output while the work stays bounded by
    the input. ``depth`` running out means "not fast" (the exact path then reports depth or
    circularity with a path), so the walk always terminates.
    """
    try:
        if type(value) is dict or type(value) is list:
            return _walk(value, min(max_depth, _FAST_DEPTH_CAP), {0: max_bytes})
        if _fast_root(value) > max_bytes:
            raise _Over
        return value
    except _Over:
        raise _over(max_bytes) from None
    except Exception:  # _NotFast, or a RecursionError: the exact path decides and explains
        return _NOT_FAST


def _walk(node: Any, depth: int, state: dict[int, Any]) -> object:
    """``_fast_snapshot`` of one exact dict or list. ``state[0]`` is the room left under
    max_bytes; ``state[id(c)]`` is ``(c, copy, output size, depth)`` for each container
    ``c`` copied so far (``c`` kept alive so that its id cannot be reused meanwhile),
    reused where ``c`` occurs again with at least the depth budget it was copied with.

    The scalar rules are written out in both loops (and in ``_fast_root``): this is the
    hot path of every pure-Python prepare, and a call per value would double its cost.
    """
    seen = state.get(id(node))
    if seen is not None and seen[3] <= depth:
        room = state[0] - seen[2]
        state[0] = room
        if room < 0:
            raise _Over
        return seen[1]
    if depth <= 0:
        raise _NotFast
    depth -= 1
    start = state[0]
    own = 1  # brackets and commas: 1 + one per member
    out = node.copy()  # the one read of this container; validated and encoded from here
    if type(out) is dict:
        for k, v in out.items():
            if type(k) is not str or not (k.isascii() or _find_astral(k) is None):
                raise _NotFast
            own += len(k) + 4
            tv = type(v)
            if tv is str:
                own += len(v) + 2
            elif tv is int:
                if not _MIN_SAFE <= v <= MAX_SAFE_INTEGER:
                    raise _NotFast
                own += 1
            elif tv is bool or v is None:
                own += 4
            elif tv is float:
                if not (1e-4 <= v < 1e16 or -1e16 < v <= -1e-4) or v.is_integer():
                    raise _NotFast
                own += 1
            elif tv is dict or tv is list:
                out[k] = _walk(v, depth, state)  # an existing key: the copy keeps its size
            else:
                raise _NotFast
    else:
        for i, v in enumerate(out):
            own += 1
            tv = type(v)
            if tv is str:
                own += len(v) + 2
            elif tv is int:
                if not _MIN_SAFE <= v <= MAX_SAFE_INTEGER:
                    raise _NotFast
                own += 1
            elif tv is bool or v is None:
                own += 4
            elif tv is float:
                if not (1e-4 <= v < 1e16 or -1e16 < v <= -1e-4) or v.is_integer():
                    raise _NotFast
                own += 1
            elif tv is dict or tv is list:
                out[i] = _walk(v, depth, state)
            else:
                raise _NotFast
    room = state[0] - own
    state[0] = room
    if room < 0:
        raise _Over
    state[id(node)] = (node, out, start - room, depth + 1)
    return out


def _fast_root(v: object) -> int:
    """A scalar at the root: its output size (a lower bound), or raise ``_NotFast``."""
    t = type(v)
    if t is str:
        return len(cast("str", v)) + 2
    if t is bool or v is None:
        return 4
    if t is int and _MIN_SAFE <= cast("int", v) <= MAX_SAFE_INTEGER:
        return 1
    if t is float:
        f = cast("float", v)
        if (1e-4 <= f < 1e16 or -1e16 < f <= -1e-4) and not f.is_integer():
            return 1
    raise _NotFast


def _fast_ok(value: object, depth: int) -> bool:
    """True iff ``value`` has the common shape (see :func:`_fast_snapshot`)."""
    return _fast_snapshot(value, depth, _UNLIMITED) is not _NOT_FAST


# -------------------------------------------------------------------------- exact path


def _es6_number(f: float) -> str:
    """ES6 ``Number.prototype.toString`` of a finite double (ECMA-262 7.1.12.1).

    ``repr`` gives the shortest round-tripping digits (the same digit string ES6
    requires); only the layout differs: ES6 writes plain decimals for 1e-7 <= |x| < 1e21
    and ``d.ddde+N`` / ``d.ddde-N`` outside that range, never a trailing ``.0``.
    """
    if f == 0.0:
        return "0"  # also -0.0
    r = float.__repr__(f)
    sign = ""
    if r[0] == "-":
        sign = "-"
        r = r[1:]
    mantissa, e, exp = r.partition("e")
    if not e:
        # repr already used fixed notation (1e-4 <= |x| < 1e16): ES6 agrees there,
        # except that it never writes the ".0" of an integral value.
        if mantissa.endswith(".0"):
            mantissa = mantissa[:-2]
        return sign + mantissa
    int_part, _, frac = mantissa.partition(".")
    digits = int_part + frac  # k significant digits, no leading/trailing zeros
    k = len(digits)
    n = int(exp) + 1  # value = 0.digits * 10**n
    if k <= n <= 21:
        return sign + digits + "0" * (n - k)
    if 0 < n <= 21:
        return sign + digits[:n] + "." + digits[n:]
    if -6 < n <= 0:
        return sign + "0." + "0" * (-n) + digits
    e10 = n - 1
    head = digits[0] if k == 1 else digits[0] + "." + digits[1:]
    return f"{sign}{head}e{'+' if e10 >= 0 else '-'}{abs(e10)}"


def _int_text(value: int) -> str:
    if _MIN_SAFE <= value <= MAX_SAFE_INTEGER:
        return int.__repr__(value)
    # the value itself is not quoted: it may be an account or card number
    bits = value.bit_length()
    if bits <= 2000:  # str() stays cheap and under any int_max_str_digits setting (>= 640)
        size = f"a {len(str(abs(value)))}-digit integer"
    else:
        size = f"an integer of about {int(bits * 0.30103)} digits"
    raise _Fail(f"{size} is outside the safe range ±(2**53-1)")


def _float_text(value: float) -> str:
    if math.isfinite(value):
        return _es6_number(value)
    if math.isnan(value):
        raise _Fail("NaN is not valid JSON")
    raise _Fail(f"{'-' if value < 0 else ''}Infinity is not valid JSON")


def _bool_text(value: bool) -> str:
    return "true" if value else "false"


def _null_text(value: None) -> str:
    return "null"


# Exact scalar types -> their canonical text (raising ``_Fail`` when refused).
_SCALAR_TEXT: Final[dict[type, Callable[[Any], str]]] = {
    str: _encode_str,
    int: _int_text,
    float: _float_text,
    bool: _bool_text,
    _NONE_TYPE: _null_text,
}


def _scalar(value: object) -> str:
    """Canonical text of a non-container value (subclasses included), or raise ``_Fail``.

    A subclass is read as its base type (``int.__index__`` and ``float.__float__`` of a
    subclass return the plain value): its own methods (``__le__``, ``__float__``,
    ``__class__``...) never run, so they can neither raise nor answer differently twice.
    """
    t = type(value)
    if issubclass(t, str):
        return _encode_str(str.__str__(cast("str", value)))
    if issubclass(t, int):  # bool is exact-typed and never gets here
        return _int_text(int.__index__(cast("int", value)))
    if issubclass(t, float):
        return _float_text(float.__float__(cast("float", value)))
    if issubclass(t, (bytes, bytearray, memoryview)):
        raise _Fail(f"{t.__name__} is not valid JSON (encode it as a string)")
    if issubclass(t, (set, frozenset)):
        raise _Fail(f"{t.__name__} is not valid JSON (use a sorted list)")
    raise _Fail(f"{t.__name__} is not a JSON type")


_ALL: Final = slice(None)


def _elements(node: object) -> Sequence[object]:
    """A list's or tuple's elements, read once from its storage: a snapshot that another
    thread cannot change under the encoder, taken without running a subclass's
    ``__iter__``/``__len__``/``__getitem__``."""
    if type(node) is tuple:
        return node
    if issubclass(type(node), list):
        return list.copy(cast("list[object]", node))
    return tuple.__getitem__(cast("tuple[object, ...]", node), _ALL)  # an exact tuple


def _members(node: object) -> list[tuple[Any, Any]]:
    """A dict's members, read once from its storage (a subclass's ``items`` never runs)."""
    return list(dict.items(cast("dict[Any, Any]", node)))


def _utf16_key(item: tuple[str, object]) -> bytes:
    """Sort key: big-endian UTF-16 bytes compare exactly like UTF-16 code units."""
    return item[0].encode("utf-16-be")


def _sorted_items(items: list[tuple[Any, Any]]) -> list[tuple[str, Any]]:
    """Members (from :func:`_members`) in RFC 8785 order: by UTF-16 code units of the
    (plain ``str``) key."""
    plain = True
    for k, _ in items:
        if type(k) is not str:
            plain = False
            items = [(_plain_key(k), v) for k, v in items]
            break
    joined = "".join([k for k, _ in items])
    if joined.isascii() or _find_astral(joined) is None:
        # No surrogate pairs in UTF-16: code-point order is UTF-16 order.
        items.sort(key=_first)
    else:
        try:
            items.sort(key=_utf16_key)
        except UnicodeEncodeError:
            bad = next(k for k, _ in items if not _encodable(k))
            raise _Fail(f"key {bad!r} contains a lone surrogate") from None
    if not plain:
        # str subclasses with their own __eq__/__hash__ can be two keys of one dict and
        # the same string: an object with a repeated member name is not I-JSON
        for (a, _), (b, _) in itertools.pairwise(items):
            if a == b:
                raise _Fail(f"key {a!r} occurs twice")
    return items


def _plain_key(k: object) -> str:
    t = type(k)
    if issubclass(t, str):
        # drop the subclass: its __lt__/__eq__ must not matter
        return str.__str__(cast("str", k))
    if t is int:
        safe = _MIN_SAFE <= cast("int", k) <= MAX_SAFE_INTEGER
    else:
        safe = k is None or t is bool or t is float
    # builtins whose repr is short and runs no user code are shown; anything else by type
    shown = f"{k!r} ({t.__name__})" if safe else f"of type {t.__name__}"
    raise _Fail(f"object key {shown} is not a string")


_Written = dict[int, tuple[object, int, int, int, int]]


def _exact(value: object, depth: int, out: list[str], room: int, written: _Written) -> int:
    """Append the canonical text of ``value`` to ``out`` (recursive, reference path).

    ``room`` is how many more characters ``max_bytes`` allows (a character is at least one
    UTF-8 byte, so this undercounts, never overcounts); the room left is returned, and the
    walk stops with ``_Over`` as soon as it runs out. Each container is read once
    (:func:`_elements`, :func:`_members`) and each value validated as it is written.
    ``written[id(c)]`` is ``(c, depth, start, end, chars)``: container ``c``'s text is
    ``out[start:end]``. Where ``c`` occurs again (shared, and with at least that depth
    budget) those pieces are repeated rather than walked again: the output is still
    counted in full, but the work is bounded by the input.
    """
    t = type(value)
    fmt = _SCALAR_TEXT.get(t)
    if fmt is not None:
        text = fmt(value)
        out.append(text)
        return room - len(text)
    if not issubclass(t, (dict, list, tuple)):
        text = _scalar(value)
        out.append(text)
        return room - len(text)
    again = written.get(id(value))
    if again is not None and again[1] <= depth:
        room -= again[4]
        if room < 0:
            raise _Over
        out += out[again[2] : again[3]]
        return room
    if depth <= 0:
        raise _Fail("nesting is deeper than max_depth", value)
    start = len(out)
    before = room
    if issubclass(t, dict):
        room = _exact_members(value, depth - 1, out, room, written)
    else:
        room = _exact_elements(value, depth - 1, out, room, written)
    written[id(value)] = (value, depth, start, len(out), before - room)
    return room


def _exact_members(value: object, depth: int, out: list[str], room: int, w: _Written) -> int:
    members = _members(value)
    if not members:
        out.append("{}")
        return room - 2
    sep = "{"
    for k, v in _sorted_items(members):
        key = _encode_str(k)
        out.append(sep)
        out.append(key)
        out.append(":")
        room -= len(key) + 2
        try:
            fmt = _SCALAR_TEXT.get(type(v))
            if fmt is not None:
                text = fmt(v)
                out.append(text)
                room -= len(text)
            else:
                room = _exact(v, depth, out, room, w)
        except _Fail as fail:
            fail.segments.append(k)
            fail.containers.append(value)
            raise
        if room < 0:
            raise _Over
        sep = ","
    out.append("}")
    return room - 1


def _exact_elements(value: object, depth: int, out: list[str], room: int, w: _Written) -> int:
    elements = _elements(value)
    if not elements:
        out.append("[]")
        return room - 2
    sep = "["
    for i, v in enumerate(elements):
        out.append(sep)
        room -= 1
        try:
            fmt = _SCALAR_TEXT.get(type(v))
            if fmt is not None:
                text = fmt(v)
                out.append(text)
                room -= len(text)
            else:
                room = _exact(v, depth, out, room, w)
        except _Fail as fail:
            fail.segments.append(i)
            fail.containers.append(value)
            raise
        if room < 0:
            raise _Over
        sep = ","
    out.append("]")
    return room - 1


_first: Final = operator.itemgetter(0)


def _encodable(s: str) -> bool:
    try:
        str.encode(s, "utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _find_surrogate(value: object, depth: int) -> _Fail | None:
    """Locate the first string (or key) that is not valid UTF-8 (error path only)."""
    t = type(value)
    if issubclass(t, str):
        if _encodable(cast("str", value)):
            return None
        return _Fail("string contains a lone surrogate")
    if depth <= 0:
        return None
    if issubclass(t, dict):
        for k, v in _members(value):
            if issubclass(type(k), str) and not _encodable(k):
                return _Fail(f"key {k!r} contains a lone surrogate")
            fail = _find_surrogate(v, depth - 1)
            if fail is not None:
                fail.segments.append(k)
                return fail
    elif issubclass(t, (list, tuple)):
        for i, v in enumerate(_elements(value)):
            fail = _find_surrogate(v, depth - 1)
            if fail is not None:
                fail.segments.append(i)
                return fail
    return None


def _format_path(segments: list[str | int]) -> str:
    """Outermost-first segments -> ``args.amount`` / ``items[3]`` / ``meta["a b"]``."""
    if not segments:
        return "$"
    parts: list[str] = []
    for seg in segments:
        if isinstance(seg, int):
            parts.append(f"[{seg}]")
        elif seg.isidentifier():
            parts.append(f".{seg}" if parts else seg)
        else:
            parts.append(f"[{json.encoder.py_encode_basestring_ascii(seg)}]")
    return "".join(parts)


def _to_error(fail: _Fail) -> CanonicalError:
    segments = fail.segments[::-1]
    if fail.node is not None:
        # Depth overflow: if a container on the path repeats, it is a cycle, not depth.
        chain = [*fail.containers[::-1], fail.node]
        seen: dict[int, int] = {}
        for i, node in enumerate(chain):
            j = seen.setdefault(id(node), i)
            if j != i:
                return CanonicalError(
                    _format_path(segments[:i]),
                    f"circular reference (this container is its own ancestor at "
                    f"{_format_path(segments[:j])})",
                )
    return CanonicalError(_format_path(segments), fail.message)


def _exact_text(value: object, max_depth: int, max_bytes: int = _UNLIMITED) -> str:
    """The reference serializer (also the test oracle for the fast path)."""
    out: list[str] = []
    try:
        room = _exact(value, max_depth, out, max_bytes, {})
    except _Fail as fail:
        raise _to_error(fail) from None
    except _Over:
        raise _over(max_bytes) from None
    if room < 0:
        raise _over(max_bytes)
    return "".join(out)


def _exact_bytes(value: object, max_depth: int = 64) -> bytes:
    """Exact path only, no fast path: private, for tests and benchmarks."""
    text = _exact_text(value, max_depth)
    return _encode_utf8(text, value, max_depth)


def _encode_utf8(text: str, value: object, max_depth: int) -> bytes:
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        fail = _find_surrogate(value, max_depth)
        if fail is None:  # pragma: no cover - the walk mirrors the encoder
            fail = _Fail("text contains a lone surrogate")
        raise _to_error(fail) from None


def _children(node: object) -> Iterator[tuple[str | int, object]]:
    if issubclass(type(node), dict):
        return iter(_members(node))
    return enumerate(_elements(node))


def _diagnose_deep(value: object) -> CanonicalError:
    """Explain a RecursionError (only reachable with a huge ``max_depth``) without recursing.

    An iterative walk that tracks the containers on the current path: a repeat is a cycle;
    otherwise the input is simply nested deeper than this interpreter's stack allows.
    """
    containers = (dict, list, tuple)
    path: list[str | int] = []
    nodes: list[object] = [value]
    on_path: dict[int, int] = {id(value): 0}
    done: set[int] = set()  # fully explored (acyclic below): skip shared subtrees
    stack = [_children(value)] if issubclass(type(value), containers) else []
    while stack:
        try:
            seg, child = next(stack[-1])
        except StopIteration:
            stack.pop()
            node = nodes.pop()
            del on_path[id(node)]
            done.add(id(node))
            if path:
                path.pop()
            continue
        if not issubclass(type(child), containers) or id(child) in done:
            continue
        path.append(seg)
        j = on_path.get(id(child))
        if j is not None:
            return CanonicalError(
                _format_path(path),
                f"circular reference (this container is its own ancestor at "
                f"{_format_path(path[:j])})",
            )
        on_path[id(child)] = len(nodes)
        nodes.append(child)
        stack.append(_children(child))
    return CanonicalError("$", "nesting is deeper than the interpreter's stack allows")


# ------------------------------------------------------------------------- orjson
#
# For values that pass the shape check the stdlib encoder's bytes are already RFC 8785's; so
# are orjson's, ~5x sooner: the same escapes, code-point key order (UTF-16 order for BMP
# keys), and the same shortest digits for the floats the check lets through. Hypothesis
# proves the three paths byte-identical in tests/test_canonical.py. orjson is not consulted
# for anything the check refuses: its float format, key order beyond the BMP and lossy
# encodings (NaN as null, UUIDs, enums) are not RFC 8785's. It only ever encodes the
# private snapshot the check made (see ``_fast_snapshot``).

_orjson: Any
try:
    import orjson as _orjson
except ImportError:  # pragma: no cover - orjson is a dependency; stay correct without it
    _orjson = None

_OJ_SORT = 0 if _orjson is None else _orjson.OPT_SORT_KEYS


def _own(data: bytes) -> bytes:
    """An exact-size copy. orjson hands out bytes whose buffer keeps its ~4 KiB working
    capacity however short the JSON: a kept certificate would hold two of them. Copying is
    cheaper than one ``dumps``; every bytes this module returns is exact-size."""
    return b"%b" % data


def _fast_encode(snapshot: object) -> bytes | None:
    """Bytes of a value ``_fast_snapshot`` admitted (and copied), or None: a lone surrogate,
    which the exact path then names."""
    if _orjson is not None:
        try:
            return _own(_orjson.dumps(snapshot, option=_OJ_SORT))
        except TypeError:
            return None
    if _C_ENCODE is not None:  # pragma: no cover - orjson is a dependency
        try:
            return "".join(_C_ENCODE(snapshot, 0)).encode("utf-8")
        except UnicodeEncodeError:
            return None
    return None  # pragma: no cover


# ------------------------------------------------------------------------- C encoder
#
# effectfence._speedups.canonical: the whole RFC 8785 algorithm in C for exact JSON types
# (any float, any key order, tuples as arrays), or None whenever it is not sure; then the
# paths above decide and name the error. It counts max_bytes as it writes and answers False
# as soon as the output would pass it. Proven byte-identical to the reference encoder by
# tests/test_speedups.py.

_c_canonical: Callable[[object, int, int], bytes | bool | None] | None = None
_c_string: Callable[[str], bytes | None] | None = None
if _accel.speedups is not None:
    _c_canonical = _accel.speedups.canonical
    _c_string = _accel.speedups.string


# ------------------------------------------------------------------------------ API


def _limit(max_bytes: int | None) -> int:
    if max_bytes is None or max_bytes >= _UNLIMITED:
        return _UNLIMITED
    return max_bytes if max_bytes > 0 else 0


def _python_encode(value: object, max_depth: int, max_bytes: int) -> bytes:
    data: bytes | None = None
    snapshot = _fast_snapshot(value, max_depth, max_bytes)
    if snapshot is not _NOT_FAST:
        data = _fast_encode(snapshot)
    if data is None:
        text = _exact_text(value, max_depth, max_bytes)
        data = _encode_utf8(text, value, max_depth)
    return data


def _on_a_fresh_stack(fn: Callable[..., bytes], *args: Any) -> bytes:
    """``fn(*args)`` in a new thread, whose stack starts empty; its result or its error."""
    out: list[bytes] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            out.append(fn(*args))
        except BaseException as exc:  # handed back to the caller, whatever it is
            error.append(exc)

    thread = threading.Thread(target=run, name="effectfence-deep-encode", daemon=True)
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return out[0]


def _python_bytes(value: object, max_depth: int, max_bytes: int) -> bytes:
    """The Python encoder: orjson over the fast path's snapshot where the shape allows, the
    exact path otherwise. Only ``CanonicalError`` leaves it.

    Deep values recurse, so whether one encoded hung on how deep the CALLER's stack was: a
    payload admitted at prepare failed at commit or at a replay made from deeper down
    (found by review). A value the caller's stack could not hold is encoded again on a
    fresh stack, so the answer depends on the value and ``max_depth`` alone."""
    try:
        try:
            data = _python_encode(value, max_depth, max_bytes)
        except RecursionError:
            data = _on_a_fresh_stack(_python_encode, value, max_depth, max_bytes)
    except CanonicalError:
        raise
    except RecursionError:
        # only reachable with a max_depth beyond the interpreter's stack
        try:
            error = _diagnose_deep(value)
        except Exception:
            error = CanonicalError("$", "nesting is deeper than the interpreter's stack allows")
        raise error from None
    except Exception as exc:
        # e.g. a dict resized by another thread while it was copied. The message names the
        # exception's type, never its text: that could quote the value.
        raise CanonicalError(
            "$", f"the value could not be read ({type(exc).__name__}); was it being changed?"
        ) from exc
    if len(data) > max_bytes:
        raise _over(max_bytes, len(data))
    return data


def canonical_bytes(value: object, *, max_depth: int = 64, max_bytes: int | None = None) -> bytes:
    """RFC 8785 canonical UTF-8 bytes of ``value``; raise ``CanonicalError`` if not JSON.

    ``max_depth`` bounds container nesting (and so turns cycles into a clear error);
    ``max_bytes`` bounds the output size, counted while encoding: an oversized value is
    refused after about ``max_bytes`` of work, however much larger its JSON would be.
    """
    limit = _limit(max_bytes)
    if _c_canonical is not None and type(max_depth) is int:
        data = _c_canonical(value, max_depth, limit)
        if data is not None and data is not False:
            return data  # type: ignore[return-value]
        # None: not sure; False: over the limit, which the C encoder can reach before a
        # NaN or a depth the Python one names (found by review): the reference decides
        # and names it, in bounded work
    return _python_bytes(value, max_depth, limit)


def fast_bytes(value: object, max_depth: int, *, max_bytes: int | None = None) -> bytes | None:
    """The common-shape encoding alone (no exact fallback): bytes, or None for "take the
    full path". For hot callers that then fall back to :func:`canonical_bytes`. A value
    whose output would pass ``max_bytes`` is refused here already (``CanonicalError``)."""
    limit = _limit(max_bytes)
    if _c_canonical is not None and type(max_depth) is int:
        data = _c_canonical(value, max_depth, limit)
        if data is False:  # over the limit: the reference names the first fault (see above)
            return _python_bytes(value, max_depth, limit)
        return data  # type: ignore[return-value]
    snapshot = _fast_snapshot(value, max_depth, limit)
    if snapshot is _NOT_FAST:
        return None
    data = _fast_encode(snapshot)
    if data is not None and len(data) > limit:
        raise _over(limit, len(data))
    return data


_STRINGS: dict[str, bytes] = {}


def name_bytes(name: str) -> bytes:
    """:func:`string_bytes` for names that repeat (domains, tools, agents): remembered in a
    small bounded table, since the same few names are encoded on every request."""
    out = _STRINGS.get(name)
    if out is None:
        out = string_bytes(name)
        if len(_STRINGS) >= 4096:
            _STRINGS.clear()
        _STRINGS[name] = out
    return out


def sort_keys_bytes(flat: dict[str, int]) -> bytes:
    """A flat dict of ASCII keys to safe non-negative ints (a vector clock), encoded.

    For that shape any sorted JSON encoder is exact; the caller guarantees the shape."""
    if _orjson is not None:
        try:
            return _own(_orjson.dumps(flat, option=_OJ_SORT | _orjson.OPT_STRICT_INTEGER))
        except TypeError:
            pass
    return canonical_bytes(flat)


# The shortest integer outside the safe range has 16 digits: text without such a run holds
# none, and is returned as parsed (the common case costs one regex scan, in C).
_long_digits_b: Final = re.compile(rb"[0-9]{16}").search
_long_digits_s: Final = re.compile(r"[0-9]{16}").search


def json_loads(data: bytes | str) -> Any:
    """Parse canonical JSON back into the value that was encoded (a cheap deep copy).

    RFC 8785 writes an integral double the way ES6 does, without a fraction: 1.7e18 is
    ``1700000000000000000``. A parser reads that as an int, which the encoder refuses
    outside ±(2**53-1), so a decoded certificate would no longer re-encode (verify False,
    a durable store unable to write it). Such an int in canonical text can only have come
    from a float, so it is decoded as the float: exactly the one that was encoded (the
    canonical text of a double is its shortest round-trip digits, and int -> float rounds
    correctly). Deep nesting is a ``ValueError`` like any other malformed JSON.
    """
    try:
        value = _orjson.loads(data) if _orjson is not None else json.loads(data)
    except RecursionError:
        raise ValueError("JSON is nested deeper than the interpreter's stack allows") from None
    long = _long_digits_s(data) if isinstance(data, str) else _long_digits_b(data)
    if long is not None:
        value = floats_back(value)
    return value


def floats_back(value: Any) -> Any:
    """``value`` (freshly decoded, ours to change) with every int outside the safe range
    replaced by its float: canonical JSON writes an integral double without a fraction, so
    any JSON parser reads 1e16 back as an int, which the encoder refuses (see
    :func:`json_loads`). For JSON another parser read (an MCP client's arguments).
    Iterative: decoded JSON may be nested past the stack."""
    t = type(value)
    if t is int:
        return value if _MIN_SAFE <= value <= MAX_SAFE_INTEGER else float(value)
    if t is not dict and t is not list:
        return value
    stack: list[Any] = [value]
    while stack:
        node = stack.pop()
        pairs = node.items() if type(node) is dict else enumerate(node)
        for k, v in pairs:  # assigning an existing key or index: the size never changes
            tv = type(v)
            if tv is int:
                if not _MIN_SAFE <= v <= MAX_SAFE_INTEGER:
                    node[k] = float(v)
            elif tv is dict or tv is list:
                stack.append(v)
    return value


def string_bytes(text: str) -> bytes:
    """RFC 8785 form of one ``str``: orjson's string escapes are RFC 8785's for any valid str
    (proven in tests/test_canonical.py); a lone surrogate goes to the exact path, which
    refuses it by name."""
    if _c_string is not None:
        data = _c_string(text)
        if data is not None:
            return data
    if _orjson is not None and type(text) is str:
        try:
            return _own(_orjson.dumps(text))
        except TypeError:
            pass
    return canonical_bytes(text)


def canonical_str(value: object, *, max_depth: int = 64, max_bytes: int | None = None) -> str:
    """``canonical_bytes`` decoded: the same canonical text as ``str``."""
    return canonical_bytes(value, max_depth=max_depth, max_bytes=max_bytes).decode("utf-8")


def sha256_hex(value: object, *, max_depth: int = 64, max_bytes: int | None = None) -> str:
    """Hex SHA-256 of the canonical bytes: the fingerprint and certificate digest."""
    return hashlib.sha256(
        canonical_bytes(value, max_depth=max_depth, max_bytes=max_bytes)
    ).hexdigest()


def check_json(value: object, *, max_depth: int = 64) -> None:
    """Validate that ``value`` is canonicalizable JSON; raise ``CanonicalError`` if not.

    Serializing is the cheapest complete check (the UTF-8 step is what catches lone
    surrogates), so this simply discards the bytes.
    """
    canonical_bytes(value, max_depth=max_depth)

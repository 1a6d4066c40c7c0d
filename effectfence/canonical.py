"""RFC 8785 (JCS) canonical JSON: the bytes every fingerprint and certificate is hashed over.

Two paths, one output. The *fast path* hands values of the common shape (exact
dict/list/str/int/bool/None, BMP-only keys, safe ints, floats that ``repr`` already
writes the ES6 way) to the stdlib C encoder, built once: for that shape the C encoder's
output is already RFC 8785 (code-point key order equals UTF-16 order without surrogate
pairs, ``repr`` is the ES6 number form, string escaping is the JCS escaping). Everything
else goes to the *exact path*, which formats floats the ES6 way and sorts keys by UTF-16
code units. The shape check is what keeps the fast path honest; the tests prove both
paths byte-identical to each other and to ``rfc8785``.
"""

from __future__ import annotations

import hashlib
import json
import json.encoder
import math
import operator
import re
from collections.abc import Callable, Iterator
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


def _fast_ok(value: object, depth: int) -> bool:
    """True iff ``value`` has the shape whose C-encoder output is already RFC 8785.

    Admitted: exact dict/list/str/bool/None; ints in the safe range (``repr`` is the ES6
    form); keys without characters beyond the BMP (then code-point order *is* UTF-16
    code-unit order: ASCII is the O(1) common case); and floats with
    ``1e-4 <= |x| < 1e16`` that are not integral. For those, ``repr`` prints the shortest
    round-trip digits in plain decimal with a fractional part, which is exactly ES6's
    layout (ES6 is plain decimal on 1e-7..1e21; the digits are the same shortest digits
    the exact path uses). Integral floats (``repr`` adds ``.0``) and exponent-form floats
    go to the exact path. Lone surrogates pass this check but fail the UTF-8 step, which
    then reports them with a path.

    ``depth`` is the remaining container budget; running out means "not fast" (the exact
    path then reports depth or circularity with a path), so this walk always terminates.
    """
    t = type(value)
    if t is dict:
        if depth <= 0:
            return False
        depth -= 1
        for k, v in value.items():  # type: ignore[attr-defined]
            if type(k) is not str or not (k.isascii() or _find_astral(k) is None):
                return False
            tv = type(v)
            if tv is str or tv is bool or v is None:
                continue
            if tv is int:
                if _MIN_SAFE <= v <= MAX_SAFE_INTEGER:
                    continue
                return False
            if tv is float:
                if (1e-4 <= v < 1e16 or -1e16 < v <= -1e-4) and not v.is_integer():
                    continue
                return False
            if (tv is dict or tv is list) and _fast_ok(v, depth):
                continue
            return False
        return True
    if t is list:
        if depth <= 0:
            return False
        depth -= 1
        for v in value:  # type: ignore[attr-defined]
            tv = type(v)
            if tv is str or tv is bool or v is None:
                continue
            if tv is int:
                if _MIN_SAFE <= v <= MAX_SAFE_INTEGER:
                    continue
                return False
            if tv is float:
                if (1e-4 <= v < 1e16 or -1e16 < v <= -1e-4) and not v.is_integer():
                    continue
                return False
            if (tv is dict or tv is list) and _fast_ok(v, depth):
                continue
            return False
        return True
    if t is str or t is bool or value is None:
        return True
    if t is int:
        return _MIN_SAFE <= value <= MAX_SAFE_INTEGER  # type: ignore[operator]
    if t is float:
        f: float = value  # type: ignore[assignment]
        return (1e-4 <= f < 1e16 or -1e16 < f <= -1e-4) and not f.is_integer()
    return False


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
    digits = len(str(abs(int(value))))
    raise _Fail(f"a {digits}-digit integer is outside the safe range ±(2**53-1)")


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
    """Canonical text of a non-container value (subclasses included), or raise ``_Fail``."""
    if isinstance(value, str):
        return _encode_str(value)
    if isinstance(value, int):  # bool is exact-typed and never gets here
        return _int_text(value)
    if isinstance(value, float):
        return _float_text(value)
    if isinstance(value, (bytes, bytearray, memoryview)):
        raise _Fail(f"{type(value).__name__} is not valid JSON (encode it as a string)")
    if isinstance(value, (set, frozenset)):
        raise _Fail(f"{type(value).__name__} is not valid JSON (use a sorted list)")
    raise _Fail(f"{type(value).__name__} is not a JSON type")


def _utf16_key(item: tuple[str, object]) -> bytes:
    """Sort key: big-endian UTF-16 bytes compare exactly like UTF-16 code units."""
    return item[0].encode("utf-16-be")


def _sorted_items(value: dict[Any, Any]) -> list[tuple[str, Any]]:
    """Members in RFC 8785 order: by UTF-16 code units of the (plain ``str``) key."""
    items = list(value.items())
    for k in value:
        if type(k) is not str:
            items = [(_plain_key(k), v) for k, v in items]
            break
    joined = "".join([k for k, _ in items])
    if joined.isascii() or _find_astral(joined) is None:
        # No surrogate pairs in UTF-16: code-point order is UTF-16 order.
        items.sort(key=_first)
        return items
    try:
        items.sort(key=_utf16_key)
    except UnicodeEncodeError:
        bad = next(k for k, _ in items if not _encodable(k))
        raise _Fail(f"key {bad!r} contains a lone surrogate") from None
    return items


def _plain_key(k: object) -> str:
    if isinstance(k, str):
        return str.__str__(k)  # drop the subclass: its __lt__/__eq__ must not matter
    raise _Fail(f"object key {k!r} ({type(k).__name__}) is not a string")


def _exact(value: object, depth: int, out: list[str]) -> None:
    """Append the canonical text of ``value`` to ``out`` (recursive, reference path)."""
    fmt = _SCALAR_TEXT.get(type(value))
    if fmt is not None:
        out.append(fmt(value))
    elif isinstance(value, dict):
        if depth <= 0:
            raise _Fail("nesting is deeper than max_depth", value)
        if not value:
            out.append("{}")
            return
        depth -= 1
        sep = "{"
        for k, v in _sorted_items(value):
            out.append(sep)
            out.append(_encode_str(k))
            out.append(":")
            try:
                fmt = _SCALAR_TEXT.get(type(v))
                if fmt is not None:
                    out.append(fmt(v))
                else:
                    _exact(v, depth, out)
            except _Fail as fail:
                fail.segments.append(k)
                fail.containers.append(value)
                raise
            sep = ","
        out.append("}")
    elif isinstance(value, (list, tuple)):
        if depth <= 0:
            raise _Fail("nesting is deeper than max_depth", value)
        if not value:
            out.append("[]")
            return
        depth -= 1
        sep = "["
        for i, v in enumerate(value):
            out.append(sep)
            try:
                fmt = _SCALAR_TEXT.get(type(v))
                if fmt is not None:
                    out.append(fmt(v))
                else:
                    _exact(v, depth, out)
            except _Fail as fail:
                fail.segments.append(i)
                fail.containers.append(value)
                raise
            sep = ","
        out.append("]")
    else:
        out.append(_scalar(value))


_first: Final = operator.itemgetter(0)


def _encodable(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _find_surrogate(value: object, depth: int) -> _Fail | None:
    """Locate the first string (or key) that is not valid UTF-8 (error path only)."""
    if isinstance(value, str):
        return None if _encodable(value) else _Fail("string contains a lone surrogate")
    if depth <= 0:
        return None
    if isinstance(value, dict):
        for k, v in value.items():
            if not _encodable(k):
                return _Fail(f"key {k!r} contains a lone surrogate")
            fail = _find_surrogate(v, depth - 1)
            if fail is not None:
                fail.segments.append(k)
                return fail
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
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


def _exact_text(value: object, max_depth: int) -> str:
    """The reference serializer (also the test oracle for the fast path)."""
    out: list[str] = []
    try:
        _exact(value, max_depth, out)
    except _Fail as fail:
        raise _to_error(fail) from None
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
    if isinstance(node, dict):
        return iter(node.items())
    return enumerate(cast("list[object]", node))


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
    stack = [_children(value)] if isinstance(value, containers) else []
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
        if not isinstance(child, containers) or id(child) in done:
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
# For values that pass ``_fast_ok`` the stdlib encoder's bytes are already RFC 8785's; so are
# orjson's, ~5x sooner: the same escapes, code-point key order (UTF-16 order for BMP keys),
# and the same shortest digits for the floats ``_fast_ok`` lets through. Hypothesis proves the
# three paths byte-identical in tests/test_canonical.py. orjson is not consulted for anything
# ``_fast_ok`` refuses: its float format, key order beyond the BMP and lossy encodings (NaN
# as null, UUIDs, enums) are not RFC 8785's.

_orjson: Any
try:
    import orjson as _orjson
except ImportError:  # pragma: no cover - orjson is a dependency; stay correct without it
    _orjson = None

_OJ_SORT = 0 if _orjson is None else _orjson.OPT_SORT_KEYS


# ------------------------------------------------------------------------- C encoder
#
# effectfence._speedups.canonical: the whole RFC 8785 algorithm in C for exact JSON types
# (any float, any key order, tuples as arrays), or None whenever it is not sure; then the
# paths above decide and name the error. Proven byte-identical to the reference encoder
# by tests/test_speedups.py.

_c_canonical: Callable[[object, int], bytes | None] | None = None
_c_string: Callable[[str], bytes | None] | None = None
if _accel.speedups is not None:
    _c_canonical = _accel.speedups.canonical
    _c_string = _accel.speedups.string


# ------------------------------------------------------------------------------ API


def canonical_bytes(value: object, *, max_depth: int = 64, max_bytes: int | None = None) -> bytes:
    """RFC 8785 canonical UTF-8 bytes of ``value``; raise ``CanonicalError`` if not JSON.

    ``max_depth`` bounds container nesting (and so turns cycles into a clear error);
    ``max_bytes`` bounds the output size.
    """
    data: bytes | None = None
    if _c_canonical is not None and type(max_depth) is int:
        data = _c_canonical(value, max_depth)
    if data is not None:
        if max_bytes is not None and len(data) > max_bytes:
            raise CanonicalError(
                "$", f"canonical form is {len(data)} bytes, over max_bytes={max_bytes}"
            )
        return data
    try:
        fast = _fast_ok(value, max_depth)
        if fast and _orjson is not None:
            try:
                data = _orjson.dumps(value, option=_OJ_SORT)
            except TypeError:  # a lone surrogate: the exact path names it
                data = None
        if data is None:
            if fast and _C_ENCODE is not None:
                text = "".join(_C_ENCODE(value, 0))
            else:
                text = _exact_text(value, max_depth)
            try:
                data = text.encode("utf-8")
            except UnicodeEncodeError:
                data = _encode_utf8(text, value, max_depth)
    except RecursionError:
        raise _diagnose_deep(value) from None
    if max_bytes is not None and len(data) > max_bytes:
        raise CanonicalError(
            "$", f"canonical form is {len(data)} bytes, over max_bytes={max_bytes}"
        )
    return data


def fast_bytes(value: object, max_depth: int) -> bytes | None:
    """The common-shape encoding alone (no exact fallback): bytes, or None for "take the
    full path". For hot callers that then fall back to :func:`canonical_bytes`."""
    if _c_canonical is not None and type(max_depth) is int:
        return _c_canonical(value, max_depth)
    if _orjson is not None and _fast_ok(value, max_depth):
        try:
            out: bytes = _orjson.dumps(value, option=_OJ_SORT)
            return out
        except (TypeError, RecursionError):
            return None
    return None


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
            out: bytes = _orjson.dumps(flat, option=_OJ_SORT | _orjson.OPT_STRICT_INTEGER)
            return out
        except TypeError:
            pass
    return canonical_bytes(flat)


def json_loads(data: bytes) -> Any:
    """Parse JSON this module produced (a cheap deep copy of a canonical value)."""
    if _orjson is not None:
        return _orjson.loads(data)
    return json.loads(data)


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
            out: bytes = _orjson.dumps(text)
            return out
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

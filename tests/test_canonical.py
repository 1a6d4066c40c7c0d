"""RFC 8785 canonical JSON: published vectors, the rfc8785 oracle, refusals, routing."""

from __future__ import annotations

import enum
import hashlib
import json
import math
import struct
import sys
import uuid
from pathlib import Path
from typing import Any

import orjson
import pytest
import rfc8785
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from effectfence import canonical
from effectfence.canonical import (
    MAX_SAFE_INTEGER,
    CanonicalError,
    _es6_number,
    _exact_bytes,
    _fast_ok,
    canonical_bytes,
    canonical_str,
    check_json,
    sha256_hex,
)

VECTORS = Path(__file__).parent / "vectors" / "jcs"
VECTOR_NAMES = sorted(p.stem for p in (VECTORS / "input").glob("*.json"))

# --------------------------------------------------------------------- published vectors


@pytest.mark.parametrize("name", VECTOR_NAMES)
def test_published_vector(name: str) -> None:
    value = json.loads((VECTORS / "input" / f"{name}.json").read_bytes())
    expected = (VECTORS / "output" / f"{name}.json").read_bytes()
    assert canonical_bytes(value) == expected
    assert _exact_bytes(value) == expected
    outhex = VECTORS / "outhex" / f"{name}.txt"
    if outhex.exists():
        assert canonical_bytes(value) == bytes.fromhex(outhex.read_text())


def test_vector_set_is_complete() -> None:
    assert len(VECTOR_NAMES) == 9
    assert {"rfc8785-3.2.2", "rfc8785-3.2.3", "weird", "values"} <= set(VECTOR_NAMES)


def _number_table() -> list[tuple[str, str]]:
    rows = []
    for line in (VECTORS / "numbers.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            bits, text = line.split()
            rows.append((bits, text))
    return rows


NUMBER_TABLE = _number_table()


def _double(bits: str) -> float:
    value: float = struct.unpack(">d", bytes.fromhex(bits))[0]
    return value


@pytest.mark.parametrize(("bits", "text"), NUMBER_TABLE)
def test_appendix_b_numbers(bits: str, text: str) -> None:
    value = _double(bits)
    if text == "error":
        with pytest.raises(CanonicalError):
            canonical_bytes(value)
        with pytest.raises(CanonicalError):
            canonical_bytes({"n": [value]})
        return
    assert canonical_bytes(value) == text.encode()
    assert canonical_bytes({"n": value}) == b'{"n":' + text.encode() + b"}"
    assert rfc8785.dumps(value) == text.encode()


def test_appendix_b_table_is_complete() -> None:
    assert len(NUMBER_TABLE) == 26


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (1.0, "1"),
        (-1.0, "-1"),
        (0.0, "0"),
        (-0.0, "0"),
        (1e21, "1e+21"),
        (1e20, "100000000000000000000"),
        (1.5e20, "150000000000000000000"),
        (123456789012345680000.0, "123456789012345680000"),
        (1e16, "10000000000000000"),
        (1e15, "1000000000000000"),
        (1e-7, "1e-7"),
        (1.5e-7, "1.5e-7"),
        (1e-6, "0.000001"),
        (1.25e-5, "0.0000125"),
        (0.0001, "0.0001"),
        (0.1, "0.1"),
        (0.5, "0.5"),
        (5e-324, "5e-324"),
        (2.2250738585072014e-308, "2.2250738585072014e-308"),
        (1.7976931348623157e308, "1.7976931348623157e+308"),
        (9007199254740993.0, "9007199254740992"),
        (1e100, "1e+100"),
        (-1.5e-10, "-1.5e-10"),
    ],
)
def test_number_edges(value: float, text: str) -> None:
    assert canonical_bytes(value) == text.encode()
    assert _es6_number(value) == text
    assert rfc8785.dumps(value) == text.encode()


def test_ints_serialize_as_decimal() -> None:
    assert canonical_bytes(MAX_SAFE_INTEGER) == b"9007199254740991"
    assert canonical_bytes(-MAX_SAFE_INTEGER) == b"-9007199254740991"
    assert canonical_bytes([0, -1, True, False, None]) == b"[0,-1,true,false,null]"


# ---------------------------------------------------------------------------- strings


def test_string_escaping() -> None:
    s = '"\\\b\t\n\f\r\x00\x01\x1f\x7f\u2028\u2029/é€\U0001f600'
    expected = '"\\"\\\\\\b\\t\\n\\f\\r\\u0000\\u0001\\u001f\x7f\u2028\u2029/é€\U0001f600"'
    assert canonical_bytes(s) == expected.encode()
    assert canonical_bytes(s) == rfc8785.dumps(s)
    assert canonical_bytes({"k": s}) == _exact_bytes({"k": s})


def test_every_control_char() -> None:
    for c in range(0x20):
        assert canonical_bytes(chr(c)) == rfc8785.dumps(chr(c))
    assert canonical_bytes("\x0b") == b'"\\u000b"'


# -------------------------------------------------------------------------- key order


def test_keys_sort_by_utf16_code_units_not_code_points() -> None:
    value = {"\ue000": 1, "\U0001f600": 2, "\uffff": 3, "z": 4, "\ud7ff": 5}
    # Code-point order would put U+E000 and U+FFFF before U+1F600 (surrogates D83D DE00).
    assert sorted(value) == ["z", "\ud7ff", "\ue000", "\uffff", "\U0001f600"]
    expected = '{"z":4,"\ud7ff":5,"\U0001f600":2,"\ue000":1,"\uffff":3}'.encode()
    assert canonical_bytes(value) == expected
    assert rfc8785.dumps(value) == expected


def test_nested_non_ascii_keys_sorted_too() -> None:
    value = {"a": [{"\ufb33": 1, "\U0001f602": 2, "1": 3}]}
    assert canonical_bytes(value) == rfc8785.dumps(value)
    assert canonical_str(value) == '{"a":[{"1":3,"\U0001f602":2,"\ufb33":1}]}'


def test_locale_and_case_do_not_matter() -> None:
    assert canonical_bytes({"b": 1, "B": 2, "a": 3, "A": 4}) == b'{"A":4,"B":2,"a":3,"b":1}'


# -------------------------------------------------------------------- accepted shapes


class Colour(enum.StrEnum):
    RED = "red"


class Level(enum.IntEnum):
    HIGH = 3


class Key(str):
    pass


class Sub(dict[str, Any]):
    pass


def test_subclasses_and_tuples_are_accepted_as_their_base() -> None:
    value = {Key("b"): Colour.RED, "a": (Level.HIGH, 2.5), "c": Sub(x=[])}
    assert canonical_bytes(value) == b'{"a":[3,2.5],"b":"red","c":{"x":[]}}'
    assert canonical_bytes(value) == rfc8785.dumps(value)
    assert not _fast_ok(value, 64)


def test_str_subclass_key_with_odd_ordering_still_sorts_by_value() -> None:
    class Backwards(str):
        def __lt__(self, other: object) -> bool:
            return str.__gt__(self, other)  # type: ignore[operator]

    value = {Backwards("a"): 1, Backwards("b"): 2}
    assert canonical_bytes(value) == b'{"a":1,"b":2}'


def test_api_helpers() -> None:
    value = {"b": [1, "x"], "a": None}
    data = canonical_bytes(value)
    assert data == b'{"a":null,"b":[1,"x"]}'
    assert canonical_str(value) == data.decode()
    assert sha256_hex(value) == hashlib.sha256(data).hexdigest()
    assert check_json(value) is None
    assert canonical_bytes({}) == b"{}"
    assert canonical_bytes([]) == b"[]"
    assert canonical_bytes("x") == b'"x"'
    assert canonical_bytes(None) == b"null"


# ---------------------------------------------------------------------------- refusals


class Opaque:
    pass


@pytest.mark.parametrize(
    ("value", "path", "fragment"),
    [
        (math.nan, "$", "NaN is not valid JSON"),
        ({"args": {"amount": math.nan}}, "args.amount", "NaN is not valid JSON"),
        ({"args": {"amount": math.inf}}, "args.amount", "Infinity"),
        ([1, [2, -math.inf]], "[1][1]", "-Infinity"),
        ({"a": {1: "x"}}, "a", "object key 1 (int) is not a string"),
        ({"a": {None: "x"}}, "a", "is not a string"),
        ({"blob": b"\x00"}, "blob", "bytes"),
        ({"blob": bytearray(b"x")}, "blob", "bytearray"),
        ({"tags": {"x", "y"}}, "tags", "set"),
        ({"tags": frozenset()}, "tags", "frozenset"),
        ({"obj": Opaque()}, "obj", "Opaque is not a JSON type"),
        ({"n": MAX_SAFE_INTEGER + 1}, "n", "outside the safe range"),
        ({"n": -MAX_SAFE_INTEGER - 1}, "n", "outside the safe range"),
        ({"n": [2**64]}, "n[0]", "outside the safe range"),
        ({"s": ["ok", "bad\ud800"]}, "s[1]", "lone surrogate"),
        ({"k": {"\udc00": 1}}, "k", "lone surrogate"),
        ({"k": {"\U0001f600": 1, "\ud83d": 2}}, "k", "lone surrogate"),
        ({"odd key": {"x y": math.nan}}, '["odd key"]["x y"]', "NaN"),
        ({"m": 1 + 2j}, "m", "complex"),
    ],
)
def test_refusals_name_the_path(value: object, path: str, fragment: str) -> None:
    with pytest.raises(CanonicalError) as info:
        canonical_bytes(value)
    assert info.value.path == path
    assert fragment in str(info.value)
    assert str(info.value).startswith(f"{path}: ")
    with pytest.raises(CanonicalError):
        check_json(value)
    assert isinstance(info.value, ValueError)


def test_max_depth_boundary() -> None:
    nested: Any = 1
    for _ in range(5):
        nested = [nested]
    assert canonical_bytes(nested, max_depth=5) == b"[[[[[1]]]]]"
    with pytest.raises(CanonicalError) as info:
        canonical_bytes(nested, max_depth=4)
    assert info.value.path == "[0][0][0][0]"
    assert "max_depth" in str(info.value)
    with pytest.raises(CanonicalError):
        canonical_bytes({"a": {}}, max_depth=1)
    assert canonical_bytes(7, max_depth=0) == b"7"


def test_deep_input_is_refused_not_recursion_error() -> None:
    deep: Any = []
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(CanonicalError) as info:
        canonical_bytes(deep)
    assert "max_depth" in str(info.value)
    # A max_depth beyond the interpreter's stack still ends in CanonicalError.
    with pytest.raises(CanonicalError):
        canonical_bytes(deep, max_depth=10**9)
    with pytest.raises(CanonicalError):
        check_json(deep, max_depth=sys.getrecursionlimit() * 10)


def test_cycles_are_reported_clearly() -> None:
    loop: dict[str, Any] = {"a": 1}
    loop["self"] = loop
    with pytest.raises(CanonicalError) as info:
        canonical_bytes(loop)
    assert info.value.path == "self"
    assert "circular reference" in str(info.value)

    outer: dict[str, Any] = {"items": [{"id": 1}]}
    outer["items"][0]["back"] = outer["items"]
    with pytest.raises(CanonicalError) as info:
        canonical_bytes(outer)
    assert info.value.path == "items[0].back"
    assert "its own ancestor at items" in str(info.value)

    with pytest.raises(CanonicalError, match="circular"):
        canonical_bytes(loop, max_depth=10**9)


def test_shared_but_acyclic_references_are_fine() -> None:
    shared = {"x": 1}
    assert canonical_bytes({"a": shared, "b": [shared, shared]}) == (
        b'{"a":{"x":1},"b":[{"x":1},{"x":1}]}'
    )


def test_max_bytes() -> None:
    value = {"a": "x" * 10}
    size = len(canonical_bytes(value))
    assert canonical_bytes(value, max_bytes=size) == b'{"a":"xxxxxxxxxx"}'
    with pytest.raises(CanonicalError) as info:
        canonical_bytes(value, max_bytes=size - 1)
    assert info.value.path == "$"
    assert "max_bytes" in str(info.value)
    with pytest.raises(CanonicalError):
        sha256_hex({"f": 1.5, "g": "é" * 10}, max_bytes=10)  # exact path too
    with pytest.raises(CanonicalError):
        canonical_str("é", max_bytes=3)  # counted in UTF-8 bytes, not characters


# ---------------------------------------------------------------------- routing matters


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ({"amount": 1.0}, b'{"amount":1}'),
        ({"big": 1e16}, b'{"big":10000000000000000}'),
        ({"tiny": 1e-5}, b'{"tiny":0.00001}'),
        ({"\ue000": 1, "\U0001f600": 2}, '{"\U0001f600":2,"\ue000":1}'.encode()),
        ({"n": 2**60}, None),
        ({"a": [2.5, 100.0]}, b'{"a":[2.5,100]}'),
        ({"a": {"b": -3e-5}}, b'{"a":{"b":-0.00003}}'),
    ],
)
def test_fast_path_would_be_wrong_for_floats_and_non_ascii_keys(
    value: dict[str, Any], expected: bytes | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stdlib encoder writes repr(float) and sorts by code point: routing is load-bearing."""
    assert not _fast_ok(value, 64)
    if expected is None:
        with pytest.raises(CanonicalError):
            canonical_bytes(value)
    else:
        assert canonical_bytes(value) == expected == rfc8785.dumps(value)
    monkeypatch.setattr(canonical, "_c_canonical", None)  # the Python routing, not the C one
    monkeypatch.setattr(canonical, "_fast_snapshot", lambda v, d, b: v)  # "fast", uncopied
    monkeypatch.setattr(canonical, "_orjson", None)  # the stdlib encoder's mistakes
    if expected is None:
        assert canonical_bytes(value) == b'{"n":1152921504606846976}'  # silently accepted
    else:
        assert canonical_bytes(value) != expected


def test_fast_path_is_taken_for_the_common_shape() -> None:
    cert = {
        "intent": "inv-1",
        "args": {"amount": 10, "ok": True, "note": None, "who": "é\U0001f600"},
        "pairs": [["a", 1], ["b", 2]],
        "token": MAX_SAFE_INTEGER,
        "größe €": [12.5, -0.0125, 0.0001, 1234567890123.4],  # BMP key, repr-safe floats
    }
    assert _fast_ok(cert, 64)
    assert canonical_bytes(cert) == _exact_bytes(cert) == rfc8785.dumps(cert)
    assert not _fast_ok(cert, 2)
    assert not _fast_ok({"a": (1,)}, 64)
    assert not _fast_ok({"a": Key("x")}, 64)


# -------------------------------------------------------------------------- hypothesis

TRICKY = st.sampled_from(
    ["\x00", "\x1f", '"', "\\", "\x7f", "\u2028", "\ud7ff", "\ue000", "\uffff", "\U0001f600"]
)
TEXT = st.text(
    st.characters(exclude_categories=("Cs",)) | TRICKY,
    max_size=12,
)
FLOATS = st.floats(allow_nan=False, allow_infinity=False) | st.sampled_from(
    [5e-324, -5e-324, 1e21, 1e-7, 1e-6, 9.999999999999997e22, 1e16, 0.1, 2.0**53]
)
SAFE_INTS = st.integers(-MAX_SAFE_INTEGER, MAX_SAFE_INTEGER)
SCALARS = st.none() | st.booleans() | SAFE_INTS | FLOATS | TEXT
JSON_VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(TEXT, inner, max_size=5),
    max_leaves=30,
)

BMP_KEYS = st.text(
    st.characters(max_codepoint=0x7F)
    | st.characters(max_codepoint=0xFFFF, exclude_categories=("Cs",)),
    max_size=8,
)
REPR_SAFE_FLOATS = st.floats(min_value=-1e15, max_value=1e15).filter(
    lambda f: abs(f) >= 1e-4 and not f.is_integer()
)
FAST_SHAPED = st.recursive(
    st.none() | st.booleans() | SAFE_INTS | TEXT | REPR_SAFE_FLOATS,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(BMP_KEYS, inner, max_size=6),
    max_leaves=30,
)

HYPO = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@HYPO
@given(JSON_VALUES)
def test_matches_rfc8785_package(value: Any) -> None:
    assert canonical_bytes(value) == rfc8785.dumps(value)


@HYPO
@given(JSON_VALUES)
def test_fast_and_exact_paths_agree(value: Any) -> None:
    data = canonical_bytes(value)
    assert data == _exact_bytes(value)
    # Same JSON value (numbers compared as doubles: "1e+16" may read back as an int).
    assert json.loads(data, parse_int=float) == json.loads(json.dumps(value), parse_int=float)


@HYPO
@given(FAST_SHAPED)
def test_fast_shaped_values_take_the_fast_path_and_agree(value: Any) -> None:
    assert _fast_ok(value, 64)
    data = canonical_bytes(value)
    assert data == _exact_bytes(value) == rfc8785.dumps(value)


@settings(max_examples=2000, deadline=None)
@given(FLOATS)
def test_float_text_round_trips_and_matches_oracle(value: float) -> None:
    text = _es6_number(value) if value != 0 else "0"
    assert float(text) == value
    assert canonical_bytes(value) == text.encode() == rfc8785.dumps(value)


@settings(max_examples=500, deadline=None)
@given(st.dictionaries(TEXT, SAFE_INTS, max_size=8))
def test_key_order_is_utf16(value: dict[str, int]) -> None:
    keys = list(json.loads(canonical_bytes(value)))
    assert keys == sorted(value, key=lambda k: k.encode("utf-16-be"))


@settings(max_examples=3000, deadline=None)
@given(FLOATS)
def test_fast_float_rule_matches_es6(value: float) -> None:
    """Whenever the shape check admits a float, the C encoder's repr is already ES6."""
    if _fast_ok(value, 64):
        assert json.dumps(value) == _es6_number(value)
    else:
        assert value == 0 or value.is_integer() or not 1e-4 <= abs(value) < 1e16


class Plain(enum.Enum):
    ONE = 1


# -- the orjson encoder ---------------------------------------------------------------------


@HYPO
@given(FAST_SHAPED)
def test_orjson_bytes_equal_the_stdlib_fast_path(value: Any) -> None:
    """Where _fast_ok says yes, orjson, the stdlib encoder and the exact path agree."""
    assert _fast_ok(value, 64)
    stdlib = "".join(canonical._C_ENCODE(value, 0)).encode("utf-8")  # type: ignore[misc]
    assert orjson.dumps(value, option=orjson.OPT_SORT_KEYS) == stdlib == _exact_bytes(value)


@pytest.mark.parametrize(
    "value",
    [
        {"a": 1.0},  # orjson writes 1.0, RFC 8785 writes 1
        {"a": [1e16]},  # orjson 1e+16, RFC 8785 10000000000000000
        {"\U0001f600": 1, "\ue000": 2},  # code-point order is not UTF-16 order
        {"a": math.nan},  # orjson writes null instead of refusing
        {"a": uuid.UUID(int=1)},  # orjson writes a string instead of refusing
        {"a": Plain.ONE},
        {"a": 2**60},
    ],
)
def test_orjson_is_never_asked_where_it_is_not_exact(value: Any) -> None:
    assert not _fast_ok(value, 64)
    raw = orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
    try:
        exact: bytes | None = _exact_bytes(value)
    except CanonicalError:
        exact = None
    assert raw != exact
    if exact is None:
        with pytest.raises(CanonicalError):
            canonical_bytes(value)
    else:
        assert canonical_bytes(value) == exact


@HYPO
@given(TEXT | st.text())
def test_string_bytes_is_exact(text: str) -> None:
    try:
        expected = _exact_bytes(text)
    except CanonicalError:
        with pytest.raises(CanonicalError):
            canonical.string_bytes(text)
        return
    assert canonical.string_bytes(text) == expected


def test_string_bytes_refuses_lone_surrogates() -> None:
    with pytest.raises(CanonicalError):
        canonical.string_bytes("a\ud800b")


def test_name_bytes_is_string_bytes_and_stays_bounded() -> None:
    names = [f"agent-{i}" for i in range(5000)] + ["tōol", "dömain:\U0001f600"]
    for n in names:
        assert canonical.name_bytes(n) == canonical.string_bytes(n) == _exact_bytes(n)
    assert len(canonical._STRINGS) <= 4096


def test_fast_bytes_answers_only_for_the_common_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(canonical, "_c_canonical", None)  # the Python fast path
    assert (
        canonical.fast_bytes({"b": 1, "a": [True, None, "x"]}, 8) == b'{"a":[true,null,"x"],"b":1}'
    )
    assert canonical.fast_bytes({"a": 1.0}, 8) is None  # integral float: exact path
    assert canonical.fast_bytes({"a": "\ud800"}, 8) is None  # lone surrogate: exact path names it
    assert canonical.fast_bytes([[[1]]], 2) is None  # too deep: exact path names it


# ------------------------------------------------- decoding gives back what was encoded

#: integral doubles past 2**53 (RFC 8785 writes them without a fraction, e.g. 1.7e18 as
#: 1700000000000000000) and every other float the encoder accepts
_any_float = st.floats(allow_nan=False, allow_infinity=False)
_integral_past_2_53 = st.integers(2**53, 2**72).map(float) | st.integers(-(2**72), -(2**53)).map(
    float
)
_encodable_float = _any_float | _integral_past_2_53


@settings(max_examples=500, deadline=None)
@given(x=_encodable_float)
def test_every_encodable_float_survives_encode_decode_encode(x: float) -> None:
    """Review 2, bug 1: canonical text of 1.7e18 decoded to an int the encoder refuses, so
    a certificate holding it failed to verify, and durable stores could not write it."""
    for value in (x, [x], {"ts_ns": x, "nested": [{"v": x}]}):
        data = canonical_bytes(value)
        back = canonical.json_loads(data)
        assert back == value
        assert canonical_bytes(back) == data
        assert canonical.json_loads(data.decode()) == value  # text in, the same value out


@pytest.mark.parametrize("x", [2.0**53, 1e17, 1.7e18, -1.7e18, 2.0**64, 1e20, 9.99e20])
def test_integral_floats_past_2_53_decode_as_floats(x: float) -> None:
    data = canonical_bytes({"ts_ns": x})
    assert b"e" not in data and b"." not in data  # the form that reads as an int
    back = canonical.json_loads(data)
    assert type(back["ts_ns"]) is float and back["ts_ns"] == x
    # safe integers stay ints, strings of digits stay strings
    same = canonical.json_loads(b'{"a":9007199254740991,"b":"17000000000000000000"}')
    assert same == {"a": 9007199254740991, "b": "17000000000000000000"}
    assert type(same["a"]) is int


def test_json_loads_turns_deep_nesting_into_a_value_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without orjson the stdlib parser raises RecursionError; callers expect ValueError."""
    deep = b"[" * 100_000 + b"]" * 100_000
    with pytest.raises(ValueError):
        canonical.json_loads(deep)
    monkeypatch.setattr(canonical, "_orjson", None)
    with pytest.raises(ValueError):
        canonical.json_loads(deep)
    nested = b"[" * 900 + b"1700000000000000000" + b"]" * 900  # the float walk never recurses
    value = canonical.json_loads(nested)
    for _ in range(900):
        value = value[0]
    assert value == 1.7e18 and type(value) is float

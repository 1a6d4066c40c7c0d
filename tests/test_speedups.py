"""The C accelerator (effectfence._speedups): pure functions equal to their Python twins.

Canonical bytes identical to the reference encoder (or a decline, for the reference to
name the problem), and the request constructor building or refusing exactly as the Python
``__init__`` does. It holds no rule of the protocol, so the guarantee suites need no
compiled twin of themselves: they run the one Python decider in both builds.
"""

from __future__ import annotations

import json
import os
import struct
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import rfc8785
from hypothesis import given, settings
from hypothesis import strategies as st

from effectfence import (
    EffectFence,
    EffectRequest,
    FenceConfig,
    InvalidRequest,
    _accel,
)
from effectfence.canonical import CanonicalError, _es6_number, _exact_bytes, canonical_bytes
from effectfence.cert import MAX_PAYLOAD_DEPTH
from effectfence.counters import backend_info

sp = _accel.speedups
needs_c = pytest.mark.skipif(sp is None, reason=f"accelerator off: {_accel.import_error}")
VECTORS = Path(__file__).parent / "vectors" / "jcs"


def test_accelerator_presence_follows_the_backend() -> None:
    """CI's atomic run must exercise the C paths; its pure run must not touch them."""
    forced = os.environ.get("EFFECTFENCE_COUNTERS", "").strip().lower()
    if forced == "atomic":
        assert sp is not None
    if forced == "pure":
        assert sp is None
    assert backend_info()["speedups"] is (sp is not None)


# ------------------------------------------------------------------------- canonical JSON

_keys = st.text(max_size=6)
_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**60), max_value=2**60)
    | st.floats()
    | st.text(max_size=8)
)
_json = st.recursive(
    _scalars,
    lambda c: st.lists(c, max_size=4) | st.tuples(c, c) | st.dictionaries(_keys, c, max_size=5),
    max_leaves=24,
)


def _reference(value: object, depth: int = 64) -> bytes | None:
    try:
        return _exact_bytes(value, depth)
    except CanonicalError:
        return None


@needs_c
@settings(max_examples=600)
@given(_json)
def test_c_encoder_equals_the_reference_or_declines_what_it_refuses(value: Any) -> None:
    got = sp.canonical(value, 64)
    assert got == _reference(value)
    if got is not None and not isinstance(value, tuple):
        assert got == rfc8785.dumps(value)


@needs_c
@settings(max_examples=400)
@given(st.floats(allow_nan=False, allow_infinity=False))
def test_c_encoder_writes_every_double_the_es6_way(x: float) -> None:
    assert sp.canonical(x, 1) == _es6_number(x).encode()
    assert sp.canonical([x], 2) == b"[" + _es6_number(x).encode() + b"]"


@needs_c
def test_c_encoder_on_the_published_number_table() -> None:
    rows = 0
    for line in (VECTORS / "numbers.txt").read_text().splitlines():
        if not line or line.startswith("#"):
            continue
        bits, text = line.split()
        x = struct.unpack(">d", bytes.fromhex(bits.zfill(16)))[0]
        assert sp.canonical(x, 1) == (
            None if x != x or x in (float("inf"), -float("inf")) else text.encode()
        )
        rows += 1
    assert rows > 20


@needs_c
@pytest.mark.parametrize("name", sorted(p.stem for p in (VECTORS / "input").glob("*.json")))
def test_c_encoder_on_the_published_vectors(name: str) -> None:
    value = json.loads((VECTORS / "input" / f"{name}.json").read_bytes())
    assert sp.canonical(value, 64) == (VECTORS / "output" / f"{name}.json").read_bytes()


def _objects(lowest: int, longest_key: int, min_size: int, max_size: int) -> Any:
    """JSON objects of small ints whose keys run from ``lowest`` into the astral planes."""
    chars = st.characters(min_codepoint=lowest, max_codepoint=0x1F6FF, exclude_categories=["Cs"])
    return st.dictionaries(
        st.text(chars, max_size=longest_key),
        st.integers(0, 9),
        min_size=min_size,
        max_size=max_size,
    )


@needs_c
@settings(max_examples=300)
@given(_objects(0xD7F0, 3, 0, 6))
def test_c_encoder_orders_keys_by_utf16_code_units(value: dict[str, int]) -> None:
    """Keys mixing U+E000..U+FFFF with astral characters: code-point order is wrong here."""
    assert sp.canonical(value, 2) == _reference(value) == rfc8785.dumps(value)


@needs_c
@settings(max_examples=150)
@given(_objects(0x20, 4, 9, 40))
def test_c_encoder_sorts_large_objects_too(value: dict[str, int]) -> None:
    """Up to 8 members are insertion-sorted, more go through qsort: both orders are exact."""
    assert sp.canonical(value, 2) == _reference(value) == rfc8785.dumps(value)


class _Str(str):
    pass


class _Dict(dict):  # type: ignore[type-arg]
    pass


class _Int(int):
    pass


_cycle: list[Any] = []
_cycle.append(_cycle)


@needs_c
@pytest.mark.parametrize(
    "value",
    [
        float("nan"),
        float("inf"),
        2**53,
        -(2**53),
        2**70,
        "\ud800",
        {"\udfff": 1},
        {1: 2},
        {"a": b"bytes"},
        {"a": {1, 2}},
        _Str("x"),
        _Dict(a=1),
        {"a": _Int(1)},
        object(),
        [[[[1]]]],
        _cycle,
    ],
    ids=repr,
)
def test_c_encoder_declines_and_the_reference_names_the_problem(value: Any) -> None:
    assert sp.canonical(value, 3) is None
    subclassed = isinstance(value, (_Str, _Dict)) or value == {"a": 1}
    if subclassed:  # JSON after all: the Python path encodes it (as its plain base type)
        assert canonical_bytes(value, max_depth=3) == _exact_bytes(value, 3)
    else:
        with pytest.raises(CanonicalError):
            canonical_bytes(value, max_depth=3)


@needs_c
def test_c_encoder_caps_depth_without_recursing_into_a_cycle() -> None:
    assert sp.canonical(_cycle, 10**9) is None
    deep: Any = 1
    for _ in range(600):
        deep = [deep]
    assert sp.canonical(deep, 10**9) is None  # beyond the C cap: the Python encoder decides
    assert sp.canonical(deep, 601) is None
    assert sp.canonical([[1]], 2) == b"[[1]]"


@needs_c
@settings(max_examples=300)
@given(st.text())
def test_c_string_is_the_reference(text: str) -> None:
    assert sp.string(text) == _exact_bytes(text)


@needs_c
def test_c_string_declines_lone_surrogates_and_subclasses() -> None:
    assert sp.string("a\ud800b") is None
    assert sp.string(_Str("x")) is None
    assert sp.string('\x00"\\\x1f\x7f\u2028') == b'"\\u0000\\"\\\\\\u001f\x7f\xe2\x80\xa8"'


# ---------------------------------------------------------------------- EffectRequest init

_names = st.one_of(
    st.text(max_size=6),
    st.sampled_from(["", "x" * 512, "x" * 513, "caf\u00e9", "a\ud800", "\U0001f600", "a\x00"]),
    st.sampled_from([None, 5, b"bytes"]),
)
_req_args = st.sampled_from([None, {}, {"a": 1}, [("a", 1)], "text", 7])


def _built(init: Callable[..., None], call: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    obj = EffectRequest.__new__(EffectRequest)
    try:
        init(obj, *call, **kw)
    except InvalidRequest as exc:
        return ("refused", str(exc))
    return ("built", *(getattr(obj, f) for f in EffectRequest.__slots__))


@needs_c
@settings(max_examples=500)
@given(
    st.tuples(_names, _names, _names),
    st.lists(st.one_of(_req_args, _names), max_size=2),
    st.sampled_from([{}, {"expected_seq": 3}, {"parent": "p"}]),
)
def test_request_init_in_c_builds_or_refuses_exactly_as_the_python_init(
    names: tuple[Any, ...], rest: list[Any], kw: dict[str, Any]
) -> None:
    call = (*names, *rest)
    fast = EffectRequest.__init__
    assert type(fast) is sp.RequestInit
    assert _built(fast, call, kw) == _built(fast.__wrapped__, call, kw)


@needs_c
@pytest.mark.parametrize(
    "call",
    [
        ("", "d", "t"),
        ("i", "d", "x" * 513),
        ("i", "d", "t", {}, ""),
        ("i", "d", "t", [1]),
        # NUL: PostgreSQL's text cannot hold it, found at commit after the effect ran
        ("i\x00", "d", "t"),
        ("i", "d\x00", "t"),
        ("i", "d", "\x00"),
        ("i", "d", "t", {}, "a\x00"),
    ],
)
def test_request_init_in_c_refuses_what_python_refuses(call: tuple[Any, ...]) -> None:
    with pytest.raises(InvalidRequest):
        EffectRequest(*call)
    req = EffectRequest("i", "d", "t")
    assert (req.args, req.agent, req.read_set, req.parent) == ({}, "anonymous", (), None)


@needs_c
def test_deep_input_never_recurses_deep_in_c(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by review: ~320 bytes of C stack per nesting level up to 512 levels overflowed
    a 128 KiB thread stack. Deeper than 128 levels now goes to the Python encoder."""
    deep: Any = 1
    for _ in range(128):
        deep = [deep]
    assert sp.canonical(deep, 10**9) == b"[" * 128 + b"1" + b"]" * 128
    assert sp.canonical([deep], 10**9) is None
    nested: Any = {"v": 1}
    for _ in range(MAX_PAYLOAD_DEPTH - 2):
        nested = {"k": nested}
    fence = EffectFence(FenceConfig(auto_sweep=False, max_depth=MAX_PAYLOAD_DEPTH))
    out: list[Any] = []
    old = threading.stack_size(128 * 1024)
    try:
        t = threading.Thread(
            target=lambda: out.append(fence.prepare(EffectRequest("deep", "d", "t", nested)))
        )
        t.start()
        t.join()
    finally:
        threading.stack_size(old)
    assert out and out[0].fresh


# ------------------------------------------------------------------ wrap's nesting walk


@needs_c
@settings(max_examples=1500)
@given(
    st.binary(max_size=80).map(lambda b: bytes(b'[]{}"\\ a'[x % 8] for x in b)), st.integers(0, 6)
)
def test_c_nesting_walk_is_the_reference(line: bytes, limit: int) -> None:
    """Brackets, quotes and escapes in any order (valid JSON or not), walked alike."""
    from effectfence.wrap.proxy import nesting_over

    assert sp.nesting_over(line, limit) is nesting_over(line, limit)


@needs_c
def test_c_nesting_walk_on_lines_the_wrapper_meets() -> None:
    from effectfence.wrap.proxy import MAX_DEPTH, _shallow, nesting_over

    table = json.dumps({"rows": [[i, "a]b[", {"k": [i]}] for i in range(2000)]}).encode()
    deep = b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1)
    in_text = json.dumps(["[" * 2000, "\\[" * 700, '"{' * 700]).encode()
    for line, shallow in ((table, True), (deep, False), (in_text, True), (table + deep, False)):
        assert _shallow(line) is shallow
        assert sp.nesting_over(line, MAX_DEPTH) is (not shallow) is nesting_over(line, MAX_DEPTH)
    big = b"[" * (1 << 17) + b"]" * (1 << 17)  # walked without the GIL: same answer
    assert sp.nesting_over(big, 1 << 17) is False and sp.nesting_over(big, (1 << 17) - 1)
    with pytest.raises(TypeError):
        sp.nesting_over("[]", 1)


# ------------------------------------------------- found by review: C and Python alike

_FOREIGN_CERTS = r"""
import gc, sys, weakref
from effectfence.counters import new_table
from effectfence.store.cmemory import CMemoryStore
s = CMemoryStore(counters=new_table("atomic"))
def claim(i):
    return s.claim(i, expect=None, fingerprint=b"f", domain="d", agent="a", lease_ttl=1.0,
                   reclaim_after=2.0, compare=(), reserve_at=None).record
def complete(i, rec, cert, compare=()):
    return s.complete(i, rec.token, cert, fingerprint=b"f", result_ttl=1.0, reclaim_after=2.0,
                      compare=compare, own_seq=None, stale_reason="stale", stale_reclaim_after=1.0)
class Cert:  # a certificate of the caller's, in a reference cycle
    def __init__(self):
        self.hash, self.vector_clock, self.me = "h", {"a": 1}, self
c = Cert(); w = weakref.ref(c)
complete("i", claim("i"), c); s.clear("i"); del c; gc.collect()
f = lambda: None  # a function as the cert, on the stale path
complete("j", claim("j"), f, compare=(("d", 999),)); del f
gc.collect()
print("freed" if w() is None else "leaked")
"""


def test_the_c_memory_store_leaves_a_callers_certificate_to_the_collector() -> None:
    """complete untracked whatever cert it was given from the cyclic GC: a cert in a cycle
    was never freed, and a function passed as one crashed the process when freed (found
    by review). Only the fence's own EffectCert is untracked now."""
    from effectfence._accel import memstore

    if memstore is None:
        pytest.skip(f"the C memory store is off: {_accel.memstore_error}")
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _FOREIGN_CERTS], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, (out.returncode, out.stderr[-500:])
    assert out.stdout.strip() == "freed"


@needs_c
def test_a_subclass_of_the_request_is_built_by_its_own_setattr() -> None:
    """The C __init__ wrote any subclass's slots directly, past its __setattr__: the same
    class built different requests in the compiled and the pure build (found by review)."""

    class Normalised(EffectRequest):
        __slots__ = ()

        def __setattr__(self, name: str, value: Any) -> None:
            super().__setattr__(name, value.lower() if name == "tool" else value)

    assert Normalised("i1", "d", "Charge").tool == "charge"
    assert EffectRequest("i1", "d", "Charge").tool == "Charge"


def test_every_memory_store_takes_the_same_options() -> None:
    from effectfence.store import open_store

    store = open_store("memory:", audit_keep=5)  # the C store refused audit_keep
    assert store._audit.maxlen == 5  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("value", "depth", "limit", "named"),
    [
        ({"k" * 100: float("nan")}, 64, 50, "NaN"),
        ({"": []}, 1, 0, "deeper"),
    ],
)
def test_a_value_over_the_limit_is_refused_for_its_first_fault(
    value: Any, depth: int, limit: int, named: str
) -> None:
    """Past max_bytes the C encoder answered "over max_bytes" where the Python encoder
    names the NaN, or the depth, it meets first: the compiled build told callers to send
    less (found by review). The reference names it in both builds."""
    with pytest.raises(CanonicalError, match=named):
        canonical_bytes(value, max_depth=depth, max_bytes=limit)

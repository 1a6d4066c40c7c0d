"""The certificate hash's compiled twin (effectfence._certhash) equals its definition.

``spliced_hash_py`` is the definition (itself proven equal to the canonical form of
``cert_body`` in tests/test_cert_clock.py); the C function must return the same hex digest
for every input it answers, and decline (None) rather than guess. Checked on the frozen
vectors and on generated certificates, including the shapes it must decline.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from effectfence import _accel, cert
from effectfence.canonical import CanonicalError, canonical_bytes, string_bytes

VECTORS = json.loads((Path(__file__).parent / "vectors" / "certs.json").read_text())
C = cert._C_CERT_HASH
needs_c = pytest.mark.skipif(
    C is None, reason=f"certificate hash in C off: {_accel.certhash_error}"
)


def _parts(f: dict[str, Any]) -> tuple[Any, ...]:
    return (
        f["intent"],
        f["parent"],
        f["domain"],
        f["seq"],
        f["tool"],
        canonical_bytes(f["args"]),
        canonical_bytes(f["result"]),
        dict(f["vector_clock"]),
        tuple((d, s) for d, s in f["read_set"]),
        f["agent"],
    )


def test_presence_follows_the_build() -> None:
    """The compiled build uses the C hash; the pure build never touches it."""
    if _accel.speedups is None:
        assert C is None
    else:
        assert (C is not None) == (_accel.certhash is not None)


@needs_c
def test_format_constant_is_the_python_one() -> None:
    assert _accel.certhash.FORMAT_JSON.encode() == string_bytes(cert.CERT_FORMAT)


@needs_c
@pytest.mark.parametrize("vector", VECTORS["vectors"], ids=lambda v: v["fields"]["intent"])
def test_frozen_vectors(vector: dict[str, Any]) -> None:
    parts = _parts(vector["fields"])
    assert C(*parts) == vector["hash"]
    assert cert.spliced_hash(*parts) == vector["hash"] == cert.spliced_hash_py(*parts)
    assert hashlib.sha256(vector["canonical"].encode()).hexdigest() == vector["hash"]


names = st.text(min_size=1, max_size=12)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53) + 1, 2**53 - 1) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=8,
)


@needs_c
@settings(max_examples=400, deadline=None)
@given(
    intent=st.text(min_size=1, max_size=20),
    parent=st.none() | st.text(min_size=1, max_size=70),
    domain=names,
    seq=st.integers(-(2**60), 2**60) | st.booleans(),
    tool=names,
    args=json_values,
    result=json_values,
    clock=st.dictionaries(names, st.integers(0, 2**54) | st.floats(0, 9)),
    read_set=st.lists(st.tuples(names, st.integers(-(2**54), 2**54)), max_size=3),
    agent=names,
)
def test_c_hash_equals_the_definition(**f: Any) -> None:
    """Byte-identical where it answers; where the definition refuses, the C declines."""
    parts = (
        f["intent"],
        f["parent"],
        f["domain"],
        f["seq"],
        f["tool"],
        canonical_bytes(f["args"]),
        canonical_bytes(f["result"]),
        f["clock"],
        tuple(f["read_set"]),
        f["agent"],
    )
    try:
        want: str | None = cert.spliced_hash_py(*parts)
    except CanonicalError:
        want = None
    got = C(*parts)
    assert got is None or got == want
    if want is None:
        with pytest.raises(CanonicalError):
            cert.spliced_hash(*parts)
    else:
        assert cert.spliced_hash(*parts) == want


@needs_c
@pytest.mark.parametrize(
    "change",
    [
        {"seq": True},
        {"seq": 2**53},
        {"args": bytearray(b"{}")},
        {"clock": {"a": 1.0}},
        {"clock": {"a": 2**53}},
        {"read_set": (["d", 1],)},
        {"read_set": (("d", 2**53),)},
        {"intent": "lone \ud800"},
        {"parent": 7},
    ],
    ids=repr,
)
def test_c_declines_what_it_is_not_sure_of(change: dict[str, Any]) -> None:
    f: dict[str, Any] = {
        "intent": "i",
        "parent": None,
        "domain": "d",
        "seq": 1,
        "tool": "t",
        "args": b"{}",
        "result": b"null",
        "clock": {"a": 1},
        "read_set": (),
        "agent": "a",
        **change,
    }
    order = ("intent", "parent", "domain", "seq", "tool", "args", "result", "clock", "read_set")
    assert C(*(f[k] for k in order), f["agent"]) is None

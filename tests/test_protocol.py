"""The state table itself: complete, consistent with DESIGN.md, and the README's copy current."""

from __future__ import annotations

from pathlib import Path

import pytest

from effectfence.protocol import (
    PREPARE_TABLE,
    TICKET_TABLE,
    Action,
    IntentRecord,
    Row,
    State,
    TicketVerdict,
    decide_prepare,
    diagram,
    judge_ticket,
    observe,
)


def test_tables_cover_every_key() -> None:
    keys = {(row, same) for row in Row for same in (True, False)}
    assert set(PREPARE_TABLE) == keys
    assert set(TICKET_TABLE) == keys - {(Row.ABSENT, True)}  # no token matches nothing


def test_only_a_current_in_flight_token_passes() -> None:
    allowed = {k for k, v in TICKET_TABLE.items() if v is TicketVerdict.ALLOW}
    assert allowed == {(Row.IN_FLIGHT_LIVE, True), (Row.IN_FLIGHT_LAPSED, True)}


def test_claims_only_where_design_allows() -> None:
    claims = {k for k, v in PREPARE_TABLE.items() if v in (Action.CLAIM, Action.TAKEOVER)}
    assert claims == {
        (Row.ABSENT, True),
        (Row.ABSENT, False),
        (Row.DONE_EXPIRED, True),
        (Row.DONE_EXPIRED, False),
        (Row.IN_FLIGHT_LAPSED, True),
    }
    assert PREPARE_TABLE[Row.DONE_LIVE, False] is Action.REFUSE_CONFLICT


def rec(state: State, **kw: float) -> IntentRecord:
    return IntentRecord("i", state, 7, b"fp", "d", "a", **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("record", "now", "row"),
    [
        (None, 0.0, Row.ABSENT),
        (rec(State.IN_FLIGHT, lease_until=10.0), 9.999, Row.IN_FLIGHT_LIVE),
        (rec(State.IN_FLIGHT, lease_until=10.0), 10.0, Row.IN_FLIGHT_LAPSED),
        (rec(State.DONE, until=10.0), 9.0, Row.DONE_LIVE),
        (rec(State.DONE, until=10.0), 10.0, Row.DONE_EXPIRED),
        (rec(State.FAILED), 1e9, Row.FAILED),
    ],
)
def test_observe_rows(record: IntentRecord | None, now: float, row: Row) -> None:
    assert observe(record, now) is row


def test_refusals_name_operation_state_and_token() -> None:
    r = rec(State.DONE, until=10.0)
    verdict, refusal = judge_ticket("commit", r, 5.0, "i", 7)
    assert verdict is TicketVerdict.COMMITTED  # the committing ticket: see recommit
    assert refusal is not None and refusal.details["committed_by_this_ticket"] is True
    verdict, refusal = judge_ticket("commit", r, 5.0, "i", 8)
    assert verdict is TicketVerdict.LEASE_LOST
    assert refusal is not None and refusal.code == "lease_lost"
    assert "can't commit" in refusal.message and "state=done" in refusal.message
    lapsed = rec(State.IN_FLIGHT, lease_until=1.0)
    assert judge_ticket("commit", lapsed, 5.0, "i", 7) == (TicketVerdict.ALLOW, None)
    assert decide_prepare(r, 5.0, b"other") == (Row.DONE_LIVE, Action.REFUSE_CONFLICT)


def test_readme_diagram_is_generated_from_the_table() -> None:
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    start = readme.index("<!-- state-diagram:begin -->")
    end = readme.index("<!-- state-diagram:end -->")
    block = readme[start:end]
    assert "```mermaid\n" + diagram() + "\n```" in block, (
        "run: python -c 'from effectfence.protocol import diagram; print(diagram())'"
    )

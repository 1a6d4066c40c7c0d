"""Commands refused on bad input say what was wrong, in one line, and make nothing: each case
here printed a traceback, an empty message or another problem's message (found by a
hostile-input trial)."""

from __future__ import annotations

from pathlib import Path

import pytest

from effectfence import EffectFence, EffectRequest
from effectfence.errors import LeaseLost


def test_storm_refuses_a_report_path_it_cannot_write_before_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from effectfence.storm import main

    assert main(["--waves", "1", "--racers", "2", "--json", str(tmp_path / "no" / "x.json")]) == 2
    err = capsys.readouterr()
    assert "can't write" in err.err and "No such file or directory" in err.err
    assert err.out == ""  # refused before the run, not after it


def test_storm_names_the_amount_it_refuses(capsys: pytest.CaptureFixture[str]) -> None:
    from effectfence.storm import main

    assert main(["--amount-cents", "-5"]) == 2
    assert "--amount-cents must be >= 0" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["nan", "-1", "0", "inf"])
def test_probe_refuses_a_timeout_that_is_no_time(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from effectfence.wrap.probe import main

    with pytest.raises(SystemExit) as exited:
        main(["--tool", "x", "--timeout", value, "--", "true"])
    assert exited.value.code == 2
    assert "--timeout must be a positive number of seconds" in capsys.readouterr().err


@pytest.mark.parametrize("bind", ["99999", "127.0.0.1:-5", "[::1]", "8765x"])
def test_console_refuses_a_bind_it_cannot_use_in_one_line(
    bind: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from effectfence.operator.console import main

    assert main(["--store", "memory:", "--http", bind]) == 2
    err = capsys.readouterr().err
    assert err.startswith("effectfence console: --http") and "Traceback" not in err


@pytest.mark.parametrize("op", ["abort", "release", "renew"])
def test_a_committed_ticket_is_not_told_it_gave_another_result(op: str) -> None:
    """Only a commit gives a result: an abort, release or renew of a committed ticket was
    told "already committed with another result"."""
    fence = EffectFence()
    ticket = fence.prepare(EffectRequest("pay:1", "acct:1", "charge", {"c": 1}, "a")).ticket
    fence.commit(ticket, {"ok": True})
    with pytest.raises(LeaseLost) as refused:
        getattr(fence, op)(ticket)
    assert "already committed;" in refused.value.message
    assert "another result" not in refused.value.message
    with pytest.raises(LeaseLost) as recommit:
        fence.commit(ticket, {"ok": False})
    assert "already committed with another result" in recommit.value.message


def test_a_clear_expecting_a_token_no_store_can_hold_is_invalid_request() -> None:
    """Past the stores' 64-bit tokens it was refused intent_in_flight, retryable, as if the
    record had moved (found by review)."""
    from effectfence.errors import InvalidRequest

    fence = EffectFence()
    fence.prepare(EffectRequest("pay:2", "acct:1", "charge", {"c": 1}, "a"))
    with pytest.raises(InvalidRequest, match="expect_token must be a token"):
        fence.clear("pay:2", reason="checked", who="op", force=True, expect_token=2**70)
    assert fence.intent_status("pay:2").state == "in_flight"

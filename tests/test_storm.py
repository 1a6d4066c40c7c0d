"""``effectfence storm``: the 1,000-attempt demonstration, run small and at full size."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from effectfence import EffectFence, EffectRequest, FenceConfig, Fresh
from effectfence.counters import AtomicCounterTable
from effectfence.storm import REFERENCE_MS, main, run_storm

TABLES = ["pure"] + (["atomic"] if AtomicCounterTable is not None else [])


def _load(path: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(path.read_text())
    return doc


@pytest.mark.parametrize("counters", TABLES)
def test_small_storm_exit_code_and_json(
    tmp_path: Path, counters: str, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "storm.json"
    rc = main(["--waves", "4", "--racers", "5", "--counters", counters, "--json", str(out)])
    assert rc == 0
    doc = _load(out)
    assert doc["ok"] is True and doc["reference_ms"] == REFERENCE_MS
    (run,) = doc["runs"]
    assert run["counters"] == counters and run["store"] == "memory"
    assert run["attempts"] == 20 and run["executions"] == 1
    assert run["replays"] + sum(run["refused"].values()) == 19
    assert run["double_charge_cents"] == 19 * 77700
    assert run["harness_ms"] > 0 and run["fence_sum_ms"] > 0
    assert set(doc["summary"]) == {counters}
    text = capsys.readouterr().out
    assert "exactly one execution" in text and "$14,763.00" in text


def test_default_storm_both_tables(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The full demonstration: 40 waves x 25 new threads, both tables side by side."""
    out = tmp_path / "storm.json"
    assert main(["--json", str(out)]) == 0
    doc = _load(out)
    assert sorted(r["counters"] for r in doc["runs"]) == sorted(TABLES)
    for run in doc["runs"]:
        assert (run["waves"], run["racers"], run["attempts"]) == (40, 25, 1000)
        assert run["executions"] == 1, run
        assert run["replays"] + sum(run["refused"].values()) == 999
        assert run["double_charge_cents"] == 999 * 77700
        assert 0 < run["prepare_p50_us"] <= run["prepare_p99_us"]
        # the fence's own time is measured and reported beside the harness's
        assert 0 < run["fence_sum_ms"] < run["elapsed_ms"]
        assert run["fence_share_ms"] == pytest.approx(run["elapsed_ms"] - run["harness_ms"])
    text = capsys.readouterr().out
    assert "$776,223.00" in text and "harness" in text


def test_runs_and_amount_flags(tmp_path: Path) -> None:
    out = tmp_path / "s.json"
    sizes = ["--waves", "2", "--racers", "3", "--runs", "3", "--counters", "pure"]
    rc = main([*sizes, "--amount-cents", "100", "--json", str(out)])
    assert rc == 0
    doc = _load(out)
    assert len(doc["runs"]) == 3 and doc["summary"]["pure"]["runs"] == 3
    assert all(r["double_charge_cents"] == 500 for r in doc["runs"])


@pytest.mark.parametrize(
    "argv", [["--waves", "0"], ["--racers", "0"], ["--runs", "0"], ["--amount-cents", "-1"]]
)
def test_bad_sizes_are_refused(argv: list[str]) -> None:
    assert main(argv) == 2


def test_unknown_store_is_a_usage_error() -> None:
    with pytest.raises(SystemExit) as ei:
        main(["--store", "nowhere"])
    assert ei.value.code == 2


class LeakyFence(EffectFence):
    """A broken fence that admits every attempt: the storm must notice and fail."""

    def prepare(self, request: EffectRequest) -> Fresh:  # type: ignore[override]
        adm = super().prepare(request)
        if adm.fresh:
            return adm  # type: ignore[return-value]
        self.clear_intent(request.intent)
        fresh = super().prepare(request)
        assert isinstance(fresh, Fresh)
        return fresh


def test_a_double_execution_fails_the_storm() -> None:
    report = run_storm(waves=3, racers=4, counters="pure", fence=LeakyFence(FenceConfig()))
    assert report.executions > 1 and not report.ok
    assert report.to_dict()["ok"] is False

"""Fixtures over every store in ``support.STORES`` and an injected clock."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import settings
from support import STORES, FakeClock, FenceFactory

from effectfence import EffectFence, FenceConfig

# Nothing a test runs may touch the user's own state directory, where the servers' default
# store lives: every process the tests start inherits this one, made for the session.
os.environ["XDG_STATE_HOME"] = tempfile.mkdtemp(prefix="effectfence-test-state-")

# CI runs are reproducible (a failure there replays the same examples here); local runs
# explore, and keep what they find in .hypothesis/.
settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


@pytest.fixture(params=sorted(STORES))
def store_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def make_fence(store_kind: str, clock: FakeClock) -> Iterator[FenceFactory]:
    """Build fences on the parametrized store, all sharing the test's clock."""
    made: list[EffectFence] = []

    def factory(**config: Any) -> EffectFence:
        config.setdefault("auto_sweep", False)
        store = STORES[store_kind](clock)
        fence = EffectFence(FenceConfig(**config), store=store)
        made.append(fence)
        return fence

    yield factory
    for f in made:
        f.store.close()


@pytest.fixture
def fence(make_fence: FenceFactory) -> EffectFence:
    return make_fence(lease_ttl=10.0, result_ttl=100.0)

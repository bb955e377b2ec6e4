"""The network lab's fixture: a Lab removed after the test, whatever happened in it."""

from __future__ import annotations

import pytest

from tests.netlab import Lab


@pytest.fixture
def lab():
    with Lab() as built:
        yield built

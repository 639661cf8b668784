"""Put this directory's shared helper modules (header_probe.py) on sys.path (importlib
import mode)."""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

# Every test's machine checks each pick of its ready set against every task's condition.
import pytest  # noqa: E402

from vmm.machine import Machine  # noqa: E402

Machine.verify_ready_set = True


@pytest.fixture(autouse=True)
def _ready_set_is_exact():
    """No machine of the test picked from a ready set that differed from a full scan."""
    Machine.ready_set_violations.clear()
    yield
    found = list(Machine.ready_set_violations)
    Machine.ready_set_violations.clear()
    assert not found, found[:3]

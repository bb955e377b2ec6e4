"""swarm.logs.stop_on_signals: a stop signal sets the program's stop event, and a shutdown that then gets stuck
prints where every thread is, instead of hanging silently."""

from __future__ import annotations

import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.helpers import wait_until

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[2]
CHILD = """
import sys, threading
from swarm.logs import stop_on_signals
stop = threading.Event()
stop_on_signals(stop, stuck_after={stuck_after})
print("ready", flush=True)
stop.wait()
print("stopping", flush=True)
if sys.argv[1] == "stuck":
    threading.Event().wait()  # a shutdown that never ends
"""
START_TIMEOUT = 30.0


def child(how: str, stuck_after: float, out) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", CHILD.format(stuck_after=stuck_after), how], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=out, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def test_a_shutdown_stuck_after_a_stop_signal_prints_every_thread_s_stack():
    with tempfile.TemporaryFile("w+") as err:
        proc = child("stuck", 0.5, err)
        try:
            proc.send_signal(signal.SIGTERM)
            assert proc.stdout.readline().strip() == "stopping"  # the signal set the stop event

            def dumped() -> str:
                err.seek(0)
                text = err.read()
                return text if "most recent call first" in text else ""

            text = wait_until(dumped, START_TIMEOUT, what="faulthandler's dump of the stuck child")
            assert "<string>" in text  # the child's own frame, where it waits
            assert proc.poll() is None  # only a report: the program goes on (a checkpoint may still be writing)
        finally:
            proc.kill()
            proc.wait()


def test_a_prompt_shutdown_prints_nothing():
    with tempfile.TemporaryFile("w+") as err:
        proc = child("prompt", 10.0, err)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(START_TIMEOUT) == 0
        err.seek(0)
        assert "most recent call first" not in err.read()

"""bench/fuzz.py --quick passes: a real stage server refuses ~300 fuzzed RPCs cleanly and comes out unchanged.

Run as a program of its own, so its memory figures are its own and everything it starts (its DHT
process, two p2pd daemons) ends with its process group.
"""

from __future__ import annotations

import re

import pytest

pytestmark = pytest.mark.timeout(90)

FUZZ_TIMEOUT = 75.0  # imports, the server's start and ~300 calls; ~12 s on 2 idle cores
KINDS = ("valid-forward", "garbage-metadata", "bad-field", "truncated", "stop-mid-tensor", "invalid-backward")


def test_quick_fuzz_passes(procs):
    # 1% lost replies allowed: p2pd loses about one reply stream in 10^4 calls under load, not our server
    proc = procs.run("python", "bench/fuzz.py", "--quick", "--max-unavailable", "0.01", timeout=FUZZ_TIMEOUT)
    out = proc.stdout()
    assert proc.returncode == 0, proc.describe()
    assert out.rstrip().endswith("PASSED"), proc.describe()
    assert "parameters, gradients, samples unchanged: yes" in out
    assert "valid forward after the fuzz gives the same output: yes" in out
    total = re.search(r"^total\s+(\d+)\s+(\d+)\s+(\d+)", out, re.MULTILINE)
    assert total is not None and int(total[1]) == 300, proc.describe()
    assert int(total[2]) > 0 and int(total[3]) > 0  # some were served (ok), most refused (bad_request)
    for kind in KINDS:
        assert re.search(rf"^{kind}\s+\d+", out, re.MULTILINE), f"no {kind} requests were sent\n{out}"

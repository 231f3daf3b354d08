"""llama-server with a budget keeps serving under concurrent load and client faults (scripts/server_faults.py, two
rounds): two slots answer their own passkey requests while clients disconnect mid-prefill and mid-stream and bad
requests arrive; no answer holds another request's key, the server answers after every round, RSS stays flat."""
from __future__ import annotations

import sys

from conftest import REPO, run


def test_the_server_keeps_serving_under_load_and_faults(tmp_path):
    proc = run([sys.executable, REPO / "scripts" / "server_faults.py", "--rounds", "2", "--log", tmp_path / "server.log"],
               timeout=1200)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:] + (tmp_path / "server.log").read_text()[-3000:]
    assert "0 with another's" in out and "2 rounds" in out, out[-2000:]

"""TRL's full-weight sync on vLLM's CPU backend: the limitation the LoRA sync works around, pinned.

If a later vLLM CPU build accepts TRL's in-place weight reload, this test fails: update `docs/vllm.md` (and the
benchmark) then.
"""

import json
import os
import subprocess
import sys

import pytest
from vllm_helpers import clean_env

pytestmark = pytest.mark.vllm

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "trl_full_sync_script.py")


def test_trl_full_sync_fails_in_colocate_mode_on_cpu(tmp_path):
    run = subprocess.run(
        [sys.executable, SCRIPT, str(tmp_path / "policy"), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=900,
        env=clean_env(),
    )
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, run.stdout[-3000:] + run.stderr[-3000:]
    outcome = json.loads(lines[-1].removeprefix("RESULT "))
    assert outcome["lora_sync"] is False
    assert outcome["error"] == {
        "type": "AttributeError",
        "message": "'Parameter' object has no attribute 'weight_loader'",
    }

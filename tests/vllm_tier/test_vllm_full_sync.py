"""TRL's full-weight sync (`vllm_lora_sync=False`) in colocate mode on vLLM's CPU backend.

An earlier run on this machine raised `AttributeError: 'Parameter' object has no attribute 'weight_loader'` in vLLM's
`load_weights` at the first sync; with the engine started without `enable_lora` (what `vllm_lora_sync=False` does
now) the full sync completes. This pins that it completes *and* that vLLM then samples from the merged, trained
weights: its log-probs match the policy's, not the base model's.
"""

import json
import os
import subprocess
import sys

import pytest
from vllm_helpers import clean_env

pytestmark = pytest.mark.vllm

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "trl_full_sync_script.py")


def test_trl_full_sync_in_colocate_mode_serves_the_trained_weights(tmp_path):
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
    assert outcome["error"] is None, outcome
    assert outcome["global_step"] == 3 and outcome["steps"] == [0, 1, 2]
    assert outcome["base_gap"] > 4 * outcome["policy_gap"], outcome

"""TRL's full-weight sync (`vllm_lora_sync=False`) in colocate mode on vLLM's CPU backend.

Whether it can work is decided inside vLLM: after loading, the CPU backend's GEMM dispatch
(`dispatch_cpu_unquantized_gemm(layer, remove_weight=True)`, vllm/model_executor/layers/utils.py) packs each linear
weight for oneDNN (or sgl-kernel / zentorch) and replaces `layer.weight` by an empty Parameter without a
`weight_loader`; a later `load_weights` (TRL's sync) then raises `AttributeError: 'Parameter' object has no attribute
'weight_loader'`. When the packing falls back to `torch.nn.functional.linear` the weights stay and the sync works.
The fallback is taken when oneDNN's handler cannot be created. An earlier session saw the full sync complete on this
machine and a fresh clone on 2026-11-24 saw the error; which path the earlier run took was not recorded. The script reads
the engine's linear weights before training, and the test pins the outcome each state implies: the exact error, or a
completed sync whose engine samples from the trained weights (its log-probs match the policy's, not the base
model's). trl-agentic leaves TRL's sync untouched here (docs/vllm.md, "Limitations"); the LoRA sync is unaffected.
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
    assert outcome["linear_weights"] > 0, outcome  # the probe saw the engine's layers
    if outcome["engine_dropped_linear_weights"]:
        assert outcome["error"] == {
            "type": "AttributeError",
            "message": "'Parameter' object has no attribute 'weight_loader'",
        }, outcome
        return
    assert outcome["error"] is None, outcome
    assert outcome["global_step"] == 3 and outcome["steps"] == [0, 1, 2]
    assert outcome["base_gap"] > 4 * outcome["policy_gap"], outcome

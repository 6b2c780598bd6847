"""RLVCR live on the embedded model (issue 18): `configs/rlvcr_textworld.yaml` through `trl-agentic train`, shortened.

After a warm start on solved text-world episodes in the RLVCR step format, SmolLM2-135M-Instruct writes well-formed
steps in its GRPO rollouts and the RLVCR estimator expands them (`rlvcr/expanded_steps` > 0). The test asserts that
the feature fires, not that it helps.
"""

from pathlib import Path

import pytest
from live_helpers import precision_overrides

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "rlvcr_textworld.yaml"


@pytest.mark.slow
@pytest.mark.timeout(3600)  # a warm start and a GRPO step on SmolLM2; generous for a loaded 2-core machine
def test_rlvcr_fires_on_the_text_world_after_the_warm_start(tmp_path):
    from trl_agentic.cli import make_parser, train

    overrides = ["--output_dir", str(tmp_path), *precision_overrides(), "--max_steps", "1"]
    trainer = train(*make_parser().parse_args_and_config(args=["--config", str(CONFIG), *overrides]))

    [step] = [h for h in trainer.state.log_history if "rlvcr/expanded_steps" in h]
    print({k: v for k, v in step.items() if k.startswith(("rlvcr/", "tools/", "reward"))})
    assert trainer.args.advantage_estimator == "rlvcr" and trainer.state.global_step == 1
    assert step["rlvcr/expanded_steps"] > 0, step
    # Expanded steps were scored under the four levels: their confidences are probabilities.
    assert 0 < step["rlvcr/confidence_mean"] <= 1
    # The rollouts called the environment's tool (the action of every well-formed step is an `act` call).
    assert step["tools/call_frequency"] > 0
    assert sum(step[f"rlvcr/level_frac_{level}"] for level in (1, 2, 3, 4)) == pytest.approx(1.0)

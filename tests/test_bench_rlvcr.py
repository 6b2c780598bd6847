"""The RLVCR benchmark section at its smallest size: the counted model calls are consistent with what the estimator
does (one batched generation per step with an expanded step, ceil(4 × expanded / score batch) scoring forwards, 3
expansion rows per expanded step) and the plain GRPO run makes no extra call at all."""

import math

import pytest

from trl_agentic.bench.rlvcr import RLVCRBenchSettings, render, run, summarize


@pytest.fixture(scope="module")
def raw():
    return run(settings=RLVCRBenchSettings.quick())


def _by_name(raw):
    return {r["name"]: r for r in raw["results"]}


def test_grpo_makes_no_extra_calls(raw):
    grpo = _by_name(raw)["grpo"]
    assert len(grpo["steps"]) == raw["settings"].steps
    for step in grpo["steps"]:
        assert step["est_calls"] == 1
        assert step["step_gen_calls"] == 1 and step["step_hf_generate"] == 1  # the rollouts
        assert not any(v for k, v in step.items() if k.startswith("est_") and k not in ("est_calls", "est_seconds"))
        assert step["expansion_rows"] == 0
    assert grpo["expanded"] == []


@pytest.mark.parametrize("name", ["rlvcr (copo)", "rlvcr (copo, expand)"])
def test_rlvcr_counts_match_the_estimator(raw, name):
    result = _by_name(raw)[name]
    settings = raw["settings"]
    assert result["well_formed"] > 0.5  # the policy really writes the step format
    assert len(result["expanded"]) == len(result["steps"]) == settings.steps
    assert sum(result["expanded"]) > 0
    for step, expanded, failed in zip(result["steps"], result["expanded"], result["failed_alternatives"]):
        assert step["est_calls"] == 1 and step["step_gen_calls"] == 1
        # One batched generation call when a step expands, none otherwise; 2 or 3 alternative levels per step.
        assert step["est_gen_calls"] == step["est_hf_generate"] == (1 if expanded else 0)
        assert 2 * expanded <= step["est_gen_prompts"] <= 3 * expanded
        assert step["est_gen_tokens"] <= 128 * step["est_gen_prompts"]  # rlvcr_max_thinking_tokens
        # Scoring: 4 levels per expanded step, in chunks of rlvcr_score_batch_size rows, one forward each.
        assert step["est_score_forwards"] == step["est_score_calls"] == math.ceil(4 * expanded / 16)
        assert step["est_score_rows"] == 4 * expanded - failed
        expected_rows = 3 * expanded if "expand" in name else 0
        assert step["expansion_rows"] == expected_rows
        assert step["rows"] == settings.batch_size + expected_rows


def test_rendered_section(raw):
    rows = summarize(raw)
    assert [r["estimator"] for r in rows] == ["grpo", "rlvcr (copo)", "rlvcr (copo, expand)"]
    assert rows[0]["extra_gen_calls"] == 0 and rows[0]["ratio"] == 1.0
    assert all(r["extra_gen_calls"] > 0 and r["expanded_steps"] > 0 for r in rows[1:])
    text = render(raw, quick=True)
    assert text.startswith("## RLVCR extra model calls per step")
    assert "python -m trl_agentic.bench --only rlvcr --quick" in text
    assert "build_tiny_step_model" in text
    # TRL's `step_time` times `training_step` (generation, estimator, loss, backward) and not the optimizer step.
    step_time = text[text.index("Step time: TRL's `step_time`") :].split(", median over")[0]
    assert "optimizer step is not" in step_time and "optimizer)" not in step_time
    table = [line for line in text.splitlines() if line.startswith("| ")]
    assert len(table) == 18 and all(line.count("|") == 5 for line in table)

"""A short end-to-end run of the quickstart pipeline (`make demo` in miniature) on the embedded SmolLM2 model.

Same config file and code path as the demo (warm start → held-out eval → GRPO with rollback and negatives →
held-out eval → adapter, eval_results.json, curves.png, report.html, trajectories.jsonl), with a few steps and a
few problems so it runs in minutes. The learning itself is measured by the full demo (see docs/quickstart.md).
"""

import json
from html.parser import HTMLParser
from pathlib import Path

import pytest

from trl_agentic.cli import main

pytestmark = pytest.mark.slow

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"


class _Articles(HTMLParser):
    def __init__(self):
        super().__init__()
        self.kinds = []

    def handle_starttag(self, tag, attrs):
        if tag == "article":
            self.kinds.append(dict(attrs)["data-kind"])


@pytest.mark.timeout(3600)  # the whole quickstart pipeline on SmolLM2; generous for a loaded machine
def test_quickstart_pipeline_end_to_end(tmp_path, capsys):
    out = tmp_path / "quickstart"
    overrides = {
        "output_dir": out,
        "warmstart_steps": 2,
        "warmstart_batch_size": 2,
        "num_train_tasks": 8,
        "num_eval_tasks": 4,
        "heldout_eval_batch_size": 4,
        "max_steps": 2,
        "gradient_accumulation_steps": 1,  # 4 rollouts per step (the config accumulates 4 micro-batches)
        "per_device_train_batch_size": 4,
        "num_generations": 2,
        "max_completion_length": 48,
    }
    argv = ["train", "--config", str(CONFIG)] + [f"--{k}={v}" for k, v in overrides.items()]
    assert main(argv) == 0
    printed = capsys.readouterr().out

    # Both stages and the evaluations are announced; one compact line per GRPO step.
    assert "Stage 1/2: warm start" in printed and "Stage 2/2: GRPO" in printed
    assert "[before GRPO] success" in printed and "[after GRPO] success" in printed
    assert printed.count("| reward ") == 2

    # The LoRA adapter (warm start + GRPO, one adapter on the base model).
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 16
    assert (out / "adapter_model.safetensors").stat().st_size > 100_000

    results = json.loads((out / "eval_results.json").read_text())
    assert set(results["eval"]) == {"before GRPO", "after GRPO"}
    for metrics in results["eval"].values():
        assert metrics["num_problems"] == 4
        for key in ("success_rate", "tool_call_success_rate", "tool_success_rate", "tool_failure_rate"):
            assert 0.0 <= metrics[key] <= 1.0
    assert set(results["timings"]) >= {"model", "warmstart", "eval_before", "grpo", "eval_after"}
    assert results["grpo_steps"] == 2 and results["warmstart"]["steps"] == 2
    # `make demo-record` writes the README's table from this file (tests/test_readme_demo.py).
    from trl_agentic.reporting.demo_record import demo_block

    source = {"commit": "x", "date": "d", "machine": "m", "wall": "w"}
    assert "| success rate |" in demo_block({"source": source, "run": results})

    assert (out / "curves.png").read_bytes()[:4] == b"\x89PNG"

    rows = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    assert sum(r["kind"] == "regular" for r in rows) == 2 * 4  # every rollout of both steps
    assert {r["step"] for r in rows} == {1, 2}

    parser = _Articles()
    parser.feed((out / "report.html").read_text())
    assert len(parser.kinds) == len(rows)
    assert "Held-out evaluation" in (out / "report.html").read_text()

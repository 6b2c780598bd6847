"""`trl-agentic eval`: BFCL multi-turn accuracy per category, on the tiny model and on a LoRA adapter of it."""

import json

import pytest

from trl_agentic.cli import main
from trl_agentic.envs.bfcl.dataset import select_tasks, split_scenarios
from trl_agentic.envs.bfcl.evaluate import BFCLEvalArguments, eval_rows, load_policy


def test_eval_arguments_fail_before_any_model_loads():
    with pytest.raises(ValueError, match="categories"):
        BFCLEvalArguments(categories=["simple"])
    with pytest.raises(ValueError, match="split"):
        BFCLEvalArguments(split="test")
    with pytest.raises(ValueError, match="classes"):
        BFCLEvalArguments(classes=["Bank"])
    with pytest.raises(ValueError, match="No BFCL task"):
        eval_rows(BFCLEvalArguments(categories=["base"], classes=["MathAPI"]))  # MathAPI never comes alone


def test_eval_rows_follow_the_split_and_limit():
    rows = eval_rows(BFCLEvalArguments(categories=["base", "miss_func"], classes=["TradingBot"], limit=3, seed=1))
    _, heldout = split_scenarios(0.25, 0)
    pool = {t.id for t in select_tasks(["base", "miss_func"], classes=["TradingBot"], scenarios=heldout)}
    assert len(rows) == 6 and {r["bfcl_id"] for r in rows} <= pool
    assert sum(r["bfcl_id"].startswith("multi_turn_base_") for r in rows) == 3


def test_eval_command_on_the_tiny_model_and_an_adapter(tiny_model_dir, tmp_path, capsys):
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    adapter = tmp_path / "adapter"
    peft_model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir), LoraConfig(r=2, target_modules=["q_proj"])
    )
    peft_model.save_pretrained(adapter)
    model, _ = load_policy(str(adapter))  # an adapter folder alone: loaded on its base model
    assert isinstance(model, PeftModel)

    out = tmp_path / "eval.json"
    argv = ["eval", "--model_name_or_path", tiny_model_dir, "--adapter_path", str(adapter)]
    argv += ["--categories", "base", "miss_param", "--classes", "TradingBot", "--limit", "2"]
    argv += ["--max_turn_tokens", "8", "--batch_size", "4", "--output", str(out), "--progress", "false"]
    assert main(argv) == 0
    results = json.loads(out.read_text())
    expected = {
        r["bfcl_id"]
        for r in eval_rows(BFCLEvalArguments(categories=["base", "miss_param"], classes=["TradingBot"], limit=2))
    }
    assert {t["id"] for t in results["tasks"]} == expected
    for category in ("base", "miss_param"):
        tasks = [t for t in results["tasks"] if t["category"] == category]
        summary = results["categories"][category]
        assert summary["num_tasks"] == 2
        assert summary["accuracy"] == sum(t["valid"] for t in tasks) / 2
        assert summary["turn_credit"] == pytest.approx(sum(t["turn_credit"] for t in tasks) / 2)
    for task in results["tasks"]:
        assert task["valid"] == (task["turn_credit"] == 1.0)
    assert "category" in capsys.readouterr().out


def test_batches_never_mix_environments():
    from trl_agentic.evaluation import _chunks

    rows = [{"environment": e, "k": k} for k, e in enumerate("aaabbbbbc")]
    batches = [[r["k"] for r in chunk] for chunk in _chunks(rows, 2, "environment")]
    assert batches == [[0, 1], [2], [3, 4], [5, 6], [7], [8]]
    assert [[r["k"] for r in c] for c in _chunks(rows, 4, None)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8]]

"""The `bfcl` task with TRL's GRPOTrainer (multi-environment mode) and the example's one-step run."""

import pytest

from trl_agentic.envs.bfcl import get_task
from trl_agentic.envs.bfcl.dataset import split_scenarios
from trl_agentic.envs.protocol import tool_methods
from trl_agentic.tasks import TaskArguments, build_task


def test_bfcl_task_splits_scenarios_and_builds_one_factory_per_group():
    args = TaskArguments(
        task="bfcl",
        bfcl_categories=["base", "miss_func"],
        bfcl_classes=["TradingBot", "MessageAPI"],
        num_train_tasks=0,
        num_eval_tasks=0,
        bfcl_turn_credit=True,
    )
    task = build_task(args)
    train_ids, heldout_ids = split_scenarios(0.25, 0)
    train = [get_task(r["bfcl_id"]) for r in task.train_dataset]
    held = [get_task(r["bfcl_id"]) for r in task.eval_dataset]
    assert {t.index for t in train} <= set(train_ids) and {t.index for t in held} <= set(heldout_ids)
    assert {t.category for t in train} == {"base", "miss_func"}
    assert all(set(t.involved_classes) <= {"TradingBot", "MessageAPI"} for t in train + held)
    assert [f.__name__ for f in task.reward_funcs] == ["bfcl_reward", "bfcl_turn_credit"]
    for row in [*task.train_dataset, *task.eval_dataset]:
        env = task.environment_factory[row["environment"]]()
        env.reset(**{k: v for k, v in row.items() if k != "environment"})
    capped = build_task(TaskArguments(task="bfcl", num_train_tasks=5, num_eval_tasks=3))
    assert (len(capped.train_dataset), len(capped.eval_dataset)) == (5, 3)


@pytest.mark.parametrize(
    "override,match",
    [
        ({"bfcl_categories": ["simple"]}, "bfcl_categories"),
        ({"bfcl_classes": ["Bank"]}, "bfcl_classes"),
        ({"bfcl_heldout_fraction": 1.5}, "bfcl_heldout_fraction"),
    ],
)
def test_bfcl_task_arguments_are_validated(override, match):
    with pytest.raises(ValueError, match=match):
        TaskArguments(task="bfcl", **override)


def test_trl_renders_each_groups_tools(tiny_model_dir, tmp_path):
    """TRL's GRPOTrainer probes one instance per environment name: its tools are the group's visible functions."""
    from trl_agentic import AgenticGRPOConfig, AgenticGRPOTrainer

    task = build_task(
        TaskArguments(task="bfcl", bfcl_categories=["miss_func"], bfcl_classes=["TradingBot"], num_train_tasks=4)
    )
    args = AgenticGRPOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        max_steps=1,
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=16,
        report_to="none",
    )
    trainer = AgenticGRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=task.reward_funcs,
        args=args,
        train_dataset=task.train_dataset,
        environment_factory=task.environment_factory,
    )
    assert set(trainer._env_tools) == set(task.environment_factory)
    for name, factory in task.environment_factory.items():
        assert [t.__name__ for t in trainer._env_tools[name]] == list(tool_methods(factory()))
    # The held-out function of a miss_func task is not among the tools TRL renders.
    row = task.train_dataset[0]
    held_out = {f for names in get_task(row["bfcl_id"]).missed_functions.values() for f in names}
    assert held_out and not held_out & {t.__name__ for t in trainer._env_tools[row["environment"]]}


@pytest.mark.slow
def test_example_trains_one_step_on_the_tiny_model(tiny_model_dir, tmp_path, capsys):
    import importlib.util
    import json
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("example_bfcl", repo / "examples" / "bfcl.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "out"
    argv = ["--config", str(repo / "configs" / "bfcl.yaml"), f"--model_name_or_path={tiny_model_dir}"]
    argv += [f"--output_dir={out}", "--max_steps=1", "--num_train_tasks=2", "--num_eval_tasks=2"]
    argv += ["--per_device_train_batch_size=2", "--gradient_accumulation_steps=1", "--num_generations=2"]
    argv += ["--max_completion_length=48", "--lora_r=4", "--lora_alpha=8", "--disable_tqdm=true"]
    argv += ["--warmstart_steps=1", "--warmstart_batch_size=2"]  # SFT on 2 ground-truth conversations first
    trainer = module.main(argv)
    assert trainer.state.global_step == 1
    [step] = [h for h in trainer.state.log_history if "reward" in h]
    assert "rewards/bfcl_reward/mean" in step and "rewards/bfcl_turn_credit/mean" in step
    results = json.loads((out / "bfcl_eval.json").read_text())
    assert results["before"]["overall"]["num_tasks"] == 2 and results["after"]["overall"]["num_tasks"] == 2
    printed = capsys.readouterr().out
    assert "Held-out BFCL accuracy before GRPO" in printed and "Warm start: 2 traces" in printed

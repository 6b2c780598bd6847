"""`trl-agentic train --task ...`: every built-in task's prompts ask for the tool calls its environment acts on.

Regression: `--task textworld` rows asked for RLVCR `<action>` blocks while `TextWorldToolEnv` acts only on `act`
tool calls, so every rollout scored 0 whatever the model wrote.
"""

from __future__ import annotations

import inspect
import re

import pytest

from trl_agentic.tasks import TaskArguments, build_task


def tool_names(env) -> set[str]:
    """The methods TRL's GRPOTrainer exposes as tools (same rule as its environment probe)."""
    return {
        name
        for name, _ in inspect.getmembers(type(env), predicate=inspect.isfunction)
        if name not in ("reset", "get_reward") and not name.startswith("_")
    }


def _system(row) -> str:
    return row["prompt"][0]["content"]


@pytest.mark.parametrize("name", ["calculator", "python", "textworld"])
def test_prompts_name_the_environment_tools(name):
    task = build_task(TaskArguments(task=name, num_train_tasks=3, num_eval_tasks=2))
    env = task.environment_factory()
    try:
        tools = tool_names(env)
        for dataset in (task.train_dataset, task.eval_dataset):
            for row in dataset:
                system = _system(row)
                named = set(re.findall(r"`(\w+)` tool", system))
                assert named and named <= tools, (system, tools)
                assert "<action>" not in system  # the RLVCR text format is not what these environments read
    finally:
        close = getattr(env, "close", None) or getattr(env, "_close", None)
        if close is not None:
            close()


def test_textworld_task_rewards_solving_through_the_act_tool():
    task = build_task(TaskArguments(task="textworld", num_train_tasks=2, num_eval_tasks=1))
    row = task.train_dataset[0]
    env = task.environment_factory()
    assert env.reset(**row).startswith("You are in the ")
    assert env.get_reward() == 0.0
    for action in env.world._oracle_actions():
        env.act(action)
    assert env.done and env.get_reward() == 1.0
    # Held-out problems come from a different seed.
    assert {r["task_seed"] for r in task.train_dataset}.isdisjoint(r["task_seed"] for r in task.eval_dataset)

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


BAD_TASK_ARGUMENTS = [
    # A non-finite learning rate trains a NaN adapter ("loss 5.611 -> 0.000") or fails deep in torch.
    ("warmstart_learning_rate", float("inf")),
    ("warmstart_learning_rate", float("nan")),
    ("heldout_eval_temperature", float("nan")),
    ("heldout_eval_temperature", float("inf")),
    # A generated task with no training problem trains nothing (bfcl: 0 takes every task, tested below).
    ("num_train_tasks", 0),
    # YAML numbers of the wrong type (`TrlParser` converts only strings): a float in an int field failed later with
    # a TypeError naming no field, or silently changed the run (`heldout_eval_batch_size: 2.5`: one batch).
    ("warmstart_steps", 1.5),
    ("warmstart_batch_size", 2.5),
    ("num_train_tasks", 2.5),
    ("num_eval_tasks", 3.5),
    ("heldout_eval_batch_size", 2.5),
    ("task_seed", 0.5),
    ("report_max_trajectories", 10.0),
    ("textworld_max_plan_steps", True),
    ("extra_reward_funcs", [3]),
    ("extra_reward_funcs", ["no_colon"]),
]


@pytest.mark.parametrize("name,value", BAD_TASK_ARGUMENTS, ids=[f"{n}={v!r}" for n, v in BAD_TASK_ARGUMENTS])
def test_bad_task_arguments_name_the_field(name, value):
    with pytest.raises(ValueError, match=f"`{name}`"):
        TaskArguments(**{name: value})


def test_zero_training_tasks_is_every_bfcl_task():
    assert TaskArguments(task="bfcl", num_train_tasks=0).num_train_tasks == 0


def test_one_extra_reward_function_from_yaml_is_a_list_of_one(tmp_path):
    """`extra_reward_funcs: "pkg:f"` in YAML arrives as a string (argparse converts only command-line values), which
    `build_task` iterated character by character."""
    import math

    import yaml

    from trl_agentic.cli import make_parser

    config = tmp_path / "c.yaml"
    config.write_text(
        yaml.safe_dump({"output_dir": str(tmp_path), "use_cpu": True, "extra_reward_funcs": "math:fabs"})
    )
    task_args, *_ = make_parser().parse_args_and_config(args=["--config", str(config)])
    assert task_args.extra_reward_funcs == ["math:fabs"]
    assert build_task(task_args).reward_funcs[1:] == [math.fabs]


@pytest.mark.parametrize("name", ["calculator", "python", "textworld", "logsearch", "bfcl"])
def test_own_trace_tasks_are_the_tasks_with_their_own_traces(name):
    """`OWN_TRACE_TASKS` (where `warmstart_error_fraction` warns that it does nothing) and the warm start's stage title
    both follow whether the task brings its own traces."""
    from trl_agentic.cli import _warm_start_title
    from trl_agentic.tasks import OWN_TRACE_TASKS, TASKS

    assert set(OWN_TRACE_TASKS) <= set(TASKS)
    args = TaskArguments(task=name, num_train_tasks=4, num_eval_tasks=1, warmstart_steps=2, warmstart_batch_size=3)
    task = build_task(args)
    assert (task.make_traces is not None) == (name in OWN_TRACE_TASKS)
    title = _warm_start_title(task, args, ", then")
    assert title.startswith("Stage 1/2: warm start — SFT on 6 ") and title.endswith(
        "(2 steps"
        + ("" if name in OWN_TRACE_TASKS else f", {args.warmstart_error_fraction:.0%} with a rejected call first")
        + "), then"
    )
    assert ("synthetic tool-use" in title) == (name not in OWN_TRACE_TASKS)


@pytest.mark.parametrize("difficulty", ["easy", "medium", "hard"])
def test_arithmetic_held_out_problems_are_distinct_and_never_trained_on(difficulty):
    """Regression: the held-out set was an independent draw, so with `task_difficulty: easy` 10 of the 640 held-out
    problems of task seeds 0-19 repeated a training expression. Now held-out expressions are distinct, training and
    warm-start rows have none of them, and each set is its own seed's draw with those rows skipped (a plain loop
    over the generator)."""
    from trl_agentic.envs.calculator import make_arithmetic_tasks

    def plain(n, seed, excluded, distinct):
        rows, seen = [], set(excluded)
        for row in make_arithmetic_tasks(2 * n + 64, seed, difficulty):
            if len(rows) < n and row["expression"] not in seen:
                rows.append(row)
                seen |= {row["expression"]} if distinct else set()
        assert len(rows) == n
        return rows

    for task_seed in range(20):
        args = TaskArguments(
            task="calculator",
            task_difficulty=difficulty,
            task_seed=task_seed,
            warmstart_steps=4,
            warmstart_batch_size=4,
        )
        task = build_task(args)
        heldout = plain(32, task_seed + 1, (), True)
        assert list(task.eval_dataset) == heldout
        expressions = {r["expression"] for r in heldout}
        assert len(expressions) == 32
        assert list(task.train_dataset) == plain(256, task_seed, expressions, False)
        assert list(task.warmstart_dataset) == plain(16, task_seed + 2, expressions, False)


def test_arithmetic_sets_without_repeats_are_the_generator_draws():
    """The registered ablation's sets (hard, task seeds 0 and 10, up to 256 warm-start steps of 4) had no repeat:
    they are the generator's draws, unchanged."""
    from trl_agentic.envs.calculator import make_arithmetic_tasks

    for task_seed in (0, 10):
        args = TaskArguments(
            task="calculator",
            task_difficulty="hard",
            task_seed=task_seed,
            num_train_tasks=512,
            num_eval_tasks=128,
            warmstart_steps=256,
            warmstart_batch_size=4,
        )
        task = build_task(args)
        assert list(task.eval_dataset) == make_arithmetic_tasks(128, task_seed + 1, "hard")
        assert list(task.train_dataset) == make_arithmetic_tasks(512, task_seed, "hard")
        assert list(task.warmstart_dataset) == make_arithmetic_tasks(1024, task_seed + 2, "hard")


def test_too_few_distinct_held_out_problems_is_an_error_naming_the_fields(monkeypatch):
    import trl_agentic.envs.calculator as calculator

    sizes = []

    def three_problems(n, seed, difficulty):
        sizes.append(n)
        return [{"prompt": [{"role": "user", "content": str(i % 3)}], "expression": str(i % 3)} for i in range(n)]

    monkeypatch.setattr(calculator, "make_arithmetic_tasks", three_problems)
    with pytest.raises(ValueError, match=r"found only 3 of the 4 needed .*`num_eval_tasks`"):
        build_task(TaskArguments(task="calculator", num_eval_tasks=4))
    sizes.clear()
    with pytest.raises(ValueError, match=r"found only 3 of the 100 needed"):
        build_task(TaskArguments(task="calculator", num_eval_tasks=100))
    # It stops once a doubling past 4n + 1024 draws finds nothing new, not at 64n + 1024 (minutes for a real request).
    assert max(sizes) == 1600
    task = build_task(TaskArguments(task="calculator", num_eval_tasks=2, num_train_tasks=5))
    assert task.eval_dataset["expression"] == ["0", "1"] and task.train_dataset["expression"] == ["2"] * 5

"""The household text world: scripted episodes, invalid actions, determinism, checkpoints and the tool schema."""

import inspect

import pytest
from transformers.utils import get_json_schema

from trl_agentic.envs.textworld import (
    CONTAINERS,
    EXITS,
    TextWorldEnv,
    TextWorldToolEnv,
    make_textworld_tasks,
)
from trl_agentic.rlvcr.parsing import LEVEL_SYSTEM_PROMPT, ParsedStep, parse_step, render_step

# Task 0 (checked by the first assertions of the scripted test): the agent starts in the bedroom, the coin lies in the
# open box of the living room, the goal is the bedroom's drawer (closed at the start, holding an apple).
SEED0_SCRIPT = [
    "go hallway",
    "go living room",
    "take coin",
    "go hallway",
    "go bedroom",
    "open drawer",
    "put coin in drawer",
]


def tool_names(env_class) -> list[str]:
    """The methods TRL's GRPOTrainer would expose as tools (same rule as its environment probe)."""
    return [
        name
        for name, _ in inspect.getmembers(env_class, predicate=inspect.isfunction)
        if name not in ("reset", "get_reward") and not name.startswith("_")
    ]


def test_scripted_episode_reaches_reward_one():
    env = TextWorldEnv()
    first = env.reset(task_seed=0)
    assert env.goal == "put the coin in the drawer"
    assert first.startswith("You are in the bedroom.\nContainers: drawer (closed).")
    assert "Available actions: look, inventory, go hallway, open drawer." in first
    assert env.contents["box"] == ["coin"] and env.contents["drawer"] == ["apple"]
    observations = []
    for action in SEED0_SCRIPT:
        assert not env.done
        assert env.get_reward() == 0.0
        observations.append(env.step(action))
    assert observations[2].startswith("You take the coin.")
    assert observations[5].startswith("You open the drawer. It contains: apple.")
    assert observations[-1] == "You put the coin in the drawer.\nTask complete!"
    assert env.done and env.success
    assert env.get_reward() == 1.0
    assert env.steps == 7 and env.invalid_actions == 0
    # After the end, actions change nothing and are not counted.
    assert env.step("look") == "The episode is over."
    assert env.steps == 7


def test_step_cost_reward():
    env = TextWorldEnv()
    env.reset(task_seed=0, step_cost=0.05)
    for action in SEED0_SCRIPT:
        env.step(action)
    assert env.get_reward() == pytest.approx(1.0 - 0.05 * 7)  # 0.65
    env.reset(task_seed=0, step_cost=0.5)
    for action in SEED0_SCRIPT:
        env.step(action)
    assert env.get_reward() == 0.0  # 1 - 3.5 is floored at 0


@pytest.mark.parametrize("task_seed", range(40))
def test_oracle_solves_every_task(task_seed):
    env = TextWorldEnv()
    env.reset(task_seed=task_seed)
    # The generator never starts in a solved state and the object is never in the goal container.
    assert env.goal_object not in env.contents[env.goal_container]
    plan = env._oracle_actions()
    assert 2 <= len(plan) <= 10
    for action in plan:
        assert action in env.admissible_actions  # the oracle only uses listed actions
        env.step(action)
    assert env.done and env.get_reward() == 1.0 and env.invalid_actions == 0


def test_invalid_actions_change_nothing():
    env = TextWorldEnv()
    env.reset(task_seed=0, max_steps=50)  # bedroom; the drawer is closed
    state = env._checkpoint()
    cases = {
        "": "the action is empty",
        "fly away": "unknown action 'fly away'",
        "go garden": "there is no room called 'garden'",
        "go kitchen": "the kitchen is not adjacent to the bedroom",
        "go bedroom": "you are already in the bedroom",
        "open fridge": "there is no fridge in the bedroom",
        "open sofa": "there is no container called 'sofa'",
        "close drawer": "the drawer is already closed",
        "take coin": "you see no coin here",
        "take unicorn": "there is no object called 'unicorn'",
        "put coin in drawer": "you are not carrying 'coin'",
        "put coin": "use 'put <object> in <container>'",
        "look around " * 20: "unknown action 'look around look around",
    }
    for number, (action, message) in enumerate(cases.items(), start=1):
        observation = env.step(action)
        assert observation.startswith("Nothing happens: "), (action, observation)
        assert message in observation, (action, observation)
        assert len(observation.split("\n")[0]) < 300  # huge actions are not echoed in full
        assert env.invalid_actions == number and env.steps == number
        changed = {k for k, v in env._checkpoint().items() if state[k] != v}
        assert changed == {"steps", "invalid_actions"}, action
    assert env.step(12345).startswith("Nothing happens: unknown action '12345'")  # not even a string


def test_closed_container_hides_and_blocks():
    env = TextWorldEnv()
    env.reset(task_seed=0, max_steps=50)
    # The closed drawer holds an apple that can be neither seen nor taken.
    assert "apple" not in env.step("look")
    assert env.step("take apple").startswith("Nothing happens: you see no apple here.")
    assert env.step("take apple from drawer").startswith("Nothing happens: the drawer is closed.")
    env.step("go hallway")
    env.step("go living room")
    env.step("take coin")
    env.step("go hallway")
    env.step("go bedroom")
    assert env.step("put coin in drawer").startswith("Nothing happens: the drawer is closed.")
    assert env.step("open drawer").startswith("You open the drawer.")
    assert env.step("close drawer").startswith("You close the drawer.")
    assert env.step("open drawer").startswith("You open the drawer.")
    # The non-openable containers cannot be closed.
    env2 = TextWorldEnv()
    env2.reset(task_seed=2)  # starts in the bathroom, which has the open basket
    assert env2.location == "bathroom"
    assert env2.step("close basket").startswith("Nothing happens: the basket cannot be opened or closed.")


def test_action_normalisation():
    env = TextWorldEnv()
    env.reset(task_seed=0)
    assert env.step("Go to the Hallway.").startswith("You are in the hallway.")
    assert env.step("  GO   living   ROOM ").startswith("You are in the living room.")
    assert env.step("take the coin").startswith("You take the coin.")
    assert (
        env.step("inventory")
        == "You are carrying: coin.\nAvailable actions: " + ", ".join(env.admissible_actions) + "."
    )


def test_runs_out_of_steps():
    env = TextWorldEnv()
    env.reset(task_seed=0, max_steps=3)
    env.step("look")
    env.step("look")
    last = env.step("look")
    assert last.endswith("The episode is over: you are out of steps.")
    assert env.done and not env.success and env.get_reward() == 0.0
    with pytest.raises(ValueError):
        env.reset(max_steps=0)


def test_show_actions_off():
    env = TextWorldEnv()
    first = env.reset(task_seed=0, show_actions=False)
    assert "Available actions" not in first
    assert "Available actions" not in env.step("look")


def test_determinism():
    actions = ["look", "go hallway", "open fridge", "go kitchen", "open fridge", "take apple", "go living room"]
    runs = []
    for _ in range(2):
        env = TextWorldEnv()
        runs.append([env.reset(task_seed=123)] + [env.step(a) for a in actions])
    assert runs[0] == runs[1]
    layouts = set()
    for task_seed in range(20):
        env = TextWorldEnv()
        env.reset(task_seed=task_seed)
        layouts.add((env.goal, env.location, str(env.floor), str(env.contents)))
    assert len(layouts) > 10  # the seed matters
    assert make_textworld_tasks(5, seed=7) == make_textworld_tasks(5, seed=7)
    assert make_textworld_tasks(5, seed=7) != make_textworld_tasks(5, seed=8)


def test_checkpoint_restore_round_trip():
    env = TextWorldEnv()
    env.reset(task_seed=0)
    env.step("go hallway")
    env.step("go living room")
    checkpoint = env._checkpoint()
    look = env.step("look")
    future = [env.step(a) for a in SEED0_SCRIPT[2:]]
    assert env.done and env.get_reward() == 1.0
    # Back to the checkpoint: same state, same future; the checkpoint itself is not aliased by the env.
    for _ in range(2):
        env._restore(checkpoint)
        assert env._checkpoint() == checkpoint
        assert not env.done and env.steps == 2 and env.location == "living room"
        assert env.step("look") == look
        assert [env.step(a) for a in SEED0_SCRIPT[2:]] == future
    assert checkpoint["contents"]["box"] == ["coin"] and checkpoint["inventory"] == []
    # Restoring into a fresh environment works too.
    other = TextWorldEnv()
    other._restore(checkpoint)
    assert other.step("look") == look


def test_tool_schema_and_tool_env():
    env = TextWorldEnv()
    schema = get_json_schema(env.act)
    function = schema["function"]
    assert function["name"] == "act"
    assert function["description"] == "Perform one action in the house and return what you observe."
    assert function["parameters"]["required"] == ["action"]
    assert function["parameters"]["properties"]["action"]["type"] == "string"
    assert "put <object> in <container>" in function["parameters"]["properties"]["action"]["description"]
    assert get_json_schema(TextWorldToolEnv().act) == schema
    # Under TRL's environment probe the tool env exposes exactly one tool; the text env would expose two.
    assert tool_names(TextWorldToolEnv) == ["act"]
    assert tool_names(TextWorldEnv) == ["act", "step"]
    tool_env = TextWorldToolEnv()
    row = make_textworld_tasks(1, seed=3, tool_format=True)[0]
    first = tool_env.reset(**row)  # TRL passes the whole row, prompt included
    assert first.startswith("You are in the ")
    checkpoint = tool_env._checkpoint()
    for action in tool_env.world._oracle_actions():
        tool_env.act(action)
    assert tool_env.done and tool_env.get_reward() == 1.0
    tool_env._restore(checkpoint)
    assert not tool_env.done and tool_env.get_reward() == 0.0


def test_make_textworld_tasks_rows():
    rows = make_textworld_tasks(8, seed=0, max_steps=15)
    assert len(rows) == 8
    assert len({row["task_seed"] for row in rows}) == 8
    env = TextWorldEnv()
    for row in rows:
        system, user = row["prompt"]
        assert system["role"] == "system" and user["role"] == "user"
        assert system["content"].startswith(LEVEL_SYSTEM_PROMPT)
        assert system["content"].endswith(f"Your task is to: {row['goal']}.")
        assert "at most 15 actions" in system["content"]
        assert env.reset(**row).startswith("You are in the ")
        assert env.goal == row["goal"] and env.max_steps == 15
    tool_rows = make_textworld_tasks(2, seed=0, tool_format=True)
    assert "<level>" not in tool_rows[0]["prompt"][0]["content"]
    assert "`act` tool" in tool_rows[0]["prompt"][0]["content"]
    assert [r["task_seed"] for r in tool_rows] == [r["task_seed"] for r in rows[:2]]


def test_level_format_agent_loop():
    """A scripted policy that answers in the level format, parsed like the RLVCR rollout would parse it."""
    row = make_textworld_tasks(1, seed=11)[0]
    env = TextWorldEnv()
    env.reset(**row)
    plan = env._oracle_actions()
    for turn, action in enumerate(plan):
        level = 1 + turn % 4
        text = render_step(level, None if level == 1 else f"I should {action} now.", action)
        parsed = parse_step(text)
        assert isinstance(parsed, ParsedStep) and parsed.level == level
        env.step(parsed.action)
    assert env.get_reward() == 1.0


def test_world_is_connected_and_consistent():
    for room, exits in EXITS.items():
        for other in exits:
            assert room in EXITS[other]  # doors work both ways
    assert {room for room, _ in CONTAINERS.values()} <= set(EXITS)


def test_max_plan_steps_keeps_only_tasks_with_a_plan_that_short():
    """Rollouts of k tool rounds can solve plans of up to k steps: the filter keeps exactly those, and without it the
    draw is the historical one (datasets of recorded runs stay what they were)."""
    from trl_agentic.envs.textworld import TextWorldEnv, make_textworld_tasks

    def plan_length(row):
        env = TextWorldEnv()
        env.reset(task_seed=row["task_seed"], max_steps=row["max_steps"])
        return len(env._oracle_actions())

    short = make_textworld_tasks(16, seed=5, max_plan_steps=3)
    assert len(short) == 16 and len({r["task_seed"] for r in short}) == 16
    assert max(plan_length(r) for r in short) <= 3
    unfiltered = make_textworld_tasks(64, seed=5)
    assert max(plan_length(r) for r in unfiltered) > 3  # the filter has something to remove
    import random

    assert [r["task_seed"] for r in unfiltered] == random.Random(5).sample(range(2**31), 64)


def test_a_text_world_task_without_a_warm_start_or_held_out_tasks_builds_with_a_plan_filter():
    """`textworld_max_plan_steps` with no warm-start traces (the default `warmstart_steps: 0`) and no held-out tasks:
    the empty splits are empty (the filter's search raised "Fewer than 0 text-world tasks ...")."""
    from trl_agentic.envs.textworld import make_textworld_tasks
    from trl_agentic.tasks import TaskArguments, build_task

    assert make_textworld_tasks(0, seed=5, max_plan_steps=3) == []
    task = build_task(TaskArguments(task="textworld", num_train_tasks=4, num_eval_tasks=0, textworld_max_plan_steps=3))
    assert len(task.train_dataset) == 4 and not task.eval_dataset


def _key_from_seed(task_seed: int) -> tuple:
    """The world of a task seed, read from the world's own state (not through `world_key`)."""
    env = TextWorldEnv()
    env.reset(task_seed=task_seed)
    place = [("in", c) for c, objs in env.contents.items() if env.goal_object in objs]
    place += [("floor", r) for r, objs in env.floor.items() if env.goal_object in objs]
    assert len(place) == 1
    return env.goal_object, env.goal_container, place[0], env.location


def test_a_world_key_fixes_the_plan_and_there_are_1575_worlds():
    """Two task seeds of one world differ only in their distractors: they have the same shortest plan. Seven objects,
    five goal containers, nine other starting places and five start rooms make 1575 worlds."""
    from trl_agentic.envs.textworld import OBJECTS, ROOMS, _world_plans, world_key

    plans: dict[tuple, list[str]] = {}
    env = TextWorldEnv()
    for task_seed in range(3000):
        env.reset(task_seed=task_seed)
        key = _key_from_seed(task_seed)
        assert world_key(env) == f"{key[0]}>{key[1]}|{key[2][0]}:{key[2][1]}|{key[3]}"
        assert plans.setdefault(key, env._oracle_actions()) == env._oracle_actions()
        assert _world_plans()[world_key(env)] == len(env._oracle_actions())
    assert len(_world_plans()) == len(OBJECTS) * len(CONTAINERS) * (len(ROOMS) + len(CONTAINERS) - 1) * len(ROOMS)


@pytest.mark.parametrize("fraction", [0.0, 0.1, 0.25, 0.5, 1.0])
def test_split_worlds_cuts_every_plan_length_at_the_fraction(fraction):
    from trl_agentic.envs.textworld import _world_plans, split_worlds

    train, heldout = split_worlds(fraction)
    assert not train & heldout and train | heldout == set(_world_plans())
    for length in set(_world_plans().values()):
        keys = {k for k, v in _world_plans().items() if v == length}
        assert len(keys & heldout) == round(fraction * len(keys))
        short_train, short_heldout = split_worlds(fraction, max_plan_steps=length)
        assert short_heldout == {k for k in heldout if _world_plans()[k] <= length}
        assert short_train == {k for k in train if _world_plans()[k] <= length}
    assert split_worlds(fraction) == split_worlds(fraction)  # fixed: no seed


@pytest.mark.parametrize("max_plan_steps", [0, 3])
def test_no_held_out_world_is_trained_on_whatever_the_seed(max_plan_steps):
    """Regression: training and held-out sets were two seeds' draws from the same 1575 worlds: at the CLI's defaults
    22 of the 160 held-out tasks of task seeds 0-4 were a training world of their own seed, and at the first
    ablation's settings (plans of at most 3 steps) 95 of 128. Now no held-out world of any seed is a training or
    warm-start world of any seed, and the held-out tasks of a set are different worlds. Worlds are recomputed here from
    the task seeds, not read from the rows' `world` column."""
    from trl_agentic.tasks import TaskArguments, build_task

    trained, heldout_sets = set(), []
    for task_seed in range(5):
        args = TaskArguments(
            task="textworld",
            task_seed=task_seed,
            num_eval_tasks=20 if max_plan_steps else 32,
            textworld_max_plan_steps=max_plan_steps,
            warmstart_steps=16,
            warmstart_batch_size=2,
        )
        task = build_task(args)
        for dataset in (task.train_dataset, task.warmstart_dataset):
            trained |= {_key_from_seed(r["task_seed"]) for r in dataset}
        worlds = [_key_from_seed(r["task_seed"]) for r in task.eval_dataset]
        assert len(set(worlds)) == len(worlds) == args.num_eval_tasks
        heldout_sets.append(set(worlds))
    assert not trained & set().union(*heldout_sets)
    assert len(task.train_dataset) == 256 and len({r["task_seed"] for r in task.train_dataset}) == 256


def test_text_world_split_errors_name_the_field_before_any_model_loads():
    from trl_agentic.tasks import TaskArguments

    with pytest.raises(ValueError, match=r"`num_eval_tasks` = 21, but only 20 text worlds with a plan of at most 3"):
        TaskArguments(task="textworld", num_eval_tasks=21, textworld_max_plan_steps=3)
    TaskArguments(task="textworld", num_eval_tasks=20, textworld_max_plan_steps=3)
    with pytest.raises(ValueError, match="`textworld_heldout_fraction` must be in"):
        TaskArguments(task="textworld", textworld_heldout_fraction=1.0)
    with pytest.raises(
        ValueError,
        match=r"No text world with a plan of at most 1 steps is left for training \(`textworld_max_plan_steps` = 1, `textworld_heldout_fraction` = 0.25\)",
    ):
        TaskArguments(task="textworld", textworld_max_plan_steps=1)
    with pytest.raises(ValueError, match="`num_eval_tasks` = 1, but only 0 text worlds"):
        TaskArguments(task="textworld", num_eval_tasks=1, textworld_heldout_fraction=0.0)
    TaskArguments(task="textworld", num_eval_tasks=0, textworld_heldout_fraction=0.0)
    with pytest.raises(ValueError, match="`split` must be"):
        make_textworld_tasks(1, split="test")


def test_a_problem_is_its_world_not_its_seed():
    """The ablation's `problem_key` (held-out problems kept out of training and validation sets) names a text-world
    problem by its world: two seeds of one world are one problem, two worlds two problems."""
    from trl_agentic.ablation.cells import problem_key

    rows = {r["task_seed"]: r for r in make_textworld_tasks(400, seed=0)}
    by_world: dict[tuple, list[int]] = {}
    for task_seed in rows:
        by_world.setdefault(_key_from_seed(task_seed), []).append(task_seed)
    a, b = next(seeds for seeds in by_world.values() if len(seeds) > 1)[:2]
    other = next(seeds[0] for world, seeds in by_world.items() if world != _key_from_seed(a))
    assert problem_key(rows[a]) == problem_key(rows[b]) != problem_key(rows[other])
    assert len({problem_key(r) for r in rows.values()}) == len(by_world)

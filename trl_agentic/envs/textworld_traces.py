"""Warm-start traces of the text world in the RLVCR step format (`task: textworld`, docs/rlvcr.md).

Every assistant turn of a trace is one RLVCR step whose action is a call of the `act` tool
(`rlvcr_action_tag="tool_call"`, the format TRL's tool parser and `trl_agentic.rlvcr` both read)::

    <level>2</level>
    <think>Current state: I am in the hallway, carrying nothing. Reasoning: ...</think>
    <tool_call>
    {"name": "act", "arguments": {"action": "go kitchen"}}
    </tool_call>

The actions are the shortest plan of the episode (`TextWorldEnv._oracle_actions`), played through the real
`TextWorldToolEnv` so that every tool message is the observation the rollout would show; the episode ends with a
short plain answer once the world says "Task complete!" (a turn without a tool call, which ends the rollout). The
levels are drawn per step so that all four appear; the think text is short and says only what the step knows.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Sequence

from ..rlvcr.parsing import LEVEL1_THINK, StepTags, render_prefix
from ..rollout.tools import ErrorPolicy, run_tool_call
from .protocol import tool_methods, with_observation
from .textworld import TEXTWORLD_RULES, TextWorldToolEnv, make_textworld_tasks

__all__ = [
    "FINAL_ANSWER",
    "LEVEL_TOOL_SYSTEM_PROMPT",
    "TOOL_STEP_TAGS",
    "make_level_rows",
    "textworld_level_traces",
]

# The step tags of the tool format: the action of a step is its `act` tool call.
TOOL_STEP_TAGS = StepTags(action_open="<tool_call>", action_close="</tool_call>")

# The last turn, after the world says "Task complete!": no tool call, so the rollout ends.
FINAL_ANSWER = "The task is complete."

LEVEL_TOOL_SYSTEM_PROMPT = f"""You can think at four levels before each action: 1 (instinctive), 2 (situational \
awareness), 3 (experience integration) and 4 (strategic planning).
Each of your turns is: the level inside <level> </level> tags, your reasoning at that level inside <think> </think> \
tags (for level 1 exactly "{LEVEL1_THINK}"), then one call of the `act` tool. Once the task is complete, answer \
without a tool call."""


def make_level_rows(
    n: int, seed: int, max_plan_steps: int = 0, split: str | None = None, heldout_fraction: float = 0.25
) -> list[dict]:
    """Text-world rows whose system prompt asks for RLVCR steps with `act` tool calls (`LEVEL_TOOL_SYSTEM_PROMPT`).

    Args:
        n (`int`): Number of tasks.
        seed (`int`): Seed of the task seeds (`make_textworld_tasks`).
        max_plan_steps (`int`, *optional*, defaults to `0`): Only tasks whose shortest plan is that short (0: any).
        split (`str`, *optional*): `"train"` or `"heldout"` worlds of `split_worlds` (`make_textworld_tasks`).
        heldout_fraction (`float`, *optional*, defaults to `0.25`): Share of held-out worlds of the split.

    Returns:
        `list[dict]`: Rows of `make_textworld_tasks(n, seed, tool_format=True, ...)` with the level-format system
        prompt.
    """
    rows = make_textworld_tasks(
        n, seed, tool_format=True, max_plan_steps=max_plan_steps, split=split, heldout_fraction=heldout_fraction
    )
    for row in rows:
        rules = TEXTWORLD_RULES.format(max_steps=row["max_steps"])
        row["prompt"][0]["content"] = f"{LEVEL_TOOL_SYSTEM_PROMPT}\n\n{rules}\n\nYour task is to: {row['goal']}."
    return rows


def _reason(world, action: str) -> str:
    """Why the action is taken, in words that only use what the step can see or has planned."""
    verb, _, rest = action.partition(" ")
    if verb == "go":
        return f"I go to the {rest} to look for what I need."
    if verb == "open":
        return f"The {rest} is closed, so I open it."
    if verb == "take":
        return f"The {rest} is here, so I take it."
    return f"I carry the {world.goal_object} and the {world.goal_container} is here, so I put it in."


def _think(level: int, world, action: str, previous: str | None) -> str:
    """The think content of a step at a level (the labelled fields of `LEVEL_SYSTEM_PROMPT`, one short line each)."""
    if level == 1:
        return LEVEL1_THINK
    carrying = ", ".join(world.inventory) or "nothing"
    state = f"Current state: I am in the {world.location}, carrying {carrying}."
    reason = f"Reasoning: {_reason(world, action)}"
    if level == 2:
        return f"{state} {reason}"
    goal = f"Goal: {world.goal}."
    reflection = (
        f"Reflection: my last action, {previous}, worked." if previous else "Reflection: this is my first step."
    )
    if level == 3:
        return f"{goal} {state} {reflection} {reason}"
    evaluation = f"Evaluation: {action} is the best of the available actions."
    return f"{goal} {state} {reflection} {evaluation} {reason}"


def textworld_level_traces(rows: Sequence[dict], seed: int = 0) -> list[dict]:
    """Traces of solved text-world episodes, every assistant turn an RLVCR step with an `act` tool call.

    Args:
        rows (`Sequence[dict]`): Text-world rows (e.g. `make_level_rows`); their prompts are used as they are.
        seed (`int`, *optional*, defaults to `0`): Seed of the levels drawn per step.

    Returns:
        `list[dict]`: One dict per row, as `trl_agentic.warmstart.tokenize_trace` reads it: `prompt` (the row's
        messages, the last one completed with the initial observation as TRL's `reset` handling does), `turns`
        (assistant and tool messages), `tools` (the environment's tool methods) and `levels` (the level of each step).
    """
    rng = random.Random(seed)
    traces = []
    for row in rows:
        env = TextWorldToolEnv()
        prompt = with_observation(copy.deepcopy(list(row["prompt"])), env.reset(**row))
        tools = tool_methods(env)
        turns, levels, previous = [], [], None
        for action in env.world._oracle_actions():
            level = rng.choices((1, 2, 3, 4), weights=(3, 3, 1, 1))[0]  # all four, mostly the short ones
            think = _think(level, env.world, action, previous)
            request = {"type": "function", "function": {"name": "act", "arguments": {"action": action}}}
            # The turn is trained as `content + "\n" + <tool_call>...</tool_call>` (warmstart.tokenize_trace).
            content = render_prefix(level, think, TOOL_STEP_TAGS).removesuffix(TOOL_STEP_TAGS.action_open).rstrip()
            outcome = run_tool_call(request, tools, {}, timeout=0, max_chars=None, policy=ErrorPolicy([], []))
            if outcome.failed:
                raise ValueError(f"The world rejected the oracle action {action!r}: {outcome.content}")
            turns += [
                {"role": "assistant", "content": content, "tool_calls": [request]},
                {"role": "tool", "name": "act", "content": outcome.content},
            ]
            levels.append(level)
            previous = action
        if not env.done or env.get_reward() != 1.0:
            raise ValueError(f"The oracle plan did not solve task {row['task_seed']}.")
        turns.append({"role": "assistant", "content": FINAL_ANSWER})
        traces.append({"prompt": prompt, "turns": turns, "tools": list(tools.values()), "levels": levels})
    return traces

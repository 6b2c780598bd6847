"""Ground-truth conversations: the official ground-truth calls played through the environment, turn by turn.

Used to check the environment against the official checker (replaying the ground truth must score 100 %) and to make
warm-start traces. Each ground-truth call is one assistant message with one tool call (later calls often use an
earlier call's result), followed by its tool message; each user turn ends with a short assistant message without
tool calls, which makes the environment send the next user message. Turns whose ground truth is empty are the
`miss_param` turns (a parameter is missing: the assistant asks for it) and the `miss_func` turns (no available
function can do it: the assistant says so).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..protocol import next_user_turn, tool_methods
from .calls import ground_truth_call
from .data import BFCLTask
from .env import BFCLEnv, environment_class, tool_group

END_OF_TURN = "Done."
ASK_FOR_PARAMETER = "Some information I need for this request is missing. Could you provide it?"
NO_FUNCTION = "None of the functions I have can do this."


@dataclass
class GroundTruthEpisode:
    """
    A ground-truth conversation and the environment it was played in.

    Attributes:
        prompt (`list[dict]`): The first user message (the dataset row's `prompt`).
        messages (`list[dict]`): Everything after it: assistant (tool calls or text), tool and user messages.
        env ([`BFCLEnv`]): The environment at the end of the conversation.
        tool_errors (`list[str]`): Tool messages of ground-truth calls that reported an error.
    """

    prompt: list[dict]
    messages: list[dict]
    env: BFCLEnv
    tool_errors: list[str] = field(default_factory=list)


def _closing_text(task: BFCLTask, turn: int) -> str:
    if task.ground_truth[turn]:
        return END_OF_TURN
    return NO_FUNCTION if task.category == "miss_func" else ASK_FOR_PARAMETER


def play_ground_truth(task: BFCLTask, *, hide_excluded: bool = True, max_tool_output_chars: int | None = None):
    """
    Play a task's ground truth through its environment, as the rollout loop would run it.

    Args:
        task ([`BFCLTask`]): The task.
        hide_excluded (`bool`, *optional*, defaults to `True`): See `env.tool_group`.
        max_tool_output_chars (`int`, *optional*): Truncation of tool messages (the loop's `max_tool_output_chars`;
            None: no limit, TRL's default).

    Returns:
        [`GroundTruthEpisode`].
    """
    from ...rollout.tools import ErrorPolicy, run_tool_call

    env = environment_class(tool_group(task, hide_excluded=hide_excluded))()
    env.reset(bfcl_id=task.id)
    tools = dict(tool_methods(env))
    prompt = [{"role": "user", "content": "\n".join(m["content"] for m in task.turns[0])}]
    messages: list[dict] = []
    errors: list[str] = []
    user = None
    for turn in range(len(task.turns)):
        if turn > 0:
            if user is None:
                raise RuntimeError(f"{task.id}: the environment ended the conversation before turn {turn}.")
            for tool in user.add_tools:
                tools[tool.__name__] = tool
            for name in user.remove_tools:
                tools.pop(name, None)
            messages.append({"role": "user", "content": user.content})
        api_methods = {name: getattr(env._apis[env._owners[name]], name) for name in env._owners}
        for call in task.ground_truth[turn]:
            name, arguments = ground_truth_call(call, api_methods)
            request = {"type": "function", "function": {"name": name, "arguments": arguments}}
            outcome = run_tool_call(
                request, tools, {}, timeout=0, max_chars=max_tool_output_chars, policy=ErrorPolicy([], [])
            )
            if outcome.failed:
                errors.append(f"turn {turn}: {call} -> {outcome.content}")
            messages.append({"role": "assistant", "content": "", "tool_calls": [request]})
            messages.append({"role": "tool", "name": name, "content": outcome.content})
        closing = {"role": "assistant", "content": _closing_text(task, turn)}
        messages.append(closing)
        user = next_user_turn(env, closing)
    if user is not None:
        raise RuntimeError(f"{task.id}: the environment sent a user turn after the last one.")
    return GroundTruthEpisode(prompt=prompt, messages=messages, env=env, tool_errors=errors)


def ground_truth_traces(rows: Sequence[dict], *, hide_excluded: bool = True, max_tool_output_chars: int | None = None):
    """
    Warm-start traces (`trl_agentic.warmstart.tokenize_trace`) of the ground truth of dataset rows.

    Args:
        rows (`Sequence[dict]`): Rows of `dataset.make_rows` (their `prompt`, with its system message if any, is kept).
        hide_excluded (`bool`, *optional*, defaults to `True`): See `env.tool_group`.
        max_tool_output_chars (`int`, *optional*): As the rollout loop's (None: no limit, TRL's default).

    Returns:
        `list[dict]`: `prompt`, `turns` (assistant, tool and later user messages), `tools` (the tools rendered into
        the prompt) and `faulty` (False: every ground-truth call is right).
    """
    from .data import get_task

    traces = []
    for row in rows:
        episode = play_ground_truth(
            get_task(row["bfcl_id"]), hide_excluded=hide_excluded, max_tool_output_chars=max_tool_output_chars
        )
        traces.append(
            {
                "prompt": [dict(m) for m in row["prompt"]],
                "turns": episode.messages,
                "tools": list(tool_methods(episode.env).values()),
                "faulty": False,
            }
        )
    return traces

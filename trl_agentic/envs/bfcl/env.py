"""The BFCL multi-turn environment: one task per episode, its API classes' functions as tools, several user turns.

TRL renders one tool schema per environment *name* (`environment_factory={name: factory}`, the dataset's
`environment` column picks the factory), from the public methods of the environment's class. BFCL tasks differ in
their API classes and in the functions they hide, so there is one class per [`ToolGroup`] (API classes + hidden
functions), made once by [`environment_class`]: its public methods are exactly the task's visible functions, with
the official schemas (`schema.make_tool_function`).

An episode (`reset(bfcl_id=...)`):

- the task's API classes are instantiated from its `initial_config`, as the official checker does;
- each tool call runs the API method with the model's arguments, unchanged, and is recorded (as the call string the
  checker reads) under the current user turn; the method's return value is the tool result, as text the way BFCL's
  executor writes it (`execution_text`: a dict as JSON; a list as its `str`, where TRL would pass it on as content
  blocks, an empty response), except a `{"error": "..."}` dict, the APIs' way of reporting a failure: it is raised as
  a `ToolCallError` of type `"ToolError"`, which TRL renders as `str({"error": ...})` and both loops count as a
  failed call (a returned value never is; BFCL's executor writes the same dict as JSON);
- when the assistant ends a turn without tool calls, `_next_user_turn` moves to the next user message, or ends the
  conversation after the last one. In `miss_func` tasks a function held out so far becomes available at its turn:
  BFCL's message for that turn ("I have updated some more functions...") is sent with the function's schema in front
  of it (the system prompt is not re-rendered), and the function is added to the rollout's tools;
- `_checkpoint` / `_restore` deep-copy the API instances (including their private random generators) with the call
  record, so a rolled-back call leaves no trace in the state or in what the checker replays.

The verdict (`_official_verdict`, read by `reward.bfcl_reward`) is the official checker's on the recorded calls.
"""

from __future__ import annotations

import copy
import functools
import json
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from ...errors import ToolCallError
from ..protocol import UserTurn
from .calls import format_call, run_call
from .checker import official_verdict, turn_credit
from .data import BFCLTask, build_api_instances, function_docs, get_task
from .schema import make_tool_function


def execution_text(result: Any) -> str:
    """A returned value as BFCL's executor shows it to the model (`multi_turn_utils.execute_multi_turn_func_call`): a
    string as it is, a dict as JSON (its `str` when not serialisable), anything else as its `str`. Returned as is, a
    list would reach the chat template as content blocks, which render as an empty tool response."""
    if isinstance(result, str):
        return result
    if isinstance(result, dict):
        try:
            return json.dumps(result)
        except (TypeError, ValueError):  # an object inside, a circular reference
            return str(result)
    return str(result)


# BFCL's own user message at a `miss_func` turn (bfcl_eval.constants.default_prompts, FC variant).
ADDITIONAL_FUNCTION_PROMPT = "I have updated some more functions you can choose from. What about now?"


@dataclass(frozen=True)
class ToolGroup:
    """
    The tool set of a family of tasks: their API classes and the functions hidden from the start.

    Args:
        classes (`tuple[str, ...]`): API class names, sorted.
        hidden (`tuple[str, ...]`): Function names not exposed as tools at the start (sorted): `miss_func` functions
            held out until their turn and, with `hide_excluded`, the task's `excluded_function`s.
    """

    classes: tuple[str, ...]
    hidden: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        """The environment name (the dataset's `environment` column)."""
        name = "bfcl:" + "+".join(self.classes)
        return name + ("-" + ",".join(self.hidden) if self.hidden else "")


def tool_group(task: BFCLTask, *, hide_excluded: bool = True) -> ToolGroup:
    """
    The [`ToolGroup`] of a task.

    Args:
        task ([`BFCLTask`]): The task.
        hide_excluded (`bool`, *optional*, defaults to `True`):
            Hide the task's `excluded_function`s (18 tasks per category). BFCL 2026.3.23's own inference does not
            read that field (it shows every function of the involved classes); the replay is unaffected either way
            (no ground truth calls an excluded function).
    """
    hidden = {name for names in task.missed_functions.values() for name in names}
    if hide_excluded:
        hidden |= set(task.excluded_functions)
    return ToolGroup(tuple(sorted(task.involved_classes)), tuple(sorted(hidden)))


# Error type of an API's `{"error": ...}` report (`rollback_on_errors` in configs/bfcl.yaml lists it).
API_ERROR = "ToolError"


def _run_tool(env: BFCLEnv, name: str, arguments: dict) -> Any:
    return env._execute(name, arguments)


class BFCLEnv:
    """
    Base class of the BFCL environments; use [`environment_class`] for the class of a [`ToolGroup`].

    TRL protocol: `reset(bfcl_id=..., **row)`, one public method per visible function. Underscore methods (invisible
    to TRL): `_next_user_turn`, `_checkpoint`, `_restore`, `_official_verdict`, `_turn_credit`.
    """

    group: ClassVar[ToolGroup] = ToolGroup(())
    # Function name -> API class, for every function of the group's classes (visible or not).
    _owners: ClassVar[dict[str, str]] = {}
    # Functions of the group that are hidden at the start (held out or excluded): name -> tool function.
    _hidden_tools: ClassVar[dict[str, Callable]] = {}

    def __init__(self):
        self._task: BFCLTask | None = None
        self._apis: dict[str, object] = {}
        self._calls: list[list[str]] = []
        self._turn = 0
        self._added: list[str] = []

    # -- TRL environment protocol ---------------------------------------------------------------------------------
    def reset(self, bfcl_id: str, **row) -> None:
        """Start the episode of the task `bfcl_id` (the dataset's `bfcl_id` column)."""
        task = get_task(bfcl_id)
        if tuple(sorted(task.involved_classes)) != self.group.classes or not set(self.group.hidden) >= {
            name for names in task.missed_functions.values() for name in names
        }:
            raise ValueError(
                f"Task {bfcl_id} needs the environment of {tool_group(task).name!r}, not {self.group.name!r}: "
                "check the dataset's `environment` column."
            )
        self._task = task
        self._apis = build_api_instances(task)
        self._calls = [[]]
        self._turn = 0
        self._added = []
        return None

    # -- tools -----------------------------------------------------------------------------------------------------
    def _execute(self, name: str, arguments: dict) -> Any:
        if self._task is None:
            raise RuntimeError("Call reset(bfcl_id=...) before using the tools.")
        # Recorded before running: a call that raises is replayed (and raises) in the checker as well.
        call = format_call(name, arguments)
        self._calls[self._turn].append(call)
        result = run_call(call, getattr(self._apis[self._owners[name]], name))  # the values the checker's run gets
        if isinstance(result, dict) and set(result) == {"error"} and isinstance(result["error"], str):
            # The API's failure report: raised, so that the loops count it (TRL renders `str({"error": message})`).
            raise ToolCallError(result["error"], error_type=API_ERROR)
        return execution_text(result)

    # -- several user turns ----------------------------------------------------------------------------------------
    def _next_user_turn(self, assistant_message: dict) -> str | UserTurn | None:
        """The next user message of the task (None after the last one). See `trl_agentic.envs.protocol`."""
        task = self._task
        if task is None or self._turn + 1 >= len(task.turns):
            return None
        self._turn += 1
        self._calls.append([])
        held_out = task.missed_functions.get(self._turn)
        if held_out:
            self._added.extend(held_out)
            tools = [getattr(self, name) for name in held_out]
            return UserTurn(content=additional_function_message(tools), add_tools=tools)
        return "\n".join(message["content"] for message in task.turns[self._turn])

    def __getattr__(self, name: str):
        # A held-out function, once a user turn added it, is an attribute of the episode like the visible ones: the
        # loop re-binds a rollout's tools by name when it moves the episode to a fresh instance (timed-out call).
        if not name.startswith("_") and name in self.__dict__.get("_added", ()):
            return types.MethodType(self._hidden_tools[name], self)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    # -- rollback --------------------------------------------------------------------------------------------------
    def _checkpoint(self) -> Any:
        # The task is immutable (shared, not copied); a fresh instance restored from this state continues the episode.
        return self._task, copy.deepcopy((self._apis, self._calls, self._turn, self._added))

    def _restore(self, state: Any) -> None:
        self._task = state[0]
        self._apis, self._calls, self._turn, self._added = copy.deepcopy(state[1])

    # -- scoring ---------------------------------------------------------------------------------------------------
    @property
    def _turn_calls(self) -> list[list[str]]:
        """The recorded calls of each user turn reached so far (call strings, as the checker reads them)."""
        return [list(calls) for calls in self._calls]

    def _official_verdict(self) -> dict:
        """The official checker's verdict on the episode (`checker.official_verdict`)."""
        return official_verdict(self._task, self._turn_calls)

    def _turn_credit(self) -> float:
        """Our per-turn partial credit (`checker.turn_credit`)."""
        return turn_credit(self._task, self._turn_calls)


def additional_function_message(tools: list[Callable]) -> str:
    """BFCL's `miss_func` message, preceded by the new functions' JSON schemas as TRL's chat template shows tools."""
    from transformers.utils import get_json_schema

    schemas = "\n".join(json.dumps(get_json_schema(tool), ensure_ascii=False) for tool in tools)
    return f"{schemas}\n{ADDITIONAL_FUNCTION_PROMPT}"


@functools.cache
def environment_class(group: ToolGroup) -> type[BFCLEnv]:
    """
    The environment class of a [`ToolGroup`] (made once, then cached): a [`BFCLEnv`] subclass whose public methods
    are the group's visible functions with the official schemas.

    Args:
        group ([`ToolGroup`]): API classes and hidden functions.
    """
    owners, visible, hidden = {}, {}, {}
    for class_name in group.classes:
        for doc in function_docs(class_name):
            owners[doc["name"]] = class_name
            tool = make_tool_function(doc, _run_tool)
            (hidden if doc["name"] in group.hidden else visible)[doc["name"]] = tool
    unknown = set(group.hidden) - set(owners)
    if unknown:
        raise ValueError(f"Hidden functions {sorted(unknown)} are not functions of {list(group.classes)}.")
    namespace = {
        **visible,
        "group": group,
        "_owners": owners,
        "_hidden_tools": hidden,
        "__doc__": f"BFCL multi-turn environment with the functions of {', '.join(group.classes)}"
        + (f" (hidden at the start: {', '.join(group.hidden)})." if group.hidden else "."),
        "__module__": __name__,
    }
    class_name = "BFCLEnv_" + "_".join(group.classes) + ("_minus_" + "_".join(group.hidden) if group.hidden else "")
    return type(class_name, (BFCLEnv,), namespace)

"""State checkpoints for TRL environments, and tool discovery exactly as TRL does it.

TRL's `GRPOTrainer` exposes every public method of an environment (other than `reset` and `get_reward`) as a tool.
Our trainer rolls environments back to an earlier turn, so it also needs to save and restore their state. Environments
can provide this through two underscore methods, invisible to TRL's tool discovery:

- `_checkpoint(self) -> Any`: return a snapshot of the state;
- `_restore(self, state) -> None`: put the environment back into a snapshotted state (possibly several times).

Environments that define neither get a default: a deep copy of the instance `__dict__`.
"""

import copy
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

_NOT_TOOLS = ("reset", "get_reward")


def tool_methods(env: Any) -> dict[str, Callable]:
    """
    Returns the environment's tools, discovered exactly as TRL's `GRPOTrainer` discovers them.

    Args:
        env (`Any`):
            An environment instance.

    Returns:
        `dict[str, Callable]`: Bound methods by name, in alphabetical order (the order TRL uses).
    """
    # Listed on the class, as TRL does: getmembers on the instance would evaluate properties.
    return {
        name: getattr(env, name)
        for name, _ in inspect.getmembers(type(env), predicate=inspect.isfunction)
        if name not in _NOT_TOOLS and not name.startswith("_")
    }


def _custom_state_methods(env: Any) -> bool:
    has_checkpoint = callable(getattr(type(env), "_checkpoint", None))
    has_restore = callable(getattr(type(env), "_restore", None))
    if has_checkpoint != has_restore:
        defined, missing = ("_checkpoint", "_restore") if has_checkpoint else ("_restore", "_checkpoint")
        raise TypeError(
            f"Environment {type(env).__qualname__} defines `{defined}` but not `{missing}`: define both (or neither, "
            "to use the default deep copy of the instance attributes)."
        )
    return has_checkpoint


def checkpoint_env(env: Any) -> Any:
    """
    Snapshots an environment's state.

    Args:
        env (`Any`):
            An environment instance.

    Returns:
        `Any`: `env._checkpoint()` if the environment defines it, else a deep copy of `vars(env)`.
    """
    if _custom_state_methods(env):
        return env._checkpoint()
    try:
        return copy.deepcopy(vars(env))
    except Exception:
        # State the start-up check could not see (made by `reset` or a tool: a lock, a socket, a file): the same
        # actionable error, naming the attribute, rather than copy's bare "cannot pickle '_thread.lock' object".
        check_checkpointable(env)
        raise


def restore_env(env: Any, state: Any) -> None:
    """
    Puts an environment back into a state returned by `checkpoint_env`.

    The same state can be restored several times: the default restore copies it again rather than adopting it.

    Args:
        env (`Any`):
            The environment the state was taken from.
        state (`Any`):
            A value returned by `checkpoint_env(env)`.
    """
    if _custom_state_methods(env):
        env._restore(state)
        return
    attributes = vars(env)
    attributes.clear()
    attributes.update(copy.deepcopy(state))


def check_checkpointable(env: Any) -> None:
    """
    Fails early, with an actionable message, if `checkpoint_env` would fail on this environment.

    Meant to run at trainer start-up when rollback is enabled. Environments with `_checkpoint`/`_restore` are trusted;
    for the others the default deep copy is attempted, and on failure the offending attribute is named.

    Args:
        env (`Any`):
            An environment instance.

    Raises:
        `TypeError`: If only one of `_checkpoint`/`_restore` is defined, or the instance attributes cannot be copied.
    """
    if _custom_state_methods(env):
        return
    name = type(env).__qualname__
    advice = f"Implement `_checkpoint(self)` and `_restore(self, state)` on {name} to save and restore its state."
    try:
        attributes = vars(env)
    except TypeError:
        raise TypeError(
            f"Environment {name} has no instance `__dict__` to copy (it uses `__slots__`?). {advice}"
        ) from None
    try:
        copy.deepcopy(attributes)
        return
    except Exception as exc:
        error = exc
    # Find the culprit one attribute at a time, for a message the user can act on.
    for attribute, value in attributes.items():
        try:
            copy.deepcopy(value)
        except Exception as exc:
            raise TypeError(
                f"Environment {name} cannot be checkpointed by the default deep copy: attribute {attribute!r} "
                f"({type(value).__qualname__}) cannot be copied ({type(exc).__name__}: {exc}). {advice}"
            ) from exc
    raise TypeError(
        f"Environment {name} cannot be checkpointed by the default deep copy ({type(error).__name__}: {error}). {advice}"
    ) from error


# ---------------------------------------------------------------------------------------------------------------------
# Conversations with several user turns.
#
# TRL's loop ends a rollout when the assistant stops calling tools. An environment that defines
#
#     def _next_user_turn(self, assistant_message: dict) -> str | UserTurn | None
#
# is asked, each time the assistant's turn ends without tool calls, for the next user message of the conversation:
# `None` ends the conversation; a string (or a `UserTurn`) is appended as a user message (environment tokens, masked
# from the loss) and the rollout continues in the same row. A `UserTurn` may also make tools available from that turn
# on (`add_tools`) or withdraw some (`remove_tools`). Underscore-prefixed, so TRL does not expose it as a tool.


@dataclass
class UserTurn:
    """
    The next user message of a multi-turn conversation, returned by an environment's `_next_user_turn`.

    Args:
        content (`str`):
            The user message.
        add_tools (`list[Callable]`, *optional*):
            Functions callable as tools from this turn on (by their `__name__`). How the model learns about them is
            the environment's choice (e.g. their schema in `content`): the system prompt is not re-rendered.
        remove_tools (`list[str]`, *optional*):
            Names of tools no longer callable from this turn on (a call gets a "tool not found" error).
    """

    content: str
    add_tools: list[Callable] = field(default_factory=list)
    remove_tools: list[str] = field(default_factory=list)


NEXT_USER_TURN = "_next_user_turn"


def next_user_turn(env: Any, assistant_message: dict) -> UserTurn | None:
    """
    Asks an environment for the next user turn (None when it has no `_next_user_turn` or the conversation is over).

    Args:
        env (`Any`): The rollout's environment (may be None).
        assistant_message (`dict`): The assistant message that ended without tool calls.

    Returns:
        `UserTurn | None`

    Raises:
        `TypeError`: If the hook returns something other than None, a string or a `UserTurn`.
    """
    hook = getattr(env, NEXT_USER_TURN, None) if env is not None else None
    if hook is None:
        return None
    turn = hook(assistant_message)
    if turn is None or isinstance(turn, UserTurn):
        return turn
    if isinstance(turn, str):
        return UserTurn(content=turn)
    raise TypeError(
        f"{type(env).__qualname__}.{NEXT_USER_TURN} must return None, a str or a UserTurn, got {type(turn).__name__}."
    )


def has_user_turns(env: Any) -> bool:
    """Whether an environment (instance or class) supplies further user turns (defines `_next_user_turn`)."""
    return callable(getattr(env, NEXT_USER_TURN, None))


def with_observation(prompt: list[dict], observation) -> list[dict]:
    """The prompt with `observation` (what `env.reset` returned) appended to its last message, as TRL's
    `GRPOTrainer` does before generation; `None` leaves it as it is. A new list: the row is not changed."""
    prompt = list(prompt)
    if observation is None:
        return prompt
    content = prompt[-1]["content"]
    if isinstance(observation, list) and isinstance(content, str):
        content = [{"type": "text", "text": content}]
    if isinstance(observation, str) and isinstance(content, list):
        observation = [{"type": "text", "text": observation}]
    return prompt[:-1] + [{**prompt[-1], "content": content + observation}]

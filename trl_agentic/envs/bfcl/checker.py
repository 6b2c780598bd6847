"""The official BFCL multi-turn verdict of a conversation, and our per-turn partial credit.

[`official_verdict`] is what BFCL's evaluation runner does for one multi-turn entry (`_evaluate_single_multi_turn_entry`
in `bfcl_eval.eval_checker.eval_runner`, which cannot be imported without the package's heavy dependencies): a
conversation that did not reach every turn fails as `multi_turn:force_terminated`; otherwise the package's own
`multi_turn_checker` replays the model's calls and the ground truth turn by turn on fresh API instances and compares,
after every turn with ground-truth calls, the API states (`state_checker`) and the execution results
(`response_checker`). That function is called unchanged.

The checker keeps its API instances in a module-global dict keyed by model name and task id (so that successive calls
for the same entry continue the same state). Each verdict therefore uses a fresh, unique model name, and removes its
instances afterwards.

[`turn_credit`] is ours (not BFCL's): the fraction of turns, counted from the first, that pass the official per-turn
checks, a dense signal for training. It is not zero for a conversation that never calls a tool: a turn whose ground
truth makes no call passes the checks without calls. [`no_call_turn_credit`] is that baseline, the turn credit of a
conversation that answers every user turn without a call; read every turn-credit figure against it.
"""

from __future__ import annotations

import contextlib
import itertools
import threading

from .data import BFCLTask, long_context_module_state_kept

_counter = itertools.count()
_lock = threading.Lock()


def _unique_model_name() -> str:
    with _lock:
        return f"trl_agentic_{next(_counter)}"


def _run_checker(task: BFCLTask, turn_calls: list[list[str]], ground_truth: list[list[str]]) -> dict:
    from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils
    from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker import multi_turn_checker

    # One step per call: the checker concatenates a turn's steps, so the grouping into steps does not matter.
    decoded = [[[call] for call in calls] for calls in turn_calls]
    model_name = _unique_model_name()
    try:
        with long_context_module_state_kept() if task.long_context else contextlib.nullcontext():
            return multi_turn_checker(decoded, ground_truth, task.test_entry(), task.category, model_name)
    finally:
        namespace = vars(multi_turn_utils)
        for key in [k for k in namespace if k.startswith(model_name + "_")]:
            del namespace[key]


def official_verdict(task: BFCLTask, turn_calls: list[list[str]]) -> dict:
    """
    The official verdict on a conversation.

    Args:
        task ([`BFCLTask`]): The task.
        turn_calls (`list[list[str]]`): For each user turn the conversation reached, the calls the model made in it
            (call strings, see `calls.format_call`), in order.

    Returns:
        `dict`: `{"valid": bool}`, plus `error_type` and `error_message` when not valid (the checker's own).
    """
    if len(turn_calls) != len(task.ground_truth):
        return {
            "valid": False,
            "error_type": "multi_turn:force_terminated",
            "error_message": f"The conversation reached {len(turn_calls)} of {len(task.ground_truth)} turns.",
        }
    result = _run_checker(task, turn_calls, task.ground_truth)
    out = {"valid": bool(result.get("valid"))}
    if not out["valid"]:
        out["error_type"] = result.get("error_type", "")
        out["error_message"] = str(result.get("error_message", ""))
    return out


def turn_credit(task: BFCLTask, turn_calls: list[list[str]]) -> float:
    """
    Our dense partial credit (not part of BFCL): the number of leading turns that pass the official per-turn checks,
    divided by the number of turns. A turn counts only if the conversation reached it; the checker stops at the first
    failing turn, so the first k turns pass exactly when the checker accepts the conversation cut after turn k.

    Args:
        task ([`BFCLTask`]): The task.
        turn_calls (`list[list[str]]`): As in [`official_verdict`].

    Returns:
        `float`: In [0, 1]; 1.0 exactly when the official verdict is valid.
    """
    total = len(task.ground_truth)
    reached = min(len(turn_calls), total)
    passed = 0
    for k in range(1, reached + 1):
        if not _run_checker(task, turn_calls[:k], task.ground_truth[:k]).get("valid"):
            break
        passed = k
    return passed / total if total else 0.0


def no_call_turn_credit(task: BFCLTask) -> float:
    """
    The turn credit of a conversation that reaches every user turn and makes no tool call: the baseline that turn
    credit must beat (the leading turns whose ground truth makes no call, as the official checks judge them).

    Args:
        task ([`BFCLTask`]): The task.

    Returns:
        `float`: [`turn_credit`] of `[[]] * len(task.ground_truth)`.
    """
    return turn_credit(task, [[] for _ in task.ground_truth])

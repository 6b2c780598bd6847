"""The built-in `delete_context` tool: what the model calls and how the conversation is rewritten.

The loop intercepts calls to this tool (it never runs as a plain function): the current trajectory is closed as a
snapshot row and the conversation, with the deleted messages replaced by a stub, is re-rendered as a new prompt.
"""

from __future__ import annotations

import copy

DELETE_CONTEXT_TOOL = "delete_context"


def delete_context(message_ids: list[int]) -> str:
    """
    Delete earlier messages from your context to free space. Their content is replaced by a short stub.

    Args:
        message_ids: Indices of the messages to delete, counting from 0 for the first message of the conversation.
            System messages and the latest message cannot be deleted.

    Returns:
        A confirmation of which messages were deleted.
    """
    # Never executed: the rollout loop handles this tool itself. The signature and docstring give the model its schema.
    return f"Deleted messages {message_ids}."


def apply_deletion(messages: list[dict], message_ids, stub: str) -> tuple[list[dict], list[int]]:
    """Return a copy of `messages` with the given messages' content replaced by `stub`.

    Args:
        messages: The conversation as the model saw it (the call to `delete_context` is the last assistant message).
        message_ids: Indices to delete (a list of ints; a single int is accepted).
        stub: Replacement text.

    Returns:
        `(new_messages, deleted)` with `deleted` the sorted unique indices.

    Raises:
        TypeError / ValueError: With a message for the model, when the ids are not a list of valid indices.
    """
    if isinstance(message_ids, int) and not isinstance(message_ids, bool):
        message_ids = [message_ids]
    if not isinstance(message_ids, list) or not message_ids:
        raise TypeError("message_ids must be a non-empty list of message indices")
    if not all(isinstance(m, int) and not isinstance(m, bool) for m in message_ids):
        raise TypeError("message_ids must contain integers only")
    last = len(messages) - 1
    deleted = sorted(set(message_ids))
    for m in deleted:
        if m < 0 or m > last:
            raise ValueError(f"message index {m} is out of range 0..{last}")
        if m == last:
            raise ValueError("the latest message cannot be deleted")
        if messages[m].get("role") == "system":
            raise ValueError(f"message {m} is a system message and cannot be deleted")
    new = copy.deepcopy(messages)
    for m in deleted:
        message = {"role": new[m]["role"], "content": stub}
        if "name" in new[m]:
            message["name"] = new[m]["name"]
        new[m] = message  # tool_calls of a deleted assistant turn go too: their arguments may be large
    return new, deleted

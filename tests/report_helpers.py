"""Synthetic trajectories for the report tests (built with the tiny tokenizer, no model needed)."""

import json

from trl_agentic.reporting.callbacks import describe_segments, split_segments


def tool_call(expression):
    """A calculator call as the model writes it (Qwen3 / Hermes format), ending the turn."""
    payload = json.dumps({"name": "calculate", "arguments": {"expression": expression}})
    return f"<tool_call>\n{payload}\n</tool_call><|im_end|>"


def completion(tokenizer, parts):
    """(text, is_model) parts -> completion ids and tool mask."""
    ids, mask = [], []
    for text, model in parts:
        piece = tokenizer.encode(text, add_special_tokens=False)
        ids += piece
        mask += [int(model)] * len(piece)
    return ids, mask


def synthetic_trajectories(tokenizer, steps=3):
    """Per step: 4 rollouts of one group (the first rolled back once) and its negative sample; then a snapshot row
    and a row with an RLVCR level tag."""
    trajectories = []
    for step in range(1, steps + 1):
        for r in range(4):
            rollback = r == 0
            parts = [
                (tool_call("12 * 3"), True),
                ("\n<tool_response>\n36\n</tool_response>\n", False),
                ("Answer: 36<|im_end|>", True),
            ]
            if r == 1:  # a conversation with a second user request (an environment's `_next_user_turn`)
                parts += [("\n<|im_start|>user\nNow double it.<|im_end|>\n<|im_start|>assistant\n", False)]
                parts += [("Answer: 72<|im_end|>", True)]
            ids, mask = completion(tokenizer, parts)
            segments = split_segments(tokenizer, ids, mask, [0.3 if r < 2 else -0.3] * len(ids))
            t = {
                "id": f"s{step}-r{r}",
                "step": step,
                "group": 0,
                "kind": "regular",
                "parent": None,
                "reward": 1.0 if r < 2 else 0.0,
                "rewards": {"answer_reward": 1.0 if r < 2 else 0.0},
                "advantage": 0.3 if r < 2 else -0.3,
                "question": "What is 12 * 3?",
                "answer": "36",
                "rollbacks": [{"turn": 1, "error_types": ["ValueError"], "errors": ["Invalid expression"]}]
                if rollback
                else [],
                "segments": segments,
            }
            t.update(describe_segments(segments))
            trajectories.append(t)
        ids, mask = completion(
            tokenizer, [(tool_call("12 x 3"), True), ("\n<tool_response>\n{'error': 'x'}\n</tool_response>", False)]
        )
        segments = split_segments(tokenizer, ids, mask, [-1.0] * len(ids))
        negative = {
            "id": f"s{step}-r4",
            "step": step,
            "group": 0,
            "kind": "negative",
            "parent": f"s{step}-r0",
            "reward": -0.5,
            "advantage": -1.0,
            "question": "What is 12 * 3?",
            "answer": "36",
            "rollbacks": [],
            "error_types": ["ValueError"],
            "error_messages": ["Invalid expression '12 x 3'"],
            "segments": segments,
        }
        negative.update(describe_segments(segments, [True]))  # the loop recorded the failed call
        trajectories.append(negative)
    snapshot = dict(trajectories[1], id="s3-r9", kind="snapshot", segment_index=1, parent="s3-r1")
    trajectories.append(snapshot)
    level_segments = split_segments(
        tokenizer, *completion(tokenizer, [("<level>3</level>" + tool_call("1+1"), True)]), [0.1] * 40
    )
    leveled = dict(trajectories[2], id="s3-r8", segments=level_segments, **describe_segments(level_segments))
    trajectories.append(leveled)
    return trajectories

"""Context snapshots in the rollout loop, driven by scripted generation: exact rows after `delete_context` calls.

`ScriptBackend.render_prompt` renders a conversation as `role:content|role:content…<|im_start|>` and tool results as
`<R>content</R><|im_start|>`, so every expected prompt below is written out by hand.
"""

import math
import random
from pathlib import Path

import pytest
from rollout_helpers import (
    GiveUpParseBackend,
    LedgerEnv,
    NoLogprobBackend,
    ScriptBackend,
    call,
    calls,
    run_loop,
    run_tools_loop,
    start,
)

from trl_agentic.config import DEFAULT_INFRA_ERROR_TYPES, DEFAULT_ROLLBACK_ON_ERRORS
from trl_agentic.errors import render_tool_error
from trl_agentic.rollout.loop import AgenticRolloutLoop, LoopConfig
from trl_agentic.rollout.types import RowKind

DONE = "done<|im_end|>"


def cfg(**overrides):
    base = dict(
        enable_context_snapshots=True,
        rollback_on_errors=list(DEFAULT_ROLLBACK_ON_ERRORS),
        infra_error_types=list(DEFAULT_INFRA_ERROR_TYPES),
    )
    base.update(overrides)
    return LoopConfig(**base)


def delete(*ids):
    return call("delete_context", message_ids=list(ids))


def suffix(b, *contents):
    return b.enc("".join(f"<R>{c}</R>" for c in contents) + "<|im_start|>")


def test_without_delete_context_a_rollout_is_one_row_exactly_as_before(tiny_tokenizer):
    """Backward compatibility: with snapshots on but no deletion, ids, masks, log-probs and messages are unchanged."""
    turn1 = call("add", n=2)
    outputs = {}
    for enabled in (False, True):
        b = ScriptBackend(tiny_tokenizer, [["The total is 2.<|im_end|>"]])
        env = LedgerEnv()
        prompts, prompt_ids, trl_tuple, result = run_loop(b, [turn1], [env], cfg(enable_context_snapshots=enabled))
        outputs[enabled] = (prompts, prompt_ids, trl_tuple, b.calls, env.log)
        t1, s1, t2 = b.enc(turn1), suffix(b, "2"), b.enc("The total is 2.<|im_end|>")
        tool_mask, completions, completion_ids, logprobs, n_calls, n_fail, _ = trl_tuple
        assert prompt_ids[0] == b.enc("user: go<|im_start|>")
        assert completion_ids[0] == t1 + s1 + t2
        assert tool_mask[0] == [1] * len(t1) + [0] * len(s1) + [1] * len(t2)
        assert logprobs[0] == b.lps(t1) + [0.0] * len(s1) + b.lps(t2)
        assert result.extra_rows == [] and result.num_segments == [1]
        assert (result.stats.snapshots, result.stats.snapshot_rows, result.stats.tokens_freed) == (0, 0, 0)
    assert outputs[False] == outputs[True]


def test_one_deletion_closes_the_segment_and_continues_from_the_stubbed_prompt(tiny_tokenizer):
    turn1, turn_del = call("add", n=2), delete(2)
    b = ScriptBackend(tiny_tokenizer, [[turn_del], [DONE]])
    env = LedgerEnv()
    prompts, prompt_ids, (tool_mask, completions, completion_ids, logprobs, n_calls, n_fail, _), result = run_loop(
        b, [turn1], [env], cfg()
    )
    p0 = b.enc("user: go<|im_start|>")
    t1, s1, t_del, t_done = b.enc(turn1), suffix(b, "2"), b.enc(turn_del), b.enc(DONE)
    p1 = b.enc("user:user: go|assistant:|tool:[deleted]|assistant:|tool:Deleted messages [2].<|im_start|>")

    (snap,) = result.extra_rows
    assert snap.kind == RowKind.SNAPSHOT and snap.parent == 0 and snap.segment_index == 0
    # The closed segment: original prompt, the whole trajectory up to and including the delete call.
    assert snap.prompt_ids == p0
    assert snap.completion_ids == t1 + s1 + t_del
    assert snap.tool_mask == [1] * len(t1) + [0] * len(s1) + [1] * len(t_del)
    assert snap.logprobs == b.lps(t1) + [0.0] * len(s1) + b.lps(t_del)
    assert [m["role"] for m in snap.prompt_messages] == ["user"]
    assert [m["role"] for m in snap.messages] == ["assistant", "tool", "assistant"]
    assert snap.messages[1]["content"] == "2"
    # Freed: the context the next turn would have had (segment + delete result) minus the new prompt.
    s_del = suffix(b, "Deleted messages [2].")
    # Byte-level tokens, counted by hand: 9 + 41 + 9 + 64 + 29 = 152 before, 78 after.
    assert [len(x) for x in (p0, t1, s1, t_del, s_del, p1)] == [9, 41, 9, 64, 29, 78]
    assert snap.tokens_freed == 152 - 78
    assert result.stats.tokens_freed == 74

    # The final segment (the primary row) starts from the re-rendered, stubbed conversation.
    assert prompt_ids[0] == p1
    assert completion_ids[0] == t_done
    assert tool_mask[0] == [1] * len(t_done)
    assert logprobs[0] == b.lps(t_done)
    assert b.calls == [[p0 + t1 + s1], [p1]]
    # TRL's `prompts[i]` holds the stubbed conversation; `completions[i]` keeps the episode for the reward functions.
    assert [m["content"] for m in prompts[0]] == ["user: go", "", "[deleted]", "", "Deleted messages [2]."]
    assert [m["role"] for m in completions[0]] == ["assistant", "tool", "assistant", "tool", "assistant"]
    assert completions[0][1]["content"] == "2" and completions[0][-1]["content"] == "done"
    assert result.num_segments == [2] and (n_calls, n_fail) == (2, 0) and env.total == 2
    assert (result.stats.snapshots, result.stats.snapshot_rows) == (1, 1)


def test_several_deletions_in_one_rollout(tiny_tokenizer):
    """Indices stay stable across segments (deleted messages become stubs), so the second call counts the same way."""
    turn1, t_add3, del1, t_add4, del2 = (
        call("add", n=2),
        call("add", n=3),
        delete(2, 4),
        call("add", n=4),
        delete(6, 8),
    )
    b = ScriptBackend(tiny_tokenizer, [[t_add3], [del1], [t_add4], [del2], [DONE]])
    env = LedgerEnv()
    _, prompt_ids, (tool_mask, _, completion_ids, logprobs, n_calls, _, _), result = run_loop(b, [turn1], [env], cfg())
    e = b.enc
    p0 = e("user: go<|im_start|>")
    p1 = e(
        "user:user: go|assistant:|tool:[deleted]|assistant:|tool:[deleted]|assistant:"
        "|tool:Deleted messages [2, 4].<|im_start|>"
    )
    p2 = e(
        "user:user: go|assistant:|tool:[deleted]|assistant:|tool:[deleted]|assistant:|tool:[deleted]|assistant:"
        "|tool:[deleted]|assistant:|tool:Deleted messages [6, 8].<|im_start|>"
    )
    first, second = result.extra_rows
    assert [r.segment_index for r in result.extra_rows] == [0, 1]
    assert all(r.kind == RowKind.SNAPSHOT and r.parent == 0 for r in result.extra_rows)
    assert first.prompt_ids == p0
    assert first.completion_ids == e(turn1) + suffix(b, "2") + e(t_add3) + suffix(b, "5") + e(del1)
    assert second.prompt_ids == p1
    assert second.completion_ids == e(t_add4) + suffix(b, "9") + e(del2)
    assert second.tool_mask == [1] * len(e(t_add4)) + [0] * len(suffix(b, "9")) + [1] * len(e(del2))
    assert second.logprobs == b.lps(e(t_add4)) + [0.0] * len(suffix(b, "9")) + b.lps(e(del2))
    assert prompt_ids[0] == p2 and completion_ids[0] == e(DONE) and tool_mask[0] == [1] * len(e(DONE))
    assert [c[0] for c in b.calls] == [
        p0 + e(turn1) + suffix(b, "2"),
        p0 + e(turn1) + suffix(b, "2") + e(t_add3) + suffix(b, "5"),
        p1,
        p1 + e(t_add4) + suffix(b, "9"),
        p2,
    ]
    freed1 = len(first.prompt_ids + first.completion_ids + suffix(b, "Deleted messages [2, 4].")) - len(p1)
    freed2 = len(second.prompt_ids + second.completion_ids + suffix(b, "Deleted messages [6, 8].")) - len(p2)
    assert (first.tokens_freed, second.tokens_freed) == (freed1, freed2)
    assert result.stats.tokens_freed == freed1 + freed2
    assert result.num_segments == [3] and result.stats.snapshots == 2 and env.total == 9 and n_calls == 5


def test_deletion_at_the_first_turn(tiny_tokenizer):
    """The very first turn deletes the user message: the snapshot is that one turn on the original prompt."""
    turn = delete(0)
    b = ScriptBackend(tiny_tokenizer, [[DONE]])
    _, prompt_ids, (tool_mask, _, completion_ids, logprobs, _, _, _), result = run_loop(
        b, [turn], [LedgerEnv()], cfg()
    )
    (snap,) = result.extra_rows
    assert snap.prompt_ids == b.enc("user: go<|im_start|>")
    assert snap.completion_ids == b.enc(turn) and snap.tool_mask == [1] * len(b.enc(turn))
    assert snap.logprobs == b.lps(b.enc(turn))
    p1 = b.enc("user:[deleted]|assistant:|tool:Deleted messages [0].<|im_start|>")
    assert prompt_ids[0] == p1 and completion_ids[0] == b.enc(DONE) and b.calls == [[p1]]
    assert logprobs[0] == b.lps(b.enc(DONE)) and tool_mask[0] == [1] * len(b.enc(DONE))


def test_deletion_at_the_last_turn(tiny_tokenizer):
    """The deletion uses the last tool round: the final segment is the one turn generated after it, whose call is
    left unexecuted (iteration cap, like TRL)."""
    turn1, turn_del, late = call("add", n=2), delete(2), call("add", n=5)
    b = ScriptBackend(tiny_tokenizer, [[turn_del], [late]])
    b.max_iterations = 2
    env = LedgerEnv()
    _, prompt_ids, (_, completions, completion_ids, _, n_calls, _, _), result = run_loop(b, [turn1], [env], cfg())
    (snap,) = result.extra_rows
    assert snap.completion_ids == b.enc(turn1) + suffix(b, "2") + b.enc(turn_del)
    assert prompt_ids[0] == b.enc(
        "user:user: go|assistant:|tool:[deleted]|assistant:|tool:Deleted messages [2].<|im_start|>"
    )
    assert completion_ids[0] == b.enc(late)
    assert len(b.calls) == 2 and env.total == 2 and n_calls == 2
    assert completions[0][-1]["tool_calls"][0]["function"]["arguments"] == {"n": 5}
    assert result.num_segments == [2]


def test_a_batch_mixing_rollouts_with_and_without_deletion(tiny_tokenizer):
    first = [call("add", n=1), "No tools.<|im_end|>", call("add", n=2)]
    runs = {}
    for enabled in (True, False):
        b = ScriptBackend(tiny_tokenizer, [[delete(2), "end2<|im_end|>"], [DONE]])
        envs = [LedgerEnv() for _ in first]
        runs[enabled] = (b, envs, *run_loop(b, first, envs, cfg(enable_context_snapshots=enabled)))
    b, envs, _, prompt_ids, (tool_mask, completions, completion_ids, logprobs, *_), result = runs[True]
    # One snapshot row, from rollout 0; one batched generation call per iteration.
    (snap,) = result.extra_rows
    assert snap.parent == 0 and snap.segment_index == 0
    assert snap.completion_ids == b.enc(first[0]) + suffix(b, "1") + b.enc(delete(2))
    p1 = b.enc("user:user: go|assistant:|tool:[deleted]|assistant:|tool:Deleted messages [2].<|im_start|>")
    assert [len(c) for c in b.calls] == [2, 1] and b.calls[1] == [p1]
    assert prompt_ids[0] == p1 and completion_ids[0] == b.enc(DONE)
    assert result.num_segments == [2, 1, 1]
    # Rollouts 1 and 2 are exactly what they are with snapshots off.
    _, _, _, prompt_ids_off, (tool_mask_off, completions_off, completion_ids_off, logprobs_off, *_), result_off = runs[
        False
    ]
    for i in (1, 2):
        assert prompt_ids[i] == prompt_ids_off[i] and completion_ids[i] == completion_ids_off[i]
        assert tool_mask[i] == tool_mask_off[i] and logprobs[i] == logprobs_off[i]
        assert completions[i] == completions_off[i]
    assert completion_ids[1] == b.enc(first[1])
    assert completion_ids[2] == b.enc(first[2]) + suffix(b, "2") + b.enc("end2<|im_end|>")
    # With snapshots off the call is an unknown tool: no row, the rollout goes on with the error message.
    assert result_off.extra_rows == [] and result_off.num_segments == [1, 1, 1]
    assert completions_off[0][3]["content"] == render_tool_error("Tool delete_context not found.")


def _five_deletions(tokenizer, config):
    b = ScriptBackend(tokenizer, [[delete(0)]] * 4 + [[DONE]])
    return run_loop(b, [delete(0)], [LedgerEnv()], config)[3]


def test_downsampling_keeps_the_last_segments_or_random_plus_last(tiny_tokenizer):
    full = _five_deletions(tiny_tokenizer, cfg(max_snapshots_per_episode=5))
    assert [r.segment_index for r in full.extra_rows] == [0, 1, 2, 3, 4]
    by_segment = {r.segment_index: r for r in full.extra_rows}
    # Every segment is a distinct row: each one starts from the prompt left by the previous deletion.
    assert len({tuple(r.prompt_ids) for r in full.extra_rows}) == 5

    last = _five_deletions(tiny_tokenizer, cfg(max_snapshots_per_episode=2, snapshot_downsample="last"))
    assert [r.segment_index for r in last.extra_rows] == [3, 4]
    assert all(r.prompt_ids == by_segment[r.segment_index].prompt_ids for r in last.extra_rows)
    assert (last.stats.snapshots, last.stats.snapshot_rows, last.num_segments) == (5, 2, [6])

    none = _five_deletions(tiny_tokenizer, cfg(max_snapshots_per_episode=0))
    assert none.extra_rows == [] and none.stats.snapshots == 5 and none.stats.snapshot_rows == 0

    choices = set()
    config = cfg(max_snapshots_per_episode=3, snapshot_downsample="random_plus_last")
    for seed in range(20):
        b = ScriptBackend(tiny_tokenizer, [[delete(0)]] * 4 + [[DONE]])
        loop = AgenticRolloutLoop(b, config, rng=random.Random(seed))
        _, result = loop.run(*start(b, [delete(0)]), [{}], [{}], None)
        kept = [r.segment_index for r in result.extra_rows]
        assert len(kept) == 3 and kept[-1] == 4 and kept == sorted(set(kept))
        assert all(r.prompt_ids == by_segment[r.segment_index].prompt_ids for r in result.extra_rows)
        assert result.stats.snapshot_rows == 3 and result.stats.snapshots == 5
        choices.add(tuple(kept[:-1]))
    # The two non-last segments are drawn at random from the 4 earlier ones: several draws appear.
    assert len(choices) >= 3 and choices <= {(a, c) for a in range(4) for c in range(a + 1, 4)}


@pytest.mark.parametrize(
    "ids,error",
    [
        ([1], render_tool_error("the latest message cannot be deleted")),
        ([7], render_tool_error("message index 7 is out of range 0..1")),
        ([], render_tool_error("message_ids must be a non-empty list of message indices")),
        (["a"], render_tool_error("message_ids must contain integers only")),
    ],
)
def test_invalid_deletions_are_shown_to_the_model_and_close_nothing(tiny_tokenizer, ids, error):
    turn = call("delete_context", message_ids=ids)
    b = ScriptBackend(tiny_tokenizer, [[DONE]])
    _, prompt_ids, (tool_mask, completions, completion_ids, _, n_calls, n_fail, _), result = run_loop(
        b, [turn], [LedgerEnv()], cfg()
    )
    assert completions[0][1]["content"] == error
    assert result.extra_rows == [] and result.num_segments == [1] and result.stats.snapshots == 0
    assert prompt_ids[0] == b.enc("user: go<|im_start|>")
    assert completion_ids[0] == b.enc(turn) + suffix(b, error) + b.enc(DONE)
    assert (n_calls, n_fail) == (1, 1)


def test_system_messages_cannot_be_deleted(tiny_tokenizer):
    convo = [{"role": "system", "content": "sys"}, {"role": "user", "content": "go"}]
    turn = delete(0)
    b = ScriptBackend(tiny_tokenizer, [[delete(1)], [DONE]])
    _, prompt_ids, (_, completions, _, _, _, _, _), result = run_tools_loop(b, [turn], [{}], cfg(), prompts=[convo])
    refused = render_tool_error("message 0 is a system message and cannot be deleted")
    assert completions[0][1]["content"] == refused
    (snap,) = result.extra_rows  # the retry deletes the user message instead
    assert prompt_ids[0] == b.enc(
        f"system:sys|user:[deleted]|assistant:|tool:{refused}|assistant:|tool:Deleted messages [1].<|im_start|>"
    )
    assert snap.prompt_ids == b.enc("system:sys|user:go<|im_start|>")


def test_all_delete_calls_of_one_turn_are_applied(tiny_tokenizer):
    turn1, t_add, both = (
        call("add", n=1),
        call("add", n=2),
        calls(("delete_context", {"message_ids": [2]}), ("delete_context", {"message_ids": [4]})),
    )
    b = ScriptBackend(tiny_tokenizer, [[t_add], [both], [DONE]])
    _, prompt_ids, (_, completions, _, _, _, _, _), result = run_loop(b, [turn1], [LedgerEnv()], cfg())
    assert [m["content"] for m in completions[0][-3:-1]] == ["Deleted messages [2].", "Deleted messages [4]."]
    assert prompt_ids[0] == b.enc(
        "user:user: go|assistant:|tool:[deleted]|assistant:|tool:[deleted]|assistant:"
        "|tool:Deleted messages [2].|tool:Deleted messages [4].<|im_start|>"
    )
    assert result.stats.snapshots == 1 and len(result.extra_rows) == 1


def test_a_deletion_next_to_a_malformed_call_still_applies(tiny_tokenizer):
    """Parse-error outcomes precede the calls' outcomes: the delete call must be matched to its own outcome."""
    turn1 = call("add", n=1)
    mixed = "<tool_call>{not json</tool_call>" + delete(2)
    b = GiveUpParseBackend(tiny_tokenizer, [[mixed], [DONE]])
    _, prompt_ids, (_, completions, _, _, n_calls, n_fail, _), result = run_loop(
        b, [turn1], [LedgerEnv()], cfg(malformed_tool_call_feedback=True)
    )
    parse_error, deleted = completions[0][3]["content"], completions[0][4]["content"]
    assert parse_error.startswith("{'error': 'invalid JSON") and deleted == "Deleted messages [2]."
    assert result.stats.snapshots == 1 and len(result.extra_rows) == 1
    assert prompt_ids[0] == b.enc(
        f"user:user: go|assistant:|tool:[deleted]|assistant:|tool:{parse_error}|tool:Deleted messages [2].<|im_start|>"
    )
    assert (n_calls, n_fail) == (3, 1)


def test_with_snapshots_off_a_tool_named_delete_context_is_an_ordinary_tool(tiny_tokenizer):
    def delete_context(message_ids: list[int]) -> str:
        """
        The environment's own tool.

        Args:
            message_ids: Anything.
        """
        return "env's own result"

    b = ScriptBackend(tiny_tokenizer, [[DONE]])
    _, prompt_ids, (_, completions, completion_ids, _, _, _, _), result = run_tools_loop(
        b, [delete(0)], [{"delete_context": delete_context}], cfg(enable_context_snapshots=False)
    )
    assert completions[0][1]["content"] == "env's own result"
    assert result.extra_rows == [] and result.num_segments == [1]
    assert completion_ids[0] == b.enc(delete(0)) + suffix(b, "env's own result") + b.enc(DONE)


def test_transformers_generation_without_logprobs(tiny_tokenizer):
    turn1, turn_del = call("add", n=2), delete(2)
    b = NoLogprobBackend(tiny_tokenizer, [[turn_del], [DONE]])
    env = LedgerEnv()
    _, prompt_ids, (tool_mask, _, completion_ids, logprobs, _, _, _), result = run_tools_loop(
        b, [turn1], [{"add": env.add}], cfg(), envs=[env], logprobs=False
    )
    (snap,) = result.extra_rows
    assert snap.logprobs is None and logprobs is None
    assert snap.completion_ids == b.enc(turn1) + suffix(b, "2") + b.enc(turn_del)
    assert completion_ids[0] == b.enc(DONE) and tool_mask[0] == [1] * len(b.enc(DONE))


def test_rollback_never_crosses_a_snapshot_boundary(tiny_tokenizer):
    """A failed turn after a deletion is rolled back to the start of the new segment; one before it, to its own
    start in the first segment. The environment is restored each time and the snapshot keeps only the good turn."""
    bad, good1, turn_del, bad2, good2 = (
        call("add", n="x"),
        call("add", n=1),
        delete(2),
        call("add", n="y"),
        call("add", n=3),
    )
    b = ScriptBackend(tiny_tokenizer, [[good1], [turn_del], [bad2], [good2], [DONE]])
    env = LedgerEnv()
    config = cfg(enable_tool_rollback=True, save_negative_samples=True, max_negative_samples_per_group=5)
    _, prompt_ids, (tool_mask, _, completion_ids, logprobs, _, _, _), result = run_loop(b, [bad], [env], config)
    e = b.enc
    p0 = e("user: go<|im_start|>")
    p1 = e("user:user: go|assistant:|tool:[deleted]|assistant:|tool:Deleted messages [2].<|im_start|>")
    neg0, neg1, snap = result.extra_rows  # negatives are saved as they happen, snapshots at the end
    assert [r.kind for r in result.extra_rows] == [RowKind.NEGATIVE, RowKind.NEGATIVE, RowKind.SNAPSHOT]
    err_x = render_tool_error("n must be an integer, got str")
    assert neg0.prompt_ids == p0 and neg0.segment_index == 0
    assert neg0.completion_ids == e(bad) + suffix(b, err_x)
    # Second failure: in segment 1, its negative starts from the stubbed prompt, not from the original one.
    assert neg1.prompt_ids == p1 and neg1.segment_index == 1
    assert neg1.completion_ids == e(bad2) + suffix(b, err_x)
    assert snap.prompt_ids == p0 and snap.completion_ids == e(good1) + suffix(b, "1") + e(turn_del)
    assert snap.tool_mask == [1] * len(e(good1)) + [0] * len(suffix(b, "1")) + [1] * len(e(turn_del))
    # Regenerations re-sent exactly the segment's prefix: p0 in segment 0, p1 in segment 1.
    assert [c[0] for c in b.calls] == [p0, p0 + e(good1) + suffix(b, "1"), p1, p1, p1 + e(good2) + suffix(b, "4")]
    assert prompt_ids[0] == p1
    assert completion_ids[0] == e(good2) + suffix(b, "4") + e(DONE)
    assert logprobs[0] == b.lps(e(good2)) + [0.0] * len(suffix(b, "4")) + b.lps(e(DONE))
    assert env.log == [1, 3] and env.total == 4
    assert result.stats.rollback_attempts == 2 and result.stats.snapshots == 1


def test_a_deletion_that_would_not_fit_is_refused_and_the_model_is_told(tiny_tokenizer):
    """The stubbed conversation re-renders longer than the context window allows: no snapshot, and the tool result
    says so instead of claiming a deletion."""
    stub = "S" * 300
    turn1, turn_del = call("add", n=2), delete(2)
    b = ScriptBackend(tiny_tokenizer, [[turn_del], [DONE]])
    p0 = b.enc("user: go<|im_start|>")
    refused = "Context not deleted: the shortened conversation is still too long."
    context_after = p0 + b.enc(turn1) + suffix(b, "2") + b.enc(turn_del) + suffix(b, refused)
    # Room for the old context and the answer, not for the 300-character stub (an answer past the room is cut).
    b.max_model_len = len(context_after) + len(b.enc(DONE))
    _, prompt_ids, (_, completions, completion_ids, _, _, _, _), result = run_loop(
        b, [turn1], [LedgerEnv()], cfg(context_stub_text=stub)
    )
    assert completions[0][3]["content"] == refused
    assert result.extra_rows == [] and result.stats.snapshots == 0 and result.num_segments == [1]
    assert prompt_ids[0] == p0 and b.calls == [[p0 + b.enc(turn1) + suffix(b, "2")], [context_after]]
    assert completion_ids[0] == context_after[len(p0) :] + b.enc(DONE)
    # The loop refused the call: a failed call in the counts and the record (it was counted a success), no rollback.
    assert result.stats.tool_calls == 2 and result.stats.tool_failures == 1 and result.tool_failed == [[False, True]]
    assert result.stats.rollback_attempts == 0


def test_the_worked_example_of_the_docs():
    """docs/snapshots.md: rewards [1, 2, 1, 0]; episode 2 has two snapshot rows, episode 4 one. The baseline masks
    are the ones the batch builds: final segments only ("episode") or every row ("row")."""
    import torch

    from trl_agentic.advantages import group_advantages

    rewards = torch.tensor([1.0, 2.0, 1.0, 0.0, 2.0, 2.0, 0.0])
    groups = torch.zeros(7, dtype=torch.long)
    episode = group_advantages(rewards, groups, baseline_mask=torch.tensor([True] * 4 + [False] * 3))
    row = group_advantages(rewards, groups, baseline_mask=torch.ones(7, dtype=torch.bool))
    a, b = 1 / (math.sqrt(2 / 3) + 1e-4), 8 / 7
    std = math.sqrt(sum((r - b) ** 2 for r in rewards.tolist()) / 6) + 1e-4
    assert episode.tolist() == pytest.approx([0, a, 0, -a, a, a, -a], abs=1e-6)
    assert row.tolist() == pytest.approx([(r - b) / std for r in rewards.tolist()], abs=1e-6)
    doc = (Path(__file__).resolve().parents[1] / "docs" / "snapshots.md").read_text()
    for value in (a, -a, (1 - b) / std, (2 - b) / std, (0 - b) / std):
        assert f"{value:.4f}".replace("-", "−") in doc


class StringArgumentsBackend(ScriptBackend):
    """A response parser that keeps tool-call arguments as the raw JSON string (some templates do)."""

    def parse(self, ids, prefix, row):
        message = super().parse(ids, prefix, row)
        for c in message.get("tool_calls", []):
            c["function"]["arguments"] = self.raw_arguments
        return message


@pytest.mark.parametrize(
    "raw,deleted",
    [
        ('{"message_ids": [0]}', True),
        ("message_ids=[0]", False),
    ],
)
def test_arguments_given_as_a_json_string(tiny_tokenizer, raw, deleted):
    b = StringArgumentsBackend(tiny_tokenizer, [[DONE]])
    b.raw_arguments = raw
    _, prompt_ids, (_, completions, _, _, _, n_fail, _), result = run_loop(b, [delete(0)], [LedgerEnv()], cfg())
    if deleted:
        assert completions[0][1]["content"] == "Deleted messages [0]."
        assert prompt_ids[0] == b.enc("user:[deleted]|assistant:|tool:Deleted messages [0].<|im_start|>")
        assert len(result.extra_rows) == 1 and n_fail == 0
    else:
        assert completions[0][1]["content"] == render_tool_error(
            "the arguments of delete_context must be a JSON object with a 'message_ids' list"
        )
        assert result.extra_rows == [] and n_fail == 1

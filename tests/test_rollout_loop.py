"""The rollout loop, driven by scripted generation: exact ids, masks and log-probs after tool calls and rollbacks."""

import time

import pytest
from rollout_helpers import LedgerEnv, ScriptBackend, call, run_loop, start

from trl_agentic.config import DEFAULT_INFRA_ERROR_PATTERNS, DEFAULT_ROLLBACK_ON_ERRORS
from trl_agentic.rollout.loop import AgenticRolloutLoop, LoopConfig
from trl_agentic.rollout.types import RowKind


def cfg(**overrides):
    base = dict(
        rollback_on_errors=list(DEFAULT_ROLLBACK_ON_ERRORS), infra_error_patterns=list(DEFAULT_INFRA_ERROR_PATTERNS)
    )
    base.update(overrides)
    return LoopConfig(**base)


def test_plain_tool_round_matches_trl_token_layout(tiny_tokenizer):
    """Without errors the loop builds exactly TRL's trajectory: turn, masked tool suffix, next turn."""
    b = ScriptBackend(tiny_tokenizer, [["The total is 2.<|im_end|>"]])
    env = LedgerEnv()
    turn1 = call("add", n=2)
    _, prompt_ids, (tool_mask, completions, completion_ids, logprobs, n_calls, n_fail, _), result = run_loop(
        b, [turn1], [env], cfg()
    )
    t1, suffix, t2 = b.enc(turn1), b.enc("<R>2</R><|im_start|>"), b.enc("The total is 2.<|im_end|>")
    assert completion_ids[0] == t1 + suffix + t2
    assert tool_mask[0] == [1] * len(t1) + [0] * len(suffix) + [1] * len(t2)
    assert logprobs[0] == b.lps(t1) + [0.0] * len(suffix) + b.lps(t2)
    assert b.calls == [[prompt_ids[0] + t1 + suffix]]
    assert (n_calls, n_fail) == (1, 0)
    assert [m["role"] for m in completions[0]] == ["assistant", "tool", "assistant"]
    assert env.total == 2 and result.extra_rows == []


@pytest.mark.parametrize("feedback", ["none", "hint"])
def test_rollback_saves_negative_restores_env_and_regenerates_only_the_failed_turn(tiny_tokenizer, feedback):
    bad, good, final = call("add", n="x"), call("add", n=3), "Total 3.<|im_end|>"
    b = ScriptBackend(tiny_tokenizer, [[good], [final]])
    env = LedgerEnv()
    config = cfg(enable_tool_rollback=True, save_negative_samples=True, rollback_feedback=feedback)
    _, prompt_ids, (tool_mask, completions, completion_ids, logprobs, n_calls, n_fail, _), result = run_loop(
        b, [bad], [env], config
    )
    p = prompt_ids[0]
    t_bad, t_good, t_final = b.enc(bad), b.enc(good), b.enc(final)
    err = "TypeError: n must be an integer, got str"
    hint = b.enc(f"<H>{config.rollback_hint_template.format(error=err)}</H>") if feedback == "hint" else []
    ok_suffix = b.enc("<R>3</R><|im_start|>")

    # The negative sample: the failed call and its error result, with the sampling log-probs of the failed turn.
    (neg,) = result.extra_rows
    err_suffix = b.enc(f"<R>{err}</R><|im_start|>")
    assert neg.kind == RowKind.NEGATIVE and neg.parent == 0 and neg.tool_position == 0
    assert neg.prompt_ids == p
    assert neg.completion_ids == t_bad + err_suffix
    assert neg.tool_mask == [1] * len(t_bad) + [0] * len(err_suffix)
    assert neg.logprobs == b.lps(t_bad) + [0.0] * len(err_suffix)
    assert neg.error_types == ["TypeError"] and neg.tool_calls[0]["function"]["arguments"] == {"n": "x"}

    # Regeneration reused the prefix: the first generate call saw only the prompt (+ the masked hint).
    assert b.calls[0] == [p + hint]
    assert len(b.calls) == 2
    # The final trajectory: (hint) + regenerated turn + tool result + final answer.
    assert completion_ids[0] == hint + t_good + ok_suffix + t_final
    assert tool_mask[0] == [0] * len(hint) + [1] * len(t_good) + [0] * len(ok_suffix) + [1] * len(t_final)
    assert logprobs[0] == [0.0] * len(hint) + b.lps(t_good) + [0.0] * len(ok_suffix) + b.lps(t_final)
    # The environment state after restore equals the state at the checkpoint: the failed call left no trace.
    assert env.log == [3] and env.total == 3
    assert result.stats.rollback_attempts == 1 and result.stats.rollback_recovered == 1
    assert result.stats.negatives_saved == 1 and n_fail == 1 and n_calls == 2
    roles = [m["role"] for m in completions[0]]
    assert roles == (["assistant", "user"] if feedback == "hint" else []) + ["assistant", "tool", "assistant"]


def test_retries_exhausted_keeps_error_and_continues(tiny_tokenizer):
    bad = call("add", n="x")
    b = ScriptBackend(tiny_tokenizer, [[bad], ["I give up.<|im_end|>"]])
    env = LedgerEnv()
    config = cfg(
        enable_tool_rollback=True, save_negative_samples=True, max_tool_retries=1, max_negative_samples_per_group=5
    )
    _, _, (tool_mask, completions, completion_ids, _, n_calls, n_fail, _), result = run_loop(b, [bad], [env], config)
    assert result.stats.rollback_attempts == 1 and result.stats.rollback_exhausted == 1
    assert len(result.extra_rows) == 1  # one negative for the one rollback; the kept error is not a negative
    assert "no retries left" in completions[0][1]["content"]
    assert (n_calls, n_fail) == (2, 2)
    assert env.log == ["x"]  # the kept failed call's side effect stays (no restore after exhaustion)


def test_negative_quota_per_group_and_retry_budget_bound_the_loop(tiny_tokenizer):
    bad = call("add", n="x")
    # Two rollouts of one group keep failing: 2 retries each, quota 1 negative for the group.
    b = ScriptBackend(tiny_tokenizer, [[bad, bad], [bad, bad], ["a<|im_end|>", "b<|im_end|>"]])
    envs = [LedgerEnv(), LedgerEnv()]
    config = cfg(enable_tool_rollback=True, save_negative_samples=True, max_tool_retries=2)
    *_, result = run_loop(b, [bad, bad], envs, config, group_ids=[7, 7])
    assert result.stats.rollback_attempts == 4
    assert len([r for r in result.extra_rows if r.kind == RowKind.NEGATIVE]) == 1
    assert result.stats.rollback_exhausted == 2
    assert len(b.calls) == 3 and all(len(c) == 2 for c in b.calls)  # one batched call per iteration


def test_without_rollback_errors_are_messages_and_no_negatives(tiny_tokenizer):
    bad = call("add", n="x")
    b = ScriptBackend(tiny_tokenizer, [["ok<|im_end|>"]])
    config = cfg(enable_tool_rollback=False, save_negative_samples=True)
    _, _, (_, completions, _, _, n_calls, n_fail, _), result = run_loop(b, [bad], [LedgerEnv()], config)
    assert result.extra_rows == [] and result.stats.rollback_attempts == 0
    assert completions[0][1]["content"].startswith("TypeError: n must be an integer")
    assert (n_calls, n_fail) == (1, 1)


class FlakyEnv(LedgerEnv):
    # The infrastructure's flakiness lives outside the environment state (a restore must not reset it).
    failures = 0

    def add(self, n: int) -> str:
        """
        Add a number to the running total.

        Args:
            n: The number to add.
        """
        if FlakyEnv.failures > 0:
            FlakyEnv.failures -= 1
            raise RuntimeError("SandboxTimeout: execution exceeded 1 s")
        return super().add(n)


@pytest.mark.parametrize("failures,expect_failed", [(1, False), (5, True)])
def test_infra_errors_are_retried_without_negatives(tiny_tokenizer, failures, expect_failed):
    turn = call("add", n=1)
    script = [] if expect_failed else [["done<|im_end|>"]]
    b = ScriptBackend(tiny_tokenizer, script)
    FlakyEnv.failures = failures
    env = FlakyEnv()
    config = cfg(enable_tool_rollback=True, save_negative_samples=True, max_infra_retries=2)
    *_, result = run_loop(b, [turn], [env], config)
    assert result.extra_rows == []
    assert result.stats.infra_retries == min(failures, 2)
    assert result.infra_failed == [expect_failed]
    assert result.stats.rollback_attempts == 0


def test_continuations_and_regenerations_share_one_generation_call(tiny_tokenizer):
    good, bad = call("add", n=1), call("add", n="x")
    b = ScriptBackend(tiny_tokenizer, [["end0<|im_end|>", call("add", n=2)], ["end1<|im_end|>"]])
    envs = [LedgerEnv(), LedgerEnv()]
    config = cfg(enable_tool_rollback=True)
    _, prompt_ids, (_, _, completion_ids, _, _, _, _), _ = run_loop(b, [good, bad], envs, config)
    # Iteration 1: row 0 continues after its tool result, row 1 regenerates its failed turn — one call, two contexts.
    assert len(b.calls[0]) == 2
    assert b.calls[0][1] == prompt_ids[1]
    assert envs[1].log == [2] and envs[0].log == [1]


def test_malformed_unknown_and_bad_arguments_reach_the_model(tiny_tokenizer):
    turns = [
        "<tool_call>{not json</tool_call><|im_end|>",
        call("nope", x=1),
        call("add"),
        '<tool_call>{"name": "add", "arguments": {"n": 1}}<|im_end|>',  # unclosed
    ]
    b = ScriptBackend(tiny_tokenizer, [["fine<|im_end|>"] * 4])
    envs = [LedgerEnv() for _ in turns]
    _, _, (_, completions, _, _, n_calls, n_fail, _), result = run_loop(b, turns, envs, cfg())
    contents = [c[1]["content"] for c in completions]
    assert contents[0].startswith("ToolCallParseError: invalid JSON")
    assert contents[1].startswith("ToolNotFoundError: unknown tool 'nope'; available tools: add")
    assert contents[2].startswith("TypeError:") and "missing" in contents[2]
    assert contents[3] == "ToolCallParseError: unclosed <tool_call> tag"
    assert (n_calls, n_fail) == (4, 4) and result.stats.malformed_calls == 2


class NastyEnv:
    def reset(self, **kwargs):
        pass

    def hang(self) -> str:
        """Never returns."""
        time.sleep(30)
        return "late"

    def huge(self) -> str:
        """Returns megabytes."""
        return "x" * 5_000_000

    def number(self) -> int:
        """Returns a non-string."""
        return 42


def test_hanging_huge_and_non_string_tools_never_stall(tiny_tokenizer):
    turns = [call("hang"), call("huge"), call("number")]
    b = ScriptBackend(tiny_tokenizer, [["ok<|im_end|>"] * 2])
    envs = [NastyEnv() for _ in turns]
    prompts, prompt_ids, completion_ids, completions, logprobs = start(b, turns)
    tools = [{"hang": e.hang, "huge": e.huge, "number": e.number} for e in envs]
    loop = AgenticRolloutLoop(b, cfg(tool_timeout=0.5, max_tool_output_chars=1000))
    t0 = time.monotonic()
    (_, completions, *_), result = loop.run(
        prompts, prompt_ids, completion_ids, completions, logprobs, tools, [{}] * 3, envs
    )
    assert time.monotonic() - t0 < 5
    hang, huge, number = (c[1]["content"] for c in completions)
    assert hang.startswith("ToolTimeout: tool did not return within 0.5 s")
    assert len(huge) <= 1000 and "truncated" in huge
    assert number == "42"
    assert result.infra_failed == [True, False, False]  # ToolTimeout is an infrastructure failure

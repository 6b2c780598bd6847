"""The rollout loop, driven by scripted generation: exact ids, masks and log-probs after tool calls and rollbacks."""

import threading

import pytest
from rollout_helpers import LedgerEnv, ScriptBackend, call, run_loop, run_tools_loop, start

from trl_agentic.config import DEFAULT_INFRA_ERROR_TYPES, DEFAULT_ROLLBACK_ON_ERRORS
from trl_agentic.envs.protocol import UserTurn
from trl_agentic.errors import InfrastructureError, ToolCallError, render_tool_error
from trl_agentic.rollout.loop import AgenticRolloutLoop, LoopConfig
from trl_agentic.rollout.types import RowKind

TYPE_ERROR = "n must be an integer, got str"


def cfg(**overrides):
    base = dict(rollback_on_errors=list(DEFAULT_ROLLBACK_ON_ERRORS), infra_error_types=list(DEFAULT_INFRA_ERROR_TYPES))
    base.update(overrides)
    return LoopConfig(**base)


def rollback_cfg(**overrides):
    return cfg(enable_tool_rollback=True, save_negative_samples=True, **overrides)


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
    config = rollback_cfg(rollback_feedback=feedback)
    _, prompt_ids, (tool_mask, completions, completion_ids, logprobs, n_calls, n_fail, _), result = run_loop(
        b, [bad], [env], config
    )
    p = prompt_ids[0]
    t_bad, t_good, t_final = b.enc(bad), b.enc(good), b.enc(final)
    hint_text = config.rollback_hint_template.format(error=f"TypeError: {TYPE_ERROR}")
    hint = b.enc(f"<H>{hint_text}</H>") if feedback == "hint" else []
    ok_suffix = b.enc("<R>3</R><|im_start|>")

    # The negative sample: the failed call and its error result (in TRL's error format), with the sampling
    # log-probs of the failed turn.
    (neg,) = result.extra_rows
    err_suffix = b.enc(f"<R>{render_tool_error(TYPE_ERROR)}</R><|im_start|>")
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


def test_a_negative_row_trains_only_its_failed_turn(tiny_tokenizer):
    """A failure at the second turn: the good first turn (also in the regular row) is the negative row's context
    (its prompt), so the negative advantage never reaches it; the row's trainable tokens are the failed turn's."""
    good1, bad, good2, final = call("add", n=1), call("add", n="x"), call("add", n=2), "Total 3.<|im_end|>"
    b = ScriptBackend(tiny_tokenizer, [[bad], [good2], [final]])
    env = LedgerEnv()
    _, prompt_ids, (tool_mask, _, completion_ids, _, _, _, _), result = run_loop(b, [good1], [env], rollback_cfg())
    p, e = prompt_ids[0], b.enc
    s1 = e("<R>1</R><|im_start|>")
    err = e(f"<R>{render_tool_error(TYPE_ERROR)}</R><|im_start|>")
    (neg,) = result.extra_rows
    assert neg.prompt_ids == p + e(good1) + s1
    assert neg.completion_ids == e(bad) + err
    assert neg.tool_mask == [1] * len(e(bad)) + [0] * len(err)
    assert neg.logprobs == b.lps(e(bad)) + [0.0] * len(err)
    trained = [t for t, m in zip(neg.completion_ids, neg.tool_mask) if m]
    assert trained == e(bad)
    # The regular row trains the good first turn, the regenerated turn and the answer.
    assert completion_ids[0] == e(good1) + s1 + e(good2) + e("<R>3</R><|im_start|>") + e(final)
    assert [t for t, m in zip(completion_ids[0], tool_mask[0]) if m] == e(good1) + e(good2) + e(final)
    assert env.log == [1, 2]


def test_retries_exhausted_keeps_error_and_continues(tiny_tokenizer):
    bad = call("add", n="x")
    b = ScriptBackend(tiny_tokenizer, [[bad], ["I give up.<|im_end|>"]])
    env = LedgerEnv()
    config = rollback_cfg(max_tool_retries=1, max_negative_samples_per_group=5)
    _, _, (tool_mask, completions, completion_ids, _, n_calls, n_fail, _), result = run_loop(b, [bad], [env], config)
    assert result.stats.rollback_attempts == 1 and result.stats.rollback_exhausted == 1
    assert len(result.extra_rows) == 1  # one negative for the one rollback; the kept error is not a negative
    assert completions[0][1]["content"] == render_tool_error(TYPE_ERROR)
    assert (n_calls, n_fail) == (2, 2)
    assert env.log == ["x"]  # the kept failed call's side effect stays (no restore after exhaustion)


def test_negative_quota_per_group_and_retry_budget_bound_the_loop(tiny_tokenizer):
    bad = call("add", n="x")
    # Two rollouts of one group keep failing: 2 retries each, quota 1 negative for the group.
    b = ScriptBackend(tiny_tokenizer, [[bad, bad], [bad, bad], ["a<|im_end|>", "b<|im_end|>"]])
    envs = [LedgerEnv(), LedgerEnv()]
    *_, result = run_loop(b, [bad, bad], envs, rollback_cfg(max_tool_retries=2), group_ids=[7, 7])
    assert result.stats.rollback_attempts == 4
    assert len([r for r in result.extra_rows if r.kind == RowKind.NEGATIVE]) == 1
    assert result.stats.rollback_exhausted == 2
    assert len(b.calls) == 3 and all(len(c) == 2 for c in b.calls)  # one batched call per iteration


def test_without_rollback_errors_are_trl_messages_and_no_negatives(tiny_tokenizer):
    bad = call("add", n="x")
    b = ScriptBackend(tiny_tokenizer, [["ok<|im_end|>"]])
    config = cfg(enable_tool_rollback=False, save_negative_samples=True, tool_timeout=5.0)
    _, _, (_, completions, _, _, n_calls, n_fail, _), result = run_loop(b, [bad], [LedgerEnv()], config)
    assert result.extra_rows == [] and result.stats.rollback_attempts == 0
    assert completions[0][1]["content"] == "{'error': 'n must be an integer, got str'}"  # TRL's rendering
    assert (n_calls, n_fail) == (1, 1)


class ModelCodeEnv(LedgerEnv):
    """Tools reporting the failures of model-written code the way the Python sandbox does (typed model errors)."""

    def loop_forever(self) -> str:
        """Runs code that never ends."""
        self.log.append("loop")
        raise ToolCallError("execution exceeded 5 s", error_type="SandboxTimeout")

    def caught(self) -> str:
        """Runs code that catches an error and prints it."""
        self.log.append("caught")
        return "Traceback (most recent call last):\nValueError: caught and printed by the model's own code"


def test_model_code_failures_are_model_errors_and_printed_errors_are_results(tiny_tokenizer):
    """A timeout of model-written code is the model's error: rolled back, saved as a negative (the policy is
    penalised), never retried as infrastructure nor dropped. A result that merely prints an error is a result."""
    b = ScriptBackend(tiny_tokenizer, [[call("caught")], ["done<|im_end|>"]])
    env = ModelCodeEnv()
    prompts, prompt_ids, completion_ids, completions, logprobs = start(b, [call("loop_forever")])
    tools = [{"loop_forever": env.loop_forever, "caught": env.caught}]
    loop = AgenticRolloutLoop(b, rollback_cfg())
    (_, completions, *_), result = loop.run(
        prompts, prompt_ids, completion_ids, completions, logprobs, tools, [{}], [env]
    )
    (neg,) = result.extra_rows
    assert neg.kind == RowKind.NEGATIVE and neg.error_types == ["SandboxTimeout"]
    assert result.infra_failed == [False] and result.stats.infra_retries == 0
    assert result.stats.rollback_attempts == 1
    assert env.log == ["caught"]  # the timed-out call was rolled back, the printing one ran once
    assert completions[0][1]["content"].startswith("Traceback") and result.stats.tool_failures == 1


class FlakyEnv(LedgerEnv):
    # The infrastructure's flakiness lives outside the environment state (a restore must not reset it).
    failures = 0

    def flaky_add(self, n: int) -> str:
        """
        Add a number through a flaky service.

        Args:
            n: The number to add.
        """
        if FlakyEnv.failures > 0:
            FlakyEnv.failures -= 1
            raise InfrastructureError("the service refused the connection")
        return super().add(n)


@pytest.mark.parametrize("rollback", [False, True])
@pytest.mark.parametrize("failures,expect_failed", [(1, False), (5, True)])
def test_infra_errors_are_retried_in_place_without_negatives(tiny_tokenizer, rollback, failures, expect_failed):
    """Only the failed call is re-run: the call before it in the same turn ran once (the environment saw it once),
    with or without rollback (no checkpoint to restore without it)."""
    turn = "".join(call(name, n=k).replace("<|im_end|>", "") for name, k in (("add", 1), ("flaky_add", 2)))
    turn += "<|im_end|>"
    script = [] if expect_failed else [["done<|im_end|>"]]
    b = ScriptBackend(tiny_tokenizer, script)
    FlakyEnv.failures = failures
    env = FlakyEnv()
    config = (rollback_cfg if rollback else cfg)(max_infra_retries=2)
    _, _, (_, completions, *_), result = run_tools_loop(
        b, [turn], [{"add": env.add, "flaky_add": env.flaky_add}], config, envs=[env]
    )
    assert result.extra_rows == []
    assert result.stats.infra_retries == min(failures, 2)
    assert result.infra_failed == [expect_failed]
    assert result.stats.rollback_attempts == 0
    assert env.log == ([1] if expect_failed else [1, 2])
    if not expect_failed:
        assert [m["content"] for m in completions[0][1:3]] == ["1", "3"]


def test_continuations_and_regenerations_share_one_generation_call(tiny_tokenizer):
    good, bad = call("add", n=1), call("add", n="x")
    b = ScriptBackend(tiny_tokenizer, [["end0<|im_end|>", call("add", n=2)], ["end1<|im_end|>"]])
    envs = [LedgerEnv(), LedgerEnv()]
    _, prompt_ids, (_, _, completion_ids, _, _, _, _), _ = run_loop(
        b, [good, bad], envs, cfg(enable_tool_rollback=True)
    )
    # Iteration 1: row 0 continues after its tool result, row 1 regenerates its failed turn — one call, two contexts.
    assert len(b.calls[0]) == 2
    assert b.calls[0][1] == prompt_ids[1]
    assert envs[1].log == [2] and envs[0].log == [1]


@pytest.mark.parametrize("feedback", [False, True])
def test_malformed_unknown_and_bad_arguments_reach_the_model(tiny_tokenizer, feedback):
    turns = [
        "<tool_call>{not json</tool_call><|im_end|>",
        call("nope", x=1),
        call("add"),
        '<tool_call>{"name": "add", "arguments": {"n": 1}}<|im_end|>',  # unclosed
    ]
    b = ScriptBackend(tiny_tokenizer, [["fine<|im_end|>"] * (4 if feedback else 2)])
    envs = [LedgerEnv() for _ in turns]
    _, _, (_, completions, _, _, n_calls, n_fail, _), result = run_loop(
        b, turns, envs, cfg(malformed_tool_call_feedback=feedback)
    )
    assert completions[1][1]["content"] == render_tool_error("Tool nope not found.")  # TRL's message
    assert completions[2][1]["content"].startswith("{'error': ") and "missing" in completions[2][1]["content"]
    if feedback:
        contents = [c[1]["content"] for c in completions]
        assert contents[0].startswith("{'error': 'invalid JSON in <tool_call> block")
        assert contents[3] == render_tool_error("unclosed <tool_call> tag")
        assert (n_calls, n_fail) == (4, 4) and result.stats.malformed_calls == 2
    else:  # TRL ignores malformed markup: those rollouts end as plain text
        assert len(completions[0]) == len(completions[3]) == 1
        assert (n_calls, n_fail) == (2, 2) and result.stats.malformed_calls == 0


class NastyEnv:
    clock = None  # the test's `tool_clock`: `hang` declares itself hung to it before blocking

    def __init__(self):
        self.log = []
        self.release = threading.Event()
        self.finished = threading.Event()

    def reset(self, **kwargs):
        self.log = []

    def _checkpoint(self):
        return list(self.log)

    def _restore(self, state):
        self.log = list(state)

    def hang(self) -> str:
        """Blocks until released, then changes the state."""
        NastyEnv.clock.hang()
        self.release.wait()
        self.log.append("late")
        self.finished.set()
        return "late"

    def huge(self) -> str:
        """Returns megabytes."""
        return "x" * 5_000_000

    def number(self) -> int:
        """Returns a non-string."""
        return 42


def test_hanging_huge_and_non_string_tools_never_stall(tiny_tokenizer, tool_clock):
    NastyEnv.clock = tool_clock  # the hung call times out when it blocks; the others always return in time
    turns = [call("hang"), call("huge"), call("number")]
    b = ScriptBackend(tiny_tokenizer, [["ok<|im_end|>"] * 3])
    envs = [NastyEnv() for _ in turns]
    prompts, prompt_ids, completion_ids, completions, logprobs = start(b, turns)
    tools = [{"hang": e.hang, "huge": e.huge, "number": e.number} for e in envs]
    loop = AgenticRolloutLoop(b, cfg(tool_timeout=30.0, max_tool_output_chars=1000))
    (_, completions, *_), result = loop.run(
        prompts, prompt_ids, completion_ids, completions, logprobs, tools, [{}] * 3, envs
    )
    hang, huge, number = (c[1]["content"] for c in completions)
    assert hang == render_tool_error("tool did not return within 30 s")
    assert len(huge) <= 1000 and "truncated" in huge
    assert number == "42"
    assert result.infra_failed == [False, False, False]  # a timeout is a model error, not infrastructure
    assert result.stats.truncated_outputs == 1 and result.stats.retired_environments == 1
    tools[0]["hang"].__self__.release.set()  # let the abandoned thread end


def test_a_timed_out_call_never_touches_the_environment_after_the_restore(tiny_tokenizer, tool_clock):
    """The hung call completes after the loop rolled back: it changes only the retired instance; the rollout
    continued (and the trainer's pool holds) a fresh instance restored to the state before the call."""
    NastyEnv.clock = tool_clock
    b = ScriptBackend(tiny_tokenizer, [[call("number")], ["ok<|im_end|>"]])
    env = NastyEnv()
    envs = [env]
    prompts, prompt_ids, completion_ids, completions, logprobs = start(b, [call("hang")])
    tools = [{"hang": env.hang, "huge": env.huge, "number": env.number}]
    config = rollback_cfg(tool_timeout=30.0, rollback_on_errors=["ToolTimeout"])
    loop = AgenticRolloutLoop(b, config)
    (_, completions, *_), result = loop.run(
        prompts, prompt_ids, completion_ids, completions, logprobs, tools, [{}], envs
    )
    (neg,) = result.extra_rows
    assert neg.error_types == ["ToolTimeout"] and result.stats.rollback_attempts == 1
    ((row, old, new),) = b.new_environments
    assert row == 0 and old is env and envs[0] is new and new is not env
    assert tools[0]["number"].__self__ is new and tools[0]["hang"].__self__ is new
    # Let the abandoned call finish now: it writes into the retired instance only.
    env.release.set()
    assert env.finished.wait(timeout=60)
    assert env.log == ["late"] and new.log == []
    assert completions[0][-1]["content"] == "ok"


def test_a_turn_cut_by_the_budget_is_not_rolled_back_nor_a_negative(tiny_tokenizer):
    """The second turn runs out of completion budget inside its tool call: no `ToolCallParseError` rollback into the
    same exhausted budget, no negative row; the rollout ends there and the turn is counted as truncated."""
    good = call("add", n=1)
    cut = '<tool_call>{"name": "add", "arguments": {"n": 100000000000}}</tool_call><|im_end|>'
    b = ScriptBackend(tiny_tokenizer, [[cut]])
    first = b.enc(good) + b.enc("<R>1</R><|im_start|>")
    b.max_completion_length = len(first) + 12  # the second turn is cut after 12 tokens
    env = LedgerEnv()
    _, _, (tool_mask, completions, completion_ids, _, _, _, _), result = run_loop(b, [good], [env], rollback_cfg())
    assert completion_ids[0] == first + b.enc(cut)[:12]
    assert result.extra_rows == [] and result.stats.rollback_attempts == 0
    assert result.stats.truncated_turns == 1 and result.stats.malformed_calls == 0
    assert len(b.calls) == 1 and env.log == [1]
    assert tool_mask[0][-12:] == [1] * 12  # still the model's tokens (TRL's mask_truncated_completions decides)


@pytest.mark.parametrize("n", [1, "x"])
def test_a_truncated_first_turn_runs_its_calls_as_trl_and_drops_their_results(tiny_tokenizer, n):
    """A first turn cut by the budget right after a complete call: TRL's loop runs the call (its side effects happen)
    and drops its result, which cannot fit (the cut filled the budget). Ours does the same, and never rolls such a turn
    back nor makes it a negative, even when the call fails with an error listed in `rollback_on_errors`."""
    b = ScriptBackend(tiny_tokenizer, [])
    env = LedgerEnv()
    complete_call_without_eos = call("add", n=n).replace("<|im_end|>", "")
    b.max_completion_length = len(b.enc(complete_call_without_eos))
    config = rollback_cfg(rollback_on_errors=["TypeError"])
    _, _, (tool_mask, completions, completion_ids, *_), result = run_loop(
        b, [complete_call_without_eos], [env], config
    )
    assert env.log == [n] and result.stats.truncated_turns == 1 and result.stats.tool_calls == 1
    assert completion_ids[0] == b.enc(complete_call_without_eos) and tool_mask[0] == [1] * len(completion_ids[0])
    assert [m["role"] for m in completions[0]] == ["assistant"]  # the result was dropped
    assert result.extra_rows == [] and result.stats.rollback_attempts == 0 and b.calls == []


class ConversationEnv(LedgerEnv):
    """Three user requests; the second one makes `double` available and withdraws `add`."""

    def reset(self, **kwargs):
        super().reset()
        self.requests = ["Now double it.", "Thanks, that's all."]
        self.seen = []

    def double(self) -> str:
        """Double the total."""
        self.log.append("double")
        self.total *= 2
        return str(self.total)

    def _next_user_turn(self, assistant_message):
        self.seen.append(assistant_message.get("content"))
        if not self.requests:
            return None
        content = self.requests.pop(0)
        if content.startswith("Now"):
            return UserTurn(content, add_tools=[self.double], remove_tools=["add"])
        return content


def test_user_turns_continue_the_same_row_with_masked_tokens_and_new_tools(tiny_tokenizer):
    b = ScriptBackend(
        tiny_tokenizer,
        [["It is 2.<|im_end|>"], [call("add", n=1)], [call("double")], ["It is 4.<|im_end|>"], ["Bye.<|im_end|>"]],
    )
    env = ConversationEnv()
    env.reset()
    tools = [{"add": env.add}]
    config = rollback_cfg(rollback_on_errors=["ToolNotFoundError"])
    prompts, prompt_ids, (tool_mask, completions, completion_ids, logprobs, *_), result = run_tools_loop(
        b, [call("add", n=2)], tools, config, envs=[env]
    )
    e = b.enc
    u1, u2 = e("<U>Now double it.</U><|im_start|>"), e("<U>Thanks, that's all.</U><|im_start|>")
    pieces = [
        (e(call("add", n=2)), 1),
        (e("<R>2</R><|im_start|>"), 0),
        (e("It is 2.<|im_end|>"), 1),
        (u1, 0),
        (e(call("double")), 1),  # the call to the withdrawn `add` was rolled back and regenerated
        (e("<R>4</R><|im_start|>"), 0),
        (e("It is 4.<|im_end|>"), 1),
        (u2, 0),
        (e("Bye.<|im_end|>"), 1),
    ]
    assert completion_ids[0] == [t for ids, _ in pieces for t in ids]
    assert tool_mask[0] == [m for ids, m in pieces for _ in ids]
    assert logprobs[0] == [lp for ids, m in pieces for lp in (b.lps(ids) if m else [0.0] * len(ids))]
    roles = [m["role"] for m in completions[0]]
    assert roles == ["assistant", "tool", "assistant", "user", "assistant", "tool", "assistant", "user", "assistant"]
    assert env.seen == ["It is 2.", "It is 4.", "Bye."] and env.log == [2, "double"]
    assert set(tools[0]) == {"double"}
    # The rollback inside the second request restored the state after the first request's call.
    (neg,) = result.extra_rows
    assert neg.prompt_ids == prompt_ids[0] + [t for ids, _ in pieces[:4] for t in ids]
    assert neg.error_types == ["ToolNotFoundError"] and result.stats.user_turns == 2
    # The conversation the tokens render, for the next segment or a re-render.
    assert [m["role"] for m in prompts[0]] == [
        *["user", "assistant", "tool", "assistant"],
        *["user", "assistant", "tool", "assistant"],
        "user",
    ]
    assert prompts[0][4]["content"] == "Now double it." and prompts[0][8]["content"] == "Thanks, that's all."


def test_a_user_turn_that_does_not_fit_ends_the_rollout_and_leaves_the_environment_as_it_was(tiny_tokenizer):
    b = ScriptBackend(tiny_tokenizer, [])
    b.max_completion_length = len(b.enc("It is 2.<|im_end|>")) + 3
    env = ConversationEnv()
    env.reset()
    _, _, (_, completions, *_), result = run_tools_loop(
        b, ["It is 2.<|im_end|>"], [{"add": env.add}], cfg(), envs=[env]
    )
    assert result.stats.user_turns == 0 and result.stats.user_turns_dropped == 1 and len(completions[0]) == 1
    # The hook ran (it popped a request and recorded the answer), but the model never saw the turn: its effects on
    # the environment, which the reward reads, are taken back.
    assert env.requests == ["Now double it.", "Thanks, that's all."] and env.seen == []


@pytest.mark.parametrize("room", [0, 1])
@pytest.mark.parametrize("budget", ["max_completion_length", "max_model_len"])
def test_a_user_turn_is_asked_only_with_room_left_for_its_answer(tiny_tokenizer, room, budget):
    """A turn that fills the budget exactly would end the rollout on an unanswered question: it is dropped. One token
    of room is enough under either budget (as for a tool result)."""
    b = ScriptBackend(tiny_tokenizer, [["Sure.<|im_end|>"]] if room else [])
    first, turn = b.enc("It is 2.<|im_end|>"), b.enc("<U>Now double it.</U><|im_start|>")
    if budget == "max_completion_length":
        b.max_completion_length = len(first) + len(turn) + room
    else:  # `prompt + completion < max_model_len`: one position is the answer's
        b.max_model_len = len(b.enc("user: go<|im_start|>")) + len(first) + len(turn) + room
    env = ConversationEnv()
    env.reset()
    _, _, (tool_mask, completions, completion_ids, *_), result = run_tools_loop(
        b, ["It is 2.<|im_end|>"], [{"add": env.add}], cfg(), envs=[env]
    )
    if room and budget == "max_model_len":  # the backend's generation cuts the answer (not scripted here)
        assert completion_ids[0][: len(first + turn)] == first + turn and result.stats.user_turns == 1
        assert env.requests == ["Thanks, that's all."]  # the next turn, after the scripted answer, did not fit
    elif room:
        answer = b.enc("Sure.<|im_end|>")[:1]  # cut to the one token left
        assert completion_ids[0] == first + turn + answer and tool_mask[0][-1] == 1
        assert result.stats.user_turns == 1 and result.stats.truncated_turns == 1
        assert env.requests == ["Thanks, that's all."]
    else:
        assert completion_ids[0] == first and result.stats.user_turns_dropped == 1 and len(b.calls) == 0
        assert env.requests == ["Now double it.", "Thanks, that's all."]


def test_turns_after_a_tool_change_are_parsed_with_the_new_tools(tiny_tokenizer):
    """Argument typing follows the tools the rollout has now (a response template types `"7"` as 7 for an integer
    parameter only if it knows the function): every parse after the change gets the new list."""
    b = ScriptBackend(tiny_tokenizer, [[call("double")], ["It is 4.<|im_end|>"], ["Bye.<|im_end|>"]])
    env = ConversationEnv()
    env.reset()
    run_tools_loop(b, ["It is 2.<|im_end|>"], [{"add": env.add}], cfg(), envs=[env])
    assert b.parse_tools == [None, ["double"], ["double"], ["double"]]


def test_a_retry_that_answers_without_tools_is_not_counted_as_recovered(tiny_tokenizer):
    """The failed call's retry gives up (no call); a later, unrelated successful round is not its recovery."""
    b = ScriptBackend(tiny_tokenizer, [["I cannot.<|im_end|>"], [call("add", n=1)], ["1.<|im_end|>"]])
    env = ConversationEnv()
    env.reset()
    env.requests = ["Try adding one."]
    *_, result = run_tools_loop(b, [call("add", n="x")], [{"add": env.add}], rollback_cfg(), envs=[env])
    s = result.stats
    assert (s.rollback_attempts, s.rollback_recovered, s.rollback_exhausted) == (1, 0, 0)
    assert env.log == [1] and env.total == 1  # the failed call was rolled back


class BrokenHookEnv(ConversationEnv):
    def _next_user_turn(self, assistant_message):
        raise RuntimeError("the user simulator crashed")


def test_an_exception_in_the_loop_is_raised_not_swallowed(tiny_tokenizer):
    """In one process it propagates; with several, every rank raises it at the next synchronisation
    (tests/distributed: test_an_error_on_one_rank_stops_every_rank)."""
    b = ScriptBackend(tiny_tokenizer, [])
    env = BrokenHookEnv()
    with pytest.raises(RuntimeError, match="user simulator crashed"):
        run_tools_loop(b, ["Hello.<|im_end|>"], [{"add": env.add}], cfg(), envs=[env])


def test_a_deletion_after_a_user_turn_rerenders_the_whole_conversation(tiny_tokenizer):
    """Context snapshots across user turns: the model deletes the first request's tool result in the second request;
    the closed segment holds both requests, and the next segment's prompt is the conversation (user turns included)
    with the stub."""
    b = ScriptBackend(
        tiny_tokenizer,
        [["It is 2.<|im_end|>"], [call("delete_context", message_ids=[2])], ["Ok.<|im_end|>"], ["Bye.<|im_end|>"]],
    )
    env = ConversationEnv()
    env.reset()
    env.requests = ["Forget the details.", "Thanks."]
    tools = [{"add": env.add}]
    config = cfg(enable_context_snapshots=True)
    _, prompt_ids, (tool_mask, completions, completion_ids, *_), result = run_tools_loop(
        b, [call("add", n=2)], tools, config, envs=[env]
    )
    (snap,) = result.extra_rows
    e = b.enc
    assert snap.kind == RowKind.SNAPSHOT and snap.prompt_ids == e("user: go<|im_start|>")
    assert snap.completion_ids == (
        e(call("add", n=2))
        + e("<R>2</R><|im_start|>")
        + e("It is 2.<|im_end|>")
        + e("<U>Forget the details.</U><|im_start|>")
        + e(call("delete_context", message_ids=[2]))
    )
    expected_prompt = (
        "user:user: go|assistant:|tool:[deleted]|assistant:It is 2.|user:Forget the details."
        "|assistant:|tool:Deleted messages [2].<|im_start|>"
    )
    assert prompt_ids[0] == e(expected_prompt)
    # The last segment continues the conversation: its answer, the next user turn, the final answer.
    assert completion_ids[0] == e("Ok.<|im_end|>") + e("<U>Thanks.</U><|im_start|>") + e("Bye.<|im_end|>")
    assert tool_mask[0] == [1] * len(e("Ok.<|im_end|>")) + [0] * len(e("<U>Thanks.</U><|im_start|>")) + [1] * len(
        e("Bye.<|im_end|>")
    )
    assert result.stats.user_turns == 2 and result.num_segments == [2]


def test_a_retry_whose_call_fails_with_an_error_outside_the_rollback_list_is_not_counted_as_recovered(tiny_tokenizer):
    """The regenerated turn calls an unknown tool (not in `rollback_on_errors`: no second rollback): no recovery."""
    b = ScriptBackend(tiny_tokenizer, [[call("nope")], ["Done.<|im_end|>"]])
    env = LedgerEnv()
    *_, result = run_tools_loop(b, [call("add", n="x")], [{"add": env.add}], rollback_cfg(), envs=[env])
    s = result.stats
    assert s.rollback_attempts == 1 and s.tool_failures == 2
    assert s.rollback_recovered == 0


class _OneUserTurnEnv(LedgerEnv):
    """Asks one further user turn (`turn()`), then ends the conversation."""

    def reset(self, **kwargs):
        super().reset()
        self.asked = False

    def _next_user_turn(self, message):
        if self.asked:
            return None
        self.asked = True
        return self.turn()


class _AsyncAddEnv(_OneUserTurnEnv):
    """A user turn replaces the sync `add` by an async one that adds ten times as much."""

    def turn(self):
        env = self

        async def add(n: int) -> str:
            """
            Add ten times n.

            Args:
                n: The number.
            """
            env.total += 10 * n
            return str(env.total)

        return UserTurn("Now add counts tenfold.", add_tools=[add])


def test_a_tool_added_by_a_user_turn_replaces_a_tool_of_the_same_name_of_the_other_kind(tiny_tokenizer):
    """An async `add` added over a sync `add` is the one called afterwards, and the parser sees one `add`."""
    import asyncio

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    try:
        b = ScriptBackend(tiny_tokenizer, [[call("add", n=1)], ["Done.<|im_end|>"]])
        env = _AsyncAddEnv()
        env.reset()
        p, prompt_ids, completion_ids, completions, lps = start(b, ["Hi.<|im_end|>"])
        AgenticRolloutLoop(b, cfg(), async_loop=loop).run(
            p, prompt_ids, completion_ids, completions, lps, [{"add": env.add}], [{}], [env]
        )
    finally:
        loop.call_soon_threadsafe(loop.stop)
    assert env.total == 10  # the new tool ran, not the old one (which would give 1)
    assert [t.count("add") if t else None for t in b.parse_tools] == [None, 1, 1]


class _WithdrawDeletionEnv(_OneUserTurnEnv):
    def turn(self):
        return UserTurn("No more deleting.", remove_tools=["delete_context"])


def test_a_user_turn_can_withdraw_delete_context(tiny_tokenizer):
    """After `remove_tools=["delete_context"]` a call to it is an unknown tool: nothing is deleted."""
    from rollout_helpers import calls

    from trl_agentic.rollout.context import delete_context

    b = ScriptBackend(tiny_tokenizer, [[calls(("delete_context", {"message_ids": [0]}))], ["Ok.<|im_end|>"]])
    env = _WithdrawDeletionEnv()
    env.reset()
    *_, result = run_tools_loop(
        b,
        ["Hi.<|im_end|>"],
        [{"add": env.add, "delete_context": delete_context}],
        cfg(enable_context_snapshots=True),
        envs=[env],
    )
    assert result.stats.snapshots == 0 and result.stats.tool_failures == 1


def test_a_user_turn_adding_its_own_delete_context_is_refused(tiny_tokenizer):
    """With snapshots on, `delete_context` is trl-agentic's: an environment's tool of that name is an error, not
    silently replaced."""

    class Env(LedgerEnv):
        def _next_user_turn(self, message):
            def delete_context(message_ids: list[int]) -> str:
                """
                Forget things.

                Args:
                    message_ids: Which.
                """
                return "gone"

            return UserTurn("Here is a tool.", add_tools=[delete_context])

    b = ScriptBackend(tiny_tokenizer, [])
    env = Env()
    env.reset()
    with pytest.raises(ValueError, match="adds a tool named `delete_context`"):
        run_tools_loop(b, ["Hi.<|im_end|>"], [{"add": env.add}], cfg(enable_context_snapshots=True), envs=[env])


class AsyncEnv(LedgerEnv):
    async def slow(self, n: int) -> str:
        """
        Waits forever for n == 0 (the call's time limit stops it), else returns n.

        Args:
            n: A number.
        """
        import asyncio

        if n == 0:
            await asyncio.Event().wait()
        self.log.append(n)
        return str(n)


def test_async_calls_run_after_the_sync_ones_together_and_time_out_alone(tiny_tokenizer, event_loop_thread):
    """TRL's order (sync results, then async ones in call order); a never-ending async call is cancelled at
    `tool_timeout` and reported, the other async call of the turn still returns; a call with bad arguments fails
    where TRL reports it, among the sync results. The timeout is deterministic: the returning call completes in its
    first step, before the event loop can run the timer (tool_timeout=30 only makes a wrong design slow, not flaky)."""
    env = AsyncEnv()
    turn = (
        "<tool_call>"
        + '{"name": "slow", "arguments": {"n": 0}}</tool_call><tool_call>{"name": "add", "arguments": {"n": 2}}'
        + '</tool_call><tool_call>{"name": "slow", "arguments": {"n": 5}}</tool_call>'
        + '<tool_call>{"name": "slow", "arguments": {"m": 1}}</tool_call><|im_end|>'
    )
    b = ScriptBackend(tiny_tokenizer, [["Done.<|im_end|>"]])
    p, prompt_ids, completion_ids, completions, lps = start(b, [turn])
    config = cfg(tool_timeout=1.0)
    trl_tuple, result = AgenticRolloutLoop(b, config, async_loop=event_loop_thread).run(
        p, prompt_ids, completion_ids, completions, lps, [{"add": env.add}], [{"slow": env.slow}], [env]
    )
    tools = [(m["name"], m["content"]) for m in trl_tuple[1][0] if m["role"] == "tool"]
    assert tools == [
        ("add", "2"),
        ("slow", render_tool_error("AsyncEnv.slow() got an unexpected keyword argument 'm'")),
        ("slow", render_tool_error("tool did not return within 1 s")),
        ("slow", "5"),
    ]
    assert result.stats.tool_calls == 4 and result.stats.tool_failures == 2
    assert result.stats.retired_environments == 1 and env.log == [2, 5]


def test_async_calls_after_a_timed_out_sync_call_run_on_the_fresh_environment(tiny_tokenizer, event_loop_thread):
    """An async call made before a sync call that times out: the sync call retires the environment, and the async
    call (run after it, in TRL's order) must act on the fresh instance the rollout goes on with, not the retired one."""
    release = threading.Event()  # outside the environment's state (checkpoints deep-copy it)

    class HangEnv(AsyncEnv):
        def hang(self) -> str:
            """
            Returns once the test releases it (past the call's time limit).
            """
            release.wait()
            return "late"

    env = HangEnv()
    turn = (
        '<tool_call>{"name": "slow", "arguments": {"n": 7}}</tool_call>'
        '<tool_call>{"name": "hang", "arguments": {}}</tool_call><|im_end|>'
    )
    b = ScriptBackend(tiny_tokenizer, [["Done.<|im_end|>"]])
    p, prompt_ids, completion_ids, completions, lps = start(b, [turn])
    envs = [env]
    try:
        trl_tuple, result = AgenticRolloutLoop(b, cfg(tool_timeout=1.0), async_loop=event_loop_thread).run(
            p, prompt_ids, completion_ids, completions, lps, [{"hang": env.hang}], [{"slow": env.slow}], envs
        )
    finally:
        release.set()
    tools = [(m["name"], m["content"]) for m in trl_tuple[1][0] if m["role"] == "tool"]
    assert tools == [("hang", render_tool_error("tool did not return within 1 s")), ("slow", "7")]
    assert result.stats.retired_environments == 1 and envs[0] is not env
    assert envs[0].log == [7] and env.log == []  # the model read "7": the state it goes on with holds it


def test_rollback_of_an_async_and_sync_turn_restores_the_state_and_keeps_trls_order(tiny_tokenizer, event_loop_thread):
    """A turn calling an async tool, then a sync call that fails with a rollback error: both ran (TRL runs every call
    of a turn, the sync ones first), the restore undoes both, and the negative row holds the results in TRL's order
    (the sync error first) as messages and as tokens."""
    env = AsyncEnv()
    turn = '<tool_call>{"name": "slow", "arguments": {"n": 5}}</tool_call>' + call("add", n="x")
    good = call("add", n=2)
    b = ScriptBackend(tiny_tokenizer, [[good], ["Done.<|im_end|>"]])
    p, prompt_ids, completion_ids, completions, lps = start(b, [turn])
    trl_tuple, result = AgenticRolloutLoop(b, rollback_cfg(), async_loop=event_loop_thread).run(
        p, prompt_ids, completion_ids, completions, lps, [{"add": env.add}], [{"slow": env.slow}], [env]
    )
    (neg,) = result.extra_rows
    expected = [("add", render_tool_error(TYPE_ERROR)), ("slow", "5")]
    assert [(m["name"], m["content"]) for m in neg.messages if m["role"] == "tool"] == expected
    suffix = b.enc("".join(f"<R>{content}</R>" for _, content in expected) + "<|im_start|>")
    assert neg.completion_ids == b.enc(turn) + suffix and neg.error_types == ["TypeError"]
    assert env.log == [2] and env.total == 2  # "x" and 5 were undone by the restore; only the regenerated call stays
    roles = [m["role"] for m in trl_tuple[1][0]]
    assert roles == ["assistant", "tool", "assistant"] and trl_tuple[1][0][1]["content"] == "2"


def test_list_results_pass_through_and_images_are_refused(tiny_tokenizer):
    """A list result is the message content, as in TRL's loop; `max_tool_output_chars` cuts its text blocks; an
    image block stops the loop (it does not handle images, like images in prompts)."""
    blocks = [{"type": "text", "text": "a" * 30}, {"type": "text", "text": "b" * 30}]
    image = [{"type": "image", "image": "img"}, {"type": "text", "text": "c"}]
    b = ScriptBackend(tiny_tokenizer, [["Done.<|im_end|>"] * 2])
    tools = [{"get": lambda: list(blocks)}, {"get": lambda: blocks[:1]}]
    _, _, trl_tuple, result = run_tools_loop(b, [call("get")] * 2, tools, cfg(max_tool_output_chars=40))
    cut, whole = (c[1]["content"] for c in trl_tuple[1])
    assert whole == blocks[:1] and result.stats.truncated_outputs == 1
    assert [x["type"] for x in cut] == ["text", "text"] and cut[0]["text"] == "a" * 30
    assert cut[1]["text"] == "\n...[truncated 30 chars]"  # no room left for any of the 30: the marker alone
    assert blocks[1]["text"] == "b" * 30  # the tool's own value is not modified
    with pytest.raises(NotImplementedError, match="images"):
        run_tools_loop(ScriptBackend(tiny_tokenizer, []), [call("get")], [{"get": lambda: image}], cfg())


class RoomBackend(ScriptBackend):
    """An engine without per-turn limits that, like any engine, generates no token past the model's context."""

    def generate(self, contexts):
        ids, lps = super().generate(contexts)
        rooms = [self.max_model_len - len(c) for c in contexts]
        return [x[:n] for x, n in zip(ids, rooms)], [x[:n] for x, n in zip(lps, rooms)]


class LimitedBackend(ScriptBackend):
    """A backend that asks the engine for no more than the loop can keep (`takes_turn_limits`, as the asynchronous
    worker's): each scripted output is cut at its limit, as vLLM cuts at `max_tokens`."""

    takes_turn_limits = True

    def __init__(self, tokenizer, script):
        super().__init__(tokenizer, script)
        self.limits: list[list[int]] = []

    def generate(self, contexts, limits=None):
        self.limits.append(list(limits))
        ids, lps = super().generate(contexts)
        return [x[:n] for x, n in zip(ids, limits)], [x[:n] for x, n in zip(lps, limits)]


class CallLimitedBackend(ScriptBackend):
    """A backend whose engine takes one length for the whole call (`takes_call_limit`, as the trainer's): each
    scripted output is cut at that limit, as `generate` stops at `max_new_tokens`, and not at the model's context
    (transformers' `generate` generates past `max_position_embeddings`, with a warning): the loop cuts by room."""

    takes_call_limit = True

    def __init__(self, tokenizer, script):
        super().__init__(tokenizer, script)
        self.call_limits: list[int] = []

    def generate(self, contexts, limit=None):
        self.call_limits.append(limit)
        ids, lps = super().generate(contexts)
        return [x[:limit] for x in ids], [x[:limit] for x in lps]


@pytest.mark.parametrize(
    ("budget", "room", "feedback"),
    [(70, None, "none"), (90, None, "hint"), (400, None, "none"), (400, 130, "hint"), (400, 130, "none")],
)
@pytest.mark.parametrize("cap", [None, 25])
def test_asking_the_engine_for_what_the_loop_keeps_changes_no_row(tiny_tokenizer, budget, room, feedback, cap):
    """The same scripted rollouts (a failing call rolled back, with or without a hint, a good call, a long answer)
    with an engine that ignores the per-turn limits (it stops only at the model's context) and one that honours them: every row, mask, log-prob and negative
    row is the same, and no limit asks for more than the rollout's remaining budget, the cap or the room left in the
    model's context (`room`: `max_model_len` above the prompt)."""
    turns = [call("add", n="x"), call("add", n=1)]
    script = [[call("add", n=2), "The total is three, as it was asked for, nothing less.<|im_end|>"]]
    script += [["Done, the total is three.<|im_end|>"], ["Done.<|im_end|>"]]
    prompt_len = len(ScriptBackend(tiny_tokenizer, []).enc("user: go<|im_start|>"))

    def run(backend_cls):
        b = backend_cls(tiny_tokenizer, [list(s) for s in script] * 2)
        b.max_completion_length = budget
        if room is not None:
            b.max_model_len = prompt_len + room
        config = rollback_cfg(max_turn_tokens=cap, rollback_feedback=feedback)
        _, prompt_ids, trl_tuple, result = run_loop(b, turns, [LedgerEnv(), LedgerEnv()], config)
        rows = [(e.kind, e.parent, e.prompt_ids, e.completion_ids, e.tool_mask, e.logprobs) for e in result.extra_rows]
        return b, prompt_ids, trl_tuple, rows, result.stats

    plain, prompt_ids, expected, expected_rows, expected_stats = run(RoomBackend)
    limited, _, got, rows, stats = run(LimitedBackend)
    assert got == expected and rows == expected_rows
    counters = ("truncated_turns", "turn_cap_truncations", "hints_dropped", "rollback_attempts")
    assert [getattr(stats, c) for c in counters] == [getattr(expected_stats, c) for c in counters]
    # An engine that stops at nothing (the evaluation's backend takes no limit): the loop cuts every turn itself.
    _, _, got, rows, stats = run(ScriptBackend)
    assert got == expected and rows == expected_rows
    assert [getattr(stats, c) for c in counters] == [getattr(expected_stats, c) for c in counters]
    assert stats.rollback_attempts > 0
    if room is None:
        assert (stats.truncated_turns > 0) == (cap is not None or budget < 400)  # the limits did cut turns
    by_room = 0  # limits set by the room left in the model's context
    for contexts, limits in zip(limited.calls, limited.limits):
        for context, limit in zip(contexts, limits):
            prompt = next(len(p) for p in prompt_ids if context[: len(p)] == p)
            left = budget - (len(context) - prompt)
            assert 1 <= limit <= left and (cap is None or limit <= cap)
            assert len(context) + limit <= limited.max_model_len
            by_room += limit == limited.max_model_len - len(context) < min(left, cap or left)
    assert by_room == 0 if room is None else (by_room > 0 or cap is not None)  # the room term bound some request
    assert all(len(ids) <= budget for ids in got[2])  # no completion over the budget
    # One length for the whole call (the trainer's engine): the same rows, and the length is the most any context of
    # the call can keep (its remaining budget, the cap, the room in the model's context), computed here independently.
    called, _, got, rows, stats = run(CallLimitedBackend)
    assert got == expected and rows == expected_rows
    assert [getattr(stats, c) for c in counters] == [getattr(expected_stats, c) for c in counters]
    for contexts, limit in zip(called.calls, called.call_limits):
        keeps = []
        for context in contexts:
            prompt = next(len(p) for p in prompt_ids if context[: len(p)] == p)
            keeps.append(min(budget - (len(context) - prompt), called.max_model_len - len(context), cap or budget))
        assert limit == max(max(keeps), 1)
    assert min(called.call_limits) < budget  # some later turn asked for less than the whole budget


def test_a_rollback_hint_without_room_is_left_out(tiny_tokenizer):
    """`rollback_feedback="hint"`: with room for it the hint is appended (masked) before the retried turn; with a
    budget that the failed turn almost filled, the hint would leave the retry no token, so it is left out and counted:
    the retry is sampled from the checkpoint's context and the completion stays within `max_completion_length` (it
    used to exceed it by the hint's length)."""
    bad = call("add", n="x")
    b = ScriptBackend(tiny_tokenizer, [])
    used = len(b.enc(bad))
    for budget, dropped in ((used + 200, 0), (used + 5, 1)):
        b = ScriptBackend(tiny_tokenizer, [["Done.<|im_end|>"]])
        b.max_completion_length = budget
        _, prompt_ids, (tool_mask, _, completion_ids, *_), result = run_loop(
            b, [bad], [LedgerEnv()], rollback_cfg(rollback_feedback="hint")
        )
        assert result.stats.rollback_attempts == 1 and result.stats.hints_dropped == dropped
        assert len(completion_ids[0]) <= budget
        hint_tokens = len(completion_ids[0]) - sum(tool_mask[0])
        assert (hint_tokens > 0) == (dropped == 0)  # the hint is the row's only environment text
        assert b.calls[0][0][len(prompt_ids[0]) :] == ([] if dropped else completion_ids[0][:hint_tokens])


@pytest.mark.parametrize("turn", ["first", "later"])
def test_a_turn_the_engine_stopped_on_a_generation_kwargs_stop_token_is_complete(tiny_tokenizer, turn):
    """vLLM also stops on `generation_kwargs`' `stop_token_ids` (a base checkpoint whose eos is `<|endoftext|>`, told
    to stop at `<|im_end|>`): such a turn, well within its limit, was taken for a cut one, so its call ran, its result
    was dropped and the rollout ended there (TRL's loop goes on). The first turn is TRL's generation, a later one
    the loop's."""
    later = [[call("add", n=3)]] if turn == "later" else []
    b = ScriptBackend(tiny_tokenizer, [*later, ["Total.<|im_end|>"]])
    b.stop_token_ids = {tiny_tokenizer.convert_tokens_to_ids("<|endoftext|>")}  # the engine's eos and pad only
    env = LedgerEnv()
    _, _, (_, completions, *_), result = run_loop(b, [call("add", n=2)], [env], cfg())
    assert result.stats.truncated_turns == 0
    rounds = 2 if turn == "later" else 1
    assert [m["role"] for m in completions[0]] == ["assistant", "tool"] * rounds + ["assistant"]
    assert env.log == [2, 3][:rounds]
    # The control: the same turn filling its limit is cut, as before.
    cut = ScriptBackend(tiny_tokenizer, [])
    cut.stop_token_ids = b.stop_token_ids
    cut.max_completion_length = len(cut.enc(call("add", n=2)))
    _, _, (_, completions, *_), result = run_loop(cut, [call("add", n=2)], [LedgerEnv()], cfg())
    assert result.stats.truncated_turns == 1 and [m["role"] for m in completions[0]] == ["assistant"]

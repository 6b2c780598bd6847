"""The per-turn token cap (`max_turn_tokens`): a turn that reaches it without an end-of-turn token is truncated like a
turn cut by `max_completion_length` (calls TRL's parser still finds in it run, their results are dropped, the rollout
ends there), counted in `truncated_turns` and, apart, in `turn_cap_truncations`; the trainer makes every engine
generate at most that many tokens per turn."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from rollout_helpers import LedgerEnv, ScriptBackend, call, run_loop
from trl import GRPOTrainer

from trl_agentic import AgenticGRPOConfig, AgenticGRPOTrainer
from trl_agentic.config import DEFAULT_INFRA_ERROR_TYPES, DEFAULT_ROLLBACK_ON_ERRORS
from trl_agentic.rollout.loop import LoopConfig


def cfg(**overrides):
    base = dict(rollback_on_errors=list(DEFAULT_ROLLBACK_ON_ERRORS), infra_error_types=list(DEFAULT_INFRA_ERROR_TYPES))
    base.update(overrides)
    return LoopConfig(**base)


def test_a_turn_longer_than_the_cap_is_cut_there_and_ends_the_rollout(tiny_tokenizer):
    """An engine that ignored the cap: the loop cuts the turn to the cap; the cut turn's tool call is not run."""
    first = call("add", n=1)
    second = call("add", n=222)  # longer than the cap: its call would run if it were not cut
    b = ScriptBackend(tiny_tokenizer, [[second]])
    env = LedgerEnv()
    cap = len(b.enc(first))  # the first turn fits exactly (it ends with <|im_end|>)
    _, _, (tool_mask, _, completion_ids, logprobs, _, _, _), result = run_loop(
        b, [first], [env], cfg(max_turn_tokens=cap)
    )
    suffix = b.enc("<R>1</R><|im_start|>")
    assert completion_ids[0] == b.enc(first) + suffix + b.enc(second)[:cap]
    assert tool_mask[0] == [1] * cap + [0] * len(suffix) + [1] * cap
    assert logprobs[0][-cap:] == b.lps(b.enc(second))[:cap]
    assert env.log == [1] and len(b.calls) == 1  # no third generation: the rollout ended at the cut turn
    assert result.stats.truncated_turns == 1 and result.stats.turn_cap_truncations == 1


def test_a_complete_call_in_a_turn_cut_by_the_cap_runs_and_its_result_is_dropped(tiny_tokenizer):
    """TRL's rule for a cut turn, applied to the cap: the call its parser finds runs (side effects), its result does
    not join the conversation, and the rollout ends with the cut turn, whatever budget is left."""
    first = call("add", n=1)
    second = call("add", n=2).removesuffix("<|im_end|>") + " and more words after the call"
    b = ScriptBackend(tiny_tokenizer, [[second]])
    env = LedgerEnv()
    cap = len(b.enc(second)) - 3  # the call is complete, the text after it is cut
    assert cap > len(b.enc(first))
    _, _, (tool_mask, completions, completion_ids, _, tool_calls, _, _), result = run_loop(
        b, [first], [env], cfg(max_turn_tokens=cap)
    )
    suffix = b.enc("<R>1</R><|im_start|>")
    assert completion_ids[0] == b.enc(first) + suffix + b.enc(second)[:cap]
    assert env.log == [1, 2] and tool_calls == 2 and len(b.calls) == 1
    assert [m["role"] for m in completions[0]] == ["assistant", "tool", "assistant"]  # the cut turn's result dropped
    assert result.stats.truncated_turns == 1 and result.stats.turn_cap_truncations == 1


def test_a_turn_ending_exactly_at_the_cap_is_complete(tiny_tokenizer):
    first, second = call("add", n=1), "Done.<|im_end|>"
    b = ScriptBackend(tiny_tokenizer, [[second]])
    env = LedgerEnv()
    cap = max(len(b.enc(first)), len(b.enc(second)))
    *_, result = run_loop(b, [first], [env], cfg(max_turn_tokens=cap))
    assert env.log == [1] and result.stats.truncated_turns == 0 and result.stats.turn_cap_truncations == 0


def test_a_first_turn_cut_by_the_cap_is_counted_and_not_executed(tiny_tokenizer):
    b = ScriptBackend(tiny_tokenizer, [])
    env = LedgerEnv()
    cut = b.tok.decode(b.enc(call("add", n=1))[:7])
    *_, result = run_loop(b, [cut], [env], cfg(max_turn_tokens=7))
    assert env.log == [] and result.stats.truncated_turns == 1 and result.stats.turn_cap_truncations == 1


def test_the_budget_not_the_cap_cuts_a_turn_that_runs_out_of_budget_first(tiny_tokenizer):
    """Remaining budget below the cap: a budget truncation, not a cap truncation (each is reported apart)."""
    good = call("add", n=1)
    b = ScriptBackend(tiny_tokenizer, [["x" * 50 + "<|im_end|>"]])
    first = b.enc(good) + b.enc("<R>1</R><|im_start|>")
    b.max_completion_length = len(first) + 10  # 10 tokens of budget left, cap 20
    _, _, (_, _, completion_ids, _, _, _, _), result = run_loop(b, [good], [LedgerEnv()], cfg(max_turn_tokens=20))
    assert len(completion_ids[0]) == len(first) + 10
    assert result.stats.truncated_turns == 1 and result.stats.turn_cap_truncations == 0


def test_the_cap_routes_tool_rollouts_through_our_loop():
    base = dict(output_dir="/tmp/trl-agentic-config-test", use_cpu=True, report_to="none")
    assert not AgenticGRPOConfig(**base).uses_agentic_loop
    assert AgenticGRPOConfig(**base, max_turn_tokens=64).uses_agentic_loop


def lookup(query: str) -> str:
    """
    Look something up.

    Args:
        query: What to look up.
    """
    return query


def tool_trainer(model_dir, tmp_path, prompts, caching: bool, **overrides) -> AgenticGRPOTrainer:
    """The tiny model with one tool, a zero reward and a 40-token budget, on the transformers paths."""
    args = AgenticGRPOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        report_to="none",
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=40,
        transformers_prefix_caching=caching,
        save_strategy="no",
        **overrides,
    )
    return AgenticGRPOTrainer(
        model=model_dir,
        reward_funcs=lambda completions, **kwargs: [0.0] * len(completions),
        args=args,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        tools=[lookup],
    )


@pytest.mark.parametrize("caching", [True, False])
def test_the_trainer_generates_at_most_the_cap_and_masks_cut_turns(tiny_model_dir, tmp_path, caching):
    """Both transformers paths (prefix caching and TRL's own) stop a turn at the cap; with
    `mask_truncated_completions` TRL masks such a rollout, as it masks one cut by `max_completion_length`."""
    prompts = [[{"role": "user", "content": "hi" * n}] for n in (1, 1, 4, 4)]
    trainer = tool_trainer(
        tiny_model_dir, tmp_path, prompts, max_turn_tokens=5, mask_truncated_completions=True, caching=caching
    )
    assert (trainer._prefix_cache is not None) == caching
    eos = trainer._tokenizer.eos_token_id
    # The tiny random model hardly ever writes <|im_end|>: forbid it so that every turn runs into the cap.
    original = trainer.model.generate
    trainer.model.generate = lambda *a, **k: original(*a, **{**k, "suppress_tokens": [eos]})
    trainer.model.train()
    batch = trainer._generate_and_score_completions([{"prompt": p} for p in prompts])
    lengths = batch["completion_mask"].shape[1]
    assert lengths == 5  # every rollout is its first turn, cut at 5 tokens (not 40)
    assert batch["completion_mask"].sum().item() == 0  # all truncated, all masked (TRL's rule)
    assert trainer._last_loop_result.stats.turn_cap_truncations == 4
    metrics = trainer._metrics["train"]  # the metrics the config's help names
    assert metrics["tools/truncated_turns"][-1] == metrics["tools/turn_cap_truncations"][-1] == 4
    assert trainer.generation_config.max_new_tokens == 40  # the cap applied to a copy, not the trainer's config
    # Without the cap, TRL's own generation runs past it.
    ids, _ = GRPOTrainer._generate_single_turn(trainer, [[1, 2, 3]], None, {}, 1)
    assert len(ids[0]) > 5
    assert torch.is_tensor(batch["completion_ids"])


def test_the_cap_reaches_vllm_for_the_call_only():
    """With vLLM the cap is vLLM's `max_completion_length` during the call (TRL reads it at every `generate`)."""
    import inspect
    from types import SimpleNamespace

    from trl.generation.vllm_generation import VLLMGeneration

    from trl_agentic.generation import GenerationMixin

    assert "max_completion_length = self.max_completion_length" in inspect.getsource(VLLMGeneration.generate)
    seen = []
    engine = SimpleNamespace(max_completion_length=100)
    trainer = SimpleNamespace(args=SimpleNamespace(max_turn_tokens=7), use_vllm=True, vllm_generation=engine)
    with GenerationMixin._turn_cap(trainer):
        seen.append(engine.max_completion_length)
    assert seen == [7] and engine.max_completion_length == 100
    trainer.args.max_turn_tokens = 500  # larger than the rollout budget: the budget stays
    with GenerationMixin._turn_cap(trainer):
        seen.append(engine.max_completion_length)
    assert seen == [7, 100] and engine.max_completion_length == 100


def test_the_call_limit_reaches_vllm_for_the_call_only():
    """A later turn's call limit (`_generation_limit`) is vLLM's length during the call, the smaller of it and the cap."""
    from types import SimpleNamespace

    from trl_agentic.generation import GenerationMixin

    engine = SimpleNamespace(max_completion_length=100)
    trainer = SimpleNamespace(args=SimpleNamespace(max_turn_tokens=None), use_vllm=True, vllm_generation=engine)
    seen = []
    for cap, limit in [(None, 12), (7, 12), (30, 12), (None, None), (None, 400)]:
        trainer.args.max_turn_tokens = cap
        with GenerationMixin._generation_limit(trainer, limit), GenerationMixin._turn_cap(trainer):
            seen.append(engine.max_completion_length)
        assert engine.max_completion_length == 100 and trainer._call_limit is None
    assert seen == [12, 7, 12, 100, 100]


@pytest.mark.parametrize("caching", [True, False])
def test_a_call_limit_asks_the_engine_for_fewer_tokens_and_keeps_the_same_ones(tiny_model_dir, tmp_path, caching):
    """`TrainerBackend.generate(contexts, limit=k)` (what the loop passes for a later turn: the most any context of the
    call can keep) generates at most k tokens per context on both transformers paths, and those are the first k tokens
    the unlimited call samples from the same random state; the trainer's generation config is left as it was."""
    from trl_agentic.rollout.trl_backend import TrainerBackend

    prompts = [[{"role": "user", "content": "hi"}]] * 4
    trainer = tool_trainer(tiny_model_dir, tmp_path, prompts, enable_tool_rollback=True, caching=caching)  # our loop
    assert (trainer._prefix_cache is not None) == caching
    eos = trainer._tokenizer.eos_token_id
    original = trainer.model.generate
    trainer.model.generate = lambda *a, **k: original(*a, **{**k, "suppress_tokens": [eos]})  # run to the length
    trainer.model.eval()  # no dropout: prefix caching applies
    backend = TrainerBackend(trainer)
    contexts = [[1, 2, 3, 4], [5, 6, 7, 8, 9, 10], [11, 12]]
    torch.manual_seed(0)
    unlimited, _ = backend.generate(contexts)
    torch.manual_seed(0)
    limited, _ = backend.generate(contexts, limit=6)
    assert [len(x) for x in unlimited] == [40, 40, 40]
    assert limited == [x[:6] for x in unlimited]
    assert trainer.generation_config.max_new_tokens == 40 and trainer._call_limit is None

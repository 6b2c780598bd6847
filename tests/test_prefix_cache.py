"""Prefix caching across turns (`transformers_prefix_caching`, `trl_agentic.rollout.prefix_cache`).

The reference is TRL's own generation from the whole history: `GRPOTrainer._generate_single_turn` on the same
trainer. With caching the greedy tokens must be the same and the logits of every generated position equal to float
tolerance (recorded by a logits processor at generation time), over turns that append tool results, roll back
(the cache is cropped) and delete context (reuse up to the first changed token), with rows of different lengths in
one left-padded batch.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
from datasets import Dataset
from hypothesis import given
from hypothesis import strategies as st
from transformers import LogitsProcessor, LogitsProcessorList
from trl import GRPOTrainer

from trl_agentic import AgenticGRPOConfig, AgenticGRPOTrainer
from trl_agentic.rollout.prefix_cache import (
    CachedConversation,
    PrefixCache,
    common_prefix_length,
    cut_after_eos,
    plan_layout,
    token_array,
)

# ----------------------------------------------------------------------------------------------- pure functions


def _plain_common_prefix_length(a, b):
    n = 0
    while n < len(a) and n < len(b) and a[n] == b[n]:
        n += 1
    return n


def _plain_match(conversations, context, min_reuse):
    """`PrefixCache.match` as a plain loop: the first kept conversation with the strictly longest prefix."""
    best, best_n = None, 0
    for conversation in conversations:
        n = min(_plain_common_prefix_length(conversation.ids, context), len(conversation.ids), len(context) - 1)
        if n > best_n:
            best, best_n = conversation, n
    return (None, 0) if best_n < min_reuse else (best, best_n)


tokens = st.lists(st.integers(0, 3), max_size=12)
# Token lists sharing a prefix of a common base: equal lists, one a prefix of the other, empty ones, early and late
# mismatches, and (small alphabet, short tails) several kept conversations with equally long best prefixes.
base = st.lists(st.integers(0, 3), max_size=40)
derived = st.tuples(st.integers(0, 40), st.lists(st.integers(0, 3), max_size=4))


def _derive(base_ids, cut_tail):
    cut, tail = cut_tail
    return base_ids[:cut] + tail


@given(tokens, tokens)
def test_common_prefix_length_matches_a_plain_loop(a, b):
    assert common_prefix_length(a, b) == _plain_common_prefix_length(a, b)


@given(base, derived, derived)
def test_common_prefix_length_of_shared_prefixes_lists_and_arrays(base_ids, x, y):
    a, b = _derive(base_ids, x), _derive(base_ids, y)
    expected = _plain_common_prefix_length(a, b)
    assert common_prefix_length(a, b) == expected
    assert common_prefix_length(token_array(a), token_array(b)) == expected
    assert common_prefix_length(token_array(a), b) == expected
    assert common_prefix_length(a, a) == common_prefix_length(token_array(a), token_array(a)) == len(a)
    assert common_prefix_length(a, []) == common_prefix_length([], a) == 0
    assert common_prefix_length(a, a + b) == len(a)  # one a prefix of the other


@given(st.integers(0, 6000), st.integers(0, 6000), st.integers(0, 6000))
def test_common_prefix_length_across_its_compare_blocks(length, other, mismatch):
    """Long lists (compared in blocks of 1024, 4096, ... tokens): a mismatch anywhere, or none."""
    a = [k % 7 for k in range(length)]
    b = [k % 7 for k in range(other)]
    if mismatch < len(b):
        b[mismatch] = 9
    expected = _plain_common_prefix_length(a, b)
    assert common_prefix_length(a, b) == common_prefix_length(token_array(a), token_array(b)) == expected


@given(base, st.lists(derived, max_size=6), st.lists(derived, min_size=1, max_size=5), st.integers(0, 4), st.data())
def test_match_is_the_first_longest_kept_prefix_of_a_plain_loop(base_ids, kept, contexts, min_reuse, data):
    kept_ids = [_derive(base_ids, k) for k in kept]
    if kept_ids and data.draw(st.booleans()):
        kept_ids.append(list(data.draw(st.sampled_from(kept_ids))))  # an equal copy: a tie the first must win
    conversations = [CachedConversation(ids=ids, keys=[], values=[]) for ids in kept_ids]
    pool = PrefixCache(min_reuse=min_reuse, conversations=conversations)
    contexts = [_derive(base_ids, c) for c in contexts]
    expected = [_plain_match(conversations, c, min_reuse) for c in contexts]
    for got, want in zip([pool.match(c) for c in contexts], expected, strict=True):
        assert got[0] is want[0] and got[1] == want[1]
    for got, want in zip(pool.match_all(contexts), expected, strict=True):
        assert got[0] is want[0] and got[1] == want[1]
    # Matching the conversations in two parts (as `share_prefixes` does for the prefixes it adds) is one pass.
    split = data.draw(st.integers(0, len(conversations)))
    arrays = [token_array(c) for c in contexts]
    whole = pool._longest(arrays, conversations)
    parts = pool._longest(arrays, conversations[split:], pool._longest(arrays, conversations[:split]))
    assert [(id(c), n) for c, n in parts] == [(id(c), n) for c, n in whole]


@given(st.lists(st.tuples(st.integers(1, 40), st.integers(0, 40)), min_size=1, max_size=6), st.integers(0, 7))
def test_plan_layout_takes_the_longest_feasible_cache(rows, extra_padding):
    lengths = [t for t, _ in rows]
    reusable = [min(r, t - 1) for t, r in rows]
    padded = max(lengths) + extra_padding
    cache_length, used = plan_layout(lengths, reusable, padded)
    # Brute force: the largest C such that every row's cached tokens reach column C (row i starts at padded - T_i).
    best = max(
        c for c in range(padded + 1) if all(padded - t + r >= c for t, r in zip(lengths, reusable, strict=True))
    )
    assert cache_length == best
    for t, r, u in zip(lengths, reusable, used, strict=True):
        start = padded - t
        assert u == max(0, best - start) and u <= r


def test_cut_after_eos_keeps_the_first_end_of_sequence_token():
    rows = [[5, 6, 2, 7, 2], [5, 6, 7], [3, 9, 9], []]
    assert cut_after_eos(rows, [2, 3]) == [[5, 6, 2], [5, 6, 7], [3], []]


# ----------------------------------------------------------------------------------------------- generation level


def lookup(query: str) -> str:
    """
    Look something up.

    Args:
        query: What to look up.
    """
    return query


class Recorder(LogitsProcessor):
    """Keeps the raw next-token logits of every generation step (applied after TRL's processors: none when greedy)."""

    def __init__(self):
        self.steps: list[torch.Tensor] = []

    def __call__(self, input_ids, scores):
        self.steps.append(scores.detach().float().clone())
        return scores


def _record(model):
    """Route `model.generate` through a `Recorder`; returns the list of recorders (one per generate call)."""
    calls = []
    original = model.generate

    def generate(*args, **kwargs):
        recorder = Recorder()
        calls.append(recorder)
        return original(*args, logits_processor=LogitsProcessorList([recorder]), **kwargs)

    model.generate = generate
    return calls


def _trainer(tmp_path, model_dir, peft_config=None, **overrides):
    fields = dict(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        report_to="none",
        seed=0,
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=12,
        generation_kwargs={"do_sample": False},
        save_strategy="no",
        # A feature on (never triggered: the tool returns at once), so that trl-agentic's loop runs: the cache serves
        # only that loop (with every feature off TRL's generation runs untouched).
        tool_timeout=600.0,
    )
    fields.update(overrides)
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": "hi"}]] * 4})
    return AgenticGRPOTrainer(
        model=model_dir,
        reward_funcs=lambda completions, **kwargs: [0.0] * len(completions),
        args=AgenticGRPOConfig(**fields),
        train_dataset=dataset,
        tools=[lookup],
        peft_config=peft_config,
    )


def _prompt(tok, text):
    return tok.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
    )


def _both(trainer, contexts):
    """(cached, TRL) generations of the same contexts, with their recorded logits."""
    calls = _record(trainer.model)
    try:
        cached, _ = trainer._generate_single_turn([list(c) for c in contexts], None, {}, 1)
        plain, _ = GRPOTrainer._generate_single_turn(trainer, [list(c) for c in contexts], None, {}, 1)
    finally:
        del trainer.model.generate
    return cached, plain, calls[0].steps, calls[1].steps


def _suffix(tok, text):
    return tok.encode(
        f"<|im_end|>\n<|im_start|>user\n<tool_response>\n{text}\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
        add_special_tokens=False,
    )


@pytest.mark.parametrize("pad_to_multiple_of", [None, 8])
def test_greedy_turns_and_logits_equal_with_and_without_the_cache(tiny_model_dir, tmp_path, pad_to_multiple_of):
    trainer = _trainer(tmp_path, tiny_model_dir, pad_to_multiple_of=pad_to_multiple_of)
    assert trainer._prefix_cache is not None
    tok = trainer._tokenizer
    contexts = [_prompt(tok, "x" * n) for n in (3, 17, 9, 30)]
    reused = []
    for turn in range(6):
        cached, plain, cached_logits, plain_logits = _both(trainer, contexts)
        assert cached == plain, f"turn {turn}"
        assert len(cached_logits) == len(plain_logits)
        for a, b in zip(cached_logits, plain_logits, strict=True):
            torch.testing.assert_close(a.log_softmax(-1), b.log_softmax(-1), rtol=0, atol=1e-4)
        reused.append(trainer._prefix_cache.stats.reused_tokens)
        # Tool results of different lengths; turn 2 rolls rows 0 and 2 back to the start of this turn (plus a hint);
        # turn 3 rewrites row 1 in the middle (a deletion: reuse stops at the first changed token); turn 4 starts
        # row 3 afresh (nothing to reuse).
        contexts = [c + ids + _suffix(tok, "r" * (5 + 7 * i)) for i, (c, ids) in enumerate(zip(contexts, cached))]
        if turn == 2:
            contexts[0] = contexts[0][: -len(cached[0]) - len(_suffix(tok, "r" * 5))] + tok.encode("hint")
            contexts[2] = contexts[2][: -len(cached[2]) - len(_suffix(tok, "r" * 19))]
        if turn == 3:
            middle = len(contexts[1]) // 2
            contexts[1] = contexts[1][:middle] + tok.encode("[deleted]") + contexts[1][middle + 4 :]
        if turn == 4:
            contexts[3] = _prompt(tok, "a fresh conversation")
    assert all(b > a for a, b in zip(reused, reused[1:]))


def test_lora_adapter_under_gradient_checkpointing_in_training_mode(tiny_model_dir, tmp_path):
    """A PEFT LoRA policy (non-zero adapter weights) in training mode with gradient checkpointing on, as the trainer
    generates: TRL's `unwrap_model_for_generation` turns checkpointing off around both paths; same greedy tokens and
    logits as TRL's path over three turns, with reuse."""
    from peft import LoraConfig

    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0, init_lora_weights=False)
    trainer = _trainer(tmp_path, tiny_model_dir, peft_config=lora, gradient_checkpointing=True)
    trainer.model.train()
    trainer.accelerator.unwrap_model(trainer.model).gradient_checkpointing_enable()
    assert trainer._prefix_cache is not None and trainer.model.is_gradient_checkpointing
    tok = trainer._tokenizer
    contexts = [_prompt(tok, "x" * n) for n in (3, 17, 9)]
    for turn in range(3):
        cached, plain, cached_logits, plain_logits = _both(trainer, contexts)
        assert cached == plain, f"turn {turn}"
        assert cached_logits and len(cached_logits) == len(plain_logits)
        for a, b in zip(cached_logits, plain_logits, strict=True):
            torch.testing.assert_close(a.log_softmax(-1), b.log_softmax(-1), rtol=0, atol=1e-4)
        contexts = [c + ids + _suffix(tok, "r" * (3 + i)) for i, (c, ids) in enumerate(zip(contexts, cached))]
    assert trainer._prefix_cache.stats.reused_tokens > 0 and trainer.model.is_gradient_checkpointing


def test_reuse_of_an_appended_turn_is_the_previous_conversation(tiny_model_dir, tmp_path):
    """Each row can reuse its previous context and turn but the last sampled token (whose keys and values
    generation never computes); rows whose new part is shorter than the longest row's re-feed the difference (left
    padding: every row starts its new tokens at one column)."""
    trainer = _trainer(tmp_path, tiny_model_dir, max_completion_length=6)
    tok = trainer._tokenizer
    contexts = [_prompt(tok, "y" * n) for n in (4, 11, 7)]
    first, _ = trainer._generate_single_turn([list(c) for c in contexts], None, {}, 1)
    before = trainer._prefix_cache.stats.reused_tokens
    suffixes = [_suffix(tok, "s" * k) for k in (2, 9, 5)]
    new = [c + ids + s for c, ids, s in zip(contexts, first, suffixes)]
    trainer._generate_single_turn([list(c) for c in new], None, {}, 1)
    cached = [len(c) + len(ids) - 1 for c, ids in zip(contexts, first)]
    longest_new = max(len(n) - k for n, k in zip(new, cached))
    expected = sum(max(0, len(n) - longest_new) for n in new)
    assert trainer._prefix_cache.stats.reused_tokens - before == expected > 0


def test_copies_of_a_prompt_share_one_prefill(tiny_model_dir, tmp_path):
    """The `num_generations` copies of each prompt in a first turn: each prompt is prefilled once, the copies reuse
    it (all but their last token, fed to get the first logits)."""
    trainer = _trainer(tmp_path, tiny_model_dir)
    tok = trainer._tokenizer
    p, q = _prompt(tok, "the same question"), _prompt(tok, "another, longer question: " + "q" * 40)
    contexts = [p, q, p, q]
    cached, plain, cached_logits, plain_logits = _both(trainer, contexts)
    assert cached == plain
    for a, b in zip(cached_logits, plain_logits, strict=True):
        torch.testing.assert_close(a.log_softmax(-1), b.log_softmax(-1), rtol=0, atol=1e-4)
    stats = trainer._prefix_cache.stats
    assert stats.shared_prefill_tokens == (len(p) - 1) + (len(q) - 1)
    assert stats.reused_tokens == 2 * (len(p) - 1) + 2 * (len(q) - 1)


def test_each_generation_call_matches_its_contexts_once(tiny_model_dir, tmp_path, monkeypatch):
    """Matching every context against every kept conversation is one pass per generation call (`share_prefixes`
    hands its matches to `assemble`; the prefixes it adds are matched on their own, after the earlier ones), and the
    matches `assemble` gets are those of a fresh `match_all`."""
    trainer = _trainer(tmp_path, tiny_model_dir)
    pool = trainer._prefix_cache
    tok = trainer._tokenizer
    passes = []
    checking = [False]
    longest = PrefixCache._longest

    def spy(self, arrays, conversations, best=None):
        if not checking[0]:
            passes.append((len(arrays), list(conversations), best is None))
        return longest(self, arrays, conversations, best)

    monkeypatch.setattr(PrefixCache, "_longest", spy)
    assembled = []
    assemble = pool.assemble

    def checked_assemble(contexts, padded_length, config, device, matches=None):
        checking[0] = True
        fresh = pool.match_all(contexts)
        checking[0] = False
        assert matches is not None and [(id(c), n) for c, n in matches] == [(id(c), n) for c, n in fresh]
        assembled.append(sum(n for _, n in matches))
        return assemble(contexts, padded_length, config, device, matches)

    pool.assemble = checked_assemble
    p, q = _prompt(tok, "the same question"), _prompt(tok, "another, longer question: " + "q" * 40)
    contexts = [p, q, p, q]
    for turn in range(3):
        before = list(pool.conversations)
        passes.clear()
        cached, _ = trainer._generate_single_turn([list(c) for c in contexts], None, {}, 1)
        first, *rest = passes
        assert first[0] == len(contexts) and first[2], turn
        assert [id(c) for c in first[1]] == [id(c) for c in before], turn
        for n, conversations, fresh in rest:  # only the prefixes `share_prefixes` kept in this call
            assert n == len(contexts) and not fresh and len(rest) == 1, turn
            assert all(id(c) not in map(id, before) for c in conversations)
        contexts = [c + ids + _suffix(tok, "r" * (2 + i)) for i, (c, ids) in enumerate(zip(contexts, cached))]
    assert len(assembled) == 3 and all(assembled)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_under_bf16_the_shared_prefill_runs_in_the_precision_generation_runs_in(tiny_model_dir, tmp_path, lora):
    """With `bf16=True` accelerate wraps the prepared model's own `forward` in bfloat16 autocast; PEFT's `generate`
    calls its base model, which that wrapper does not reach, so TRL generates a LoRA policy in float32 (a full model
    in bfloat16 autocast). The shared prefill must run where generation runs: its kept keys are then those of the
    forward `generate` makes (equal to float tolerance), and the copies' logits equal TRL's to float tolerance (a
    bfloat16 prefill under float32 generation moves them by ~1e-2)."""
    from peft import LoraConfig

    peft_config = (
        LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0, init_lora_weights=False)
        if lora
        else None
    )
    trainer = _trainer(tmp_path, tiny_model_dir, peft_config=peft_config, bf16=True)
    # As `train()` does (TRL generates after it): `prepare` is where accelerate wraps `forward` in autocast.
    trainer.model_wrapped = trainer.model = trainer.accelerator.prepare(trainer.model)
    tok = trainer._tokenizer
    p, q = _prompt(tok, "the same question"), _prompt(tok, "another, longer question: " + "q" * 40)
    policy = trainer.accelerator.unwrap_model(trainer.model)
    assert "forward" in policy.__dict__  # accelerate's autocast wrapper, which the test is about
    kept = []
    original = trainer._prefix_cache.share_prefixes

    def share_prefixes(model, contexts):
        matches = original(model, contexts)
        kept.extend(trainer._prefix_cache.conversations)
        return matches

    trainer._prefix_cache.share_prefixes = share_prefixes
    cached, plain, cached_logits, plain_logits = _both(trainer, [p, q, p, q])
    assert cached == plain
    for a, b in zip(cached_logits, plain_logits, strict=True):
        torch.testing.assert_close(a.log_softmax(-1), b.log_softmax(-1), rtol=0, atol=1e-4)

    # The reference: the keys a plain `generate` computes for the prompt (its cache after one new token).
    assert [c.ids for c in kept] == sorted([p[:-1], q[:-1]])
    for conversation in kept:
        ids = torch.tensor([conversation.ids + [tok.eos_token_id]])
        with torch.no_grad():
            out = policy.generate(
                input_ids=ids, max_new_tokens=1, do_sample=False, return_dict_in_generate=True, use_cache=True
            )
        reference = out.past_key_values.layers[0].keys[0, :, : len(conversation.ids)]
        assert conversation.keys[0].dtype == reference.dtype
        torch.testing.assert_close(conversation.keys[0], reference, rtol=0, atol=1e-5)
    from trl_agentic.rollout.prefix_cache import generation_module

    assert (generation_module(policy) is not policy) == lora


def test_peft_methods_whose_generate_adds_to_the_forward_are_not_cached(tiny_model_dir):
    """The prefill runs in the base model; prompt learning (virtual tokens) and activated LoRA (offsets found in
    `generate`) add to that forward in `generate`, so they are generated as TRL does, with the reason logged."""
    from peft import LoraConfig, PromptTuningConfig, get_peft_model
    from transformers import AutoModelForCausalLM, GenerationConfig

    from trl_agentic.rollout.prefix_cache import generation_module, peft_reason, unsupported_reason

    def wrap(config):
        return get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir), config)

    lora = wrap(LoraConfig(r=4, target_modules="all-linear"))
    assert peft_reason(lora) is None and unsupported_reason(lora, GenerationConfig()) is None
    assert generation_module(torch.compile(lora)) is lora.get_base_model()  # compiled: the eager module generates
    prompt = wrap(PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    assert "virtual tokens" in peft_reason(prompt) and unsupported_reason(prompt, GenerationConfig()) == peft_reason(
        prompt
    )
    alora = wrap(
        LoraConfig(task_type="CAUSAL_LM", r=4, target_modules=["q_proj", "v_proj"], alora_invocation_tokens=[5])
    )
    assert "alora_invocation_tokens" in peft_reason(alora)


def _count_forwards(model) -> list[int]:
    counter = [0]
    model.register_forward_pre_hook(lambda *_: counter.__setitem__(0, counter[0] + 1))
    return counter


@pytest.mark.parametrize("setting", ["zero3_sharded", "fsdp"])
def test_where_every_forward_is_a_collective_the_cache_makes_trls_forwards(
    tiny_model_dir, tmp_path, setting, monkeypatch
):
    """Under ZeRO-3 without gathered weights, and under FSDP with several processes, every forward is a collective
    (transformers syncs generation in both): the first turn's shared-prompt prefill, an extra forward whose count
    depends on the process's own prompts, must not happen; the cached call makes as many forwards as TRL's."""
    from types import SimpleNamespace

    trainer = _trainer(tmp_path, tiny_model_dir)
    tok = trainer._tokenizer
    p, q = _prompt(tok, "the same question"), _prompt(tok, "another, longer question: " + "q" * 40)
    contexts = [p, q, p, q]
    if setting == "fsdp":
        monkeypatch.setattr(trainer._dist, "fsdp_version", 2)
        monkeypatch.setattr(type(trainer.accelerator), "num_processes", property(lambda self: 2))
    else:
        plugin = SimpleNamespace(zero_stage=3)
        monkeypatch.setattr(type(trainer.accelerator.state), "deepspeed_plugin", property(lambda self: plugin))
        trainer.args.ds3_gather_for_generation = False
    trainer._init_generation()
    monkeypatch.undo()  # generation itself runs on this single CPU process
    counter = _count_forwards(trainer.model)
    cached, _ = trainer._generate_single_turn([list(c) for c in contexts], None, {}, 1)
    forwards, counter[0] = counter[0], 0
    plain, _ = GRPOTrainer._generate_single_turn(trainer, [list(c) for c in contexts], None, {}, 1)
    assert cached == plain and forwards == counter[0]
    assert trainer._prefix_cache.stats.shared_prefill_tokens == 0


def test_a_prompt_without_copies_is_not_worth_sharing(tiny_model_dir, tmp_path):
    """One row with a long prompt of its own sets how many tokens every row feeds (left padding): prefilling the
    other rows' shared prompt first would only add work, so it is not done."""
    trainer = _trainer(tmp_path, tiny_model_dir)
    tok = trainer._tokenizer
    p, q = _prompt(tok, "the same question"), _prompt(tok, "another, longer question: " + "q" * 40)
    cached, plain, _, _ = _both(trainer, [p, p, q, p])
    assert cached == plain
    assert trainer._prefix_cache.stats.shared_prefill_tokens == 0 and trainer._prefix_cache.stats.reused_tokens == 0


def test_sampled_turns_are_the_same_with_the_same_seed(tiny_model_dir, tmp_path):
    trainer = _trainer(tmp_path, tiny_model_dir, generation_kwargs=None, temperature=0.9, top_p=0.95, top_k=20)
    tok = trainer._tokenizer
    contexts = [_prompt(tok, "z" * n) for n in (5, 12, 2)]
    for _ in range(3):
        torch.manual_seed(7)
        cached, _ = trainer._generate_single_turn([list(c) for c in contexts], None, {}, 1)
        torch.manual_seed(7)
        plain, _ = GRPOTrainer._generate_single_turn(trainer, [list(c) for c in contexts], None, {}, 1)
        assert cached == plain
        contexts = [c + ids + _suffix(tok, "ok") for c, ids in zip(contexts, cached)]
    assert trainer._prefix_cache.stats.reused_tokens > 0


def _dropout_model(tiny_model_dir, tmp_path, p: float) -> str:
    """A copy of the tiny model with attention dropout `p` (functional: `dropout=config.attention_dropout`)."""
    import shutil
    from pathlib import Path

    out = tmp_path / f"dropout-{p}"
    shutil.copytree(tiny_model_dir, out)
    config = json.loads((out / "config.json").read_text())
    config["attention_dropout"] = p
    (out / "config.json").write_text(json.dumps(config))
    return str(Path(out))


def test_training_mode_with_dropout_samples_as_trl(tiny_model_dir, tmp_path):
    """TRL generates in training mode with dropout active, every turn's history re-encoded under fresh masks: kept
    keys and values (and a prompt prefilled once for its copies) would sample otherwise, so the cache steps aside in
    training and the same seed gives TRL's tokens; in evaluation (no dropout) it is used and is exact."""
    trainer = _trainer(
        tmp_path, _dropout_model(tiny_model_dir, tmp_path, 0.5), generation_kwargs=None, temperature=0.9
    )
    assert trainer._prefix_cache is not None
    tok = trainer._tokenizer
    for training in (True, False):
        trainer.model.train(training)
        contexts = [_prompt(tok, "z" * n) for n in (5, 12, 5, 12)]  # two prompts, two copies each
        for _ in range(3):
            torch.manual_seed(3)
            cached, _ = trainer._generate_single_turn([list(c) for c in contexts], None, {}, 1)
            torch.manual_seed(3)
            plain, _ = GRPOTrainer._generate_single_turn(trainer, [list(c) for c in contexts], None, {}, 1)
            assert cached == plain, training
            contexts = [c + ids + _suffix(tok, "ok") for c, ids in zip(contexts, cached)]
        assert (trainer._prefix_cache.stats.reused_tokens > 0) == (not training)
    assert "attention_dropout" in trainer._dropout_in_training  # what the log line names


def test_dropout_reason_names_lora_dropout_and_config_dropout(tiny_model_dir, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from trl_agentic.rollout.prefix_cache import dropout_reason

    assert dropout_reason(AutoModelForCausalLM.from_pretrained(tiny_model_dir)) is None
    for p, expected in ((0.0, None), (0.05, "lora_dropout")):
        model = get_peft_model(
            AutoModelForCausalLM.from_pretrained(tiny_model_dir),
            LoraConfig(r=2, target_modules=["q_proj"], lora_dropout=p),
        )
        reason = dropout_reason(model)
        assert reason is None if expected is None else expected in reason
    with_config = AutoModelForCausalLM.from_pretrained(_dropout_model(tiny_model_dir, tmp_path, 0.1))
    assert "attention_dropout=0.1" in dropout_reason(with_config)
    from transformers import MixtralConfig, MixtralForCausalLM

    tiny = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, vocab_size=64)
    assert dropout_reason(MixtralForCausalLM(MixtralConfig(**tiny))) is None
    assert "router_jitter_noise" in dropout_reason(MixtralForCausalLM(MixtralConfig(**tiny, router_jitter_noise=0.1)))


def test_caches_of_other_weights_are_never_reused(tiny_model_dir, tmp_path):
    trainer = _trainer(tmp_path, tiny_model_dir)
    tok = trainer._tokenizer
    contexts = [_prompt(tok, "w" * 6)]
    first, _ = trainer._generate_single_turn([list(c) for c in contexts], None, {}, 1)
    trainer.state.global_step += 1  # an optimizer step happened
    trainer._generate_single_turn([contexts[0] + first[0] + _suffix(tok, "a")], None, {}, 1)
    assert trainer._prefix_cache.stats.reused_tokens == 0


def test_no_cache_is_kept_after_the_generation_batch(tiny_model_dir, tmp_path):
    """The kept keys and values live for one generation batch, generation after the tool loop included (RLVCR's
    estimator generates alternative thinking in the batch augmenter): none is left for the training step."""
    trainer, _, _ = _rollout(tmp_path, tiny_model_dir, caching=True)
    augmenter, seen = trainer._augmenter, []

    def augment(output, *args):
        trainer._generate_single_turn([output["prompt_ids"][0].tolist()], None, {}, 1)  # as the estimator does
        seen.append(len(trainer._prefix_cache.conversations))
        return augmenter(output, *args)

    trainer._augmenter = augment
    trainer._generate_and_score_completions([{"prompt": [{"role": "user", "content": "Do the task ."}]}] * 4)
    assert seen == [1] and trainer._prefix_cache.conversations == []


def test_unsupported_models_fall_back_with_a_log_line(tiny_model_dir, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="trl_agentic.generation"):
        trainer = _trainer(tmp_path, tiny_model_dir, cache_implementation="static")
    assert trainer._prefix_cache is None
    assert "transformers_prefix_caching is on but not used" in caplog.text and "cache_implementation" in caplog.text
    off = _trainer(tmp_path, tiny_model_dir, transformers_prefix_caching=False)
    assert off._prefix_cache is None


def test_chunked_prefill_generates_as_trl(tiny_model_dir, tmp_path, caplog):
    """`prefill_chunk_size` (a generation setting for long contexts): transformers' chunked prefill feeds the input
    from its first token whatever the cache holds, so a kept prefix would be fed twice; the turns must still be
    TRL's (the cache is not used, with a log line)."""
    with caplog.at_level(logging.WARNING, logger="trl_agentic.generation"):
        trainer = _trainer(tmp_path, tiny_model_dir, generation_kwargs={"do_sample": False, "prefill_chunk_size": 4})
    tok = trainer._tokenizer
    contexts = [_prompt(tok, "x" * n) for n in (5, 12, 5, 12)]
    for turn in range(3):
        cached, plain, _, _ = _both(trainer, contexts)
        assert cached == plain, f"turn {turn}"
        contexts = [c + ids + _suffix(tok, "ok") for c, ids in zip(contexts, cached)]
    assert trainer._prefix_cache is None and "prefill_chunk_size" in caplog.text


def test_length_dependent_rope_generates_as_trl(tiny_model_dir, tmp_path):
    """LongRoPE frequencies depend on the longest position of each forward (transformers' `dynamic_rope_update`):
    once the history passes the original length, keys kept from an earlier turn's shorter forward differ from TRL's
    prefill of the whole history; the turns must still be TRL's (the cache is not used). Dynamic NTK is refused for
    the same reason (`test_sliding_window_layers_are_not_reused`); its frequencies also carry state from one forward
    to the next, so TRL's own path is not a reference that can be run twice."""
    import shutil

    out = tmp_path / "longrope"
    shutil.copytree(tiny_model_dir, out)
    config = json.loads((out / "config.json").read_text())
    config["rope_parameters"] = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0] * 8,
        "long_factor": [4.0] * 8,
        "original_max_position_embeddings": 48,
    }
    (out / "config.json").write_text(json.dumps(config))
    trainer = _trainer(tmp_path, str(out))
    tok = trainer._tokenizer
    contexts = [_prompt(tok, "x" * n) for n in (3, 9)]
    for turn in range(3):  # 22-28 tokens, then 57-63 (past 48), then 92-98
        cached, plain, _, _ = _both(trainer, contexts)
        assert cached == plain, f"turn {turn}"
        contexts = [c + ids + _suffix(tok, "ok") for c, ids in zip(contexts, cached)]
    assert max(map(len, contexts)) > 48 and trainer._prefix_cache is None


def test_sliding_window_layers_are_not_reused():
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    from trl_agentic.rollout.prefix_cache import unsupported_reason

    config = dict(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=64,
    )
    full = Qwen2ForCausalLM(Qwen2Config(**config, use_sliding_window=False))
    assert unsupported_reason(full, GenerationConfig()) is None
    sliding = Qwen2ForCausalLM(Qwen2Config(**config, use_sliding_window=True, sliding_window=8, max_window_layers=0))
    assert "DynamicSlidingWindowLayer" in unsupported_reason(sliding, GenerationConfig())
    assert "beam" in unsupported_reason(full, GenerationConfig(num_beams=2))
    dynamic = Qwen2ForCausalLM(Qwen2Config(**config, rope_parameters={"rope_type": "dynamic", "factor": 2.0}))
    assert "dynamic" in unsupported_reason(dynamic, GenerationConfig())
    linear = Qwen2ForCausalLM(Qwen2Config(**config, rope_parameters={"rope_type": "linear", "factor": 2.0}))
    assert unsupported_reason(linear, GenerationConfig()) is None  # a fixed scaling: keys do not depend on length


# ----------------------------------------------------------------------------------------------- whole rollouts


class ScriptedCalls(LogitsProcessor):
    """The tiny random model writes a few letters of its own (the cache decides which), then a scripted tool call.

    Which call comes from the conversation so far (a deterministic function of the row's tokens, so both runs see
    the same script): no tool result yet and no rollback hint -> `risky(x=1)` (a NameError: rolled back, with a hint);
    after the hint -> `risky(x=2)`; one tool result -> `delete_context([1])` (a snapshot); then a final answer.
    """

    def __init__(self, tok, plain: bool = False):
        self.tok, self.plain = tok, plain  # plain: one successful call, then the answer
        self.letters = tok.convert_tokens_to_ids(list("abcdefghijklmnopqrstuvwxyz"))
        self.turn_start = tok.encode("<|im_start|>assistant\n", add_special_tokens=False)
        self.response = tok.convert_tokens_to_ids("<tool_response>")
        self.hint = tok.encode("corrected", add_special_tokens=False)
        self.steps: list[torch.Tensor] = []

    def _script(self, ids: list[int]) -> list[int]:
        responses = ids.count(self.response)
        hinted = any(ids[k : k + len(self.hint)] == self.hint for k in range(len(ids) - len(self.hint) + 1))
        if self.plain:
            if responses:
                return self.tok.encode("done", add_special_tokens=False) + [self.tok.eos_token_id]
            call = {"name": "risky", "arguments": {"x": 2}}
        elif responses == 0:
            call = {"name": "risky", "arguments": {"x": 2 if hinted else 1}}
        elif responses == 1:
            call = {"name": "delete_context", "arguments": {"message_ids": [1]}}
        else:
            return self.tok.encode("done", add_special_tokens=False) + [self.tok.eos_token_id]
        text = f"<tool_call>\n{json.dumps(call)}\n</tool_call>"
        return self.tok.encode(text, add_special_tokens=False) + [self.tok.eos_token_id]

    def __call__(self, input_ids, scores):
        self.steps.append(scores.detach().float().clone())
        out = torch.full_like(scores, float("-inf"))
        n = len(self.turn_start)
        for b, row in enumerate(input_ids.tolist()):
            start = max(k + n for k in range(len(row) - n + 1) if row[k : k + n] == self.turn_start)
            free = 2 + start % 3  # a row-dependent number of the model's own letters
            made = len(row) - start
            if made < free:
                out[b, self.letters] = scores[b, self.letters]
            else:
                script = self._script(row[:start])
                token = script[made - free] if made - free < len(script) else self.tok.pad_token_id
                out[b, token] = 0.0
        return out


def risky(x: int) -> str:
    """
    A tool that fails the first time.

    Args:
        x: Attempt number.
    """
    if x == 1:
        raise NameError("name 'y' is not defined")
    return "fine"


AGENTIC = dict(
    enable_tool_rollback=True,
    rollback_feedback="hint",
    rollback_hint_template="Failed: {error}. Write a corrected call.",
    save_negative_samples=True,
    enable_context_snapshots=True,
)


def _rollout(tmp_path, model_dir, caching: bool, features=AGENTIC):
    args = AgenticGRPOConfig(
        output_dir=str(tmp_path / f"run-{caching}"),
        use_cpu=True,
        bf16=False,
        report_to="none",
        seed=0,
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=400,
        generation_kwargs={"do_sample": False},
        save_strategy="no",
        transformers_prefix_caching=caching,
        **features,
    )
    prompts = [[{"role": "user", "content": "Do the task " + "." * n}] for n in (1, 1, 9, 9)]
    trainer = AgenticGRPOTrainer(
        model=model_dir,
        reward_funcs=lambda completions, **kwargs: [float(len(c)) for c in completions],
        args=args,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        tools=[risky],
    )
    script = ScriptedCalls(trainer._tokenizer, plain=not features)
    original = trainer.model.generate
    trainer.model.generate = lambda *a, **k: original(*a, logits_processor=LogitsProcessorList([script]), **k)
    trainer.model.train()
    batch = trainer._generate_and_score_completions([{"prompt": p} for p in prompts])
    return trainer, batch, script


def test_a_rollout_with_rollback_and_delete_context_is_the_same_with_the_cache(tiny_model_dir, tmp_path):
    cached_trainer, cached, cached_script = _rollout(tmp_path, tiny_model_dir, caching=True)
    plain_trainer, plain, plain_script = _rollout(tmp_path, tiny_model_dir, caching=False)
    assert plain_trainer._prefix_cache is None and cached_trainer._prefix_cache is not None
    stats = cached_trainer._last_loop_result.stats
    assert stats.rollback_attempts == 4 and stats.snapshots == 4  # every row rolled back once and deleted once
    metrics = cached_trainer._metrics["train"]
    assert metrics["prefix_cache/saved_tokens"][-1] > 0 and metrics["prefix_cache/saved_ratio"][-1] > 0.3
    for key in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "tool_mask", "row_kind"):
        assert torch.equal(cached[key], plain[key]), key
    torch.testing.assert_close(cached["advantages"], plain["advantages"])
    # The log-probabilities the trainer trains with (a fresh forward of the same tokens) and the generation-time
    # logits (cached keys/values vs recomputed ones).
    logps = []
    for trainer, batch in ((cached_trainer, cached), (plain_trainer, plain)):
        ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
        mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
        with torch.no_grad():
            lp, _, _ = trainer._get_per_token_logps_and_entropies(
                trainer.model, ids, mask, batch["completion_ids"].size(1), batch_size=4
            )
        logps.append(lp)
    torch.testing.assert_close(logps[0], logps[1], rtol=0, atol=1e-5)
    assert len(cached_script.steps) == len(plain_script.steps)
    for a, b in zip(cached_script.steps, plain_script.steps, strict=True):
        torch.testing.assert_close(a.log_softmax(-1), b.log_softmax(-1), rtol=0, atol=1e-4)


def test_features_off_generates_with_trl_and_no_cache(tiny_model_dir, tmp_path):
    """Features off: TRL's `_tool_call_loop` and TRL's own `_generate_single_turn` run (no cache is built, no metric is
    logged), so that features off stays `GRPOTrainer` bit for bit; the same tokens as with caching switched off."""
    default_trainer, default, _ = _rollout(tmp_path, tiny_model_dir, caching=True, features={})
    plain_trainer, plain, _ = _rollout(tmp_path, tiny_model_dir, caching=False, features={})
    assert not default_trainer._uses_agentic_loop and default_trainer._last_loop_result is None
    assert default_trainer._prefix_cache is None
    assert "prefix_cache/saved_tokens" not in default_trainer._metrics["train"]
    for key in ("prompt_ids", "completion_ids", "completion_mask", "tool_mask"):
        assert torch.equal(default[key], plain[key]), key
    assert (default["tool_mask"] == 0).any()  # a tool result is in there: there was a second turn


def test_generations_of_the_batch_augmentation_reuse_the_rollouts(tiny_model_dir, tmp_path):
    """RLVCR's alternative thinking is generated after the rollouts, from their histories (inside
    `_generate_and_score_completions`, in the batch augmentation): the rollouts' caches are still kept then."""
    trainer = _trainer(tmp_path, tiny_model_dir)
    tok = trainer._tokenizer
    reused = []
    original = trainer._augmenter

    def augment(output, inputs, rewards, loop_result):
        row = output["prompt_ids"][0][output["prompt_mask"][0].bool()].tolist()
        row += output["completion_ids"][0][output["completion_mask"][0].bool()].tolist()
        before = trainer._prefix_cache.stats.reused_tokens
        trainer._generate_single_turn([row + tok.encode("<think>")], None, {}, 1)
        reused.append(trainer._prefix_cache.stats.reused_tokens - before)
        return original(output, inputs, rewards, loop_result)

    trainer._augmenter = augment
    trainer.model.train()
    prompts = [[{"role": "user", "content": "hi" * n}] for n in (1, 1, 3, 3)]
    trainer._generate_and_score_completions([{"prompt": p} for p in prompts])
    assert reused[0] > 0
    assert trainer._prefix_cache.conversations == []  # dropped at the end of the batch


@pytest.mark.slow
def test_smollm2_multi_turn_greedy_tokens_and_logits_equal_with_the_cache(tmp_path):
    """The embedded SmolLM2-135M (30 layers, grouped-query attention, RoPE) over three turns of a tool conversation
    with ~500-token contexts: the same greedy tokens and logits as TRL's generation from the whole history."""
    from trl_agentic.models import resolve_model_path

    trainer = _trainer(tmp_path, resolve_model_path("smollm2-135m"), max_completion_length=16)
    assert trainer._prefix_cache is not None
    tok = trainer._tokenizer
    notes = " ".join(f"line {k}: status ok, latency {k * 7 % 90} ms." for k in range(30))
    contexts = [
        tok.apply_chat_template(
            [{"role": "user", "content": f"{question} Use the lookup tool.\n{notes}"}],
            tools=[lookup],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        for question in ("Which line has the highest latency?", "Is line 7 ok?")
    ]
    for turn in range(3):
        cached, plain, cached_logits, plain_logits = _both(trainer, contexts)
        assert cached == plain, f"turn {turn}"
        for a, b in zip(cached_logits, plain_logits, strict=True):
            torch.testing.assert_close(a.log_softmax(-1), b.log_softmax(-1), rtol=0, atol=1e-3)
        result = tok.encode(
            f"<|im_end|>\n<|im_start|>tool\nresult {turn}: {notes[: 100 * (turn + 1)]}<|im_end|>\n"
            "<|im_start|>assistant\n",
            add_special_tokens=False,
        )
        contexts = [c + ids + result for c, ids in zip(contexts, cached)]
    stats = trainer._prefix_cache.stats
    assert stats.prefilled_tokens < 0.6 * stats.context_tokens

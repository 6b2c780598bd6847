"""Prefix caching across the turns of multi-turn rollouts on the transformers generation path.

TRL generates every turn of a multi-turn rollout from the whole conversation (`_generate_single_turn` on the growing
token history), so a conversation of T tokens and K turns prefills about K * T tokens. `PrefixCache` keeps, for each
conversation of the rollout batch, the keys and values its last generation call computed, and the next call prefills
only the tokens after the longest prefix the new context shares with a kept one:

- tool results, user turns and rollback hints appended to a turn: the whole previous context is reused;
- a rollback (the context cut back to the start of the failed turn): reuse up to that point (the kept cache is
  cropped);
- `delete_context` (the conversation re-rendered with stubs): reuse up to the first token that changed, i.e. up to
  the first deleted message.

Matching is by token ids (longest common prefix against every kept conversation), so nothing has to tell the cache
which row is which, and a context that shares nothing is simply prefilled in full. It is done once per call
(`share_prefixes` returns the matches, `assemble` takes them), on NumPy arrays made once per kept conversation and
per context: one vectorised compare per (context, kept conversation) pair.

Exactness. The call is `model.generate(input_ids, attention_mask, past_key_values=cache,
generation_config=trainer.generation_config)` with the SAME left-padded `input_ids` and `attention_mask` as TRL's own
path (`pad_to_multiple_of` included): every logits processor (repetition penalty, min length, ...) sees what it sees
in TRL, positions come from the attention mask as in TRL, and only the keys/values of the reused prefix come from an
earlier forward instead of this one. With left padding all rows must start their new tokens at the same column, so a
row whose new part is shorter than the longest row's re-feeds a few of its cached tokens (computed again, never
wrong). Cached keys are stored with the positions they were computed at (RoPE is applied before caching) and every
token keeps its position (`cumsum(attention_mask) - 1`) whatever column it lands in, so moving a row's cache between
batch layouts is exact up to floating-point summation order: greedy tokens equal and log-probabilities equal to float
tolerance (tests/test_prefix_cache.py). Every kept key and value is computed by the module `generate` runs
(`generation_module`: with PEFT and `bf16=True`, not accelerate's autocast wrapper of the PEFT model's `forward`), so
in the precision of the decoding that reads it.

Scope: decoder-only text models whose transformers cache is all `DynamicLayer`s (full attention; sliding-window and
linear-attention layers are not reused) with a RoPE that does not depend on the sequence length (no dynamic NTK nor
LongRoPE), greedy or multinomial sampling with one sequence per prompt (no beams), no `cache_implementation` nor
`prefill_chunk_size`. Elsewhere `unsupported_reason` says why and the trainer logs it and generates as TRL does; in
training mode a model with dropout is generated as TRL does too (`dropout_reason`).
The kept caches live for one generation batch (`_generate_and_score_completions`): weights change between batches.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import numpy as np
import torch

Match = tuple["CachedConversation | None", int]


def token_array(ids) -> np.ndarray:
    """`ids` as a 1-D int64 NumPy array (no copy when it already is one)."""
    return np.asarray(ids, dtype=np.int64).reshape(-1)


def common_prefix_length(a, b) -> int:
    """Number of leading tokens `a` and `b` (lists of token ids or `token_array`s) share.

    Compared in blocks growing fourfold: a pair that differs early (two conversations after their shared prompt)
    costs about its shared length, not the length of the shorter one; an equal pair a few vectorised compares.
    """
    n = min(len(a), len(b))
    a, b = token_array(a[:n]), token_array(b[:n])
    start, block = 0, 1024
    while start < n:
        end = min(n, start + block)
        differ = a[start:end] != b[start:end]
        first = int(differ.argmax())  # the first True, or 0 when there is none
        if differ[first]:
            return start + first
        start, block = end, 4 * block
    return n


def plan_layout(lengths: list[int], reusable: list[int], padded_length: int) -> tuple[int, list[int]]:
    """Where the reused prefixes go in a left-padded batch.

    Row `i` (`lengths[i]` tokens, the first `reusable[i]` of them cached) occupies the last `lengths[i]` of
    `padded_length` columns. The columns before `cache_length` are read from the cache, the rest are fed to the model,
    so `cache_length = padded_length - max(lengths[i] - reusable[i])` and row `i` takes `max(0, lengths[i] -
    new_length)` tokens from its cache (re-feeding the rest of what it had cached).

    Returns:
        `(cache_length, used)`: the number of cached columns and the cached tokens each row uses.
    """
    if not lengths:
        return 0, []
    new_length = max(t - r for t, r in zip(lengths, reusable, strict=True))
    used = [max(0, t - new_length) for t in lengths]
    return padded_length - new_length, used


@dataclass
class CachedConversation:
    """What one conversation's last generation left behind: the token ids and their keys and values.

    `keys[layer]` / `values[layer]` have shape `[num_kv_heads, len(ids), head_dim]`. `array` is `ids` as a
    `token_array`, made once here for matching (`ids` is not changed afterwards).
    """

    ids: list[int]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    array: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.array = token_array(self.ids)


@dataclass
class PrefixCacheStats:
    """Token counts of the generation calls since the last `reset_stats` (summed over calls)."""

    calls: int = 0
    context_tokens: int = 0  # tokens of every context passed to generate (what TRL would prefill)
    reused_tokens: int = 0  # ...whose keys and values came from the cache
    shared_prefill_tokens: int = 0  # tokens prefilled once for several contexts of a call (`share_prefixes`)
    generated_tokens: int = 0  # tokens sampled (up to and including the first end-of-sequence token)

    @property
    def prefilled_tokens(self) -> int:
        """Tokens run through the model before decoding (TRL's path: `context_tokens`)."""
        return self.context_tokens - self.reused_tokens + self.shared_prefill_tokens


def unsupported_reason(model, generation_config) -> str | None:
    """Why prefix caching cannot be used with this model and generation config, or None when it can."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    reason = peft_reason(model)
    if reason is not None:
        return reason
    if getattr(generation_config, "cache_implementation", None) is not None:
        return f"`cache_implementation={generation_config.cache_implementation!r}` builds its own cache"
    if generation_config.use_cache is False:
        return "`use_cache=False` in the generation config"
    if getattr(generation_config, "prefill_chunk_size", None) is not None:
        return (
            "`prefill_chunk_size`: transformers' chunked prefill starts from the first token, ignoring a filled cache"
        )
    if (generation_config.num_beams or 1) != 1 or (generation_config.num_return_sequences or 1) != 1:
        return "beam search or several sequences per prompt reorder the cache"
    if getattr(model.config, "is_encoder_decoder", False):
        return "encoder-decoder model"
    rope = getattr(model.config.get_text_config(decoder=True), "rope_parameters", None) or {}
    rope_types = [rope.get("rope_type")] + [v.get("rope_type") for v in rope.values() if isinstance(v, dict)]
    varying = sorted({t for t in rope_types if isinstance(t, str) and ("dynamic" in t or t == "longrope")})
    if varying:
        # transformers recomputes these frequencies from the longest position of each forward: keys kept from a
        # shorter forward were rotated otherwise than TRL's prefill of the whole history rotates them.
        return f"RoPE type {varying} rotates keys by the forward's length"
    if hasattr(model, "_supports_default_dynamic_cache") and not model._supports_default_dynamic_cache():
        return f"{type(model).__name__} does not use transformers' dynamic cache"
    cache = DynamicCache(config=model.config.get_text_config(decoder=True))
    kinds = {type(layer).__name__ for layer in cache.layers}
    if not cache.layers or kinds != {DynamicLayer.__name__}:
        return f"cache layers {sorted(kinds)} (only full-attention `DynamicLayer`s are reused)"
    return None


def peft_reason(model) -> str | None:
    """Why a PEFT model's kept keys and values would not be those its `generate` computes, or None.

    The prefill runs in the base model (`generation_module`); PEFT methods whose `generate` adds to that forward
    (virtual tokens, per-call scaling hooks, activation offsets, task ids) are generated as TRL does.
    """
    config = getattr(model, "active_peft_config", None)
    if config is None:
        return None
    peft_type = str(getattr(config.peft_type, "value", config.peft_type))
    if getattr(config, "is_prompt_learning", False):
        return f"PEFT {peft_type} adds virtual tokens in `generate`"
    if peft_type in ("XLORA", "POLY"):
        return f"PEFT {peft_type} sets per-call state in `generate`"
    if getattr(config, "alora_invocation_tokens", None):
        return "activated LoRA (`alora_invocation_tokens`) finds its offsets in `generate`"
    return None


def dropout_reason(model) -> str | None:
    """What makes the model's forward random in training mode (a dropout with p > 0, MoE router jitter), or None.

    TRL generates in the trainer's mode, so during training with dropout every turn re-encodes the history under fresh
    dropout masks (or jitter). Kept keys and values (computed under the masks that sampled the earlier tokens) and a prompt
    prefilled once for all its copies would sample from another distribution, so the cache is not used then.
    """
    from torch.nn.modules.dropout import _DropoutNd

    for name, module in model.named_modules():
        if isinstance(module, _DropoutNd) and module.p > 0:
            return f"`{name}` has p={module.p:g}"
    # Attention dropout is mostly functional (`dropout=config.attention_dropout if training`), not a module; so is
    # the router jitter of MoE models (`router_jitter_noise`, `moe_jitter_eps`).
    config = model.config.get_text_config(decoder=True)
    for key, value in config.to_dict().items():
        random_in_training = "dropout" in key or "pdrop" in key or "jitter" in key
        if random_in_training and type(value) in (int, float) and value > 0:
            return f"`{key}={value:g}` in the model config"
    return None


@dataclass
class PrefixCache:
    """The kept caches of one generation batch and the counters of what they saved.

    Args:
        min_reuse: Reuse a kept prefix only when it saves at least this many tokens (copying a cache has a cost).
    """

    min_reuse: int = 1
    conversations: list[CachedConversation] = field(default_factory=list)
    stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)

    def clear(self) -> None:
        """Drop every kept cache (their keys and values belong to the weights they were computed with)."""
        self.conversations = []

    def reset_stats(self) -> PrefixCacheStats:
        stats, self.stats = self.stats, PrefixCacheStats()
        return stats

    def match(self, context: list[int]) -> Match:
        """The kept conversation sharing the longest prefix with `context`, and how many of its tokens can be reused
        (at most `len(context) - 1`: the last token is always fed, its logits pick the next token). Of several
        sharing as long a prefix, the first kept one."""
        return self.match_all([context])[0]

    def match_all(self, contexts: list[list[int]]) -> list[Match]:
        """`match` of every context (each context made an array once)."""
        return self._reusable(self._longest([token_array(c) for c in contexts], self.conversations))

    def _longest(
        self, arrays: list[np.ndarray], conversations: list[CachedConversation], best: list[Match] | None = None
    ) -> list[Match]:
        """For each context, the first of `conversations` sharing the longest prefix with it (capped at its length
        minus one), or `(None, 0)`; without `min_reuse`. `best`: the result over earlier kept conversations, which
        `conversations` follow (a later one replaces it only when strictly longer, as in one pass over all)."""
        out = list(best) if best is not None else [(None, 0)] * len(arrays)
        for i, context in enumerate(arrays):
            best_conversation, best_n = out[i]
            for conversation in conversations:
                cap = min(len(conversation.array), len(context) - 1)
                if cap <= best_n:  # cannot share strictly more than the best so far
                    continue
                n = common_prefix_length(conversation.array[:cap], context[:cap])
                if n > best_n:
                    best_conversation, best_n = conversation, n
            out[i] = (best_conversation, best_n)
        return out

    def _reusable(self, longest: list[Match]) -> list[Match]:
        return [(c, n) if n >= self.min_reuse else (None, 0) for c, n in longest]

    def share_prefixes(self, model, contexts: list[list[int]]) -> list[Match]:
        """Prefill once, and keep, the longest prefix each context shares with another context of the call (the
        `num_generations` copies of a prompt in the first turn); rows then reuse it like a cache of an earlier turn.
        Returns `match_all(contexts)` over the kept conversations afterwards (for `assemble`), computed once.

        Done only when it lowers the call's prefill: with left padding every row feeds as many tokens as the row
        with the most uncached tokens (`plan_layout`), so sharing pays only if it shortens that longest row: cost
        without = rows x longest uncached part, with = rows x the new longest part + the shared prefixes' own prefill.
        One extra forward per shared prefix, batch size 1 (no padding: positions `0..n-1`), last logits only.
        """
        from transformers import DynamicCache

        arrays = [token_array(c) for c in contexts]
        longest = self._longest(arrays, self.conversations)
        order = sorted(range(len(contexts)), key=lambda i: contexts[i])
        shared = [0] * len(contexts)
        for a, b in zip(order, order[1:]):  # in sorted order, a row's longest shared prefix is with a neighbour
            n = min(common_prefix_length(arrays[a], arrays[b]), len(contexts[a]) - 1, len(contexts[b]) - 1)
            shared[a], shared[b] = max(shared[a], n), max(shared[b], n)
        reuse = [n for _, n in self._reusable(longest)]
        prefixes = {tuple(c[:n]) for c, n, r in zip(contexts, shared, reuse, strict=True) if n > r}
        before = max(len(c) - r for c, r in zip(contexts, reuse, strict=True))
        after = max(len(c) - max(r, n) for c, r, n in zip(contexts, reuse, shared, strict=True))
        if not prefixes or len(contexts) * after + sum(map(len, prefixes)) >= len(contexts) * before:
            return self._reusable(longest)
        device = next(model.parameters()).device
        forward = generation_module(model)
        added = len(self.conversations)
        for ids in sorted(prefixes):
            cache = DynamicCache(config=model.config.get_text_config(decoder=True))
            forward(
                input_ids=torch.tensor([ids], device=device), past_key_values=cache, use_cache=True, logits_to_keep=1
            )
            self.conversations.append(
                CachedConversation(
                    ids=list(ids),
                    keys=[layer.keys[0].clone() for layer in cache.layers],
                    values=[layer.values[0].clone() for layer in cache.layers],
                )
            )
            self.stats.shared_prefill_tokens += len(ids)
        # The prefixes just kept follow the earlier kept conversations: matching only against them continues the pass.
        return self._reusable(self._longest(arrays, self.conversations[added:], longest))

    def assemble(
        self, contexts: list[list[int]], padded_length: int, config, device, matches: list[Match] | None = None
    ) -> tuple[object, list[int]]:
        """A `DynamicCache` holding the reusable prefixes of `contexts`, laid out for their left-padded batch.

        `matches`: `match_all(contexts)` when already computed (`share_prefixes` returns it).

        Returns:
            `(cache, used)`: the cache (empty when nothing is reused) and the cached tokens each row uses.
        """
        from transformers import DynamicCache

        if matches is None:
            matches = self.match_all(contexts)
        cache_length, used = plan_layout([len(c) for c in contexts], [n for _, n in matches], padded_length)
        cache = DynamicCache(config=config.get_text_config(decoder=True))
        if cache_length == 0 or not any(used):
            return cache, [0] * len(contexts)
        sources = [conv for conv, _ in matches if conv is not None]
        num_layers = len(sources[0].keys)
        for layer in range(num_layers):
            ref = sources[0].keys[layer]
            shape = (len(contexts), ref.shape[0], cache_length, ref.shape[-1])
            keys = torch.zeros(shape, dtype=ref.dtype, device=device)
            values = torch.zeros(shape, dtype=ref.dtype, device=device)
            for i, ((conv, _), n) in enumerate(zip(matches, used, strict=True)):
                if n:  # the row's cached tokens end where its fed tokens start: at column `cache_length`
                    keys[i, :, cache_length - n :] = conv.keys[layer][:, :n]
                    values[i, :, cache_length - n :] = conv.values[layer][:, :n]
            cache.layers[layer].update(keys, values)
        return cache, used

    def keep(self, contexts: list[list[int]], completions: list[list[int]], cache, padded_length: int) -> None:
        """Replace the kept caches by those of this call's conversations (context + completion, minus the last
        sampled token, whose keys and values generation never computes)."""
        kept = []
        layers = cache.layers
        total = layers[0].keys.shape[-2] if layers and layers[0].get_seq_length() else 0
        for i, (context, completion) in enumerate(zip(contexts, completions, strict=True)):
            start = padded_length - len(context)
            length = min(len(context) + len(completion) - 1, total - start)
            if length <= 0:
                continue
            kept.append(
                CachedConversation(
                    ids=(list(context) + list(completion))[:length],
                    keys=[layer.keys[i, :, start : start + length].clone() for layer in layers],
                    values=[layer.values[i, :, start : start + length].clone() for layer in layers],
                )
            )
        self.conversations = kept


def generation_module(model):
    """The module whose forward `model.generate` runs, for a prefill whose keys and values generation then reads.

    PEFT's `generate` calls its base model's `generate`, which calls the base model's forward; accelerate's mixed
    precision wraps only the prepared (PEFT) model's own `forward` in autocast. So with `bf16=True` TRL generates a
    PEFT policy in the weights' dtype (float32 here) while calling the PEFT model itself would prefill in bfloat16.
    A model without PEFT generates through its own (wrapped) forward. PEFT methods that add to the base model's
    forward in `generate` are not cached (`peft_reason`).
    """
    model = getattr(model, "_orig_mod", model)  # `torch.compile`'s wrapper: `generate` runs the eager module
    get_base_model = getattr(model, "get_base_model", None)
    return get_base_model() if callable(get_base_model) else model


def cut_after_eos(rows: list[list[int]], eos_token_ids) -> list[list[int]]:
    """Each row up to and including its first end-of-sequence token (TRL's completion mask, as lists)."""
    eos = set(eos_token_ids)
    out = []
    for row in rows:
        cut = next((k + 1 for k, token in enumerate(row) if token in eos), len(row))
        out.append(row[:cut])
    return out


def generate_with_prefix_cache(
    model,
    pool: PrefixCache,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    contexts: list[list[int]],
    generation_config,
    eos_token_ids,
    share_within_call: bool = True,
) -> list[list[int]]:
    """`model.generate` on TRL's left-padded batch, with the kept prefixes of `contexts` as its cache.

    `input_ids` / `attention_mask` are exactly TRL's (`_generate_single_turn`), on the model's device. Returns the
    completions cut after their first end-of-sequence token, as TRL does, and keeps this call's caches in `pool`.
    With `share_within_call`, a prefix several contexts share is prefilled once first (`PrefixCache.share_prefixes`:
    one more forward, so only where a forward is not a collective of several processes).
    """
    padded_length = input_ids.shape[1]
    matches = pool.share_prefixes(model, contexts) if share_within_call else None
    cache, used = pool.assemble(contexts, padded_length, model.config, input_ids.device, matches)
    pool.clear()  # the assembled cache holds what the next call can use; the old copies go now (peak memory)
    output = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        past_key_values=cache,
        generation_config=generation_config,
    )
    completions = cut_after_eos(output[:, padded_length:].tolist(), eos_token_ids)
    pool.keep(contexts, completions, cache, padded_length)
    stats = pool.stats
    stats.calls += 1
    stats.context_tokens += sum(len(c) for c in contexts)
    stats.reused_tokens += sum(used)
    stats.generated_tokens += sum(len(c) for c in completions)
    return completions


def with_max_new_tokens(generation_config, max_new_tokens: int | None):
    """A copy of `generation_config` generating at most `max_new_tokens` (the config itself when that is no cap)."""
    current = generation_config.max_new_tokens
    if max_new_tokens is None or (current is not None and current <= max_new_tokens):
        return generation_config
    config = copy.deepcopy(generation_config)
    config.max_new_tokens = max_new_tokens
    return config

"""The RLVCR / CoPO advantage estimator (`advantage_estimator="rlvcr"`).

CogRouter (arXiv 2602.12662) trains an agent that picks a thinking depth per step, with steps written as
`<level>k</level><think>...</think><action>...</action>`. For a step of a trajectory it asks: how confident is the
policy in the action it actually took when the step is preceded by the thinking of each of the four levels? The level
that makes the taken action most likely gets more credit.

Per generation batch (`rlvcr_estimator` is called once per batch on every process, see `trl_agentic.batch`):

1. **Episode advantages**: `grpo_estimator` on the gathered rewards (group statistics over the batch's baseline rows),
   exactly 0 for the baseline rows of a group whose baseline rewards are all equal (`advantages.without_reward_spread`
   over the baseline rows; float32 statistics leave rounding noise of one sign there) and for its other rows with
   that same reward; a row outside the baseline with another reward (a negative sample) keeps its anchored advantage.
2. **Steps**: a step is one assistant turn, i.e. a maximal run of model tokens (`completion_mask * tool_mask == 1`).
   Each run is decoded and parsed with `parse_step` (strict: only whitespace around the step); the original action's
   character span is mapped to token positions with `decode_with_offsets` (byte-level tokenizers included). Only rows
   of kind `REGULAR` and `SNAPSHOT` (the policy's own trajectories) are parsed; negative samples keep the plain
   episode advantage. Malformed steps are counted (`rlvcr/invalid_format`) and never expanded.
3. **Which steps expand** (`rlvcr_expand_steps`): a row is *successful* when its reward is `> 0` (CogRouter skips
   `episode_reward <= 0`); its group is *varied* when the finite rewards of the group's baseline rows span more than
   `1e-6`. `"successful_varied"` (the paper) expands the well-formed steps of successful rows of varied groups,
   `"varied"` those of every row of a varied group, `"all"` those of every row with a finite reward.
4. **Alternative thinking**: for every expanded step and every level in `{2, 3, 4}` other than the step's own, the
   level-forcing prompt (`level_forcing_prompt`: the decoded history up to the step and the original action) is
   rendered as a user message with the chat template and pre-filled with `<level>k</level>\\n<think>`, so the model
   writes the think content directly. All of them are generated in ONE batched `_generate_single_turn` call per
   generation batch (through `rollout.trl_backend.generate_single_turn`: equal counts on every process under vLLM),
   cut at the first `</think>` or `<action>` and capped at `rlvcr_max_thinking_tokens` tokens (a capped thinking is
   kept as it is, cut back to its last whole character). Level 1 uses `LEVEL1_THINK`; the original level keeps its
   own thinking.
5. **Scoring**: for each expanded step and each level, the sequence `context + render_prefix(level, thinking) +
   the step's own tokens between the action open tag and the action (whitespace, e.g. the `\\n` of
   `<tool_call>\\n{...}`) + its original action tokens + the original tokens after the action` (context = the row's
   prompt and completion up to the step) is scored under `torch.no_grad()`, in eval mode (no dropout), in chunks of
   `rlvcr_score_batch_size` rows (a step's score does not depend on the rows it shares a chunk with); the
   confidence is `c_l = exp(mean_t log p(a_t | prefix_l))` over the action tokens (`action_confidence`).
6. **Token advantages** `(B, T)`: `"copo"`: `A_episode * w_l` on the step's tokens with `w = copo_weights(c, k)`;
   `"additive"`: `A_episode + rlvcr_step_advantage_w * A_think` with `A_think = thinking_advantages(c, cost, ...)`
   (cost = thinking tokens). Tokens outside expanded steps keep the episode advantage.
7. **Expansion rows** (`rlvcr_expand=True`, copo only): for each expanded step and each of its 3 other levels one
   `ExtraRow(kind=RowKind.EXPANSION)` with the parent's prompt and as completion the parent's completion up to the
   step (context: `tool_mask` 0, not trained) followed by the alternative step (`tool_mask` 1), with advantage
   `A_episode * w_l`. Its `logprobs` are the scoring log-probs of the step tokens, so an importance-sampling
   correction sees a ratio of ~1 on them. Rows come in (row, step, level) order; a step with an unscored level adds
   none.

Collectives: the number of generation calls and of scoring forward passes is the same on every process (a dummy
generation / a dummy 2-token forward on a process with less work), since both can be collectives (DeepSpeed ZeRO-3
parameter gathering, vLLM server mode). When no process has a step to expand there is no generation call at all.
The local work between two collectives ends at a synchronisation point (`trl_agentic.rank_errors`): an error on one
process (a parsing bug, a tokenizer failure) stops every process there instead of pairing wrong collectives.
In eval mode the estimator returns the plain episode advantages (no generation, no metrics).
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..advantages import group_reward_range, tied_rows
from ..estimators import AdvantageBatch, EstimatorResult, grpo_estimator
from ..rank_errors import raise_on_every_rank
from ..rollout.trl_backend import generate_single_turn
from ..rollout.types import ExtraRow, RowKind
from ..tracin.hooks import checkpointing_paused
from .formulas import (
    action_confidence,
    chosen_level_values,
    combine_additive,
    combine_copo,
    copo_weights,
    thinking_advantages,
)
from .parsing import (
    LEVEL1_THINK,
    ParsedStep,
    StepTags,
    cut_before_action,
    level_forcing_prompt,
    parse_step,
    render_prefix,
)

__all__ = [
    "METRIC_NAMES",
    "StepInfo",
    "decode_with_offsets",
    "expandable_rows",
    "find_steps",
    "locate_action_tokens",
    "model_runs",
    "rlvcr_estimator",
    "step_tags_from_args",
]

LEVELS = (1, 2, 3, 4)
# A reward above this is a success (CogRouter: `episode_reward <= 0` is not expanded).
SUCCESS_THRESHOLD = 0.0
# A group whose rewards span no more than this is "not varied" (CogRouter: `range < 1e-6`).
_RANGE_EPS = 1e-6
_CANDIDATE_KINDS = (int(RowKind.REGULAR), int(RowKind.SNAPSHOT))
_INCOMPLETE = "\ufffd"  # what a decoder returns for a partial multi-byte character
# What failed, in the error the other processes raise (`trl_agentic.rank_errors`).
WHERE = "the RLVCR estimator"

METRIC_NAMES = (
    "rlvcr/level_frac_1",
    "rlvcr/level_frac_2",
    "rlvcr/level_frac_3",
    "rlvcr/level_frac_4",
    "rlvcr/thinking_tokens_mean",
    "rlvcr/expanded_steps",
    "rlvcr/invalid_format",
    "rlvcr/confidence_mean",
    "rlvcr/failed_alternatives",
)


# ---------------------------------------------------------------------------------------------------------------------
# Steps and token offsets


def step_tags_from_args(args) -> StepTags:
    """The `StepTags` of the config's tag names (`rlvcr_level_tag`, `rlvcr_think_tag`, `rlvcr_action_tag`)."""
    names = (args.rlvcr_level_tag, args.rlvcr_think_tag, args.rlvcr_action_tag)
    level, think, action = (f"<{n}>" for n in names)
    level_c, think_c, action_c = (f"</{n}>" for n in names)
    return StepTags(level, level_c, think, think_c, action, action_c)


def decode_with_offsets(decode, ids: list[int]) -> tuple[str, list[tuple[int, int]]]:
    """Decode token ids and give the character span of every token in the decoded text.

    Works for any tokenizer, including byte-level ones whose single tokens may hold part of a multi-byte character
    and SentencePiece ones whose decoding of a lone token drops its leading space: tokens are decoded incrementally
    from the last position where the decoded text was known to match the full text, and when a piece does not match
    there, the whole prefix is decoded instead. Tokens that together make one character share its span; tokens that
    decode to nothing (e.g. skipped special tokens) get an empty span.

    Args:
        decode (`Callable[[list[int]], str]`):
            The decoding function, e.g. `lambda ids: tokenizer.decode(ids, skip_special_tokens=True)`.
        ids (`list[int]`):
            The token ids.

    Returns:
        `tuple[str, list[tuple[int, int]]]`: `decode(ids)` and one `(start, end)` span per token.
    """
    ids = list(ids)
    text = decode(ids)
    offsets: list[tuple[int, int]] = []
    done_tok, done_chr = 0, 0  # tokens [0, done_tok) have spans; they decode to text[:done_chr]
    for k in range(len(ids)):
        piece = decode(ids[done_tok : k + 1])
        end = None
        if not piece.endswith(_INCOMPLETE) and text.startswith(piece, done_chr):
            end = done_chr + len(piece)
        else:  # e.g. a SentencePiece piece decoded alone; the full prefix is authoritative
            prefix = decode(ids[: k + 1])
            if not prefix.endswith(_INCOMPLETE) and text.startswith(prefix) and len(prefix) >= done_chr:
                end = len(prefix)
        if end is not None:
            offsets.extend([(done_chr, end)] * (k + 1 - done_tok))
            done_tok, done_chr = k + 1, end
    offsets.extend([(done_chr, len(text))] * (len(ids) - done_tok))
    return text, offsets


def model_runs(completion_mask, tool_mask) -> list[tuple[int, int]]:
    """Token ranges `[start, end)` of the maximal runs of model tokens (`completion_mask * tool_mask != 0`).

    In a multi-turn tool rollout each run is one assistant turn: the tool results between turns have `tool_mask` 0.
    """
    on = [bool(c) and bool(t) for c, t in zip(list(completion_mask), list(tool_mask))]
    runs, start = [], None
    for i, flag in enumerate(on):
        if flag and start is None:
            start = i
        elif not flag and start is not None:
            runs.append((start, i))
            start = None
    if start is not None:
        runs.append((start, len(on)))
    return runs


def locate_action_tokens(
    text: str, offsets: list[tuple[int, int]], parsed: ParsedStep, tags: StepTags
) -> tuple[int, int, int, str] | None:
    """Token ranges of the original action of a parsed step: where the policy's own text after the action open tag
    begins, the action tokens `[i0, i1)`, and the text the first of those tokens carries before the action block's
    content.

    The action tokens are the tokens that overlap the stripped action text and end inside the action block's content
    (between the action open and close tags); so a leading-space token (`" look"`) belongs to the action. Whitespace
    between the open tag and the action in tokens of its own (`<tool_call>`, `"\n"`, `{...}`: Hermes/Qwen3's layout,
    or `<action>\nlook`) is the policy's own text too: the tokens `[g0, i0)` are kept, unscored, after the canonical
    prefix of every level, so that the scored and expanded step is the one the policy wrote. `g0` is the first token
    that carries text after the open tag (`g0 == i0` when there is no such whitespace token).

    That first token may also begin in the open tag (SmolLM2 writes `<action>"look"` as `<`, `action`, `>"`, ...): the
    part before the content (`">"`, the *lead*) is cut from the canonical prefix the step is scored and expanded
    under, so that text is exactly the step's own. A lead that is not the end of the canonical `</think>\n<action>`
    (other whitespace) cannot be joined that way: no range then. A last token that runs into the close tag stays
    outside the range (it follows the action as it is, unscored).

    Returns:
        `tuple[int, int, int, str] | None`: `(g0, i0, i1, lead)`, or `None` when no token qualifies.
    """
    a0, a1 = parsed.action_span
    content_start = text.rfind(tags.action_open, 0, a0) + len(tags.action_open)
    content_end = text.find(tags.action_close, a1)
    if content_end < 0:
        content_end = len(text)
    overlapping = [i for i, (s, e) in enumerate(offsets) if e > s and e > a0 and s < a1 and e <= content_end]
    if not overlapping:
        return None
    first = overlapping[0]
    # The first token with text after the open tag (the action's first token at the latest: it ends after a0).
    own = next(i for i, (s, e) in enumerate(offsets) if e > s and e > content_start)
    lead = text[offsets[own][0] : content_start] if offsets[own][0] < content_start else ""
    if lead and not f"{tags.think_close}\n{tags.action_open}".endswith(lead):
        return None
    return own, first, overlapping[-1] + 1, lead


@dataclass
class StepInfo:
    """One step (assistant turn) of a local row.

    Attributes:
        row: Local row index.
        index: Position of the step in its row (0 = first turn).
        start / end: Token range `[start, end)` of the turn in the row's completion.
        parsed: The parsed step, `None` when malformed.
        error: Why the step is malformed (a `PARSE_ERROR_REASONS` code or `"action_tokens"`), `None` when well formed.
        action_start / action_end: Absolute token range of the original action in the completion.
        own_start: Absolute index of the first token with text after the action open tag: the tokens
            `[own_start, action_start)` (whitespace such as the `\n` of `<tool_call>\n{...}`) are the policy's own
            text between the tag and the action, kept after every level's canonical prefix.
        lead: The text the token at `own_start` carries before the action content (`locate_action_tokens`), cut from
            every level's canonical prefix.
    """

    row: int
    index: int
    start: int
    end: int
    parsed: ParsedStep | None = None
    error: str | None = None
    action_start: int = -1
    action_end: int = -1
    own_start: int = -1
    lead: str = ""
    # Filled for expanded steps, per level 1..4: the thinking text (None when it could not be generated), its token
    # count and the tokens of its canonical prefix.
    thinking: dict = field(default_factory=dict)
    costs: dict = field(default_factory=dict)
    prefix_ids: dict = field(default_factory=dict)


def find_steps(
    completion_ids: list[int], completion_mask, tool_mask, decode, tags: StepTags, row: int = 0
) -> list[StepInfo]:
    """Split one completion into steps, parse them and locate each step's action tokens.

    Args:
        completion_ids (`list[int]`):
            The row's completion tokens (padding included; it is outside `completion_mask`).
        completion_mask, tool_mask:
            The row's masks (sequences of 0/1).
        decode (`Callable[[list[int]], str]`):
            Decoding function that drops special tokens (an end-of-turn token must not count as trailing text).
        tags (`StepTags`):
            The tag strings.
        row (`int`, *optional*, defaults to `0`):
            Local row index stored in the results.

    Returns:
        `list[StepInfo]`: one entry per assistant turn, in order.
    """
    steps = []
    for k, (start, end) in enumerate(model_runs(completion_mask, tool_mask)):
        info = StepInfo(row=row, index=k, start=start, end=end)
        text, offsets = decode_with_offsets(decode, completion_ids[start:end])
        parsed = parse_step(text, tags)
        if not isinstance(parsed, ParsedStep):
            info.error = parsed.reason
        else:
            span = locate_action_tokens(text, offsets, parsed, tags)
            if span is None:
                info.error = "action_tokens"
            else:
                info.parsed = parsed
                info.own_start, info.action_start, info.action_end = (start + i for i in span[:3])
                info.lead = span[3]
        steps.append(info)
    return steps


def expandable_rows(batch: AdvantageBatch, policy: str) -> Tensor:
    """Which local rows may have their steps expanded (see the module docstring, point 3).

    Args:
        batch (`AdvantageBatch`):
            The estimator batch (gathered rewards, group ids, baseline mask, row kinds).
        policy (`str`):
            `"successful_varied"`, `"varied"` or `"all"`.

    Returns:
        `Tensor` of shape `(B,)`, bool.
    """
    if policy not in ("successful_varied", "varied", "all"):
        raise ValueError(f"`rlvcr_expand_steps` must be 'successful_varied', 'varied' or 'all', got {policy!r}.")
    rewards = batch.rewards.double()
    finite = torch.isfinite(rewards)
    kinds = batch.row_kind.long()
    candidate = torch.zeros_like(finite)
    for kind in _CANDIDATE_KINDS:
        candidate |= kinds == kind
    ok = finite & candidate
    if policy != "all":
        stats = finite & batch.baseline_mask.bool()
        # Groups with < 2 baseline rows: a range of -inf or 0, never varied.
        ok = ok & (group_reward_range(rewards, batch.group_ids, stats) > _RANGE_EPS)
        if policy == "successful_varied":
            ok = ok & (torch.nan_to_num(rewards, nan=-math.inf) > SUCCESS_THRESHOLD)
    return ok[batch.local_index]


# ---------------------------------------------------------------------------------------------------------------------
# Generation and scoring


@contextmanager
def _generation_budget(trainer, max_new_tokens: int):
    """Cap the transformers generation length while the alternative thinking is generated.

    The trainer generates up to `max_completion_length` tokens; the thinking needs at most `max_new_tokens`. The
    trainer's call limit (`GenerationMixin._generation_limit`, the `limit` of `generate_single_turn`) caps every engine,
    vLLM included; this covers a trainer without one (the outputs are truncated afterwards in every case).
    """
    config = getattr(trainer, "generation_config", None)
    if getattr(trainer, "use_vllm", False) or config is None or getattr(config, "max_new_tokens", None) is None:
        yield
        return
    old = config.max_new_tokens
    config.max_new_tokens = min(old, max_new_tokens)
    try:
        yield
    finally:
        config.max_new_tokens = old


def _whole_characters(decode, ids: list[int]) -> list[int]:
    """`ids` without the trailing tokens of a character they hold only part of.

    A capped thinking can end inside a multi-byte character (a byte-level token holds one byte of it): its decoding
    ends with U+FFFD, whose re-encoding is text the policy never wrote. The tokens are cut back instead, to a prefix of
    what was generated.
    """
    ids = list(ids)
    while ids and decode(ids).endswith(_INCOMPLETE):
        ids.pop()
    return ids


def _render_user_prompt(trainer, text: str) -> list[int]:
    tokenizer = trainer._tokenizer
    template = getattr(trainer, "chat_template", None)
    if template is None and getattr(tokenizer, "chat_template", None) is None:
        return tokenizer.encode(text + "\n\n", add_special_tokens=False)
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}],
        chat_template=template,
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
        **(getattr(trainer, "chat_template_kwargs", None) or {}),
    )
    return list(ids[0]) if ids and isinstance(ids[0], list) else list(ids)


@contextmanager
def _eval_mode(model):
    """The model in eval mode (no dropout) for a measurement, then back to the mode it was in."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def _score(trainer, sequences: list[list[int]], tail_lengths: list[int], num_chunks: int, chunk_size: int):
    """Log-probs of the last `tail_lengths[i]` tokens of each sequence, in exactly `num_chunks` forward passes.

    Sequences are sorted by length (less padding) and left-padded per chunk, so the scored tokens of every row end
    at the last position and `logits_to_keep` = the longest tail of the chunk (the LM head runs on few positions).

    A confidence is a measurement of the policy, so it is taken in eval mode (no dropout: in train mode every score
    would carry its own random mask) and must not depend on which other sequences share its forward pass: causal
    attention with masked left padding leaves a row's log-probs unchanged by its companions up to float rounding
    (RoPE scores depend on relative positions only; `tests/rlvcr/test_estimator.py` checks alone vs mixed to 1e-5).
    """
    tokenizer = trainer._tokenizer
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    device = trainer.accelerator.device
    order = sorted(range(len(sequences)), key=lambda i: -len(sequences[i]))
    chunks = [order[k : k + chunk_size] for k in range(0, len(order), chunk_size)]
    results: list[Tensor | None] = [None] * len(sequences)
    model = trainer.model
    with torch.no_grad(), checkpointing_paused(model), _eval_mode(model):
        for c in range(num_chunks):
            if c < len(chunks):
                idx = chunks[c]
                rows = [sequences[i] for i in idx]
                keep = max(tail_lengths[i] for i in idx)
            else:  # dummy pass: another process has more chunks
                idx, rows, keep = [], [[pad, pad]], 1
            width = max(len(r) for r in rows)
            input_ids = torch.full((len(rows), width), pad, dtype=torch.long, device=device)
            attention = torch.zeros((len(rows), width), dtype=torch.long, device=device)
            for j, r in enumerate(rows):
                input_ids[j, width - len(r) :] = torch.tensor(r, dtype=torch.long, device=device)
                attention[j, width - len(r) :] = 1
            logps, _, _ = trainer._get_per_token_logps_and_entropies(
                model, input_ids, attention, keep, batch_size=len(rows)
            )
            for j, i in enumerate(idx):
                results[i] = logps[j, keep - tail_lengths[i] :].detach().double().cpu()
    return results


# ---------------------------------------------------------------------------------------------------------------------
# The estimator


def rlvcr_estimator(batch: AdvantageBatch, trainer) -> Tensor | EstimatorResult:
    """RLVCR / CoPO token-level advantages (see the module docstring for the full procedure).

    Args:
        batch (`AdvantageBatch`):
            The generation batch (gathered rewards and group ids, local token tensors).
        trainer:
            The `AgenticGRPOTrainer` (config `rlvcr_*` fields, tokenizer, generation, scoring, metrics).

    Returns:
        `Tensor` of shape `(B, T)` with the token advantages of the local rows, or, with `rlvcr_expand=True`, an
        `EstimatorResult` that also carries the expansion rows and their advantages. In eval mode: the `(B,)` episode
        advantages.
    """
    args = trainer.args
    episode = grpo_estimator(batch, trainer).to(torch.float32)
    # 0 where it is 0 in exact arithmetic: TRL's float32 statistics leave rounding noise of one sign in a group whose
    # baseline rewards are all equal (six rewards of 0.3: 3.0e-4 on every row), which CoPO's weights and the additive
    # rule would carry onto every token of the group (and TracIn's validation direction would follow).
    tied = tied_rows(batch.rewards, batch.group_ids, batch.baseline_mask)[batch.local_index]
    episode = episode.masked_fill(tied.to(episode.device), 0.0)
    if not trainer.model.training:
        return episode
    # Every local step that can fail on one process ends at a synchronisation point before the next collective
    # (`trl_agentic.rank_errors`): an error on any process raises on every process there.
    error = None
    try:
        mode, expand = args.rlvcr_mode, args.rlvcr_expand
        if expand and mode != "copo":
            raise ValueError("`rlvcr_expand=True` needs `rlvcr_mode='copo'` (expansion rows carry CoPO advantages).")
        tokenizer = trainer._tokenizer
        tags = step_tags_from_args(args)
        device = batch.completion_ids.device
        num_rows, width = batch.completion_ids.shape

        def decode(ids):
            return tokenizer.decode(ids, skip_special_tokens=True)

        # 2. Steps of the policy's own rows.
        local_kind = batch.row_kind[batch.local_index].long().tolist()
        completion_ids = batch.completion_ids.tolist()
        completion_mask = batch.completion_mask.tolist()
        tool_mask = batch.tool_mask.tolist()
        steps_by_row: list[list[StepInfo]] = []
        for r in range(num_rows):
            if local_kind[r] in _CANDIDATE_KINDS:
                steps_by_row.append(find_steps(completion_ids[r], completion_mask[r], tool_mask[r], decode, tags, r))
            else:
                steps_by_row.append([])
        num_steps = max((len(s) for s in steps_by_row), default=0)
        step_ids = torch.full((num_rows, width), -1, dtype=torch.long, device=device)
        for steps in steps_by_row:
            for s in steps:
                step_ids[s.row, s.start : s.end] = s.index

        # 3. Expandable steps.
        expandable = expandable_rows(batch, args.rlvcr_expand_steps).tolist()
        items = [s for r, steps in enumerate(steps_by_row) if expandable[r] for s in steps if s.parsed is not None]
        prompts = [
            [t for t, m in zip(ids, mask) if m]
            for ids, mask in zip(batch.prompt_ids.tolist(), batch.prompt_mask.tolist())
        ]
        items = [s for s in items if prompts[s.row] or s.start > 0]  # the first scored token needs a context

        # Same number of collective calls on every process: one generation when any process has work, and the largest
        # number of scoring chunks.
        requests = [(s, level) for s in items for level in (2, 3, 4) if level != s.parsed.level]
        chunk_size = args.rlvcr_score_batch_size
        local_chunks = math.ceil(len(items) * len(LEVELS) / chunk_size)
    except Exception as e:  # noqa: BLE001 - raised on every process just below
        error = e
    raise_on_every_rank(trainer.accelerator, error, WHERE)
    plan = torch.tensor([len(requests), local_chunks], dtype=torch.long, device=trainer.accelerator.device)
    plan = trainer.accelerator.reduce(plan, reduction="max").tolist()
    any_requests, num_chunks = plan[0] > 0, int(plan[1])

    # 4. Alternative thinking, one batched generation call.
    error = contexts = budget = None
    try:
        for s in items:
            s.thinking = {level: None for level in LEVELS}
            s.thinking[s.parsed.level] = s.parsed.think
            if s.parsed.level != 1:
                s.thinking[1] = LEVEL1_THINK
        if any_requests:
            contexts = []
            for s, level in requests:
                history = decode(prompts[s.row] + completion_ids[s.row][: s.start])
                text = level_forcing_prompt(history, level, s.parsed.action, args.rlvcr_level_prompt_template, tags)
                prefill = f"{tags.level_open}{level}{tags.level_close}\n{tags.think_open}"
                contexts.append(
                    _render_user_prompt(trainer, text) + tokenizer.encode(prefill, add_special_tokens=False)
                )
            budget = args.rlvcr_max_thinking_tokens
            if not contexts:  # dummy call: another process generates
                contexts = [prompts[0] if num_rows and prompts[0] else [tokenizer.eos_token_id]]
    except Exception as e:  # noqa: BLE001 - raised on every process just below
        error = e
    raise_on_every_rank(trainer.accelerator, error, WHERE)
    generated = []
    if any_requests:
        # Through the rollout's call: under vLLM with several processes, process k gets the outputs [k n, (k + 1) n)
        # of every process's gathered prompts, n its own count, so the counts are padded to be equal there; `limit`
        # caps every engine (vLLM included) at the budget.
        with _generation_budget(trainer, budget):
            generated, _ = generate_single_turn(trainer, contexts, limit=budget)

    error = None
    try:
        failed_alternatives = 0
        for (s, level), ids in zip(requests, generated):
            kept = _whole_characters(decode, list(ids)[:budget])
            think = cut_before_action(tags.think_open + decode(kept) + tags.think_close, tags)
            s.thinking[level] = think
            failed_alternatives += think is None

        # 5. Scoring: context + canonical prefix of each level + the step's own text from the action tag on (its
        # whitespace after the tag, its action, the rest of the turn).
        sequences, tails, owners = [], [], []
        for n, s in enumerate(items):
            context = prompts[s.row] + completion_ids[s.row][: s.start]
            own = completion_ids[s.row][s.own_start : s.action_start]  # whitespace after the tag: not scored
            action = completion_ids[s.row][s.action_start : s.action_end]
            rest = completion_ids[s.row][s.action_end : s.end]
            for level in LEVELS:
                think = s.thinking[level]
                if think is None:
                    continue
                canonical = render_prefix(level, think, tags)
                # Without the lead the step's first own token carries: prefix + own tokens is the step's own text.
                canonical = canonical[: len(canonical) - len(s.lead)]
                prefix = tokenizer.encode(canonical, add_special_tokens=False) + own
                s.prefix_ids[level] = prefix
                s.costs[level] = len(tokenizer.encode(think, add_special_tokens=False))
                sequences.append(context + prefix + action + rest)
                tails.append(len(prefix) + len(action) + len(rest))
                owners.append((n, level))
    except Exception as e:  # noqa: BLE001 - raised on every process just below
        error = e
    raise_on_every_rank(trainer.accelerator, error, WHERE)
    logps = _score(trainer, sequences, tails, num_chunks, chunk_size) if num_chunks else []
    error = None
    try:
        confidence = torch.full((len(items), len(LEVELS)), math.nan, dtype=torch.float64)
        cost = torch.full((len(items), len(LEVELS)), math.nan, dtype=torch.float64)
        step_logps = {}
        for (n, level), lp in zip(owners, logps):
            s = items[n]
            a0 = len(s.prefix_ids[level])
            a1 = a0 + s.action_end - s.action_start
            mask = torch.zeros((1, lp.numel()), dtype=torch.bool)
            mask[0, a0:a1] = True
            confidence[n, level - 1] = action_confidence(lp[None], mask)[0]
            cost[n, level - 1] = s.costs[level]
            step_logps[(n, level)] = lp

        # 6. Token advantages.
        levels = torch.tensor([s.parsed.level for s in items], dtype=torch.long)
        per_step = torch.full((num_rows, num_steps), math.nan, dtype=torch.float64)
        weights = None
        if mode == "copo":
            weights = copo_weights(confidence, k=args.rlvcr_k).double()
            chosen = chosen_level_values(weights, levels) if items else torch.zeros(0, dtype=torch.float64)
        else:
            think_adv = thinking_advantages(
                confidence, cost, alpha=args.rlvcr_alpha, cost_max=args.rlvcr_cost_max, mode=args.rlvcr_norm_mode
            )
            chosen = chosen_level_values(think_adv, levels) if items else torch.zeros(0, dtype=torch.float64)
        for n, s in enumerate(items):
            per_step[s.row, s.index] = chosen[n]
        per_step = per_step.to(device)
        if mode == "copo":
            advantages = combine_copo(episode.double(), per_step, step_ids)
        else:
            advantages = combine_additive(episode.double(), per_step, step_ids, args.rlvcr_step_advantage_w)
        advantages = advantages.to(torch.float32)

        # 7. Expansion rows.
        extra_rows, extra_adv = [], []
        if expand:
            for n, s in enumerate(items):
                if torch.isnan(confidence[n]).any():
                    continue  # an unscored level: the step keeps the plain episode advantage, no rows
                context = completion_ids[s.row][: s.start]
                action_and_rest = completion_ids[s.row][s.action_start : s.end]
                for level in LEVELS:
                    if level == s.parsed.level:
                        continue
                    step = s.prefix_ids[level] + action_and_rest
                    extra_rows.append(
                        ExtraRow(
                            kind=RowKind.EXPANSION,
                            parent=s.row,
                            prompt_ids=list(prompts[s.row]),
                            completion_ids=context + step,
                            tool_mask=[0] * len(context) + [1] * len(step),
                            logprobs=[0.0] * len(context) + step_logps[(n, level)].tolist(),
                        )
                    )
                    extra_adv.append(float(episode[s.row]) * float(weights[n, level - 1]))

        # 8. Metrics, summed over processes (one reduce, same order everywhere).
        valid = [s for steps in steps_by_row for s in steps if s.parsed is not None]
        invalid = sum(1 for steps in steps_by_row for s in steps if s.parsed is None)
        think_tokens = sum(len(tokenizer.encode(s.parsed.think, add_special_tokens=False)) for s in valid)
        finite_conf = confidence[torch.isfinite(confidence)]
        local = [
            len(valid),
            *(sum(1 for s in valid if s.parsed.level == level) for level in LEVELS),
            think_tokens,
            int(torch.isfinite(confidence).all(dim=-1).sum()),  # scored under every level; not a fallen-back step
            invalid,
            float(finite_conf.sum()) if finite_conf.numel() else 0.0,
            finite_conf.numel(),
            failed_alternatives,
        ]
    except Exception as e:  # noqa: BLE001 - raised on every process just below
        error = e
    raise_on_every_rank(trainer.accelerator, error, WHERE)
    total = trainer.accelerator.reduce(
        torch.tensor(local, dtype=torch.float64, device=trainer.accelerator.device), reduction="sum"
    ).tolist()
    n_valid, l1, l2, l3, l4, tokens, expanded, n_invalid, conf_sum, conf_n, failed = total
    metrics = trainer._metrics["train"]
    for level, count in zip(LEVELS, (l1, l2, l3, l4)):
        metrics[f"rlvcr/level_frac_{level}"].append(count / n_valid if n_valid else math.nan)
    metrics["rlvcr/thinking_tokens_mean"].append(tokens / n_valid if n_valid else math.nan)
    metrics["rlvcr/expanded_steps"].append(expanded)
    metrics["rlvcr/invalid_format"].append(n_invalid)
    metrics["rlvcr/confidence_mean"].append(conf_sum / conf_n if conf_n else math.nan)
    metrics["rlvcr/failed_alternatives"].append(failed)

    if expand:
        return EstimatorResult(
            advantages=advantages,
            extra_rows=extra_rows,
            extra_advantages=torch.tensor(extra_adv, dtype=torch.float32, device=device),
        )
    return advantages

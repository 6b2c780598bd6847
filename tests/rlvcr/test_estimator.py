"""The RLVCR estimator against hand-computed numbers, with a fake trainer around the real tiny byte-level tokenizer.

The fake trainer scores a sequence by reading back the level of its last `<level>` block and the text of its last
action block, and gives every scored token the log-probability `log(CONF[action][level])`. So the confidence of a level
is exactly (up to float32 rounding of the log) the table value, and a step scored with the wrong action (the public
CogRouter bug) would get the other action's numbers.
"""

import math
import re
import threading
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import fields, replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trl_agentic.advantages import group_advantages
from trl_agentic.config import AgenticGRPOConfig
from trl_agentic.estimators import AdvantageBatch, EstimatorResult
from trl_agentic.rlvcr.estimator import (
    decode_with_offsets,
    expandable_rows,
    find_steps,
    model_runs,
    rlvcr_estimator,
    step_tags_from_args,
)
from trl_agentic.rlvcr.parsing import DEFAULT_TAGS, LEVEL1_THINK, StepTags, render_prefix
from trl_agentic.rollout.types import RowKind

E = math.e
NAN = float("nan")
A_PAIR = 0.5 / (math.sqrt(0.5) + 1e-4)  # GRPO advantage of rewards (1, 0) in a group of 2: 0.5 / (std + 1e-4)

CALL = '{"name": "act", "arguments": {"action": "look"}}'  # a Hermes/Qwen3 tool call as the action
# Confidence of each action under each level (level -> c).
CONF = {
    "look": {1: 0.2, 2: 0.5, 3: 0.8, 4: 0.5},
    '"look"': {1: 0.3, 2: 0.7, 3: 0.4, 4: 0.6},
    "take apple": {1: 0.9, 2: 0.3, 3: 0.6, 4: 0.3},
    "wait": {1: 0.4, 2: 0.4, 3: 0.4, 4: 0.4},
    "x": {1: 0.5, 2: 0.5, 3: 0.5, 4: 0.5},
    CALL: {1: 0.25, 2: 0.6, 3: 0.35, 4: 0.7},
}
# Generated alternative thinking per forced level.
ALT = {2: "alt two", 3: "alt three thinking", 4: "alt four thinking longer"}

PROMPT = "<|im_start|>user\nPut the apple away.<|im_end|>\n<|im_start|>assistant\n"
TOOL = (
    "<|im_end|>\n<|im_start|>user\n<tool_response>\nYou see an apple.\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\n"
)


def step(level, think, action, end="<|im_end|>"):
    return f"<level>{level}</level>\n<think>{think}</think>\n<action>{action}</action>{end}"


STEP_LOOK = step(2, "I should look first.", "look", end="")
STEP_TAKE = step(3, "The apple is here.", "take apple")
STEP_FAIL = step(4, "Maybe wait.", "wait")


def rlvcr_args(**overrides):
    values = {f.name: f.default for f in fields(AgenticGRPOConfig) if f.name.startswith("rlvcr_")}
    values.update(gradient_checkpointing_kwargs=None)
    values.update(overrides)
    return SimpleNamespace(**values)


class FakeAccelerator:
    """Single process; `others` simulates what the other processes contribute to a `max` reduce."""

    device = torch.device("cpu")
    num_processes = 1

    def __init__(self, others=None):
        self.others = others
        self.reduces = []

    def reduce(self, tensor, reduction="sum"):
        self.reduces.append(reduction)
        if reduction == "max" and self.others is not None:
            return torch.maximum(tensor, torch.tensor(self.others, dtype=tensor.dtype))
        return tensor.clone()


class FakeModel:
    def __init__(self, training):
        self.training = training

    def train(self, mode=True):
        self.training = mode

    def eval(self):
        self.training = False


class FakeTrainer:
    """Scores every token of a sequence `log(CONF[action][level])`; with `newline_logp`, a token of newlines only
    `newline_logp` instead (a confidence that counted one would not be the table's)."""

    def __init__(self, tokenizer, args, others=None, alt=None, training=True, newline_logp=None):
        self._tokenizer = tokenizer
        self.args = args
        self.chat_template = None
        self.chat_template_kwargs = {}
        self.model = FakeModel(training)
        self.accelerator = FakeAccelerator(others)
        self._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
        self.alt = ALT if alt is None else alt
        self.generation_calls = []
        self.scored = []  # (decoded sequence, logits_to_keep)
        self.scored_ids = []  # the token ids of each scored sequence
        self.score_calls = 0
        self.newline_logp = newline_logp

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations):
        assert images is None and multimodal_fields == {} and num_generations == 1
        texts = [self._tokenizer.decode(ids) for ids in prompt_ids]
        self.generation_calls.append(texts)
        out = []
        for text in texts:
            match = re.search(r"<level>(\d)</level>\n<think>$", text)
            level = int(match.group(1)) if match else 2
            out.append(self._tokenizer.encode(self.alt[level] + "</think>\n<action>x</action><|im_end|>"))
        return out, None

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None):
        self.score_calls += 1
        assert not torch.is_grad_enabled() and not model.training  # no-grad, eval mode (no dropout)
        out = torch.zeros((input_ids.size(0), logits_to_keep), dtype=torch.float32)
        for j in range(input_ids.size(0)):
            ids = input_ids[j][attention_mask[j].bool()].tolist()
            text = self._tokenizer.decode(ids)
            self.scored.append((text, logits_to_keep))
            self.scored_ids.append(ids)
            level_pos = text.rfind("<level>")
            if level_pos < 0:  # dummy pass
                continue
            level = int(text[level_pos + len("<level>")])
            open_tag = max(("<action>", "<tool_call>"), key=text.rfind)
            start = text.rfind(open_tag) + len(open_tag)
            action = text[start : text.find("</" + open_tag[1:], start)].strip()
            out[j] = math.log(CONF[action][level])
            if self.newline_logp is not None:
                for t, token in enumerate(ids[len(ids) - logits_to_keep :]):
                    if self._tokenizer.decode([token]).strip("\n") == "":
                        out[j, t] = self.newline_logp
        return out, None, None


def make_batch(tok, rows, rewards, groups, kinds=None, baseline=None, scale="group"):
    """rows: list of completions, each a list of (text, is_model) segments; every row gets PROMPT."""
    prompts = [tok.encode(PROMPT) for _ in rows]
    comps, tools = [], []
    for segments in rows:
        ids, mask = [], []
        for text, is_model in segments:
            piece = tok.encode(text)
            ids += piece
            mask += [int(is_model)] * len(piece)
        comps.append(ids)
        tools.append(mask)
    pad = tok.pad_token_id
    width_p, width_c = max(map(len, prompts)), max(map(len, comps)) + 3  # extra right padding
    n = len(rows)
    prompt_ids = torch.full((n, width_p), pad)
    prompt_mask = torch.zeros((n, width_p), dtype=torch.long)
    completion_ids = torch.full((n, width_c), pad)
    completion_mask = torch.zeros((n, width_c), dtype=torch.long)
    tool_mask = torch.ones((n, width_c), dtype=torch.long)
    for r in range(n):
        prompt_ids[r, width_p - len(prompts[r]) :] = torch.tensor(prompts[r])
        prompt_mask[r, width_p - len(prompts[r]) :] = 1
        completion_ids[r, : len(comps[r])] = torch.tensor(comps[r])
        completion_mask[r, : len(comps[r])] = 1
        tool_mask[r, : len(comps[r])] = torch.tensor(tools[r])
    kinds = kinds if kinds is not None else [int(RowKind.REGULAR)] * n
    baseline = baseline if baseline is not None else [k == RowKind.REGULAR for k in kinds]
    return AdvantageBatch(
        rewards=torch.tensor(rewards, dtype=torch.float32),
        group_ids=torch.tensor(groups),
        baseline_mask=torch.tensor(baseline, dtype=torch.bool),
        row_kind=torch.tensor(kinds),
        episode_ids=torch.arange(n),
        local_index=torch.arange(n),
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=completion_ids,
        completion_mask=completion_mask,
        tool_mask=tool_mask,
        loss_mask=completion_mask * tool_mask,
        scale=scale,
    )


def two_row_batch(tok):
    """Row 0 (reward 1): two turns (look, tool result, take apple). Row 1 (reward 0): one turn (wait)."""
    return make_batch(
        tok, [[(STEP_LOOK, True), (TOOL, False), (STEP_TAKE, True)], [(STEP_FAIL, True)]], [1.0, 0.0], [0, 0]
    )


def token_ranges(tok, segments):
    """(start, end) token range of each segment of a completion."""
    out, pos = [], 0
    for text, _ in segments:
        n = len(tok.encode(text))
        out.append((pos, pos + n))
        pos += n
    return out


def close(a, b, tol=1e-5):
    assert abs(a - b) <= tol, (a, b)


# ---- offsets, runs, steps ----


def test_decode_with_offsets_byte_level_multibyte(tiny_tokenizer):
    text = "a\u00e9<think>\U0001f642b"
    ids = tiny_tokenizer.encode(text)
    # Byte-level: "a" (1 token), "é" (2 byte tokens), "<think>" (1 added token), the emoji (4 bytes), "b".
    assert len(ids) == 9
    decoded, offsets = decode_with_offsets(tiny_tokenizer.decode, ids)
    assert decoded == text
    assert offsets == [(0, 1), (1, 2), (1, 2), (2, 9), (9, 10), (9, 10), (9, 10), (9, 10), (10, 11)]


def test_decode_with_offsets_sentencepiece_like_and_skipped_tokens():
    # A SentencePiece-like decoder: words joined by spaces, a lone word decodes without its space, id 0 is skipped.
    vocab = {0: None, 1: "look", 2: "around", 3: "now"}

    def decode(ids):
        return " ".join(vocab[i] for i in ids if vocab[i] is not None)

    text, offsets = decode_with_offsets(decode, [1, 0, 2, 3])
    assert text == "look around now"
    assert offsets == [(0, 4), (4, 4), (4, 11), (11, 15)]


def test_model_runs():
    completion = [1, 1, 1, 1, 1, 1, 1, 0, 0]
    tool = [1, 1, 0, 0, 1, 1, 1, 1, 1]
    assert model_runs(completion, tool) == [(0, 2), (4, 7)]
    assert model_runs([1, 1], [0, 0]) == []
    assert model_runs([1, 1, 1], [1, 1, 1]) == [(0, 3)]


def test_find_steps_multi_turn_and_action_tokens(tiny_tokenizer):
    tok = tiny_tokenizer
    segments = [(step(2, "hmm", "  look around ", end=""), True), (TOOL, False)]
    segments += [(step(3, "The apple is here.", "take apple", end=""), True), (TOOL, False)]
    segments.append(("no tags here<|im_end|>", True))
    ids, mask = [], []
    for text, is_model in segments:
        piece = tok.encode(text)
        ids += piece
        mask += [int(is_model)] * len(piece)
    steps = find_steps(ids, [1] * len(ids), mask, lambda x: tok.decode(x, skip_special_tokens=True), DEFAULT_TAGS, 7)
    ranges = token_ranges(tok, segments)
    assert [(s.start, s.end) for s in steps] == [ranges[0], ranges[2], ranges[4]]
    assert [s.index for s in steps] == [0, 1, 2] and all(s.row == 7 for s in steps)
    assert [s.parsed.level for s in steps[:2]] == [2, 3]
    assert tok.decode(ids[steps[0].action_start : steps[0].action_end]) == "look around"
    assert tok.decode(ids[steps[1].action_start : steps[1].action_end]) == "take apple"
    assert steps[2].parsed is None and steps[2].error == "no_level"


@pytest.mark.parametrize(
    "text, reason",
    [
        ("<level>5</level><think>a</think><action>b</action>", "bad_level"),
        ("<level>2</level><think>a</think>", "no_action"),
        ("<level>2</level><think>a</think><action>b</action> and more", "trailing_text"),
        ("just text", "no_level"),
    ],
)
def test_find_steps_malformed(tiny_tokenizer, text, reason):
    ids = tiny_tokenizer.encode(text)
    steps = find_steps(ids, [1] * len(ids), [1] * len(ids), tiny_tokenizer.decode, DEFAULT_TAGS)
    assert len(steps) == 1 and steps[0].parsed is None and steps[0].error == reason


def test_find_steps_custom_tags_tool_call_action(tiny_tokenizer):
    tags = step_tags_from_args(rlvcr_args(rlvcr_action_tag="tool_call"))
    assert tags == StepTags(action_open="<tool_call>", action_close="</tool_call>")
    call = '{"name": "act", "arguments": {"action": "look"}}'
    text = f"<level>1</level>\n<think>{LEVEL1_THINK}</think>\n<tool_call>\n{call}\n</tool_call><|im_end|>"
    ids = tiny_tokenizer.encode(text)
    steps = find_steps(
        ids, [1] * len(ids), [1] * len(ids), lambda x: tiny_tokenizer.decode(x, skip_special_tokens=True), tags
    )
    assert steps[0].parsed.level == 1 and steps[0].parsed.action == call
    assert tiny_tokenizer.decode(ids[steps[0].action_start : steps[0].action_end]) == call


def test_an_action_token_that_begins_in_the_open_tag_is_an_action_token():
    vocab = {1: "<level>2</level>", 2: "<think>x</think>\n", 3: "<action>lo", 4: "ok", 5: "</action>"}

    def decode(ids):
        return "".join(vocab[i] for i in ids)

    steps = find_steps([1, 2, 3, 4, 5], [1] * 5, [1] * 5, decode, DEFAULT_TAGS)
    # "<action>lo" carries the open tag: it is cut from the canonical prefix the step is scored under.
    assert (steps[0].action_start, steps[0].action_end, steps[0].lead) == (2, 4, "<action>")
    vocab[2], vocab[3] = "<think>x</think>\n<act", "ion>lo"
    assert (find_steps([1, 2, 3, 4, 5], [1] * 5, [1] * 5, decode, DEFAULT_TAGS)[0].lead) == "ion>"
    # Other whitespace before the tag than the canonical "\n": the step's text cannot be kept, so it is not scored.
    vocab[2], vocab[3] = "<think>x</think>", " <action>lo"
    steps = find_steps([1, 2, 3, 4, 5], [1] * 5, [1] * 5, decode, DEFAULT_TAGS)
    assert steps[0].parsed is None and steps[0].error == "action_tokens"
    # A token that runs into the close tag stays outside (it follows the action, unscored); none left: not scored.
    vocab[2], vocab[3], vocab[4] = "<think>x</think>\n", "<action>", "look</action>"
    steps = find_steps([1, 2, 3, 4], [1] * 4, [1] * 4, decode, DEFAULT_TAGS)
    assert steps[0].parsed is None and steps[0].error == "action_tokens"


class MergingTokenizer:
    """Greedy longest match over characters and a few merges, as SmolLM2's BPE writes `<action>"look"` as `<`,
    `action`, `>"`, ...: the first action token begins in the open tag."""

    special = ["<|pad|>", "<|im_end|>", "<|im_start|>"]
    pieces = special + ['>"', "action", "<", ">", "\n"] + [chr(c) for c in range(32, 127)]
    pad_token_id = 0

    def encode(self, text, add_special_tokens=False):
        ids, i = [], 0
        while i < len(text):
            best = max((p for p in self.pieces if text.startswith(p, i)), key=len)
            ids.append(self.pieces.index(best))
            i += len(best)
        return ids

    def decode(self, ids, skip_special_tokens=False):
        skip = len(self.special) if skip_special_tokens else 0
        return "".join(self.pieces[i] for i in ids if i >= skip)


def test_a_step_whose_first_action_token_begins_in_the_tag_is_scored_and_expanded_with_its_own_text():
    """The action `"look"` is scored under each level and expanded as the policy wrote it (the first token `>"` was
    left out of it, and with it the quote: `<action>look"</action>` was scored, and trained in expansion rows)."""
    tok = MergingTokenizer()
    own = step(2, "I should look first.", '"look"')
    batch = make_batch(tok, [[(own, True)], [(STEP_FAIL, True)]], [1.0, 0.0], [0, 0])
    assert '>"' in [tok.pieces[i] for i in batch.completion_ids[0].tolist()]
    trainer = FakeTrainer(tok, rlvcr_args(rlvcr_mode="copo", rlvcr_expand=True))
    result = rlvcr_estimator(batch, trainer)
    think = {1: LEVEL1_THINK, 2: "I should look first.", 3: ALT[3], 4: ALT[4]}
    scored = [text for text, _ in trainer.scored]
    for level in (1, 2, 3, 4):
        assert PROMPT + render_prefix(level, think[level]) + '"look"</action><|im_end|>' in scored
    rows = result.extra_rows
    assert [tok.decode(r.completion_ids) for r in rows] == [
        render_prefix(level, think[level]) + '"look"</action><|im_end|>' for level in (1, 3, 4)
    ]
    assert all(len(r.logprobs) == len(r.completion_ids) for r in rows)
    # Confidences of the quoted action (the fake scores by the action text): the level-2 step's CoPO weight.
    n = len(tok.encode(own))
    advantages = result.advantages[0, :n]
    assert torch.allclose(advantages, torch.full_like(advantages, A_PAIR * copo_w(CONF['"look"'], 2)), atol=1e-5)


def test_expandable_rows_policies(tiny_tokenizer):
    # group 0: rewards 1, 0 (varied) + a negative row; group 1: 1, 1 (uniform); group 2: NaN, 0.5, 0 (varied over
    # the finite rows); group 3: one row; group 4: 2, 0 where the 0-row is outside the baseline (so not varied).
    rewards = [1.0, 0.0, -1.0, 1.0, 1.0, NAN, 0.5, 0.0, 1.0, 2.0, 0.0]
    groups = [0, 0, 0, 1, 1, 2, 2, 2, 3, 4, 4]
    neg, reg = int(RowKind.NEGATIVE), int(RowKind.REGULAR)
    kinds = [reg, reg, neg, reg, reg, reg, reg, reg, reg, reg, int(RowKind.SNAPSHOT)]
    baseline = [True, True, False, True, True, True, True, True, True, True, False]
    batch = make_batch(tiny_tokenizer, [[("x", True)]] * 11, rewards, groups, kinds, baseline)
    got = {p: expandable_rows(batch, p).tolist() for p in ("successful_varied", "varied", "all")}
    t, f = True, False
    assert got["successful_varied"] == [t, f, f, f, f, f, t, f, f, f, f]
    assert got["varied"] == [t, t, f, f, f, f, t, t, f, f, f]
    assert got["all"] == [t, t, f, t, t, f, t, t, t, t, t]
    with pytest.raises(ValueError):
        expandable_rows(batch, "some")


# ---- the estimator: copo ----


def copo_w(conf, level):
    lo, hi = min(conf.values()), max(conf.values())
    norm = {lv: 0.5 if hi - lo <= 1e-6 else (c - lo) / (hi - lo) for lv, c in conf.items()}
    mean = sum(math.exp(2 * v) for v in norm.values()) / 4
    return math.exp(2 * norm[level]) / mean


def test_copo_weights_hand_computed_values():
    # The closed forms below are what `copo_w` must give for the CONF table.
    close(copo_w(CONF["look"], 2), 4 * E / (1 + E) ** 2, 1e-12)  # c~ = (0, .5, 1, .5)
    close(copo_w(CONF["take apple"], 3), 4 * E / (E**2 + E + 2), 1e-12)  # c~ = (1, 0, .5, 0)


def test_copo_token_advantages_differ_by_step(tiny_tokenizer):
    tok = tiny_tokenizer
    trainer = FakeTrainer(tok, rlvcr_args(rlvcr_mode="copo"))
    batch = two_row_batch(tok)
    adv = rlvcr_estimator(batch, trainer)
    assert adv.shape == batch.completion_ids.shape and adv.dtype == torch.float32

    r_look, r_tool, r_take = token_ranges(tok, [(STEP_LOOK, 1), (TOOL, 0), (STEP_TAKE, 1)])
    w_look, w_take = 4 * E / (1 + E) ** 2, 4 * E / (E**2 + E + 2)
    row0 = adv[0].tolist()
    assert all(abs(v - A_PAIR * w_look) < 1e-5 for v in row0[slice(*r_look)])
    assert all(abs(v - A_PAIR) < 1e-5 for v in row0[slice(*r_tool)])  # tool tokens: weight 1
    assert all(abs(v - A_PAIR * w_take) < 1e-5 for v in row0[slice(*r_take)])
    assert all(abs(v - A_PAIR) < 1e-5 for v in row0[r_take[1] :])  # padding: weight 1
    # Row 1 failed: not expanded (successful_varied), plain episode advantage.
    assert torch.allclose(adv[1], torch.full_like(adv[1], -A_PAIR), atol=1e-5)

    # ONE generation call for both steps: levels {3, 4} for the level-2 step, {2, 4} for the level-3 step.
    assert len(trainer.generation_calls) == 1
    contexts = trainer.generation_calls[0]
    assert [c[-len("<level>k</level>\n<think>") :] for c in contexts] == [
        f"<level>{k}</level>\n<think>" for k in (3, 4, 2, 4)
    ]
    assert all('"look"' in c for c in contexts[:2]) and all('"take apple"' in c for c in contexts[2:])
    assert "You see an apple." not in contexts[0] and "You see an apple." in contexts[2]  # history up to the step
    assert "Level 3 (Experience Integration)" in contexts[0] and "Level 2 (Situational" in contexts[2]

    # Each step is scored with ITS OWN action under the 4 canonical prefixes, in one chunk of 8 rows.
    assert trainer.score_calls == 1 and len(trainer.scored) == 8
    scored = [text for text, _ in trainer.scored]
    think = {2: "I should look first.", 3: ALT[3], 4: ALT[4], 1: LEVEL1_THINK}
    for level in (1, 2, 3, 4):
        expected = PROMPT + render_prefix(level, think[level]) + "look</action>"
        assert expected in scored
    think = {3: "The apple is here.", 2: ALT[2], 4: ALT[4], 1: LEVEL1_THINK}
    for level in (1, 2, 3, 4):
        expected = PROMPT + STEP_LOOK + TOOL + render_prefix(level, think[level]) + "take apple</action><|im_end|>"
        assert expected in scored

    m = trainer._metrics["train"]
    assert [m[f"rlvcr/level_frac_{k}"] for k in (1, 2, 3, 4)] == [[0.0], [1 / 3], [1 / 3], [1 / 3]]
    assert m["rlvcr/expanded_steps"] == [2] and m["rlvcr/invalid_format"] == [0]
    close(m["rlvcr/confidence_mean"][0], (0.2 + 0.5 + 0.8 + 0.5 + 0.9 + 0.3 + 0.6 + 0.3) / 8)
    # Byte-level tokenizer: one token per ASCII character of the original think texts.
    close(m["rlvcr/thinking_tokens_mean"][0], (20 + 18 + 11) / 3, 1e-9)
    assert m["rlvcr/failed_alternatives"] == [0]


def test_copo_equal_confidences_single_row_and_nan_rewards(tiny_tokenizer):
    tok = tiny_tokenizer
    # Group 0: equal confidences for "wait" -> all weights 1. Group 1: a single row (A = 0) expanded under "all".
    # Group 2: NaN, 1, 0 -> the NaN row gets 0 and is not expanded; the others form a pair.
    rows = [[(STEP_FAIL, True)], [(step(2, "t", "wait"), True)], [(STEP_TAKE, True)]]
    rows += [[(STEP_TAKE, True)], [(STEP_TAKE, True)], [(STEP_LOOK, True)]]
    batch = make_batch(tok, rows, [1.0, 0.0, 1.0, NAN, 1.0, 0.0], [0, 0, 1, 2, 2, 2])
    trainer = FakeTrainer(tok, rlvcr_args(rlvcr_mode="copo", rlvcr_expand_steps="all"))
    adv = rlvcr_estimator(batch, trainer)
    n = [len(tok.encode(r[0][0])) for r in rows]
    for r, value in enumerate([A_PAIR, -A_PAIR, 0.0, 0.0, A_PAIR * copo_w(CONF["take apple"], 3)]):
        assert torch.allclose(adv[r, : n[r]], torch.full((n[r],), value), atol=1e-5), r
    close(adv[5, 0].item(), -A_PAIR * copo_w(CONF["look"], 2))
    # Expanded: every finite-reward row (5 steps); the NaN row is not.
    assert trainer._metrics["train"]["rlvcr/expanded_steps"] == [5]


def test_copo_all_gives_the_advantages_of_varied(tiny_tokenizer):
    # In copo mode a group without spread has A_ep = 0 and so 0 on every token whatever its weights: "all" expands
    # more steps (the warning at config time) for the same advantages as "varied".
    tok = tiny_tokenizer
    rows = [[(STEP_FAIL, True)], [(step(2, "t", "wait"), True)], [(STEP_TAKE, True)]]
    rows += [[(STEP_TAKE, True)], [(STEP_LOOK, True)], [(STEP_LOOK, True)]]
    rewards, groups = [1.0, 0.0, 1.0, 1.0, 0.0, 0.0], [0, 0, 1, 1, 2, 2]
    found = {}
    for policy in ("varied", "all"):
        trainer = FakeTrainer(tok, rlvcr_args(rlvcr_mode="copo", rlvcr_expand_steps=policy))
        found[policy] = (rlvcr_estimator(make_batch(tok, rows, rewards, groups), trainer), trainer)
    assert torch.equal(found["varied"][0], found["all"][0])
    assert found["varied"][0][:2].abs().sum() > 0  # the varied group's advantages are not 0
    expanded = {p: t._metrics["train"]["rlvcr/expanded_steps"] for p, (_, t) in found.items()}
    assert expanded == {"varied": [2], "all": [6]}


# ---- the estimator: additive ----


def additive_think_adv(confs, costs, alpha, cost_max, mode, level):
    rewards = {lv: confs[lv] + alpha * (0.5 - min(1.0, costs[lv] / cost_max)) for lv in (1, 2, 3, 4)}
    mean = sum(rewards.values()) / 4
    value = rewards[level] - mean
    if mode == "mean_std_norm":
        std = math.sqrt(sum((v - mean) ** 2 for v in rewards.values()) / 3)
        value /= std + 1e-6
    return value


@pytest.mark.parametrize("norm", ["mean_norm", "mean_std_norm"])
def test_additive_token_advantages_hand_computed(tiny_tokenizer, norm):
    tok = tiny_tokenizer
    args = rlvcr_args(rlvcr_mode="additive", rlvcr_norm_mode=norm, rlvcr_alpha=0.5, rlvcr_cost_max=20.0)
    args.rlvcr_step_advantage_w = 0.7
    trainer = FakeTrainer(tok, args)
    batch = two_row_batch(tok)
    adv = rlvcr_estimator(batch, trainer)
    # Thinking costs = characters (byte-level tokenizer): LEVEL1_THINK has 39.
    costs_look = {1: 39, 2: len("I should look first."), 3: len(ALT[3]), 4: len(ALT[4])}
    costs_take = {1: 39, 2: len(ALT[2]), 3: len("The apple is here."), 4: len(ALT[4])}
    t_look = additive_think_adv(CONF["look"], costs_look, 0.5, 20.0, norm, 2)
    t_take = additive_think_adv(CONF["take apple"], costs_take, 0.5, 20.0, norm, 3)
    if norm == "mean_norm":  # by hand: R = c + 0.5 * (0.5 - min(1, cost / 20))
        r = [0.2 - 0.25, 0.5 + 0.5 * (0.5 - 20 / 20), 0.8 + 0.5 * (0.5 - 18 / 20), 0.5 - 0.25]
        close(t_look, r[1] - sum(r) / 4, 1e-12)
    r_look, r_tool, r_take = token_ranges(tok, [(STEP_LOOK, 1), (TOOL, 0), (STEP_TAKE, 1)])
    close(adv[0, r_look[0]].item(), A_PAIR + 0.7 * t_look)
    close(adv[0, r_look[1] - 1].item(), A_PAIR + 0.7 * t_look)
    close(adv[0, r_tool[0]].item(), A_PAIR)
    close(adv[0, r_take[0]].item(), A_PAIR + 0.7 * t_take)
    assert t_look != pytest.approx(t_take)
    assert torch.allclose(adv[1], torch.full_like(adv[1], -A_PAIR), atol=1e-6)


def test_additive_degenerate_groups(tiny_tokenizer):
    tok = tiny_tokenizer
    # Equal confidences and alpha = 0 -> zero thinking advantage; a single-row group (A_ep = 0) still gets
    # w * A_think under "all"; a NaN reward row gets 0 and is not expanded.
    rows = [[(step(2, "t", "wait"), True)], [(STEP_FAIL, True)], [(STEP_LOOK, True)], [(STEP_TAKE, True)]]
    batch = make_batch(tok, rows, [1.0, 0.0, 1.0, NAN], [0, 0, 1, 2])
    args = rlvcr_args(rlvcr_mode="additive", rlvcr_expand_steps="all", rlvcr_alpha=0.0)
    trainer = FakeTrainer(tok, args)
    adv = rlvcr_estimator(batch, trainer)
    n = [len(tok.encode(r[0][0])) for r in rows]
    close(adv[0, 0].item(), A_PAIR)
    close(adv[1, n[1] - 1].item(), -A_PAIR)
    # Single-row group, "look" at level 2: A_ep = 0 and A_think = 0.5 - mean(.2, .5, .8, .5) = 0.
    close(adv[2, 0].item(), 0.0)
    assert torch.count_nonzero(adv[3]) == 0
    # The same single-row group at level 3: A = 0 + 1.0 * (0.8 - 0.5).
    rows = [[(step(3, "t", "look"), True)]]
    trainer = FakeTrainer(tok, args)
    adv = rlvcr_estimator(make_batch(tok, rows, [1.0], [0]), trainer)
    close(adv[0, 0].item(), 0.8 - 0.5)


@pytest.mark.parametrize("mode", ["copo", "additive"])
def test_a_group_without_reward_spread_has_episode_advantage_exactly_zero(tiny_tokenizer, mode):
    # Six rollouts rewarded 0.3: TRL's float32 group advantages are noise of one sign (the control). The episode
    # advantage RLVCR builds on is exactly 0 instead, so under "all" (every step expanded, tied groups included) the
    # tokens carry CoPO's 0 or the additive rule's w * A_think alone: the advantages of six rollouts rewarded 0, whose
    # statistics are exact, bit for bit. A group with a spread beside it keeps its GRPO advantages.
    tok = tiny_tokenizer
    noise = group_advantages(torch.full((6,), 0.3), torch.zeros(6, dtype=torch.long))
    assert bool((noise != 0).all())
    rows = [[(STEP_LOOK, True), (TOOL, False), (STEP_TAKE, True)], [(STEP_FAIL, True)]] * 3 + [[(STEP_TAKE, True)]] * 2
    args = rlvcr_args(rlvcr_mode=mode, rlvcr_expand_steps="all", rlvcr_step_advantage_w=0.7)
    found = {}
    for tie in (0.3, 0.0):
        rewards = [tie] * 6 + [1.0, 0.0]
        found[tie] = rlvcr_estimator(make_batch(tok, rows, rewards, [0] * 6 + [1, 1]), FakeTrainer(tok, args))
    assert torch.equal(found[0.3], found[0.0])
    adv = found[0.3]
    if mode == "copo":
        close(adv[6, 0].item(), A_PAIR * copo_w(CONF["take apple"], 3))
        close(adv[7, 0].item(), -A_PAIR * copo_w(CONF["take apple"], 3))
        assert torch.count_nonzero(adv[:6]) == 0
    else:  # the same step in both rows: the same thinking advantage, episode advantages +-A_PAIR
        close(adv[6, 0].item() - adv[7, 0].item(), 2 * A_PAIR)
        assert torch.count_nonzero(adv[:6]) > 0  # the thinking advantages of the tied group's steps


# ---- expansion rows ----


def test_expand_rows_and_advantages(tiny_tokenizer):
    tok = tiny_tokenizer
    trainer = FakeTrainer(tok, rlvcr_args(rlvcr_mode="copo", rlvcr_expand=True))
    batch = two_row_batch(tok)
    result = rlvcr_estimator(batch, trainer)
    assert isinstance(result, EstimatorResult)
    rows = result.extra_rows
    assert len(rows) == 6 and result.extra_advantages.shape == (6,)
    assert all(r.kind == RowKind.EXPANSION and r.parent == 0 for r in rows)
    assert all(r.prompt_ids == tok.encode(PROMPT) for r in rows)
    # First step (level 2): levels 1, 3, 4; completion = the alternative step only (no context before step 0).
    think = {1: LEVEL1_THINK, 3: ALT[3], 4: ALT[4]}
    for r, level in zip(rows[:3], (1, 3, 4)):
        assert tok.decode(r.completion_ids) == render_prefix(level, think[level]) + "look</action>"
        assert r.tool_mask == [1] * len(r.completion_ids)
    # Second step (level 3): levels 1, 2, 4 after the context (step 0 + tool result), which is masked.
    think = {1: LEVEL1_THINK, 2: ALT[2], 4: ALT[4]}
    context = tok.encode(STEP_LOOK + TOOL)
    for r, level in zip(rows[3:], (1, 2, 4)):
        alt = render_prefix(level, think[level]) + "take apple</action><|im_end|>"
        assert tok.decode(r.completion_ids) == STEP_LOOK + TOOL + alt
        assert r.tool_mask == [0] * len(context) + [1] * len(tok.encode(alt))
        assert len(r.logprobs) == len(r.completion_ids)
        assert r.logprobs[len(context)] == pytest.approx(math.log(CONF["take apple"][level]), abs=1e-6)
    expected = [A_PAIR * copo_w(CONF["look"], lv) for lv in (1, 3, 4)]
    expected += [A_PAIR * copo_w(CONF["take apple"], lv) for lv in (1, 2, 4)]
    assert torch.allclose(result.extra_advantages, torch.tensor(expected), atol=1e-5)
    # The original rows' advantages are the same as without expansion.
    plain = rlvcr_estimator(batch, FakeTrainer(tok, rlvcr_args(rlvcr_mode="copo")))
    assert torch.equal(result.advantages, plain)


def test_expand_needs_copo(tiny_tokenizer):
    trainer = FakeTrainer(tiny_tokenizer, rlvcr_args(rlvcr_mode="additive", rlvcr_expand=True))
    with pytest.raises(ValueError, match="rlvcr_expand"):
        rlvcr_estimator(two_row_batch(tiny_tokenizer), trainer)


# ---- generation details, failures, collectives, eval ----


def test_thinking_is_capped_and_failed_alternatives_fall_back(tiny_tokenizer):
    tok = tiny_tokenizer
    # Level 3: a long thinking without a close tag, capped to 6 tokens (= characters). Level 4: contains a tag ->
    # unusable -> the step's weights fall back to 1.
    alt = {2: "x", 3: "abcdefghijkl", 4: "a<think>b"}
    args = rlvcr_args(rlvcr_mode="copo", rlvcr_max_thinking_tokens=6)
    trainer = FakeTrainer(tok, args, alt=alt)
    batch = make_batch(tok, [[(STEP_LOOK, True)], [(STEP_FAIL, True)]], [1.0, 0.0], [0, 0])
    adv = rlvcr_estimator(batch, trainer)
    scored = [t for t, _ in trainer.scored]
    assert PROMPT + render_prefix(3, "abcdef") + "look</action>" in scored
    assert not any("<level>4</level>" in t for t in scored)  # level 4 was not scored
    assert len(scored) == 3
    assert torch.allclose(adv[0], torch.full_like(adv[0], A_PAIR), atol=1e-5)
    assert trainer._metrics["train"]["rlvcr/failed_alternatives"] == [1]
    assert trainer._metrics["train"]["rlvcr/expanded_steps"] == [0]  # it fell back: not scored under the 4 levels


def test_no_work_anywhere_means_no_generation(tiny_tokenizer):
    tok = tiny_tokenizer
    batch = make_batch(tok, [[(STEP_LOOK, True)], [(STEP_FAIL, True)]], [1.0, 1.0], [0, 0])  # uniform group
    trainer = FakeTrainer(tok, rlvcr_args())
    adv = rlvcr_estimator(batch, trainer)
    assert trainer.generation_calls == [] and trainer.score_calls == 0
    assert torch.count_nonzero(adv) == 0
    m = trainer._metrics["train"]
    assert m["rlvcr/expanded_steps"] == [0] and math.isnan(m["rlvcr/confidence_mean"][0])
    assert m["rlvcr/level_frac_2"] == [0.5] and m["rlvcr/level_frac_4"] == [0.5]


def test_idle_process_makes_matching_dummy_calls(tiny_tokenizer):
    tok = tiny_tokenizer
    batch = make_batch(tok, [[(STEP_LOOK, True)], [(STEP_FAIL, True)]], [1.0, 1.0], [0, 0])
    # Another process has 5 generation requests and 3 scoring chunks.
    trainer = FakeTrainer(tok, rlvcr_args(), others=[5, 3])
    rlvcr_estimator(batch, trainer)
    assert len(trainer.generation_calls) == 1 and len(trainer.generation_calls[0]) == 1
    assert trainer.score_calls == 3 and all(keep == 1 for _, keep in trainer.scored)
    assert trainer.accelerator.reduces == ["max", "sum"]


def test_scoring_chunks(tiny_tokenizer):
    tok = tiny_tokenizer
    trainer = FakeTrainer(tok, rlvcr_args(rlvcr_score_batch_size=3))
    rlvcr_estimator(two_row_batch(tok), trainer)
    assert trainer.score_calls == 3 and len(trainer.scored) == 8  # 8 sequences in chunks of 3, 3, 2


def test_malformed_steps_are_counted_not_expanded(tiny_tokenizer):
    tok = tiny_tokenizer
    rows = [[("I will look.<|im_end|>", True)], [(STEP_FAIL, True)], [(step(7, "t", "look"), True)]]
    trainer = FakeTrainer(tok, rlvcr_args(rlvcr_expand_steps="all"))
    rlvcr_estimator(make_batch(tok, rows, [1.0, 0.0, 1.0], [0, 0, 0]), trainer)
    m = trainer._metrics["train"]
    assert m["rlvcr/invalid_format"] == [2] and m["rlvcr/expanded_steps"] == [1]
    assert m["rlvcr/level_frac_4"] == [1.0]


def test_negative_rows_keep_the_episode_advantage(tiny_tokenizer):
    tok = tiny_tokenizer
    kinds = [int(RowKind.REGULAR), int(RowKind.REGULAR), int(RowKind.NEGATIVE)]
    batch = make_batch(
        tok, [[(STEP_LOOK, True)], [(STEP_FAIL, True)], [(STEP_LOOK, True)]], [1, 0, -1], [0] * 3, kinds
    )
    trainer = FakeTrainer(tok, rlvcr_args(rlvcr_expand_steps="all"))
    adv = rlvcr_estimator(batch, trainer)
    # Baseline = the 2 regular rows; the negative row is scored against them, (-1 - 0.5) / (sqrt(.5) + 1e-4) = -2.1,
    # and clipped to the largest magnitude of a baseline row of a group of 2, 1 / sqrt(2).
    assert torch.allclose(adv[2], torch.full_like(adv[2], -1 / math.sqrt(2)), atol=1e-5)
    assert trainer._metrics["train"]["rlvcr/expanded_steps"] == [2]


def test_eval_mode_returns_episode_advantages(tiny_tokenizer):
    trainer = FakeTrainer(tiny_tokenizer, rlvcr_args(), training=False)
    adv = rlvcr_estimator(two_row_batch(tiny_tokenizer), trainer)
    assert adv.shape == (2,)
    assert adv.tolist() == pytest.approx([A_PAIR, -A_PAIR], abs=1e-6)
    assert trainer.generation_calls == [] and not trainer._metrics["train"]


# ---- the documented custom estimator ----


def test_docs_custom_estimator_example_runs():
    doc = (Path(__file__).resolve().parents[2] / "docs" / "rlvcr.md").read_text()
    block = re.search(r"<!-- custom-estimator -->\n```python\n(.*?)```", doc, re.S).group(1)
    assert len(block.strip().splitlines()) <= 15
    namespace = {}
    exec(block, namespace)
    batch = SimpleNamespace(
        rewards=torch.tensor([1.0, 0.0, 3.0, NAN]),
        group_ids=torch.tensor([0, 0, 1, 1]),
        baseline_mask=torch.tensor([True, True, True, True]),
        local_index=torch.tensor([1, 2, 3]),
        loss_mask=torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1]]),
    )
    adv = namespace["leave_one_out"](batch, None)
    # Group 0: rewards 1, 0 -> row 1 gets 0 - 1 = -1. Group 1: 3 and NaN -> row 2 alone: 0, the NaN row: 0.
    assert adv.tolist() == [-1.0, 0.0, 0.0]


# ---- scoring on a real model ----


def test_a_steps_confidence_does_not_depend_on_its_batch_companions(tiny_model_dir):
    """The same sequence scored alone and in a mixed, left-padded chunk: same log-probs and confidence to 1e-5.

    With LoRA dropout on and the trainer in train mode (as during training), scoring must run in eval mode; the model
    is back in train mode afterwards.
    """
    from datasets import Dataset
    from peft import LoraConfig

    from trl_agentic import AgenticGRPOTrainer
    from trl_agentic.rlvcr.estimator import _score
    from trl_agentic.rlvcr.formulas import action_confidence

    args = AgenticGRPOConfig(
        output_dir="/tmp/unused",
        use_cpu=True,
        bf16=False,
        report_to="none",
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
    )
    trainer = AgenticGRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=lambda completions, **kwargs: [0.0] * len(completions),
        args=args,
        train_dataset=Dataset.from_dict({"prompt": ["hi"] * 8}),
        peft_config=LoraConfig(
            r=4, lora_alpha=8, lora_dropout=0.3, target_modules="all-linear", init_lora_weights=False
        ),
    )
    trainer.model.train()
    generator = torch.Generator().manual_seed(0)
    sequences = [torch.randint(3, 200, (n,), generator=generator).tolist() for n in (30, 12, 50, 7)]
    sequences.append(list(sequences[0]))
    tails = [6, 4, 9, 3, 6]

    def confidence(logps, tail):
        mask = torch.zeros((1, logps.numel()), dtype=torch.bool)
        mask[0, logps.numel() - tail + 1 :] = True  # the "action": all but the first scored token
        return float(action_confidence(logps[None], mask)[0])

    alone = _score(trainer, [sequences[0]], [tails[0]], 1, 1)[0]
    again = _score(trainer, [sequences[0]], [tails[0]], 1, 1)[0]
    mixed = _score(trainer, sequences, tails, 2, 3)  # chunks of 3 and 2 rows, different paddings
    assert trainer.model.training
    torch.testing.assert_close(again, alone, rtol=0, atol=0)  # no dropout noise between two calls
    torch.testing.assert_close(mixed[0], alone, rtol=0, atol=1e-5)
    torch.testing.assert_close(mixed[4], alone, rtol=0, atol=1e-5)  # same sequence, other chunk and padding
    for scored in (mixed[0], mixed[4]):
        close(confidence(scored, tails[0]), confidence(alone, tails[0]))
        assert abs(confidence(scored, tails[0]) / confidence(alone, tails[0]) - 1) < 1e-5


# ---- the policy's own text after the action tag ----


def _tagged(tag):
    open_tag, close_tag = f"<{tag}>", f"</{tag}>"
    action = "look" if tag == "action" else CALL
    fail = f"<level>4</level>\n<think>Maybe wait.</think>\n{open_tag}wait{close_tag}<|im_end|>"
    return open_tag, close_tag, action, fail


@pytest.mark.parametrize("tag", ["action", "tool_call"])
def test_whitespace_between_the_action_tag_and_the_action_is_scored_and_expanded_as_written(tiny_tokenizer, tag):
    """`<action>\\nlook` / `<tool_call>\\n{...}` (Hermes/Qwen3's layout): the `\\n` after the open tag is the policy's
    own text. The scored sequence of every level and every expansion row hold it (the original level's scored
    sequence is the policy's own tokens, id for id); the confidence is over the action tokens alone (a newline
    token scored otherwise than the action would change it)."""
    tok = tiny_tokenizer
    open_tag, close_tag, action, fail = _tagged(tag)
    own = f"<level>2</level>\n<think>I should look first.</think>\n{open_tag}\n{action}\n{close_tag}<|im_end|>"
    own_ids = tok.encode(own)
    head = own[: own.index(open_tag) + len(open_tag)]
    assert own_ids[: len(tok.encode(head))] == tok.encode(head)
    after_tag = own_ids[len(tok.encode(head)) :]  # the policy's own tokens from the tag on: "\n", the action, ...
    assert tok.decode(after_tag[:1]) == "\n"
    batch = make_batch(tok, [[(own, True)], [(fail, True)]], [1.0, 0.0], [0, 0])
    args = rlvcr_args(rlvcr_mode="copo", rlvcr_expand=True, rlvcr_action_tag=tag)
    trainer = FakeTrainer(tok, args, newline_logp=math.log(1e-3))
    result = rlvcr_estimator(batch, trainer)
    tags = step_tags_from_args(args)
    think = {1: LEVEL1_THINK, 2: "I should look first.", 3: ALT[3], 4: ALT[4]}
    prompt = tok.encode(PROMPT)
    assert prompt + own_ids in trainer.scored_ids  # the original level: exactly what the policy wrote
    for level in (1, 2, 3, 4):
        assert prompt + tok.encode(render_prefix(level, think[level], tags)) + after_tag in trainer.scored_ids
    rows = result.extra_rows
    assert [r.completion_ids for r in rows] == [
        tok.encode(render_prefix(level, think[level], tags)) + after_tag for level in (1, 3, 4)
    ]
    assert all(len(r.logprobs) == len(r.completion_ids) == len(r.tool_mask) for r in rows)
    # The confidences are the table's: the newline tokens around the action are outside the confidence mask.
    n = len(own_ids)
    expected = A_PAIR * copo_w(CONF[action], 2)
    assert torch.allclose(result.advantages[0, :n], torch.full((n,), expected), atol=1e-5)
    expected = [A_PAIR * copo_w(CONF[action], level) for level in (1, 3, 4)]
    assert torch.allclose(result.extra_advantages, torch.tensor(expected), atol=1e-5)


class NewlineMergingTokenizer(MergingTokenizer):
    """`MergingTokenizer` with `>\\n` merged too: `<action>\\nlook` is `<`, `action`, `>\\n`, `l`, ...: the whitespace
    after the tag shares a token with the tag's end."""

    pieces = MergingTokenizer.special + ['>"', ">\n", "action", "<", ">", "\n"] + [chr(c) for c in range(32, 127)]


def _own_tokens_from(tok, ids, char):
    """The index of the first token of `ids` whose decoded text reaches past character `char`."""
    for k in range(len(ids)):
        if len(tok.decode(ids[: k + 1])) > char:
            return k
    return len(ids)


@settings(max_examples=60, deadline=None)
@given(
    which=st.sampled_from(["byte_level", "merging", "newline_merging"]),
    level=st.sampled_from([1, 2, 3, 4]),
    think=st.text(alphabet="ab .\n", min_size=1, max_size=12).filter(lambda s: s.strip()),
    action=st.sampled_from(["look", '"look"', "take apple"]),
    between=st.sampled_from(["", "\n", " ", "\n\n"]),
    after_tag=st.sampled_from(["", "\n", " ", "\n\n", "\n "]),
    tail=st.sampled_from(["", "\n"]),
)
def test_scored_and_expanded_steps_are_the_policys_own_text_from_the_action_tag_on(
    tiny_tokenizer, which, level, think, action, between, after_tag, tail
):
    """Whatever the whitespace around the blocks and after the action tag, and however the tokenizer splits the tag
    (byte-level; SmolLM2-like merges `>"` and `>\\n`): every scored sequence and every expansion row is the canonical
    prefix of its level followed by the policy's own text after the tag, and ends with the policy's own tokens from
    the first token that carries no tag text."""
    tok = {"byte_level": tiny_tokenizer, "merging": MergingTokenizer(), "newline_merging": NewlineMergingTokenizer()}
    tok = tok[which]
    own = f"<level>{level}</level>{between}<think>{think}</think>{between}<action>{after_tag}{action}{tail}</action>"
    batch = make_batch(tok, [[(own, True)], [(STEP_FAIL, True)]], [1.0, 0.0], [0, 0])
    trainer = FakeTrainer(tok, rlvcr_args(rlvcr_mode="copo", rlvcr_expand=True))
    result = rlvcr_estimator(batch, trainer)
    own_ids = tok.encode(own)
    content = own.index("<action>") + len("<action>")
    k = _own_tokens_from(tok, own_ids, content)
    k += len(tok.decode(own_ids[:k])) < content  # that token carries the tag's end too: the next one on
    thinking = {lv: ALT.get(lv) for lv in (2, 3, 4)}
    thinking[1] = LEVEL1_THINK
    thinking[level] = think.strip()
    assert len(trainer.scored_ids) == 4
    for ids in trainer.scored_ids:
        text = tok.decode(ids)
        lv = int(text[text.rfind("<level>") + len("<level>")])
        assert text == PROMPT + render_prefix(lv, thinking[lv]) + own[content:]
        assert ids[len(ids) - (len(own_ids) - k) :] == own_ids[k:]
    assert len(result.extra_rows) == 3
    for row in result.extra_rows:
        text = tok.decode(row.completion_ids)
        lv = int(text[len("<level>")])
        assert text == render_prefix(lv, thinking[lv]) + own[content:]
        assert row.completion_ids[len(row.completion_ids) - (len(own_ids) - k) :] == own_ids[k:]


# ---- ties, capped thinking, processes ----


@pytest.mark.parametrize("policy", ["successful_varied", "all"])
def test_a_tied_group_with_a_negative_sample_keeps_exact_zeros(tiny_tokenizer, policy):
    """Six rollouts rewarded 0.3, a snapshot segment scored 0.3 (outside the baseline) and a negative sample at -1
    (outside the baseline, `group_baseline="episodes"`). The tie is decided over the baseline rows: the rollouts and
    the snapshot get exactly 0 (float32 statistics alone leave 3e-4 of noise; the negative's other reward made the
    group count as varied), the negative its anchored advantage, by hand:
    clip(0 + (-1 - 0.3) / max(std + 1e-4, std_floor=0.1), -C, C) = -C with C = (6 - 1) / sqrt(6)."""
    tok = tiny_tokenizer
    reg, snap, neg = int(RowKind.REGULAR), int(RowKind.SNAPSHOT), int(RowKind.NEGATIVE)
    rows = [[(STEP_TAKE, True)]] * 7 + [[(STEP_FAIL, True)]]
    kinds = [reg] * 6 + [snap, neg]
    baseline = [True] * 6 + [False, False]
    batch = make_batch(tok, rows, [0.3] * 7 + [-1.0], [0] * 8, kinds, baseline)
    trainer = FakeTrainer(tok, rlvcr_args(rlvcr_mode="copo", rlvcr_expand_steps=policy))
    adv = rlvcr_estimator(batch, trainer)
    assert torch.count_nonzero(adv[:7]) == 0
    n = len(tok.encode(STEP_FAIL))
    assert torch.allclose(adv[7, :n], torch.full((n,), -5 / math.sqrt(6)), atol=1e-5)
    # The rollouts' steps were expanded under "all" only (the group is not varied): weights times 0.
    assert trainer._metrics["train"]["rlvcr/expanded_steps"] == [7 if policy == "all" else 0]


def test_a_capped_thinking_cut_inside_a_character_keeps_whole_characters(tiny_tokenizer):
    """A cap of 4 byte-level tokens cuts "思考..." (3 bytes a character) after the first byte of the second character:
    the thinking is the whole first character, the generated tokens, not U+FFFD (whose bytes the policy never
    wrote)."""
    tok = tiny_tokenizer
    alt = {2: "x", 3: "思考思考思考", 4: "y"}
    args = rlvcr_args(rlvcr_mode="copo", rlvcr_expand=True, rlvcr_max_thinking_tokens=4)
    trainer = FakeTrainer(tok, args, alt=alt)
    batch = make_batch(tok, [[(STEP_LOOK, True)], [(STEP_FAIL, True)]], [1.0, 0.0], [0, 0])
    result = rlvcr_estimator(batch, trainer)
    generated = tok.encode(alt[3])[:4]
    assert len(tok.encode("思")) == 3 and generated[:3] == tok.encode("思")
    expected = tok.encode(render_prefix(3, "思")) + tok.encode("look</action>")
    assert [r.completion_ids for r in result.extra_rows][1] == expected
    assert tok.encode(PROMPT) + expected in trainer.scored_ids
    assert not any("\ufffd" in text for text, _ in trainer.scored)
    assert trainer._metrics["train"]["rlvcr/failed_alternatives"] == [0]


class SimulatedProcesses:
    """`n` processes as threads that meet in collectives (an all-gather)."""

    def __init__(self, n):
        self.n = n
        self.barrier = threading.Barrier(n, timeout=60)
        self.slots = [None] * n

    def all_gather(self, rank, value):
        self.slots[rank] = value
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()
        return out

    def run(self, fn):
        results, errors = [None] * self.n, []

        def target(rank):
            try:
                results[rank] = fn(rank)
            except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
                errors.append(e)
                self.barrier.abort()

        threads = [threading.Thread(target=target, args=(rank,)) for rank in range(self.n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return results


class ProcessAccelerator:
    device = torch.device("cpu")

    def __init__(self, processes, rank):
        self.processes, self.process_index, self.num_processes = processes, rank, processes.n
        self.is_main_process = rank == 0

    def reduce(self, tensor, reduction="sum"):
        stacked = torch.stack(self.processes.all_gather(self.process_index, tensor.clone()))
        return stacked.max(0).values if reduction == "max" else stacked.sum(0)


class VLLMFakeTrainer(FakeTrainer):
    """TRL's vLLM generation across processes: every process's prompts are gathered and generated, and process k keeps
    the outputs `[k n, (k + 1) n)`, `n` its own prompt count. The thinking names the action and level it was forced
    for."""

    use_vllm = True

    def __init__(self, tokenizer, args, processes, rank):
        super().__init__(tokenizer, args)
        self.accelerator = ProcessAccelerator(processes, rank)
        self.limits = []
        self.sent = []

    @contextmanager
    def _generation_limit(self, limit):
        self.limits.append(limit)
        yield

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations):
        rank, n = self.accelerator.process_index, len(prompt_ids)
        self.sent.append(n)
        everyone = [p for ps in self.accelerator.processes.all_gather(rank, list(prompt_ids)) for p in ps]
        outputs = []
        for ids in everyone:
            text = self._tokenizer.decode(ids)
            match = re.search(r"<level>(\d)</level>\n<think>$", text)
            action = next((a for a in ("take apple", "look", "wait") if f'"{a}"' in text), "none")
            thinking = f"for {action} at {match.group(1) if match else 'none'}"
            outputs.append(self._tokenizer.encode(thinking + "</think>"))
        return outputs[rank * n : (rank + 1) * n], None


@pytest.mark.parametrize("idle", [False, True])
def test_each_process_gets_the_thinking_of_its_own_contexts_under_vllm(tiny_tokenizer, idle):
    """Two processes with 4 and 2 alternatives to generate (or 4 and none: a dummy call): the calls are padded to
    equal counts, so each process gets the thinking generated for its own contexts (before, process 1 got process
    0's: another action, another level), and the budget caps vLLM too (the call limit)."""
    tok = tiny_tokenizer
    look = step(2, "I should look first.", "look")
    local = [two_row_batch(tok)]
    if idle:  # a tied group: nothing to expand
        local.append(make_batch(tok, [[(look, True)], [(STEP_FAIL, True)]], [1.0, 1.0], [1, 1]))
    else:
        local.append(make_batch(tok, [[(look, True)], [(STEP_FAIL, True)]], [1.0, 0.0], [1, 1]))
    # The gathered rewards and groups of both processes; each process keeps its own token tensors.
    rewards = torch.cat([b.rewards for b in local])
    group_ids = torch.tensor([0, 0, 1, 1])
    batches = [
        replace(
            b,
            rewards=rewards,
            group_ids=group_ids,
            baseline_mask=torch.ones(4, dtype=torch.bool),
            row_kind=torch.zeros(4, dtype=torch.long),
            episode_ids=torch.arange(4),
            local_index=torch.arange(2 * k, 2 * k + 2),
        )
        for k, b in enumerate(local)
    ]
    processes = SimulatedProcesses(2)
    args = rlvcr_args(rlvcr_mode="copo", rlvcr_expand=True)
    trainers = [VLLMFakeTrainer(tok, args, processes, rank) for rank in (0, 1)]
    results = processes.run(lambda rank: rlvcr_estimator(batches[rank], trainers[rank]))
    expected = {0: [("look", 3), ("look", 4), ("take apple", 2), ("take apple", 4)], 1: [("look", 3), ("look", 4)]}
    if idle:
        expected[1] = []
    for rank, result in enumerate(results):
        rows = [tok.decode(r.completion_ids) for r in result.extra_rows]
        rows = [text[text.rfind("<level>") :] for text in rows]
        alternatives = [text for text in rows if not text.startswith("<level>1<")]
        assert len(alternatives) == len(expected[rank])
        for text, (action, level) in zip(alternatives, expected[rank]):
            assert text.startswith(render_prefix(level, f"for {action} at {level}") + action), (rank, text)
    assert [t.sent for t in trainers] == [[4], [4]]  # one call on each, equal counts
    assert all(t.limits == [args.rlvcr_max_thinking_tokens] for t in trainers)

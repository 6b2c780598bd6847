"""End to end on the tiny model: scripted rollouts call `delete_context` → snapshot rows in the batch → training.

Generation is scripted (`_generate_single_turn` replaced), everything else is the real trainer: TRL's chat template,
response parsing, tool-suffix tokens, the rollout loop, the batch augmentation, the advantages and the loss.
"""

import json
import math
import re
from collections import Counter

import pytest
import torch
from datasets import Dataset

from trl_agentic import AgenticGRPOConfig, AgenticGRPOTrainer
from trl_agentic.rollout.types import RowKind

NOTES = "The quarterly notes: " + "revenue grew, costs fell, the team shipped the release on time. " * 8
STUB = "[gone]"


class NotesEnv:
    def reset(self, **kwargs):
        self.reads = 0

    def read_notes(self) -> str:
        """
        Read the long project notes.

        Returns:
            The notes.
        """
        self.reads += 1
        return NOTES


def reads_reward(environments, **kwargs):
    return [float(env.reads) for env in environments]


def _call(name, **arguments):
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


# Each plan is the list of the rollout's assistant turns. The message indices of `delete_context` count the
# conversation: 0 user, 1 assistant (read), 2 tool (the notes), 3 assistant (delete), 4 tool, 5 assistant, 6 tool, …
PLANS = {
    "A": [_call("read_notes"), _call("delete_context", message_ids=[2]), "Done."],  # one deletion
    "B": [
        _call("read_notes"),
        _call("delete_context", message_ids=[2]),
        _call("read_notes"),
        _call("delete_context", message_ids=[6]),
        "Done.",
    ],  # two deletions
    "C": [_call("read_notes"), "Done."],  # no deletion
    "D": [_call("delete_context", message_ids=[0]), "Done."],  # deletion at the first turn
}
# Two groups of 4 rollouts (k-th rollout of the generation batch → plan).
ORDER = ["A", "B", "C", "D", "C", "B", "B", "D"]
REWARD = {"A": 1.0, "B": 2.0, "C": 1.0, "D": 0.0}  # number of reads
SNAPSHOTS = {"A": 1, "B": 2, "C": 0, "D": 1}


def _turn(plan, k):
    return f"Plan {plan}\n{PLANS[plan][k]}<|im_end|>"


class ScriptedGeneration:
    """Stands in for `_generate_single_turn`. A first turn (bare prompt) follows `ORDER`; later turns read the plan
    from the first assistant turn (never deleted) and the turn number from the count of assistant turns."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.first = 0
        self.batch_sizes = []

    def __call__(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        self.batch_sizes.append(len(prompt_ids))
        out = []
        for ids in prompt_ids:
            text = self.tok.decode(ids)
            match = re.search(r"Plan ([A-D])", text)
            if match is None:
                plan, k = ORDER[self.first % len(ORDER)], 0
                self.first += 1
            else:
                plan, k = match.group(1), text.count("<|im_start|>assistant") - 1
            out.append(_turn(plan, k))
        return [self.tok.encode(s, add_special_tokens=False) for s in out], None


def _chatml(*messages):
    """Hand-written ChatML of a conversation tail, as TRL's training Qwen3 template renders it: tool results are user
    turns with <tool_response>, and every assistant turn gets an empty think block (the scripted turns have none)."""
    parts = []
    for role, content in messages:
        if role == "tool":
            parts.append(f"<|im_start|>user\n<tool_response>\n{content}\n</tool_response><|im_end|>\n")
        elif role == "assistant":
            parts.append(f"<|im_start|>assistant\n<think>\n\n</think>\n\n{content}<|im_end|>\n")
        else:
            parts.append(f"<|im_start|>{role}\n{content}<|im_end|>\n")
    return "".join(parts) + "<|im_start|>assistant\n"


def _expected_prompts(plan):
    """The decoded prompt of every segment of a plan, after the system block: each deletion stubs its messages."""
    user = ("user", "Read the notes.")
    first = (
        ("assistant", f"Plan {plan}\n{PLANS[plan][0]}"),
        ("tool", NOTES) if plan != "D" else ("tool", "Deleted messages [0]."),
    )
    if plan == "C":
        return [_chatml(user)]
    if plan == "D":
        return [_chatml(user), _chatml(("user", STUB), *first)]
    read = ("assistant", f"Plan {plan}\n{PLANS[plan][0]}")
    delete1 = ("assistant", f"Plan {plan}\n{PLANS[plan][1]}")
    seg1 = _chatml(user, read, ("tool", STUB), delete1, ("tool", "Deleted messages [2]."))
    if plan == "A":
        return [_chatml(user), seg1]
    read2, delete2 = ("assistant", f"Plan B\n{PLANS['B'][2]}"), ("assistant", f"Plan B\n{PLANS['B'][3]}")
    seg2 = _chatml(
        user,
        read,
        ("tool", STUB),
        delete1,
        ("tool", "Deleted messages [2]."),
        read2,
        ("tool", STUB),
        delete2,
        ("tool", "Deleted messages [6]."),
    )
    return [_chatml(user), seg1, seg2]


def _std(values):
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def _train(tmp_path, model_dir, tokenizer, generation_cls=None, reward_funcs=reads_reward, **overrides):
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": "Read the notes."}]] * 16})
    fields = dict(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        report_to="none",
        seed=0,
        max_steps=1,
        learning_rate=5e-2,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=1024,
        logging_steps=1,
        save_strategy="no",
        enable_context_snapshots=True,
        context_stub_text=STUB,
    )
    args = AgenticGRPOConfig(**{**fields, **overrides})
    trainer = AgenticGRPOTrainer(
        model=model_dir, reward_funcs=reward_funcs, args=args, train_dataset=dataset, environment_factory=NotesEnv
    )
    generation = (generation_cls or ScriptedGeneration)(tokenizer)
    trainer._generate_single_turn = generation
    captured = []
    original = trainer._augmenter.__call__

    def capture(output, inputs, rewards_per_func, loop_result):
        batch = original(output, inputs, rewards_per_func, loop_result)
        captured.append((batch, rewards_per_func.clone(), loop_result))
        return batch

    trainer._augmenter = capture
    # Every sequence the model runs forward on (generation is scripted, so these are the loss's forward passes).
    seen = []

    def record(module, args, kwargs):
        ids, mask = kwargs.get("input_ids"), kwargs.get("attention_mask")
        if ids is not None and module.training:
            seen.extend(tuple(row[m.bool()].tolist()) for row, m in zip(ids, mask))

    hook = trainer.model.register_forward_pre_hook(record, with_kwargs=True)
    before = {k: v.clone() for k, v in trainer.model.named_parameters()}
    trainer.train()
    hook.remove()
    return trainer, generation, captured, before, seen


@pytest.mark.parametrize("mode", ["episode", "row"])
def test_snapshot_rows_reach_the_batch_and_are_trained_on(tiny_model_dir, tiny_tokenizer, tmp_path, mode):
    # "row" mode also adds a per-segment reward term (a context-length penalty) to the snapshot rows.
    overrides = {"snapshot_advantage": mode}
    if mode == "row":
        overrides["snapshot_reward_func"] = "rollout_helpers:context_length_penalty"
    trainer, generation, captured, before, seen = _train(tmp_path, tiny_model_dir, tiny_tokenizer, **overrides)
    tok = tiny_tokenizer
    assert len(captured) == 1  # one step, one generation batch

    batch, rewards_per_func, loop_result = captured[0]
    kinds, groups, adv = batch["row_kind"], batch["group_id"], batch["advantages"]
    n_snap = sum(SNAPSHOTS[p] for p in ORDER)  # 9
    assert kinds.tolist() == [RowKind.REGULAR] * 8 + [RowKind.SNAPSHOT] * n_snap
    assert batch["prompt_ids"].size(0) == 8 + n_snap  # steps_per_generation = 1: no padding rows
    assert rewards_per_func[:, 0].tolist() == [REWARD[p] for p in ORDER]

    # Snapshot rows follow the regular rows, in loop order: parent, then segment.
    extras = loop_result.extra_rows
    assert [(e.parent, e.segment_index) for e in extras] == [
        (i, s) for i, p in enumerate(ORDER) for s in range(SNAPSHOTS[p])
    ]
    assert loop_result.num_segments == [SNAPSHOTS[p] + 1 for p in ORDER]
    # Every row is (parent, segment index); the regular row of a rollout is its last segment.
    rows = [(i, SNAPSHOTS[p]) for i, p in enumerate(ORDER)] + [(e.parent, e.segment_index) for e in extras]
    # The batch records each row's episode (rollout) and segment index; is_snapshot is row_kind == SNAPSHOT.
    assert batch["episode_id"].tolist() == [p for p, _ in rows]
    assert batch["segment_index"].tolist() == [s for _, s in rows]

    # 1. Each segment's prompt is the conversation re-rendered with the stub, decoded and compared by hand.
    prompt_mask = batch["prompt_mask"].bool()
    system = None
    for r, (parent, segment) in enumerate(rows):
        text = tok.decode(batch["prompt_ids"][r][prompt_mask[r]])
        head, _, tail = text.partition("<|im_start|>user\n")
        system = system or head
        assert head == system and "# Tools" in head and '"name": "delete_context"' in head
        assert "<|im_start|>user\n" + tail == _expected_prompts(ORDER[parent])[segment], (r, parent, segment)
        if segment > 0:
            assert NOTES not in text and STUB in text

    # 2. Every segment has trainable tokens; a snapshot row ends with its delete_context call.
    loss_mask = batch["completion_mask"] * batch["tool_mask"]
    assert (loss_mask.sum(dim=1) > 0).all()
    for r, (parent, segment) in enumerate(rows[8:], start=8):
        ids = batch["completion_ids"][r][batch["completion_mask"][r].bool()]
        trained = tok.decode(batch["completion_ids"][r][loss_mask[r].bool()])
        assert tok.decode(ids).endswith(f"{PLANS[ORDER[parent]][2 * segment + (ORDER[parent] != 'D')]}<|im_end|>")
        assert NOTES not in trained  # tool results are masked
    # The final segments' trainable text is the plan's turns after the last deletion.
    for i, plan in enumerate(ORDER):
        trained = tok.decode(batch["completion_ids"][i][loss_mask[i].bool()])
        last_turns = PLANS[plan][2 * SNAPSHOTS[plan] :] if plan != "D" else PLANS[plan][1:]
        assert trained == "".join(_turn(plan, len(PLANS[plan]) - len(last_turns) + j) for j in range(len(last_turns)))

    # 3. Group ids: every snapshot row is in its parent's prompt group.
    assert groups[:8].tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert groups[8:].tolist() == [groups[parent].item() for parent, _ in rows[8:]]

    # 4. Advantages, computed by hand from the rewards (TRL's scale_rewards="group": unbiased std + 1e-4).
    rewards = [REWARD[ORDER[parent]] for parent, _ in rows]
    if mode == "row":
        lengths = (batch["prompt_mask"].sum(1) + batch["completion_mask"].sum(1)).tolist()
        for r in range(8, len(rows)):
            rewards[r] += -0.001 * lengths[r]
    expected = []
    for r, (parent, _) in enumerate(rows):
        group = parent // 4
        if mode == "episode":  # statistics over the group's 4 episodes; segments scored like their episode
            members = [REWARD[ORDER[j]] for j in range(4 * group, 4 * group + 4)]
        else:  # every segment is a group member
            members = [rewards[q] for q, (p, _) in enumerate(rows) if p // 4 == group]
        mean = sum(members) / len(members)
        expected.append((rewards[r] - mean) / (_std(members) + 1e-4))
    assert adv.tolist() == pytest.approx(expected, abs=1e-5)
    if mode == "episode":
        # Group 0 has rewards [1, 2, 1, 0]: mean 1, std sqrt(2/3); group 1 [1, 2, 2, 0]: mean 1.25, std
        # sqrt(2.75/3). A segment's advantage is its episode's.
        assert adv[:4].tolist() == pytest.approx([0.0, 1.2245949, 0.0, -1.2245949], abs=1e-6)
        assert adv[4:8].tolist() == pytest.approx([-0.2610892, 0.7832676, 0.7832676, -1.3054461], abs=1e-6)
        assert adv[8:].tolist() == pytest.approx([adv[parent].item() for parent, _ in rows[8:]], abs=1e-7)
    else:
        # Group 0 as rows: [1, 2, 1, 0] + A's segment 1 + B's two segments 2, 2 + D's segment 0, minus penalties.
        assert len([p for p, _ in rows if p // 4 == 0]) == 8 and len([p for p, _ in rows if p // 4 == 1]) == 9
        assert adv[8].item() < adv[0].item()  # same episode reward, the snapshot pays its length penalty

    # 5. Metrics: snapshot rows, snapshots per episode, tokens freed (the context each deletion shrank).
    logs = [h for h in trainer.state.log_history if "snapshots/rows" in h]
    assert len(logs) == 1
    # Byte-level tokens: deleting the notes frees len(NOTES) - len(STUB), minus the 2 × 6 tokens of the empty think
    # blocks the template adds to the two re-rendered assistant turns; deleting the user message frees 15 - 6 - 6.
    assert len(tok.encode(NOTES, add_special_tokens=False)) == len(NOTES) == 533
    per_notes, per_user = 533 - len(STUB) - 12, len("Read the notes.") - len(STUB) - 6
    assert [e.tokens_freed for e in extras] == [per_user if ORDER[e.parent] == "D" else per_notes for e in extras]
    freed = 7 * per_notes + 2 * per_user  # A: 1, B: 2 × 3 rollouts, D: 2 rollouts
    assert freed == 3611
    for h in logs:
        assert h["snapshots/rows"] == n_snap
        assert h["snapshots/per_episode_mean"] == pytest.approx(n_snap / 8)
        assert h["context/tokens_freed"] == freed
    # TRL's first turn, then one batched call per loop iteration: 8 tool rounds, then A + 3 B, then the 3 B's twice.
    assert generation.batch_sizes == [8, 8, 4, 3, 3]

    # 6. Every segment went through the training forward pass, and training moved the weights.
    full = [
        tuple(batch["prompt_ids"][r][prompt_mask[r]].tolist() + ids[batch["completion_mask"][r].bool()].tolist())
        for r, ids in enumerate(batch["completion_ids"])
    ]
    # Multiset inclusion: identical segments of different rollouts (the groups share plans) each had their pass.
    counts = Counter(seen)
    assert all(counts[x] >= c for x, c in Counter(full).items()) and sum(Counter(full).values()) == len(rows) == 17
    moved = [k for k, v in trainer.model.named_parameters() if not torch.equal(before[k], v)]
    assert moved
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 1 and all(math.isfinite(x) for x in losses)
    assert batch["num_items_in_batch"].item() == loss_mask.sum().item()


@pytest.mark.parametrize("floor", [None, 0.5])
def test_a_tiny_segment_term_in_tied_groups_gives_a_tiny_advantage(tiny_model_dir, tiny_tokenizer, tmp_path, floor):
    """Issue 35, item 1: every rollout scores 1 (both groups tie) and each snapshot segment gets +0.001. 009b255 gave
    each segment the clip bound (4 - 1) / sqrt(4) = 1.5; now its episode's advantage (0) + 0.001 / max(1e-4, F), with
    F = `advantage_std_floor` (default 0.1, or as configured)."""

    def constant_reward(completions, **kwargs):
        return [1.0] * len(completions)

    _, _, captured, _, _ = _train(
        tmp_path,
        tiny_model_dir,
        tiny_tokenizer,
        reward_funcs=constant_reward,
        snapshot_advantage="episode",
        snapshot_reward_func="rollout_helpers:thousandth_bonus",
        **({} if floor is None else {"advantage_std_floor": floor}),
    )
    batch = captured[0][0]
    snapshot = batch["row_kind"] == RowKind.SNAPSHOT
    assert int(snapshot.sum()) == sum(SNAPSHOTS[p] for p in ORDER)
    assert batch["advantages"][~snapshot].tolist() == [0.0] * 8
    expected = 0.001 / (0.1 if floor is None else floor)
    assert batch["advantages"][snapshot].tolist() == pytest.approx([expected] * int(snapshot.sum()), rel=1e-4)


def hundredth_reads_reward(environments, **kwargs):
    return [0.01 * env.reads for env in environments]


def test_segments_get_their_episodes_advantage_when_the_spread_is_below_the_floor(
    tiny_model_dir, tiny_tokenizer, tmp_path
):
    """'episode' mode: a snapshot segment (scored with its episode's reward) gets its episode's advantage exactly,
    also in groups whose spread is below `advantage_std_floor` (rewards of 0.01 per read: std ~0.008 < 0.1). The
    trainer measures a row outside the baseline from its episode; measured from the group mean, a segment of
    episode B would get (0.02 - 0.01) / 0.1 = 0.1 instead of B's 1.21. Hand-computed from the rewards."""
    _, _, captured, _, _ = _train(
        tmp_path, tiny_model_dir, tiny_tokenizer, reward_funcs=hundredth_reads_reward, snapshot_advantage="episode"
    )
    batch = captured[0][0]
    episode, adv = batch["episode_id"].tolist(), batch["advantages"].tolist()
    rewards = [0.01 * REWARD[p] for p in ORDER]
    hand = []
    for i in range(8):
        members = rewards[4 * (i // 4) : 4 * (i // 4) + 4]
        mean = sum(members) / 4
        hand.append((rewards[i] - mean) / (_std(members) + 1e-4))
        assert _std(members) < 0.1
    assert adv == pytest.approx([hand[e] for e in episode], rel=1e-4, abs=1e-6)
    assert len(adv) == 17 and max(abs(a) for a in adv) > 1.0
    # From the group mean with the floored divisor, B's segments would differ (the comparison can fail).
    assert abs(hand[1] - (rewards[1] - 0.01) / 0.1) > 1.0


class TruncatedA(ScriptedGeneration):
    """Plan A's last turn is cut by the budget (no end-of-turn token)."""

    def __call__(self, *args, **kwargs):
        ids, logprobs = super().__call__(*args, **kwargs)
        return [x[:-1] if self.tok.decode(x).startswith("Plan A\nDone.") else x for x in ids], logprobs


def test_mask_truncated_completions_masks_the_earlier_segments_of_a_truncated_episode(
    tiny_model_dir, tiny_tokenizer, tmp_path
):
    """TRL masks a truncated row (`mask_truncated_completions`); the snapshot rows of the same episode (its earlier
    segments, rewarded with its reward) are not trained either, while other episodes' snapshot rows are."""
    _, _, captured, _, _ = _train(
        tmp_path, tiny_model_dir, tiny_tokenizer, generation_cls=TruncatedA, mask_truncated_completions=True
    )
    batch = captured[0][0]
    loss_mask = batch["completion_mask"] * batch["tool_mask"]
    plans = [re.search(r"Plan ([A-D])", tiny_tokenizer.decode(ids)) for ids in batch["prompt_ids"]]
    plans = [
        (m or re.search(r"Plan ([A-D])", tiny_tokenizer.decode(c))).group(1)
        for m, c in zip(plans, batch["completion_ids"])
    ]
    trained = {}
    for plan, kind, mask in zip(plans, batch["row_kind"].tolist(), loss_mask.sum(dim=1).tolist()):
        trained.setdefault((plan, RowKind(kind).name), []).append(mask > 0)
    assert trained[("A", "REGULAR")] == [False] and trained[("A", "SNAPSHOT")] == [False]
    assert all(trained[("B", "SNAPSHOT")]) and len(trained[("B", "SNAPSHOT")]) == 6
    assert all(trained[("D", "SNAPSHOT")]) and all(trained[("C", "REGULAR")])

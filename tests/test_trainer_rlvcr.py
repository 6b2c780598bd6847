"""End to end on the tiny model: scripted multi-turn tool rollouts in the level format -> RLVCR (CoPO) advantages.

Every assistant turn is a step `<level>k</level><think>...</think><tool_call>{...}</tool_call>` (the action tag is set
to `tool_call`, so the action is the tool call). The test checks the token advantages of the first batch against
confidences computed independently with a plain forward pass of a fresh copy of the model, and that the training
run makes exactly one batched alternative-generation call per training step, logs the metrics and moves the weights.
"""

import json
import math
import re
from collections import Counter

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM

from trl_agentic import AgenticGRPOConfig, AgenticGRPOTrainer
from trl_agentic.rlvcr.estimator import _generation_budget
from trl_agentic.rlvcr.parsing import LEVEL1_THINK, StepTags, render_prefix

TAGS = StepTags(action_open="<tool_call>", action_close="</tool_call>")
# Per rollout of a group (k = how many times the prompt was seen, mod 4): (level, action) of its two tool turns.
PLANS = {
    0: [(2, "look"), (3, "go north")],  # success
    1: [(4, "look"), (1, "go south")],
    2: [(2, "look"), (2, "go north")],  # success
    3: [(3, "wait"), (4, "go south")],
}
SUCCESS = {0, 2}


class StepEnv:
    def reset(self, **kwargs):
        self.actions = []

    def act(self, action: str) -> str:
        """
        Perform an action.

        Args:
            action: The action text.
        """
        self.actions.append(action)
        return f"You did: {action}"


def goal_reward(environments, **kwargs):
    return [1.0 if "go north" in env.actions else 0.0 for env in environments]


def call(action):
    return json.dumps({"name": "act", "arguments": {"action": action}})


def think_text(k, turn):
    return LEVEL1_THINK if PLANS[k][turn][0] == 1 else f"Rollout {k}, turn {turn}: thinking."


def turn_text(k, turn):
    level, action = PLANS[k][turn]
    return f"<level>{level}</level>\n<think>{think_text(k, turn)}</think>\n<tool_call>\n{call(action)}\n</tool_call>"


def alt_text(level):
    return f"Forced level {level} reasoning."


class ScriptedGeneration:
    """Rollout turns from PLANS (the third turn is a malformed "Done."); forcing prompts get a fixed thinking."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.seen = Counter()
        self.forcing_calls = []  # per call: the forced levels
        self.mixed_calls = 0

    def __call__(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        out, forced = [], []
        for ids in prompt_ids:
            text = self.tok.decode(ids)
            match = re.search(r"<level>(\d)</level>\n<think>$", text)
            if "Now think at Level" in text and match:
                forced.append(int(match.group(1)))
                out.append(f"{alt_text(int(match.group(1)))}</think>\n<tool_call>\n{{}}\n</tool_call><|im_end|>")
                continue
            turns = text.count("<tool_response>")
            if turns == 0:
                k = self.seen[tuple(ids)] % 4
                self.seen[tuple(ids)] += 1
                out.append(turn_text(k, 0) + "<|im_end|>")
            elif turns == 1:
                k = int(re.search(r"Rollout (\d), turn 0", text).group(1)) if "Rollout" in text else 1
                out.append(turn_text(k, 1) + "<|im_end|>")
            else:
                out.append("Done.<|im_end|>")
        if forced:
            self.forcing_calls.append(forced)
            self.mixed_calls += len(forced) != len(prompt_ids)
        return [self.tok.encode(s, add_special_tokens=False) for s in out], None


@pytest.fixture(scope="module")
def peaked_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with scaled-up weights: its random logits are nearly uniform, which would make the four levels'
    confidences equal to ~1e-6; scaled, they differ by tens of percent."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 2:
                param.mul_(20.0 if "lm_head" in name else math.sqrt(20.0))
    path = tmp_path_factory.mktemp("peaked") / "model"
    model.save_pretrained(path)
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(path)
    return str(path)


def runs(completion_mask, tool_mask):
    on = (completion_mask * tool_mask).tolist()
    out, start = [], None
    for i, v in enumerate(on + [0]):
        if v and start is None:
            start = i
        if not v and start is not None:
            out.append((start, i))
            start = None
    return out


def test_rlvcr_copo_training_run(peaked_model_dir, tiny_tokenizer, tmp_path):
    tok = tiny_tokenizer
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": "Go north."}]] * 8})
    args = AgenticGRPOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        report_to="none",
        seed=0,
        max_steps=2,
        learning_rate=5e-2,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=1024,
        max_tool_calling_iterations=4,
        logging_steps=1,
        save_strategy="no",
        advantage_estimator="rlvcr",
        rlvcr_mode="copo",
        rlvcr_action_tag="tool_call",
        rlvcr_score_batch_size=5,
    )
    trainer = AgenticGRPOTrainer(
        model=peaked_model_dir,
        reward_funcs=goal_reward,
        args=args,
        train_dataset=dataset,
        environment_factory=StepEnv,
    )
    generation = ScriptedGeneration(tok)
    trainer._generate_single_turn = generation
    batches = []
    original = trainer._augmenter.__call__

    def capture(*a, **k):
        batch = original(*a, **k)
        batches.append({key: v.clone() if isinstance(v, torch.Tensor) else v for key, v in batch.items()})
        return batch

    trainer._augmenter = capture
    before = {k: v.clone() for k, v in trainer.model.named_parameters()}
    trainer.train()

    # Exactly one batched alternative-generation call per training step, with nothing else in it: 2 successful
    # rollouts x 2 steps, 2 forced levels each (levels {2, 3, 4} minus the step's own).
    assert len(generation.forcing_calls) == 2 and generation.mixed_calls == 0
    assert all(sorted(c) == sorted([3, 4, 2, 4, 3, 4, 3, 4]) for c in generation.forcing_calls)

    # Token advantages of the first batch vs an independent computation.
    batch = batches[0]
    adv = batch["advantages"]
    assert adv.shape == batch["completion_ids"].shape
    fresh = AutoModelForCausalLM.from_pretrained(peaked_model_dir).eval()
    a_ep = 0.5 / (math.sqrt(1 / 3) + 1e-4)  # rewards (1, 0, 1, 0): mean 0.5, unbiased std sqrt(1/3)
    checked = 0
    for r in range(adv.size(0)):
        prompt = batch["prompt_ids"][r][batch["prompt_mask"][r].bool()].tolist()
        completion = batch["completion_ids"][r].tolist()
        steps = runs(batch["completion_mask"][r], batch["tool_mask"][r])
        first = tok.decode(completion[steps[0][0] : steps[0][1]])
        k = int(re.search(r"Rollout (\d)", first).group(1)) if "Rollout" in first else 1
        assert len(steps) == 3  # two tool turns + "Done."
        if k not in SUCCESS:
            mask = batch["completion_mask"][r].bool()
            assert torch.allclose(adv[r][mask], torch.full_like(adv[r][mask], -a_ep), atol=1e-5)
            continue
        values = []
        for turn in (0, 1):
            start, end = steps[turn]
            level, action = PLANS[k][turn]
            thinking = {lv: alt_text(lv) for lv in (2, 3, 4)}
            thinking[1] = LEVEL1_THINK
            thinking[level] = think_text(k, turn)
            conf = {}
            for lv in (1, 2, 3, 4):
                # The canonical prefix, then the policy's own "\n" after the tag (`turn_text`), then the action.
                head = prompt + completion[:start] + tok.encode(render_prefix(lv, thinking[lv], TAGS) + "\n")
                act = tok.encode(call(action))
                ids = torch.tensor([head + act])
                with torch.no_grad():
                    logp = torch.log_softmax(fresh(ids).logits[0, :-1].double(), dim=-1)
                token_logp = logp[torch.arange(ids.size(1) - 1), ids[0, 1:]][-len(act) :]
                conf[lv] = math.exp(token_logp.mean().item())
            lo, hi = min(conf.values()), max(conf.values())
            assert hi - lo > 1e-3 * hi  # the levels really differ
            norm = {lv: (c - lo) / (hi - lo) for lv, c in conf.items()}
            weight = math.exp(2 * norm[level]) / (sum(math.exp(2 * v) for v in norm.values()) / 4)
            values.append(a_ep * weight)
            got = adv[r, start:end]
            assert torch.allclose(got, torch.full_like(got, a_ep * weight), atol=2e-3), (r, turn, got[0], weight)
        assert abs(values[0] - values[1]) > 1e-2  # token advantages differ by step
        start, end = steps[2]
        assert torch.allclose(adv[r, start:end], torch.full_like(adv[r, start:end], a_ep), atol=1e-5)  # malformed
        checked += 1
    assert checked == 2

    logs = [h for h in trainer.state.log_history if "rlvcr/expanded_steps" in h]
    assert len(logs) == 2
    for h in logs:
        assert h["rlvcr/expanded_steps"] == 4 and h["rlvcr/invalid_format"] == 4
        # Levels of the 8 well-formed steps: 2, 3, 4, 1, 2, 2, 3, 4.
        assert [h[f"rlvcr/level_frac_{lv}"] for lv in (1, 2, 3, 4)] == [1 / 8, 3 / 8, 2 / 8, 2 / 8]
        assert 0 < h["rlvcr/confidence_mean"] < 1 and h["rlvcr/failed_alternatives"] == 0
    moved = [k for k, v in trainer.model.named_parameters() if not torch.equal(before[k], v)]
    assert moved
    assert all(math.isfinite(h["loss"]) for h in trainer.state.log_history if "loss" in h)


def test_generation_budget_caps_real_generation(tiny_model_dir, tmp_path):
    args = AgenticGRPOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        report_to="none",
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=24,
        advantage_estimator="rlvcr",
    )
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": "Hi."}]] * 2})
    trainer = AgenticGRPOTrainer(model=tiny_model_dir, reward_funcs=goal_reward, args=args, train_dataset=dataset)
    prompts = [[257, 72, 105], [257, 72, 105, 33]]
    torch.manual_seed(0)
    with _generation_budget(trainer, 3):
        capped, _ = trainer._generate_single_turn(prompts, None, {}, num_generations=1)
    assert trainer.generation_config.max_new_tokens == 24  # restored
    uncapped, _ = trainer._generate_single_turn(prompts, None, {}, num_generations=1)
    assert all(len(c) <= 3 for c in capped)
    assert max(len(c) for c in uncapped) > 3  # the random tiny model rarely stops early


def test_rlvcr_expansion_rows_reach_the_batch(peaked_model_dir, tiny_tokenizer, tmp_path):
    tok = tiny_tokenizer
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": "Go north."}]] * 4})
    args = AgenticGRPOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        report_to="none",
        seed=0,
        max_steps=1,
        learning_rate=5e-2,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=1024,
        max_tool_calling_iterations=4,
        logging_steps=1,
        save_strategy="no",
        advantage_estimator="rlvcr",
        rlvcr_mode="copo",
        rlvcr_expand=True,
        rlvcr_action_tag="tool_call",
    )
    trainer = AgenticGRPOTrainer(
        model=peaked_model_dir, reward_funcs=goal_reward, args=args, train_dataset=dataset, environment_factory=StepEnv
    )
    trainer._generate_single_turn = ScriptedGeneration(tok)
    batches = []
    original = trainer._augmenter.__call__

    def capture(*a, **k):
        batch = original(*a, **k)
        batches.append({key: v.clone() if isinstance(v, torch.Tensor) else v for key, v in batch.items()})
        return batch

    trainer._augmenter = capture
    trainer.train()

    batch = batches[0]
    kinds = batch["row_kind"].tolist()
    expansion = [i for i, kind in enumerate(kinds) if kind == 4]  # RowKind.EXPANSION
    assert len(expansion) == 12  # 2 successful rollouts x 2 steps x 3 other levels
    regular = [i for i, kind in enumerate(kinds) if kind == 0]
    assert len(regular) == 4
    assert all(batch["group_id"][i] == batch["group_id"][regular[0]] for i in expansion)
    a_ep = 0.5 / (math.sqrt(1 / 3) + 1e-4)
    trained = batch["completion_mask"] * batch["tool_mask"]
    rows = []  # (context tokens, level, advantage) of each expansion row, in batch order
    steps_ids = []  # the trained tokens of each expansion row
    for i in expansion:
        mask = trained[i].bool()
        context_len = int(mask.int().argmax())
        ids = batch["completion_ids"][i][mask].tolist()
        text = tok.decode(ids)
        # Only the alternative step is trained: a canonical prefix, then the policy's own text from the action tag on
        # (its "\n", the original action, the end of the turn).
        assert re.fullmatch(
            r"<level>\d</level>\n<think>[^<]*</think>\n<tool_call>\n\{.*\}\n</tool_call><\|im_end\|>", text
        )
        assert mask[context_len:].sum() == len(ids)  # the context is one block before the step
        level = int(text[len("<level>")])
        thinking = text[text.index("<think>") + len("<think>") : text.index("</think>")]
        assert thinking == (LEVEL1_THINK if level == 1 else alt_text(level))
        row_adv = batch["advantages"][i][mask]
        assert torch.allclose(row_adv, row_adv[0].expand_as(row_adv))
        rows.append((batch["completion_ids"][i][:context_len].tolist(), level, row_adv[0].item()))
        steps_ids.append(ids)
    # Expansion rows come in (row, step, level) order: 3 per expanded step. Per step, the 4 levels' CoPO weights
    # average to 1, so (A of the chosen level on the original row + the 3 expansion rows) / 4 = A_ep.
    successful = []
    for r in regular:
        steps = runs(batch["completion_mask"][r], batch["tool_mask"][r])
        first = tok.decode(batch["completion_ids"][r][steps[0][0] : steps[0][1]].tolist())
        k = int(re.search(r"Rollout (\d)", first).group(1)) if "Rollout" in first else 1
        if k in SUCCESS:
            successful += [(r, k, turn, *steps[turn]) for turn in (0, 1)]
    assert len(successful) == 4
    tag = tok.convert_tokens_to_ids("<tool_call>")
    for n, (r, k, turn, start, end) in enumerate(successful):
        group = rows[3 * n : 3 * n + 3]
        completion = batch["completion_ids"][r].tolist()
        # Each alternative step ends with the parent's own tokens from the action tag on, id for id.
        own = completion[start:end]
        own = own[own.index(tag) :]
        assert all(ids[len(ids) - len(own) :] == own for ids in steps_ids[3 * n : 3 * n + 3])
        assert all(context == completion[:start] for context, _, _ in group)
        assert sorted(level for _, level, _ in group) == [lv for lv in (1, 2, 3, 4) if lv != PLANS[k][turn][0]]
        chosen = batch["advantages"][r, start].item()
        assert abs((chosen + sum(value for _, _, value in group)) / 4 - a_ep) < 1e-5
        assert abs(chosen - a_ep) > 1e-3  # a real reweighting
    assert batch["num_items_in_batch"].item() == trained.sum().item()
    assert all(math.isfinite(h["loss"]) for h in trainer.state.log_history if "loss" in h)

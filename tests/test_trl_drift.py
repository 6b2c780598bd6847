"""Drift guards: where trl-agentic re-derives what TRL computes, both are run on the same inputs against the installed
TRL, so that a TRL upgrade that changes TRL's side fails here instead of training silently differently.

- reward aggregation (weights, `None` rewards) and advantage post-processing (group/batch/none scaling, NaN rows):
  `BatchAugmenter` + `group_advantages` vs TRL's `_generate_and_score_completions`;
- old and reference log-probs of extra rows (`AgenticGRPOTrainer._logps_for_rows`, `BatchAugmenter._ref_logps`) vs
  TRL's `old_per_token_logps` / `ref_per_token_logps` of the same rows;
- loss normalisers: tests/test_parity.py and tests/test_parity_tools.py (bitwise losses for every loss type used) and
  tests/test_padding_rows_loss.py (the row weighting is exactly 1 without padding);
- the vLLM importance-sampling ratio: tests/vllm_tier (TRL computes it only with vLLM);
- the prompt completed with what `env.reset` returns (`envs.protocol.with_observation`) vs the prompts TRL gives its
  reward functions.
"""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from trl import GRPOTrainer
from trl.trainer.utils import nanstd

from trl_agentic import AgenticGRPOConfig, AgenticGRPOTrainer

WORDS = ["alpha", "beta", "gamma", "delta"]


class Script:
    """Deterministic plain-text generation: the k-th copy of a prompt in a call gets answer k (so groups vary)."""

    def __init__(self, tokenizer):
        self.tok = tokenizer

    def __call__(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        seen: dict[tuple, int] = {}
        texts = []
        for ids in prompt_ids:
            k = seen.get(tuple(ids), 0)
            seen[tuple(ids)] = k + 1
            texts.append(" ".join(WORDS[: 1 + (k + len(ids)) % 4]) + "<|im_end|>")
        return [self.tok.encode(t, add_special_tokens=False) for t in texts], None


def length_reward(completions, **kwargs):
    return [float(len(c[0]["content"]) % 5) for c in completions]


def sometimes_none(completions, **kwargs):
    # None = this reward function does not apply to that row (TRL: NaN, ignored in the weighted sum).
    return [None if "gamma" in c[0]["content"] else float(c[0]["content"].count("a")) for c in completions]


def always_none_for_beta(completions, **kwargs):
    # Both functions None on a row: the row is unscorable (NaN reward, advantage 0).
    return [None if c[0]["content"].startswith("alpha beta") else 1.0 for c in completions]


def _trainer(model_dir, tmp_path, **overrides):
    values = dict(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        report_to="none",
        seed=5,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=16,
        save_strategy="no",
        reward_weights=[1.0, 0.5],
    )
    values.update(overrides)
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"Say {w}."}] for w in WORDS] * 2})
    trainer = AgenticGRPOTrainer(
        model=model_dir,
        reward_funcs=[length_reward, sometimes_none],
        args=AgenticGRPOConfig(**values),
        train_dataset=dataset,
    )
    trainer._generate_single_turn = Script(trainer._tokenizer)
    trainer.model.train()
    return trainer, [dict(r) for r in dataset.select(range(8))]


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_reward_aggregation_and_advantages_match_trl(tiny_model_dir, tmp_path, scale):
    trainer, rows = _trainer(tiny_model_dir, tmp_path, scale_rewards=scale)
    trl_output = GRPOTrainer._generate_and_score_completions(trainer, [dict(r) for r in rows])
    ours = trainer._generate_and_score_completions([dict(r) for r in rows])
    assert torch.equal(ours["advantages"], trl_output["advantages"])
    assert torch.equal(ours["completion_ids"], trl_output["completion_ids"])
    # The comparison can fail: some rewards were None and the advantages are not all zero.
    rewards = trainer._last_rewards_per_func
    assert torch.isnan(rewards).any() and trl_output["advantages"].abs().sum() > 0


def sevenths_reward(completions, **kwargs):
    # Non-integer rewards: the summation order of a group's mean matters (it does not for 0/1 rewards).
    return [len(c[0]["content"]) / 7 for c in completions]


def _trl_formula(rewards, num_generations, scale):
    """TRL 1.16's `sum_then_normalize` lines, written out on the rewards (NaN = unscorable)."""
    grouped = rewards.view(-1, num_generations)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(num_generations)
    if scale == "batch":
        std = nanstd(rewards).expand_as(rewards)
    else:
        std = nanstd(grouped, dim=1).repeat_interleave(num_generations)
    advantages = rewards - mean
    if scale != "none":
        advantages = advantages / (std + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("num_generations", [6, 16])
def test_features_off_advantages_are_trls_for_any_group_size(tiny_model_dir, tmp_path, num_generations, scale):
    """Features off, the trainer's advantages are TRL's bit for bit for group sizes where the summation order matters
    (issue 36: 009b255's `index_add` sums differed from TRL's `nanmean` for G = 5, 6, 7, 9-16)."""
    trainer, _ = _trainer(
        tiny_model_dir,
        tmp_path,
        scale_rewards=scale,
        num_generations=num_generations,
        per_device_train_batch_size=2 * num_generations,
        reward_weights=[0.3, 1.0],
    )
    trainer.reward_funcs = [sevenths_reward, length_reward]
    rows = [{"prompt": [{"role": "user", "content": f"Say {w}."}]} for w in ("alpha", "gamma")]
    rows = [dict(r) for r in rows for _ in range(num_generations)]  # two groups, as TRL's sampler repeats prompts
    ours = trainer._generate_and_score_completions([dict(r) for r in rows])
    per_func = trainer._last_rewards_per_func
    rewards = (per_func * torch.tensor([0.3, 1.0])).nansum(dim=1)
    expected = _trl_formula(rewards, num_generations, scale)
    assert torch.equal(ours["advantages"], expected)
    assert rewards.unique().numel() > 2 and expected.abs().max() > 0.1  # groups with spread, non-integer rewards


def test_unscorable_rows_match_trl(tiny_model_dir, tmp_path):
    trainer, rows = _trainer(tiny_model_dir, tmp_path)
    trainer.reward_funcs = [always_none_for_beta, always_none_for_beta]
    trl_output = GRPOTrainer._generate_and_score_completions(trainer, [dict(r) for r in rows])
    ours = trainer._generate_and_score_completions([dict(r) for r in rows])
    assert torch.isnan(trainer._last_rewards_per_func).all(dim=1).any()
    assert torch.equal(ours["advantages"], trl_output["advantages"])


def test_old_and_reference_logps_of_extra_rows_match_trl(tiny_model_dir, tmp_path):
    """TRL computes old log-probs when the generation batch spans several optimizer steps and reference log-probs
    with `beta > 0`; the extra rows' are computed by our functions, which must give TRL's values on TRL's rows."""
    trainer, rows = _trainer(
        tiny_model_dir,
        tmp_path,
        beta=0.1,
        per_device_train_batch_size=4,
        steps_per_generation=2,
        gradient_accumulation_steps=1,
    )
    trl_output = GRPOTrainer._generate_and_score_completions(trainer, [dict(r) for r in rows])
    assert trl_output["old_per_token_logps"] is not None and trl_output["ref_per_token_logps"] is not None
    inputs = (
        trl_output["prompt_ids"],
        trl_output["prompt_mask"],
        trl_output["completion_ids"],
        trl_output["completion_mask"],
    )
    old = trainer._logps_for_rows(trainer.model, *inputs)
    keys = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")
    ref = trainer._augmenter._ref_logps(dict(zip(keys, inputs)))
    mask = trl_output["completion_mask"].bool()
    torch.testing.assert_close(old[mask], trl_output["old_per_token_logps"][mask], rtol=0, atol=1e-6)
    torch.testing.assert_close(ref[mask], trl_output["ref_per_token_logps"][mask], rtol=0, atol=1e-6)
    # Old and reference differ here only if the policy moved; they are different functions of different models.
    assert trainer.ref_model is not None


class _ObservingEnv:
    """`reset` returns an observation: TRL appends it to the last prompt message."""

    def reset(self, room: int, **row):
        return f" You see room {room}."

    def look(self) -> str:
        """
        Look around.
        """
        return "nothing"


@pytest.mark.parametrize("content", ["text", "parts"])
def test_prompts_with_the_reset_observation_match_trl(tiny_model_dir, tmp_path, content):
    """`envs.protocol.with_observation` (used by the held-out evaluation and the warm-start traces) re-implements the
    prompt TRL builds from what `env.reset` returns: compared with the prompts TRL hands its reward functions."""
    from trl_agentic.envs.protocol import with_observation

    seen = []

    def record(completions, prompts, **kwargs):
        seen.extend(prompts)
        return [0.0] * len(completions)

    def message(k):
        text = f"Go {k}."
        return text if content == "text" else [{"type": "text", "text": text}]

    rows = [{"prompt": [{"role": "user", "content": message(k)}], "room": k} for k in range(4)]
    trainer = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=[record],
        args=AgenticGRPOConfig(
            output_dir=str(tmp_path),
            use_cpu=True,
            report_to="none",
            per_device_train_batch_size=4,
            num_generations=2,
            max_completion_length=8,
        ),
        train_dataset=Dataset.from_list(rows),
        environment_factory=_ObservingEnv,
    )
    trainer._generate_single_turn = Script(trainer._tokenizer)
    batch = [dict(r) for r in rows]
    GRPOTrainer._generate_and_score_completions(trainer, batch)
    expected = [with_observation(r["prompt"], _ObservingEnv().reset(**r)) for r in batch]
    assert seen == expected and seen[0] != rows[0]["prompt"]

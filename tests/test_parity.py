"""Features-off parity: `AgenticGRPOTrainer` trains exactly like TRL's `GRPOTrainer`, bit for bit.

Each scenario trains both trainers from the same tiny random model with real generation (sampling) for 4 optimizer
steps: 2 generation batches of 2 groups each, every generation batch split into 2 optimizer steps, so the second step of
each is off-policy (importance ratios differ from 1 and the loss types' clipping and weighting are exercised). Rewards
are non-integer (summation order matters). Compared, bit for bit: the rewards of every reward function, the batch TRL
trains on (token ids, masks, advantages, log-probs, token counts), every micro-batch loss, every metric TRL logs, and
all weights after the 4 steps. Our own bookkeeping is checked against TRL's layout too: group `i // G` for row `i`.

Tiers: every scenario runs in the unit tier (about 1-3 s each on the tiny model). Settings are spread over the group
sizes (G in {4, 6, 16}) instead of a full cross product; see `SCENARIOS`.
"""

import math
import random

import pytest
import torch
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

from trl_agentic import AgenticGRPOConfig, AgenticGRPOTrainer
from trl_agentic.estimators import grpo_estimator


def reward_text(completions, **kwargs):
    # A pseudo-random real number per completion text (seeded by the text, so the same in both runs): values that
    # vary across a group, so advantages are non-zero and depend on the order of summation.
    return [random.Random(c[0]["content"]).uniform(-1.0, 2.0) for c in completions]


def reward_vowels(completions, **kwargs):
    return [sum(ch in "aeiou" for ch in c[0]["content"]) / 7.0 for c in completions]


def reward_digits(completions, **kwargs):
    return [math.sqrt(1 + sum(ch.isdigit() for ch in c[0]["content"])) for c in completions]


PROMPTS = ["cats", "rain", "tea", "jazz", "maps", "salt", "owls", "glue"]


def _dataset():
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": f"Say something about {w}."}] for w in PROMPTS]})


def _by_group_size(G: int) -> dict:
    # 2 groups per generation batch, split into 2 optimizer steps of G rows each.
    return dict(num_generations=G, per_device_train_batch_size=G, steps_per_generation=2)


class _OwnEstimator:
    """trl-agentic's vectorised GRPO advantages (`grpo_estimator`) in place of TRL's: a feature on (a custom
    estimator) that changes nothing, so the vectorised path must reproduce TRL's advantages bit for bit."""

    __name__ = "own_grpo"

    def __call__(self, batch, trainer):
        return grpo_estimator(batch, trainer)


SCENARIOS = {
    # Group sizes (issue 36: TRL's nanmean vs a segment sum differ in rounding for G outside 2, 3, 4, 8).
    "G4_dapo": dict(G=4),
    "G6_dapo": dict(G=6),
    "G16_dapo": dict(G=16),
    # Advantage scaling.
    "G6_grpo_scale_batch": dict(G=6, loss_type="grpo", scale_rewards="batch"),
    "G16_dr_grpo_scale_none": dict(G=16, loss_type="dr_grpo", scale_rewards="none"),
    # Several weighted reward functions (one with a negative weight).
    "G6_weighted_rewards": dict(
        G=6, rewards=[reward_text, reward_vowels, reward_digits], reward_weights=[0.7, -1.3, 0.25]
    ),
    # Truncated completions masked out: an end-of-turn bias makes about half the completions end before the budget.
    "G4_mask_truncated": dict(G=4, mask_truncated_completions=True, loss_type="grpo", eos_bias=True),
    "G16_mask_truncated": dict(G=16, mask_truncated_completions=True, eos_bias=True),
    # Precision and adapters.
    "G6_bf16": dict(G=6, bf16=True),
    "G4_lora": dict(G=4, lora=True, loss_type="grpo"),
    "G16_lora_bf16": dict(G=16, lora=True, bf16=True, loss_type="bnpo"),
    # The loss types TRL 1.16 has beyond dapo / grpo / dr_grpo (`GRPOConfig.loss_type`).
    "G6_bnpo": dict(G=6, loss_type="bnpo"),
    "G4_cispo": dict(G=4, loss_type="cispo"),
    "G16_sapo": dict(G=16, loss_type="sapo"),
    "G6_luspo": dict(G=6, loss_type="luspo", importance_sampling_level="sequence"),
    "G4_vespo": dict(G=4, loss_type="vespo"),
    # The vectorised advantages (features on, not triggered): TRL's for every group size and scaling.
    "G6_own_estimator": dict(G=6, own_estimator=True),
    "G16_own_estimator_scale_batch": dict(G=16, own_estimator=True, scale_rewards="batch", loss_type="grpo"),
    "G4_own_estimator_scale_none": dict(G=4, own_estimator=True, scale_rewards="none"),
}
TRL_KEYS = (
    "prompt_ids",
    "prompt_mask",
    "completion_ids",
    "completion_mask",
    "advantages",
    "num_items_in_batch",
    "old_per_token_logps",
    "ref_per_token_logps",
)


def _train(trainer_cls, config_cls, model_dir, out_dir, scenario: dict):
    scenario = dict(scenario)
    G = scenario.pop("G")
    rewards = scenario.pop("rewards", [reward_text])
    lora, eos_bias, own = (
        scenario.pop("lora", False),
        scenario.pop("eos_bias", False),
        scenario.pop("own_estimator", False),
    )
    from transformers import AutoTokenizer

    if eos_bias:
        eos = AutoTokenizer.from_pretrained(model_dir).eos_token_id
        scenario["generation_kwargs"] = {"sequence_bias": [[[eos], 2.0]]}
    args = config_cls(
        output_dir=str(out_dir),
        use_cpu=True,
        bf16=scenario.pop("bf16", False),
        report_to="none",
        seed=123,
        max_steps=4,
        learning_rate=1e-2,
        max_completion_length=12,
        logging_steps=1,
        save_strategy="no",
        **_by_group_size(G),
        **scenario,
    )
    kwargs = {}
    if lora:
        from peft import LoraConfig

        kwargs["peft_config"] = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0)
    if own and trainer_cls is AgenticGRPOTrainer:
        kwargs["advantage_estimator"] = _OwnEstimator()
    trainer = trainer_cls(model=model_dir, reward_funcs=rewards, args=args, train_dataset=_dataset(), **kwargs)
    record = {"rewards": [], "batches": [], "losses": []}
    calculate, generate, compute = (
        trainer._calculate_rewards,
        trainer._generate_and_score_completions,
        trainer._compute_loss,
    )

    def calculate_rewards(*a, **k):
        out = calculate(*a, **k)
        record["rewards"].append(out.clone())
        return out

    def generate_and_score(inputs):
        batch = generate(inputs)
        record["batches"].append({k: v.clone() for k, v in batch.items() if isinstance(v, torch.Tensor)})
        return batch

    def compute_loss(model, inputs):
        loss = compute(model, inputs)
        record["losses"].append(loss.detach().clone())
        return loss

    trainer._calculate_rewards = calculate_rewards
    trainer._generate_and_score_completions = generate_and_score
    trainer._compute_loss = compute_loss
    trainer.train()
    record["history"] = [
        {k: v for k, v in h.items() if k not in ("step_time", "train_runtime", "train_samples_per_second")}
        for h in trainer.state.log_history
    ]
    record["weights"] = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    return record


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_features_off_matches_grpo_trainer(tiny_model_dir, tmp_path, name):
    scenario = SCENARIOS[name]
    G = scenario["G"]
    ref = _train(GRPOTrainer, GRPOConfig, tiny_model_dir, tmp_path / "trl", scenario)
    ours = _train(AgenticGRPOTrainer, AgenticGRPOConfig, tiny_model_dir, tmp_path / "ours", scenario)
    # Same rewards, function by function, row by row.
    assert len(ref["rewards"]) == len(ours["rewards"]) == 2
    for mine, theirs in zip(ours["rewards"], ref["rewards"]):
        assert torch.equal(mine, theirs)
    # Same batch: tokens, masks, advantages, log-probs, token count.
    assert len(ref["batches"]) == len(ours["batches"]) == 2
    for batch, ref_batch in zip(ours["batches"], ref["batches"]):
        for key in TRL_KEYS:
            assert (key in batch) == (key in ref_batch), key
            if key in ref_batch:
                assert torch.equal(batch[key], ref_batch[key]), key
        # Our group ids are TRL's layout: row i is in group i // G (two groups per generation batch).
        rows = ref_batch["prompt_ids"].size(0)
        assert rows == 2 * G and torch.equal(batch["group_id"], torch.arange(rows) // G)
    # Same loss at every micro-step, same logged metrics (ours logs extra keys only), same weights after 4 steps.
    assert len(ref["losses"]) == len(ours["losses"]) == 4
    for mine, theirs in zip(ours["losses"], ref["losses"]):
        assert torch.equal(mine, theirs)
    steps = [h for h in ours["history"] if "loss" in h]
    ref_steps = [h for h in ref["history"] if "loss" in h]
    assert len(steps) == len(ref_steps) == 4
    for step, ref_step in zip(steps, ref_steps):
        assert {k: step[k] for k in ref_step} == ref_step
    assert ref["weights"].keys() == ours["weights"].keys()
    for key, value in ref["weights"].items():
        assert torch.equal(ours["weights"][key], value), key

    # The comparison can fail: the rewards varied within groups, advantages were non-zero and not a permutation of
    # one group's values, the second step of a generation batch was off-policy, and training moved the weights.
    for batch in ref["batches"]:
        advantages = batch["advantages"]
        assert advantages.abs().sum() > 0
        assert not torch.equal(advantages[:G].sort().values, advantages[G:].sort().values)
    assert any(not torch.equal(a, b) for a, b in zip(ref["losses"][0::2], ref["losses"][1::2]))
    assert all(r.std() > 0 for r in ref["rewards"])
    assert any(r != r.round() for r in ref["rewards"][0].flatten())  # non-integer rewards
    from transformers import AutoModelForCausalLM

    start = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    trained = {k.replace("base_model.model.", "").replace(".base_layer", ""): v for k, v in ours["weights"].items()}
    moved = [k for k, v in trained.items() if k in start and not torch.equal(start[k].to(v.dtype), v)]
    lora_moved = [k for k, v in ours["weights"].items() if "lora_B" in k and v.abs().sum() > 0]
    assert lora_moved if scenario.get("lora") else moved, "training did not move the weights"
    if scenario.get("mask_truncated_completions"):
        masked = torch.cat([b["completion_mask"].sum(dim=1) == 0 for b in ref["batches"]])
        assert masked.any() and not masked.all()  # some completions were cut and masked, others ended in time

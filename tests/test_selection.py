"""`row_selection` (issue 37): the pure rules against brute force and hand counts, and one trainer-level test per mode
on the tiny model, each against an independent computation of what training on the selected rows means."""

import itertools
import math

import pytest
import torch
from datasets import Dataset
from hypothesis import given
from hypothesis import strategies as st

from trl_agentic import AgenticGRPOConfig, AgenticGRPOTrainer
from trl_agentic.selection import max_variance_rows, max_variance_subset, random_rows, successful_rows

# ------------------------------------------------------------------------------------------------ rules


def _population_variance(values):
    mean = sum(values) / len(values)
    return sum((v - mean) ** 2 for v in values) / len(values)


@given(
    st.lists(st.sampled_from([0.0, 0.1, 0.5, 1.0, -0.5, 1.1]), min_size=1, max_size=8),
    st.integers(1, 8),
    st.sampled_from([1.0, 1e-6, 1e3]),  # at 1e-6 an absolute tie tolerance of 1e-12 called every split tied
)
def test_max_variance_subset_is_as_good_as_every_subset(rewards, m, scale):
    rewards = [r * scale for r in rewards]
    chosen = max_variance_subset(rewards, m)
    if len(rewards) <= m:
        assert chosen == list(range(len(rewards)))
        return
    assert len(chosen) == m == len(set(chosen))
    best = max(
        _population_variance([rewards[k] for k in subset]) for subset in itertools.combinations(range(len(rewards)), m)
    )
    assert _population_variance([rewards[k] for k in chosen]) == pytest.approx(best, rel=1e-9, abs=1e-12 * scale**2)


def test_max_variance_subset_by_hand():
    # Two successes among six failures, keep 4: both successes and two failures (variance 0.25, the most a 0/1 set
    # has); of equal variances the split with the most "high" rewards of the sorted order (equal ones by index) wins.
    assert max_variance_subset([0, 0, 1, 0, 0, 1, 0, 0], 4) == [2, 5, 6, 7]
    # No spread: the last m of the sorted order.
    assert max_variance_subset([1.0] * 5, 2) == [3, 4]
    # NaN rewards are never chosen.
    assert max_variance_subset([math.nan, 0.0, 1.0, math.nan], 2) == [1, 2]
    # Small rewards are compared, not called tied (the top two, variance 1.6e-13, won over 2.5e-13).
    assert max_variance_subset([0.0, 0.1e-6, 0.2e-6, 1e-6], 2) == [0, 3]
    with pytest.raises(ValueError):
        max_variance_subset([0.0], 0)


def test_max_variance_rows_works_per_group_in_any_order():
    rewards = [0, 1, 0, 1, 0.5, 0.5, 0.5, 0]
    groups = [0, 1, 0, 1, 0, 1, 0, 1]  # interleaved groups
    kept = max_variance_rows(rewards, groups, 2)
    # Group 0 (rows 0, 2, 4, 6: 0, 0, 0.5, 0.5): one low, one high; group 1 (1, 3, 5, 7: 1, 1, 0.5, 0): a 1 and the 0.
    assert [k for k, v in enumerate(kept) if v] == [2, 3, 6, 7] or sum(kept) == 4
    assert _population_variance([rewards[k] for k in (0, 2, 4, 6) if kept[k]]) == pytest.approx(0.0625)
    assert sorted(rewards[k] for k in (1, 3, 5, 7) if kept[k]) == [0, 1]


@given(
    st.lists(st.sampled_from([0.0, 1.0, math.nan]), min_size=0, max_size=20), st.floats(0.05, 1.0), st.integers(0, 9)
)
def test_random_rows_keeps_the_rounded_up_share_of_scorable_rows(rewards, fraction, seed):
    kept = random_rows(rewards, fraction, seed)
    scorable = sum(not math.isnan(r) for r in rewards)
    expected = min(scorable, max(1, math.ceil(fraction * scorable - 1e-9))) if scorable else 0
    assert sum(kept) == expected
    assert not any(k and math.isnan(r) for k, r in zip(kept, rewards))
    assert kept == random_rows(rewards, fraction, seed)  # the same seed keeps the same rows


def test_random_rows_is_uniform():
    # Over many seeds every row is kept about as often: 3 of 6 rows, each kept with probability 1/2.
    counts = [0] * 6
    for seed in range(3000):
        for k, kept in enumerate(random_rows([0.0] * 6, 0.5, seed)):
            counts[k] += kept
    assert all(abs(c / 3000 - 0.5) < 0.04 for c in counts)


def test_successful_rows():
    assert successful_rows([1.0, 0.0, 1.1, math.nan, 0.99], 1.0) == [True, False, True, False, False]


# ------------------------------------------------------------------------------------------------ trainer


def reward(completions, **kwargs):
    return [float(sum(map(ord, c[0]["content"])) % 7) for c in completions]


def _trainer(tiny_model_dir, tmp_path, **overrides):
    settings = dict(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        report_to="none",
        max_steps=1,
        seed=3,
        per_device_train_batch_size=8,
        num_generations=8,
        max_completion_length=8,
        save_strategy="no",
        temperature=1.0,
    )
    settings.update(overrides)
    args = AgenticGRPOConfig(**settings)
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": "Say hi."}]] * 8})
    trainer = AgenticGRPOTrainer(model=tiny_model_dir, reward_funcs=reward, args=args, train_dataset=dataset)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    return trainer, dataset


def _grad(trainer, loss) -> torch.Tensor:
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return torch.cat([(torch.zeros_like(p) if g is None else g).flatten() for g, p in zip(grads, params)])


def _rewards(batch, tokenizer):
    texts = tokenizer.batch_decode(batch["completion_ids"] * batch["completion_mask"], skip_special_tokens=True)
    return texts


def test_random_selection_trains_on_the_kept_rows_alone(tiny_model_dir, tmp_path):
    """The masked batch's gradient is that of the kept rows as their own batch (dapo: the mean over their tokens),
    built here by hand: rows sliced out, `num_items_in_batch` counted again."""
    full, dataset = _trainer(tiny_model_dir, tmp_path / "full")
    torch.manual_seed(0)
    batch = full._generate_and_score_completions(list(dataset))
    trainer, _ = _trainer(tiny_model_dir, tmp_path / "random", row_selection="random", row_selection_fraction=0.4)
    trainer.model.load_state_dict(full.model.state_dict())
    trainer._last_rewards_per_func = full._last_rewards_per_func
    selected = trainer._select_rows(dict(batch))
    kept = (selected["tool_mask"] * selected["completion_mask"]).sum(1) > 0
    assert int(kept.sum()) == math.ceil(0.4 * 8) == int(selected["num_rows_in_batch"])
    index = kept.nonzero().squeeze(1)
    alone = {k: v[index] if isinstance(v, torch.Tensor) and v.dim() > 0 else v for k, v in batch.items()}
    alone["num_items_in_batch"] = (alone["completion_mask"] * alone.get("tool_mask", 1)).sum()
    alone["num_rows_in_batch"] = torch.tensor(len(index))
    assert batch["advantages"][index].abs().sum() > 0
    torch.testing.assert_close(selected["advantages"], batch["advantages"])  # unchanged
    g_selected = _grad(trainer, trainer._compute_loss(trainer.model, selected))
    g_alone = _grad(trainer, trainer._compute_loss(trainer.model, alone))
    assert g_alone.abs().sum() > 0
    torch.testing.assert_close(g_selected, g_alone, rtol=1e-4, atol=1e-7)
    assert trainer._metrics["train"]["selection/num_kept"] == [4.0]


def test_random_selection_draws_anew_for_each_generation_batch_of_a_step(tiny_model_dir, tmp_path):
    """With `steps_per_generation` < `gradient_accumulation_steps` a step generates several batches: each drew the
    same rows (the seed was the run's and the step's only). The first batch of a step keeps its draw."""
    full, dataset = _trainer(tiny_model_dir, tmp_path / "full")
    torch.manual_seed(0)
    batch = full._generate_and_score_completions(list(dataset))
    trainer, _ = _trainer(tiny_model_dir, tmp_path / "random", row_selection="random", row_selection_fraction=0.4)
    trainer._last_rewards_per_func = full._last_rewards_per_func
    trainer.current_gradient_accumulation_steps = 3
    draws = []
    for micro_step in range(3):  # one step (global_step 0), three generation batches
        trainer._step = micro_step
        selected = trainer._select_rows(dict(batch))
        draws.append(tuple(((selected["tool_mask"] * selected["completion_mask"]).sum(1) > 0).tolist()))
    assert all(sum(d) == 4 for d in draws) and len(set(draws)) == 3
    rewards = trainer._augmenter.last_regular_rewards
    values = (rewards if rewards is not None else full._last_rewards_per_func.sum(1)).tolist()
    assert list(draws[0]) == random_rows(values, 0.4, 3 * 1_000_003)  # the seed every recorded run used


def test_successful_selection_is_sft_on_the_successful_rollouts(tiny_model_dir, tmp_path):
    """RFT: the gradient of TRL's dapo loss on the selected batch equals the gradient of the mean negative
    log-likelihood of the successful completions' tokens, computed here with a plain forward pass."""
    trainer, dataset = _trainer(tiny_model_dir, tmp_path, row_selection="successful", row_selection_threshold=3.0)
    torch.manual_seed(1)
    batch = trainer._generate_and_score_completions(list(dataset))
    rewards = trainer._last_rewards_per_func.sum(1)
    success = rewards >= 3.0
    assert 0 < int(success.sum()) < 8, rewards  # the seed gives both kinds
    loss_mask = batch["completion_mask"] * batch.get("tool_mask", 1)
    assert torch.equal(loss_mask.sum(1) > 0, success) and torch.equal(batch["advantages"], success.float())
    assert int(batch["num_items_in_batch"]) == int(loss_mask.sum())

    # Supervised fine-tuning on the successful rows, by hand.
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    position_ids = (mask.cumsum(1) - 1).clamp(min=0)
    logits = trainer.model(input_ids=ids, attention_mask=mask, position_ids=position_ids).logits
    width = batch["completion_ids"].size(1)
    logps = torch.log_softmax(logits[:, -width - 1 : -1].float(), dim=-1)
    token_logps = logps.gather(2, batch["completion_ids"].unsqueeze(2)).squeeze(2)
    nll = -(token_logps * loss_mask).sum() / loss_mask.sum()
    g_sft = _grad(trainer, nll)
    g_rft = _grad(trainer, trainer._compute_loss(trainer.model, batch))
    assert g_sft.abs().sum() > 0
    torch.testing.assert_close(g_rft, g_sft, rtol=1e-3, atol=1e-6 * g_sft.abs().max().item())


def test_max_variance_selection_keeps_the_highest_variance_rows_with_their_own_advantages(tiny_model_dir, tmp_path):
    trainer, dataset = _trainer(tiny_model_dir, tmp_path, row_selection="max_variance", row_selection_keep=3)
    torch.manual_seed(2)
    completions = []
    original = trainer._calculate_rewards

    def spy(inputs, prompts, completions_, ids):
        completions.extend(completions_)
        return original(inputs, prompts, completions_, ids)

    trainer._calculate_rewards = spy
    batch = trainer._generate_and_score_completions(list(dataset))
    rewards = reward(completions)
    assert len(set(rewards)) > 1
    # The kept rows: 3 of 8, a subset of the largest variance (checked against every subset).
    assert batch["prompt_ids"].size(0) == 3 == int(batch["num_rows_in_batch"])
    best = max(_population_variance([rewards[k] for k in s]) for s in itertools.combinations(range(8), 3))
    texts = [completions[k][0]["content"] for k in range(8)]
    kept_texts = trainer.processing_class.batch_decode(
        [ids[m.bool()] for ids, m in zip(batch["completion_ids"], batch["completion_mask"])], skip_special_tokens=True
    )
    kept_rewards = [rewards[texts.index(t)] for t in kept_texts]
    assert _population_variance(kept_rewards) == pytest.approx(best)
    # Advantages over the kept rows only: (r - mean) / (unbiased std + 1e-4), by hand.
    mean = sum(kept_rewards) / 3
    std = math.sqrt(sum((r - mean) ** 2 for r in kept_rewards) / 2)
    expected = torch.tensor([(r - mean) / (std + 1e-4) for r in kept_rewards])
    torch.testing.assert_close(batch["advantages"], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "selection",
    [
        {"row_selection": "max_variance", "row_selection_keep": 3},
        {"row_selection": "successful", "row_selection_threshold": 3.0},
        {"row_selection": "random", "row_selection_fraction": 0.4},
    ],
)
def test_the_trajectory_report_shows_what_row_selection_trained(tiny_model_dir, tmp_path, selection):
    """The recorder read the batch before `row_selection` ran: every row showed as trained, with the advantage GRPO
    gave it (the selected batch trains `max_variance`'s recomputed advantages and `successful`'s 1/0)."""
    from trl_agentic.reporting import TrajectoryRecorder

    trainer, dataset = _trainer(tiny_model_dir, tmp_path, **selection)
    recorder = TrajectoryRecorder(trainer.processing_class).attach(trainer)
    torch.manual_seed(2)
    batch = trainer._generate_and_score_completions(list(dataset))
    assert recorder.errors == [] and len(recorder.trajectories) == 8
    trained = [t for t in recorder.trajectories if not t["not_trained"]]
    dropped = [t for t in recorder.trajectories if t["not_trained"]]
    assert all(t["not_selected"] == selection["row_selection"] for t in dropped)
    assert not any("not_selected" in t for t in trained)
    loss_rows = (batch["completion_mask"] * batch.get("tool_mask", 1)).sum(1) > 0
    assert len(trained) == int(loss_rows.sum()) == int(batch["num_rows_in_batch"]) and dropped
    # The trained rows' advantages as the loss gets them, matched by completion text.
    tok = trainer.processing_class
    texts = tok.batch_decode(
        [ids[m.bool()] for ids, m in zip(batch["completion_ids"], batch["completion_mask"])], skip_special_tokens=True
    )
    loss_advantages = {texts[k]: batch["advantages"][k].item() for k in loss_rows.nonzero().flatten().tolist()}
    for t in trained:
        text = "".join(seg["text"] for seg in t["segments"])
        text = tok.decode(tok(text, add_special_tokens=False)["input_ids"], skip_special_tokens=True)
        assert t["advantage"] == pytest.approx(loss_advantages[text], abs=1e-5)


@pytest.mark.parametrize(
    "selection",
    [
        {"row_selection": "random", "row_selection_fraction": 0.5},
        {"row_selection": "max_variance", "row_selection_keep": 2},
    ],
)
def test_a_training_step_runs_with_accumulation(tiny_model_dir, tmp_path, selection):
    """TRL splits the selected generation batch into its micro-batches and steps (2 groups of 4, 2 micro-batches)."""
    trainer, _ = _trainer(
        tiny_model_dir,
        tmp_path,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        num_generations=4,
        **selection,
    )
    before = {k: v.clone() for k, v in trainer.model.named_parameters()}
    trainer.train()
    assert trainer.state.global_step == 1
    history = [h for h in trainer.state.log_history if "selection/num_kept" in h]
    assert history and history[0]["selection/num_kept"] == 4.0
    assert any(not torch.equal(v, before[k]) for k, v in trainer.model.named_parameters())


def test_config_refuses_combinations_and_bad_values(tmp_path):
    base = dict(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", num_generations=4)
    base["per_device_train_batch_size"] = 4
    with pytest.raises(ValueError, match="does not combine with `enable_tool_rollback`"):
        AgenticGRPOConfig(**base, row_selection="random", enable_tool_rollback=True)
    with pytest.raises(ValueError, match="row_selection_keep"):
        AgenticGRPOConfig(**base, row_selection="max_variance", row_selection_keep=4)
    with pytest.raises(ValueError, match="row_selection_fraction"):
        AgenticGRPOConfig(**base, row_selection="random", row_selection_fraction=0.0)
    with pytest.raises(ValueError, match="micro-batches"):
        # 1 group of 4 (2 rows x 2 micro-batches), 3 kept rows: not 2 equal micro-batches.
        AgenticGRPOConfig(
            **{**base, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2},
            row_selection="max_variance",
            row_selection_keep=3,
        )
    with pytest.raises(ValueError, match="row_selection"):
        AgenticGRPOConfig(**base, row_selection="best")


def test_keeping_every_row_trains_as_trl_with_masked_truncated_rows(tiny_model_dir, tmp_path):
    """`row_selection_fraction=1.0` keeps every row, so the step is TRL's. A truncated row masked by
    `mask_truncated_completions` still counts in the per-row losses' row count, as in TRL (`counted_rows`): the
    recount dropped the two masked rows of four, which doubled every other row's weight in `grpo`."""
    texts = ["a<|im_end|>", "bbb<|im_end|>", "cccccccccccc", "dddddddddddd"]  # the last two: cut at 8 tokens

    def scripted(trainer):
        tok = trainer.processing_class

        def generate(prompt_ids, *args, **kwargs):
            return [tok.encode(texts[k % 4], add_special_tokens=False) for k in range(len(prompt_ids))], None

        return generate

    settings = dict(
        per_device_train_batch_size=4, num_generations=4, loss_type="grpo", mask_truncated_completions=True
    )
    plain, dataset = _trainer(tiny_model_dir, tmp_path / "plain", **settings)
    plain._generate_single_turn = scripted(plain)
    batch = plain._generate_and_score_completions(list(dataset)[:4])
    assert int((batch["completion_mask"].sum(1) > 0).sum()) == 2  # two rows masked as truncated
    trainer, _ = _trainer(
        tiny_model_dir, tmp_path / "all", row_selection="random", row_selection_fraction=1.0, **settings
    )
    trainer.model.load_state_dict(plain.model.state_dict())
    trainer._last_rewards_per_func = plain._last_rewards_per_func
    selected = trainer._select_rows(dict(batch))
    assert int(selected["num_rows_in_batch"]) == 4
    g_plain = _grad(plain, plain._compute_loss(plain.model, batch))
    assert g_plain.abs().sum() > 0
    torch.testing.assert_close(_grad(trainer, trainer._compute_loss(trainer.model, selected)), g_plain)


@pytest.mark.parametrize("aggregation", ["sum_then_normalize", "normalize_then_sum"])
def test_max_variance_with_unscorable_rows_trains_every_kept_row(tiny_model_dir, tmp_path, aggregation):
    """A group with one scorable rollout keeps one row: 2 + 1 kept rows, not a multiple of the 2 micro-batches. TRL's
    split dropped the remainder (a kept row, at random after its shuffle); the batch is filled with a zero-weight
    padding row instead, and every kept row weighs 1/3 in `grpo`. GDPO (`normalize_then_sum`) keeps TRL's batch,
    which has no row kinds: the fill row is made a padding row all the same (it counted: 1/4 each)."""
    from trl.trainer.utils import shuffle_sequence_dict, split_tensor_dict

    from trl_agentic.loss_weights import row_weight_factor
    from trl_agentic.rollout.types import RowKind

    values = [1.0, 0.0, 2.0, 1.0, None, None, None, 3.0]

    def scored(completions, **kwargs):
        return values[: len(completions)]

    trainer, dataset = _trainer(
        tiny_model_dir, tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=2, num_generations=4,
        row_selection="max_variance", row_selection_keep=2, loss_type="grpo", multi_objective_aggregation=aggregation,
    )  # fmt: skip
    trainer.reward_funcs[0] = scored
    torch.manual_seed(0)
    batch = trainer._generate_and_score_completions(list(dataset))
    kinds = batch["row_kind"].tolist()
    assert len(kinds) == 4 and kinds.count(int(RowKind.PADDING)) == 1
    assert int(batch["num_rows_in_batch"]) == 3
    real = [k for k in range(4) if kinds[k] != RowKind.PADDING]
    pad = kinds.index(int(RowKind.PADDING))
    assert batch["completion_mask"][pad].sum() == 0 and batch["advantages"][pad] == 0
    # The kept rows: rewards 0 and 2 of the first group (advantages -/+ 0.707), the only scorable row of the second.
    torch.testing.assert_close(
        batch["advantages"][real], torch.tensor([-1 / math.sqrt(2), 1 / math.sqrt(2), 0.0]), atol=1e-3, rtol=0
    )
    for seed in range(4):  # TRL's shuffle and split: every kept row reaches the loss, each weighing 1/3
        torch.manual_seed(seed)
        chunks = split_tensor_dict(shuffle_sequence_dict(dict(batch)), 2)
        weights = [
            float(row_weight_factor(c, "grpo", 1, 2))
            / (c["prompt_ids"].size(0) * 2)
            * float(c["completion_mask"][k].any())
            for c in chunks
            for k in range(c["prompt_ids"].size(0))
        ]
        assert sorted(weights) == pytest.approx([0.0, 1 / 3, 1 / 3, 1 / 3])


def test_max_variance_never_selects_a_rollout_lost_to_infrastructure(tiny_model_dir, tiny_tokenizer, tmp_path):
    """A lost rollout has no reward (NaN: out of its group's statistics). Its environment's total (0) made it the
    low end of the largest variance, so the tied group (the others all 2) trained one row with advantage +0.707."""
    from test_row_count import DownOnceEnv, Script

    def total(environments, **kwargs):
        return [float(env.total) for env in environments]

    DownOnceEnv.remaining = 1
    args = AgenticGRPOConfig(
        output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", seed=0, per_device_train_batch_size=4,
        num_generations=4, max_completion_length=256, save_strategy="no", max_tool_output_chars=1000,
        max_infra_retries=0, row_selection="max_variance", row_selection_keep=2, loss_type="grpo",
    )  # fmt: skip
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": "task 0"}]] * 4})
    trainer = AgenticGRPOTrainer(
        model=tiny_model_dir, reward_funcs=total, args=args, train_dataset=dataset, environment_factory=DownOnceEnv
    )
    trainer._generate_single_turn = Script(tiny_tokenizer)
    trainer.model.train()
    batch = trainer._generate_and_score_completions([dict(dataset[i]) for i in range(4)])
    assert trainer._last_loop_result.infra_failed.count(True) == 1
    assert batch["prompt_ids"].size(0) == 2 and bool(batch["counted_row"].all())
    assert int(batch["num_rows_in_batch"]) == 2
    assert batch["advantages"].tolist() == [0.0, 0.0]  # the two kept rows tie (2 and 2)


def test_bnpo_weighs_every_kept_token_equally_across_micro_batches(tiny_model_dir, tmp_path):
    """`random` masks rows as TracIn does, so `bnpo` weighs each kept token the same: the summed loss of the two
    micro-batches is the mean loss over every kept token (computed on the kept rows as one batch). TRL's per-micro-batch
    normaliser weighed the tokens of the sparser micro-batch more."""
    from trl.trainer.utils import split_tensor_dict

    trainer, dataset = _trainer(
        tiny_model_dir, tmp_path, gradient_accumulation_steps=2, per_device_train_batch_size=4, num_generations=8,
        row_selection="random", row_selection_fraction=0.4, loss_type="bnpo", max_completion_length=12,
    )  # fmt: skip
    tok = trainer.processing_class
    # Completions of 1 to 8 words (no end of turn from the random tiny model otherwise: all of one length).
    trainer._generate_single_turn = lambda prompt_ids, *a, **k: (
        [
            tok.encode(" ".join(["hi"] * (n + 1)) + "<|im_end|>", add_special_tokens=False)
            for n in range(len(prompt_ids))
        ],
        None,
    )
    batch = trainer._generate_and_score_completions(list(dataset))
    kept = (batch["completion_mask"] * batch["tool_mask"]).sum(1)
    halves = split_tensor_dict(dict(batch), 2)  # TRL shuffles first; any split of unequal token counts shows it
    counts = [int((h["completion_mask"] * h["tool_mask"]).sum()) for h in halves]
    assert counts[0] != counts[1] and min(counts) > 0, counts
    trainer.current_gradient_accumulation_steps = 2
    summed = sum(trainer._compute_loss(trainer.model, h) for h in halves)
    index = (kept > 0).nonzero().squeeze(1)
    alone = {k: v[index] for k, v in batch.items() if isinstance(v, torch.Tensor) and v.dim() > 0}
    trainer.current_gradient_accumulation_steps = 1
    mean = trainer._compute_loss(trainer.model, alone)  # no `num_rows_in_batch`: TRL's bnpo, one micro-batch
    assert abs(float(mean)) > 0
    torch.testing.assert_close(summed, mean, rtol=1e-5, atol=1e-7)

"""TracIn-filtered training with `AgenticGRPOTrainer` on the tiny model + LoRA, checked against brute force.

Brute force here means plain autograd through TRL's own loss (`GRPOTrainer._compute_loss`), one row at a time, at the
weights of the step; the hooks are not involved. Updates are compared with SGD (no momentum, no clipping, constant
learning rate), so a weight update is exactly `-lr * gradient`.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig
from trl import GRPOTrainer

from trl_agentic import AgenticGRPOConfig, AgenticGRPOTrainer
from trl_agentic.advantages import group_advantages
from trl_agentic.tracin.schedule import validation_rollout_steps, window_starts
from trl_agentic.tracin.selection import select_rows

LR = 0.05


def letter_fraction(prompts, completions, **kwargs):
    return [sum(c.isalpha() for c in text) / max(len(text), 1) for text in completions]


def constant_on_validation(prompts, completions, value=1.0, **kwargs):
    """`value` on validation prompts (no validation group has a reward spread), the letter fraction elsewhere."""
    scores = letter_fraction(prompts, completions)
    return [value if prompt.startswith("Validate") else score for prompt, score in zip(prompts, scores)]


def tied_on_validation(prompts, completions, **kwargs):
    """0.3 on validation prompts: six equal rewards whose float32 GRPO advantages are rounding noise, not 0."""
    return constant_on_validation(prompts, completions, value=0.3)


def tied_on_one_validation_prompt(prompts, completions, **kwargs):
    """0.3 on "Validate tie:" (a group without spread), the letter fraction elsewhere."""
    scores = letter_fraction(prompts, completions)
    return [0.3 if prompt.startswith("Validate tie") else score for prompt, score in zip(prompts, scores)]


TRAIN = Dataset.from_dict({"prompt": [f"Say something about {i}:" for i in range(32)]})
VAL = Dataset.from_dict({"prompt": [f"Validate {i}:" for i in range(6)]})


def make_config(tmp_path, **overrides) -> AgenticGRPOConfig:
    values = dict(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        bf16=False,
        report_to="none",
        seed=3,
        max_steps=1,
        learning_rate=LR,
        optim="sgd",
        max_grad_norm=0.0,
        lr_scheduler_type="constant",
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=10,
        logging_steps=1,
        save_strategy="no",
        gradient_checkpointing=False,
        tracin_enabled=True,
        tracin_val_num_generations=2,
        tracin_val_batch_size=2,
    )
    values.update(overrides)
    return AgenticGRPOConfig(**values)


def lora_config(**overrides) -> LoraConfig:
    # Random (non-zero) B, so the lora_A terms of the scores are exercised from the first step.
    values = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear", init_lora_weights=False)
    values.update(overrides)
    return LoraConfig(**values)


def make_trainer(model_dir, tmp_path, reward=letter_fraction, val=VAL, peft=True, **overrides):
    return AgenticGRPOTrainer(
        model=model_dir,
        reward_funcs=reward,
        args=make_config(tmp_path, **overrides),
        train_dataset=TRAIN,
        tracin_eval_dataset=val,
        peft_config=lora_config() if peft is True else (peft or None),
    )


def starts(trainer, total_steps: int) -> list[int]:
    args = trainer.args
    return window_starts(total_steps, args.steps_per_generation, args.num_iterations, args.gradient_accumulation_steps)


def trainable(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}


def load(model, weights: dict[str, torch.Tensor]) -> None:
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in weights.items():
            params[name].copy_(value)


class Recorder:
    """Keeps copies of the validation batch and of the training batches the TracIn step saw."""

    def __init__(self, trainer):
        self.val_batches, self.fused_inputs = [], []
        rollout, fused = trainer._tracin_rollout_validation, trainer._tracin_fused_loss

        def rollout_and_keep(rows):
            batch, reward = rollout(rows)
            self.val_batches.append(_copy(batch))
            return batch, reward

        def fused_and_keep(model, inputs):
            self.fused_inputs.append(_copy(inputs))
            return fused(model, inputs)

        trainer._tracin_rollout_validation = rollout_and_keep
        trainer._tracin_fused_loss = fused_and_keep


def _copy(batch: dict) -> dict:
    return {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def loss_mask(batch) -> torch.Tensor:
    return batch["completion_mask"] * batch.get("tool_mask", torch.ones_like(batch["completion_mask"]))


def trl_loss(trainer, batch) -> torch.Tensor:
    """TRL's own loss (the base class method, never the TracIn override)."""
    return GRPOTrainer._compute_loss(trainer, trainer.model, batch)


def grad_of(loss, params) -> torch.Tensor:
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1) for g, p in zip(grads, params)])


def only_rows(batch, keep: torch.Tensor, num_items=None) -> dict:
    """The batch with the loss mask of rows outside `keep` zeroed (and optionally new token and row normalisers: the
    trained rows are then the kept ones)."""
    out = dict(batch)
    out["tool_mask"] = loss_mask(batch) * keep.unsqueeze(1).to(batch["completion_mask"].dtype)
    if num_items is not None:
        out["num_items_in_batch"] = torch.tensor(num_items, dtype=batch["num_items_in_batch"].dtype)
        if "num_rows_in_batch" in batch:
            out["num_rows_in_batch"] = keep.sum().to(batch["num_rows_in_batch"].dtype)
    return out


def subset(batch, keep: torch.Tensor) -> dict:
    """A batch made of the kept rows only (what "training on exactly those rows" means), normalisers recomputed."""
    out = {k: v[keep] if isinstance(v, torch.Tensor) and v.dim() > 0 else v for k, v in batch.items()}
    out["num_items_in_batch"] = loss_mask(out).sum().to(batch["num_items_in_batch"].dtype)
    out.pop("num_rows_in_batch", None)  # TRL's own loss over these rows: their plain mean
    return out


def brute_force_scores(trainer, batch, direction: torch.Tensor, return_grads=False):
    """score_b = <autograd grad of row b's term of TRL's loss, V>, one backward per row."""
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    rows = batch["prompt_ids"].size(0)
    mask = loss_mask(batch)
    scores, grads = [], []
    for b in range(rows):
        keep = torch.zeros(rows, dtype=torch.bool)
        keep[b] = True
        grad = grad_of(trl_loss(trainer, only_rows(batch, keep)), params)
        if trainer.loss_type == "bnpo":  # normalised by the micro-batch's token count, not the row's own
            grad = grad * mask[b].sum().clamp(min=1) / mask.sum().clamp(min=1)
        scores.append(grad @ direction)
        grads.append(grad)
    return (torch.stack(scores), torch.stack(grads)) if return_grads else torch.stack(scores)


def brute_force_direction(trainer, val_batch) -> torch.Tensor:
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    return grad_of(trl_loss(trainer, val_batch), params)


def decoded_completions(tokenizer, batch) -> list[str]:
    return [
        tokenizer.decode(ids[mask.bool()], skip_special_tokens=True)
        for ids, mask in zip(batch["completion_ids"], batch["completion_mask"])
    ]


def plain_update(model_dir, tmp_path, before, batch, **overrides) -> dict[str, torch.Tensor]:
    """Weight update of one plain GRPO step (TracIn off) on a given batch, from the weights `before`."""
    trainer = make_trainer(model_dir, tmp_path / "plain", val=None, tracin_enabled=False, **overrides)
    load(trainer.model, before)
    trainer._generate_and_score_completions = lambda inputs: _copy(batch)
    trainer.train()
    after = trainable(trainer.model)
    return {name: after[name] - before[name] for name in before}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, rtol=1e-4) -> None:
    scale = expected.abs().max().clamp(min=1e-12)
    error = ((actual - expected).abs().max() / scale).item()
    assert error < rtol, f"relative error {error:.2e}\nactual={actual}\nexpected={expected}"


# ------------------------------------------------------------------------------------------------------- fused step


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "bnpo"])
def test_fused_step_selects_by_brute_force_sign_and_trains_only_selected_rows(
    tiny_model_dir, tiny_tokenizer, tmp_path, loss_type
):
    trainer = make_trainer(tiny_model_dir, tmp_path, loss_type=loss_type)
    assert trainer._tracin.fused
    recorder = Recorder(trainer)
    before = trainable(trainer.model)
    trainer.train()
    after = trainable(trainer.model)
    state = trainer._tracin
    (batch,), (val_batch,) = recorder.fused_inputs, recorder.val_batches

    # Brute force at the weights of the step.
    load(trainer.model, before)
    trainer.model.train()
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    direction = brute_force_direction(trainer, val_batch)
    hooks_direction = torch.cat(
        [torch.cat([g.A.reshape(-1), g.B.reshape(-1)]) for g in state.direction.values()]
    )  # module order = parameter order (lora_A then lora_B of each layer)
    assert_close(hooks_direction, direction)
    scores, row_grads = brute_force_scores(trainer, batch, direction, return_grads=True)
    assert_close(state.last["scores"], scores)
    valid = loss_mask(batch).sum(1) > 0
    expected = select_rows(scores, valid, mode="positive", min_selected=1)
    assert torch.equal(state.last["selected"], expected)
    assert 0 < int(expected.sum()) < int(valid.sum()), "the test needs both selected and rejected rows"

    # The update is -lr * gradient of TRL's own loss on a batch of the selected rows alone: rejected rows contribute
    # nothing and the normalisers count only what is trained (tokens for dapo/bnpo, rows for grpo).
    num_selected = float((loss_mask(batch).sum(1) * expected).sum())
    assert num_selected < float(batch["num_items_in_batch"])
    gradient = grad_of(trl_loss(trainer, subset(batch, expected)), params)
    update = torch.cat([(after[n] - before[n]).reshape(-1) for n, _ in trainer.model.named_parameters() if n in after])
    assert_close(update, -LR * gradient)
    # It is not the selected rows' terms of the unfiltered loss (that would shrink the step by |S| / B for grpo).
    naive = row_grads[expected].sum(0)
    assert (naive - gradient).abs().max() > 1e-2 * gradient.abs().max()
    if loss_type == "grpo":
        assert_close(gradient, naive * batch["prompt_ids"].size(0) / int(expected.sum()))
    masked = only_rows(batch, expected, num_items=num_selected)

    # Metrics, against the brute-force scores and decoded rewards.
    logs = trainer.state.log_history[0]
    assert logs["tracin/selected_ratio"] == pytest.approx(int(expected.sum()) / int(valid.sum()))
    assert logs["tracin/score_pos_frac"] == pytest.approx(float((scores[valid] > 0).float().mean()))
    assert logs["tracin/score_mean"] == pytest.approx(float(scores[valid].mean()), rel=1e-3)
    advantages = batch["advantages"][valid].double()
    corr = torch.corrcoef(torch.stack([scores[valid].double(), advantages]))[0, 1]
    assert logs["tracin/score_adv_corr"] == pytest.approx(float(corr), rel=1e-3, abs=1e-6)
    val_texts = decoded_completions(tiny_tokenizer, val_batch)
    val_prompts = [
        tiny_tokenizer.decode(ids[m.bool()]) for ids, m in zip(val_batch["prompt_ids"], val_batch["prompt_mask"])
    ]
    assert logs["tracin/val_reward"] == pytest.approx(sum(letter_fraction(val_prompts, val_texts)) / len(val_texts))
    # The validation rollouts did not leak into the training metrics or the completion logs.
    train_texts = decoded_completions(tiny_tokenizer, batch)
    assert logs["reward"] == pytest.approx(sum(letter_fraction(None, train_texts)) / len(train_texts))
    assert list(trainer._logs["completion"]) and set(trainer._logs["completion"]) <= set(train_texts)
    assert trainer.state.num_input_tokens_seen == int(batch["prompt_mask"].sum() + batch["completion_mask"].sum())
    # The logged loss is the loss value of the selected rows.
    assert logs["loss"] == pytest.approx(trl_loss(trainer, subset(batch, expected)).item(), rel=1e-4, abs=1e-6)
    assert masked["num_items_in_batch"] == num_selected


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_fused_update_equals_a_plain_step_on_the_hand_masked_batch(tiny_model_dir, tmp_path, loss_type):
    trainer = make_trainer(tiny_model_dir, tmp_path, loss_type=loss_type)
    recorder = Recorder(trainer)
    before = trainable(trainer.model)
    trainer.train()
    after = trainable(trainer.model)
    (batch,) = recorder.fused_inputs
    selected = trainer._tracin.last["selected"]
    assert 0 < int(selected.sum()) < selected.numel()
    num_selected = float((loss_mask(batch).sum(1) * selected).sum())
    masked = only_rows(batch, selected, num_items=num_selected)
    expected = plain_update(tiny_model_dir, tmp_path, before, masked, loss_type=loss_type)
    for name in before:
        assert_close(after[name] - before[name], expected[name])
    # ... which is a plain step on the selected rows alone.
    alone = plain_update(tiny_model_dir, tmp_path / "alone", before, subset(batch, selected), loss_type=loss_type)
    for name in before:
        assert_close(alone[name], expected[name])
    # And the rejected rows do move the weights when they are not masked: the comparison can fail.
    unfiltered = plain_update(tiny_model_dir, tmp_path / "all", before, batch, loss_type=loss_type)
    assert any((unfiltered[n] - expected[n]).abs().max() > 1e-6 for n in before)


# ------------------------------------------------------------------------------------------------------- two-pass


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_two_pass_with_accumulation_and_checkpointing(tiny_model_dir, tmp_path, loss_type):
    overrides = dict(
        steps_per_generation=2, gradient_accumulation_steps=2, gradient_checkpointing=True, loss_type=loss_type
    )
    trainer = make_trainer(tiny_model_dir, tmp_path, **overrides)
    assert not trainer._tracin.fused
    recorder = Recorder(trainer)
    before = trainable(trainer.model)
    trainer.train()
    after = trainable(trainer.model)
    chunks = [_copy(c) for c in trainer._buffered_inputs]
    assert len(chunks) == 2 and not recorder.fused_inputs

    load(trainer.model, before)
    trainer.model.train()
    direction = brute_force_direction(trainer, recorder.val_batches[0])
    num_items = torch.tensor(float(sum(c["completion_mask"].sum() for c in chunks)))
    selected_all, tokens_all = [], []
    for chunk in chunks:
        # The micro-batch as TRL buffered it, before masking (no tools: the loss mask is the completion mask).
        original = {k: v for k, v in chunk.items() if k != "tool_mask" and not k.startswith("tracin_")}
        original["num_items_in_batch"] = num_items
        assert_close(chunk["tracin_score"], brute_force_scores(trainer, original, direction))
        assert torch.equal(chunk["tracin_selected"], chunk["tracin_score"] > 0)
        selected_all.append(chunk["tracin_selected"])
        tokens_all.append(chunk["completion_mask"].sum(1))
    selected, tokens = torch.cat(selected_all), torch.cat(tokens_all)
    assert 0 < int(selected.sum()) < selected.numel()
    # The normaliser of every micro-batch is the global number of selected tokens.
    for chunk in chunks:
        assert float(chunk["num_items_in_batch"]) == float((tokens * selected).sum())
        assert torch.equal(loss_mask(chunk).sum(1) > 0, chunk["tracin_selected"])

    # Same update as a plain step on the masked rows.
    masked = {k: torch.cat([c[k] for c in chunks]) for k in chunks[0] if chunks[0][k].dim() > 0}
    masked["num_items_in_batch"] = chunks[0]["num_items_in_batch"]
    masked["num_rows_in_batch"] = chunks[0]["num_rows_in_batch"]
    assert int(masked["num_rows_in_batch"]) == int(selected.sum())
    masked = {k: v for k, v in masked.items() if not k.startswith("tracin_")}
    expected = plain_update(tiny_model_dir, tmp_path, before, masked, **overrides)
    for name in before:
        assert_close(after[name] - before[name], expected[name])


def run_from(trainer, weights, seed=123):
    """Train `trainer` from `weights` with the global RNG (generation) seeded: same rollouts in every run."""
    load(trainer.model, weights)
    before = trainable(trainer.model)
    torch.manual_seed(seed)
    trainer.train()
    after = trainable(trainer.model)
    return {n: after[n] - before[n] for n in before}


def test_fused_and_two_pass_give_the_same_step(tiny_model_dir, tmp_path):
    fused = make_trainer(tiny_model_dir, tmp_path / "fused")
    weights = trainable(fused.model)
    fused_update = run_from(fused, weights)
    two_pass = make_trainer(tiny_model_dir, tmp_path / "two_pass")
    two_pass._tracin.fused = False
    two_pass_update = run_from(two_pass, weights)
    assert_close(fused._tracin.last["scores"], two_pass._tracin.last["scores"])
    assert torch.equal(fused._tracin.last["selected"], two_pass._tracin.last["selected"])
    assert 0 < int(fused._tracin.last["selected"].sum()) < fused._tracin.last["selected"].numel()
    for name in fused_update:
        assert_close(fused_update[name], two_pass_update[name])


# ------------------------------------------------------------------------------------------------------- edge cases


@pytest.mark.parametrize("fused", [True, False])
def test_nothing_selected_leaves_the_weights_unchanged(tiny_model_dir, tmp_path, fused):
    trainer = make_trainer(
        tiny_model_dir, tmp_path, tracin_selection="threshold", tracin_threshold=1e9, tracin_min_selected=0
    )
    trainer._tracin.fused = fused
    before = trainable(trainer.model)
    trainer.train()
    after = trainable(trainer.model)
    assert not trainer._tracin.last["selected"].any()
    assert all(torch.equal(before[n], after[n]) for n in before)
    logs = trainer.state.log_history[0]
    assert logs["tracin/selected_ratio"] == 0.0 and logs["loss"] == 0.0


@pytest.mark.parametrize(
    "reward, group_size",
    [(constant_on_validation, 2), (tied_on_validation, 6)],
    ids=["exact-zero-advantages", "rounding-noise-advantages"],
)
def test_zero_validation_gradient_trains_on_every_row(tiny_model_dir, tmp_path, reward, group_size):
    """No validation group has a reward spread: V is exactly 0 and every row is trained. With six rewards of 0.3 TRL's
    float32 advantages are not 0 (the control below); V must not be built from that noise."""
    if reward is tied_on_validation:
        noise = group_advantages(torch.full((group_size,), 0.3), torch.zeros(group_size, dtype=torch.long))
        assert bool((noise != 0).any())  # the case is real: without the fix V would be this noise's direction
    trainer = make_trainer(tiny_model_dir, tmp_path, reward=reward, tracin_val_num_generations=group_size)
    with pytest.warns(
        UserWarning, match=rf"validation gradient is exactly 0 at step 0 .*group of {group_size} "
    ) as got:
        trainer.train()
    # Said once per refresh (one here), so a run whose filter never filters is not silent.
    assert sum("validation gradient is exactly 0" in str(w.message) for w in got) == 1
    assert trainer._tracin.direction_is_zero
    assert trainer._tracin.last["selected"].all()
    logs = trainer.state.log_history[0]
    assert logs["tracin/val_grad_norm"] == 0.0 and logs["tracin/selected_ratio"] == 1.0


def test_a_kl_only_validation_gradient_says_so(tiny_model_dir, tmp_path):
    """No validation group has a reward spread but beta > 0: V is the KL term's gradient alone (not 0), and the rows
    were filtered by it without a word."""
    trainer = make_trainer(tiny_model_dir, tmp_path, reward=constant_on_validation, beta=0.2)
    with pytest.warns(UserWarning, match=r"validation gradient is the KL term's alone \(beta=0.2\)") as got:
        trainer.train()
    assert not any("exactly 0" in str(w.message) for w in got)
    assert not trainer._tracin.direction_is_zero and trainer.state.log_history[0]["tracin/val_grad_norm"] > 0
    # A validation spread (the default reward) gives no such warning.
    other = make_trainer(tiny_model_dir, tmp_path / "spread", beta=0.2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        other.train()
    assert not any("KL term's alone" in str(w.message) for w in caught)


def test_zero_validation_gradient_from_no_trained_token_says_so(tiny_model_dir, tmp_path):
    """Every validation row masked (as when all its rollouts are lost to the infrastructure): V is exactly 0 for
    another reason than a missing reward spread, and the warning names that reason, not the spread."""
    trainer = make_trainer(tiny_model_dir, tmp_path, tracin_val_num_generations=2)
    rollout = trainer._tracin_rollout_validation

    def all_masked(rows):
        batch, reward = rollout(rows)
        assert trainer._tracin_trained_tokens(batch) > 0  # the control: the unmasked batch has tokens to train
        return {**batch, "completion_mask": torch.zeros_like(batch["completion_mask"])}, reward

    trainer._tracin_rollout_validation = all_masked
    with pytest.warns(UserWarning, match=r"exactly 0 at step 0 \(no validation token was left to train") as got:
        trainer.train()
    assert not any("reward spread" in str(w.message) for w in got)
    assert trainer._tracin.direction_is_zero and trainer._tracin.last["selected"].all()


def test_a_validation_group_without_reward_spread_adds_nothing_to_v(tiny_model_dir, tmp_path):
    """One validation group tied at 0.3, one with a spread: the tied group's rows get advantage 0 (not float32 noise),
    the other group keeps its GRPO advantages, and V is brute-force autograd of TRL's loss on that batch."""
    val = Dataset.from_dict({"prompt": ["Validate tie:", "Validate spread:"]})
    trainer = make_trainer(
        tiny_model_dir, tmp_path, reward=tied_on_one_validation_prompt, val=val, tracin_val_num_generations=6
    )
    recorder = Recorder(trainer)
    before = trainable(trainer.model)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        trainer.train()
    assert not [w for w in got if "validation gradient is exactly 0" in str(w.message)]  # V has information
    (val_batch,) = recorder.val_batches
    prompts = [
        trainer.processing_class.decode(ids[m.bool()])
        for ids, m in zip(val_batch["prompt_ids"], val_batch["prompt_mask"])
    ]
    tied = torch.tensor(["Validate tie" in p for p in prompts])
    assert int(tied.sum()) == 6 and int((~tied).sum()) == 6
    assert torch.equal(val_batch["advantages"][tied], torch.zeros(6))
    rewards = torch.tensor(letter_fraction(None, decoded_completions(trainer.processing_class, val_batch)))[~tied]
    assert len(set(rewards.tolist())) > 1  # the other group has a spread
    expected = group_advantages(rewards.float(), torch.zeros(6, dtype=torch.long))
    torch.testing.assert_close(val_batch["advantages"][~tied], expected, rtol=1e-5, atol=1e-6)
    assert not trainer._tracin.direction_is_zero
    # V at the weights of the step, against autograd of TRL's loss on the batch (module order = parameter order).
    load(trainer.model, before)
    trainer.model.train()
    direction = torch.cat([torch.cat([g.A.reshape(-1), g.B.reshape(-1)]) for g in trainer._tracin.direction.values()])
    assert_close(direction, brute_force_direction(trainer, val_batch))


def _custom_estimator(batch, trainer):  # a user's estimator: its advantages are its own, ties or not
    return batch.rewards


@pytest.mark.parametrize(
    ("estimator", "mode", "zeroed"),
    [
        ("grpo", "copo", True),
        ("rlvcr", "copo", True),  # CoPO: A_traj x a weight, so GRPO's tie noise times a weight
        ("trl_agentic.rlvcr.estimator:rlvcr_estimator", "copo", True),  # the same estimator by its import path
        ("rlvcr", "additive", False),  # RLVCR's additive rule can carry signal without a reward spread
        (_custom_estimator, "copo", False),  # a callable passed to the trainer, whatever the config's string says
    ],
)
@pytest.mark.parametrize("token_level", [False, True])
def test_groups_without_spread_are_zeroed_by_the_estimator_that_ran(estimator, mode, zeroed, token_level):
    """The validation batch's tied groups (here group 0) get advantage 0 on every row and token when the estimator
    that ran is GRPO or CoPO, recognised by identity rather than by the config's string; otherwise the batch is
    unchanged. (B,) and (B, T) advantages alike."""
    from types import SimpleNamespace

    from trl_agentic.estimators import resolve_estimator
    from trl_agentic.tracin.trainer_mixin import TracInMixin

    advantages = torch.tensor([3e-4, 3e-4, 0.7, -0.7])
    if token_level:
        advantages = advantages[:, None] * torch.tensor([1.0, 0.5, 2.0])
    batch = {"group_id": torch.tensor([0, 0, 1, 1]), "advantages": advantages}
    stub = SimpleNamespace(
        _augmenter=SimpleNamespace(last_tied_rows=torch.tensor([True, True, False, False])),
        args=SimpleNamespace(advantage_estimator="rlvcr" if callable(estimator) else estimator, rlvcr_mode=mode),
        advantage_estimator=resolve_estimator(estimator),
    )
    out = TracInMixin._tracin_zero_groups_without_spread(stub, batch)
    expected = advantages.clone()
    if zeroed:
        expected[:2] = 0.0
    assert torch.equal(out["advantages"], expected)
    assert torch.equal(batch["advantages"], advantages)  # the input batch is not modified


def test_validation_gradient_is_refreshed_on_schedule(tiny_model_dir, tmp_path):
    trainer = make_trainer(
        tiny_model_dir, tmp_path, max_steps=3, tracin_val_refresh_steps=2, tracin_val_rollout_steps=1
    )
    recorder = Recorder(trainer)
    trainer.train()
    assert trainer._tracin.refreshes == 2 and len(recorder.val_batches) == 2
    steps = [h for h in trainer.state.log_history if "loss" in h]
    assert ["tracin/val_reward" in h for h in steps] == [True, False, True]
    # The ablation report counts validation rollouts with the schedule function; the trainer follows it.
    rolled_out = [step for step, h in enumerate(steps) if "tracin/val_reward" in h]
    assert rolled_out == validation_rollout_steps(starts(trainer, 3), refresh_steps=2, rollout_steps=1)
    assert all("tracin/selected_ratio" in h for h in steps)
    # Each refresh rolls out tracin_val_batch_size prompts x tracin_val_num_generations, one group per prompt.
    for val_batch in recorder.val_batches:
        assert val_batch["prompt_ids"].size(0) == 4
        assert torch.equal(val_batch["prompt_ids"][0], val_batch["prompt_ids"][1])
        assert not torch.equal(val_batch["prompt_ids"][1], val_batch["prompt_ids"][2])
        assert val_batch["advantages"].abs().sum() > 0


def test_validation_rollouts_are_reused_and_v_recomputed_at_the_current_weights(tiny_model_dir, tmp_path):
    # V every step, new validation rollouts every 2 steps: rollouts at steps 0 and 2, V at step 1 from step 0's.
    trainer = make_trainer(
        tiny_model_dir, tmp_path, max_steps=3, tracin_val_refresh_steps=1, tracin_val_rollout_steps=2
    )
    recorder = Recorder(trainer)
    refresh, seen = trainer._tracin_refresh_direction, []

    def refresh_and_keep():
        weights = trainable(trainer.model)
        refresh()
        flat = torch.cat([torch.cat([g.A.reshape(-1), g.B.reshape(-1)]) for g in trainer._tracin.direction.values()])
        seen.append((trainer.state.global_step, weights, flat.clone()))

    trainer._tracin_refresh_direction = refresh_and_keep
    trainer.train()
    assert [step for step, _, _ in seen] == [0, 1, 2]
    assert trainer._tracin.refreshes == 2 and len(recorder.val_batches) == 2
    steps = [h for h in trainer.state.log_history if "loss" in h]
    assert ["tracin/val_reward" in h for h in steps] == [True, False, True]  # logged with new rollouts only
    rolled_out = [step for step, h in enumerate(steps) if "tracin/val_reward" in h]
    assert rolled_out == validation_rollout_steps(starts(trainer, 3), refresh_steps=1, rollout_steps=2)
    assert all("tracin/val_grad_norm" in h for h in steps)
    first_rollouts = {k: v for k, v in recorder.val_batches[0].items() if k != "old_per_token_logps"}
    for _, weights, direction in seen[:2]:
        load(trainer.model, weights)
        trainer.model.train()
        assert_close(direction, brute_force_direction(trainer, first_rollouts))
    # The weights moved between steps 0 and 1, and so did V (it is not the stored V of step 0).
    assert not torch.allclose(seen[0][2], seen[1][2])


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "bnpo", "dapo"])
def test_v_is_the_gradient_of_the_loss_over_a_validation_batch_that_does_not_split_evenly(
    tiny_model_dir, tmp_path, loss_type
):
    """3 prompts x 2 completions = 6 validation rows, in chunks of 4 and 2: V is the gradient of TRL's loss over the
    whole batch, every row weighed as that loss weighs it. Summing the chunks' own means gave the short chunk's rows
    twice the weight under the row-mean losses (cosine 0.91 to the true V)."""
    trainer = make_trainer(tiny_model_dir, tmp_path, loss_type=loss_type, tracin_val_batch_size=3)
    recorder = Recorder(trainer)
    before = trainable(trainer.model)
    trainer.train()
    load(trainer.model, before)
    trainer.model.train()
    val = dict(recorder.val_batches[0])
    assert val["prompt_ids"].size(0) == 6 and trainer.args.per_device_train_batch_size == 4
    val.pop("num_rows_in_batch", None)
    direction = torch.cat([torch.cat([g.A.reshape(-1), g.B.reshape(-1)]) for g in trainer._tracin.direction.values()])
    assert_close(direction, brute_force_direction(trainer, val))


@pytest.mark.parametrize("checkpointing", ["non_reentrant", "reentrant"])
def test_gradient_checkpointing_gives_the_same_scores(tiny_model_dir, tmp_path, checkpointing):
    reference = make_trainer(tiny_model_dir, tmp_path / "reference")
    weights = trainable(reference.model)
    reference_update = run_from(reference, weights)
    kwargs = {"use_reentrant": checkpointing == "reentrant"}
    context = pytest.warns(UserWarning, match="reentrant") if checkpointing == "reentrant" else _no_warning()
    with context:
        trainer = make_trainer(
            tiny_model_dir, tmp_path / "gc", gradient_checkpointing=True, gradient_checkpointing_kwargs=kwargs
        )
    update = run_from(trainer, weights)
    assert_close(trainer._tracin.last["scores"], reference._tracin.last["scores"])
    assert torch.equal(trainer._tracin.last["selected"], reference._tracin.last["selected"])
    for name in update:
        assert_close(update[name], reference_update[name])


class _no_warning:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# ------------------------------------------------------------------------------------------------------- start-up


def test_rejects_a_model_without_peft_lora(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match="peft.PeftModel"):
        make_trainer(tiny_model_dir, tmp_path, peft=False)


def test_rejects_lora_on_lm_head(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match="lm_head"):
        make_trainer(tiny_model_dir, tmp_path, peft=lora_config(target_modules=["q_proj", "lm_head"]))


def test_rejects_an_empty_or_missing_validation_set(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match="empty"):
        make_trainer(tiny_model_dir, tmp_path, val=VAL.select([]))
    with pytest.raises(ValueError, match="validation prompts"):
        make_trainer(tiny_model_dir, tmp_path, val=None)


def test_eval_dataset_is_the_default_validation_set_with_a_warning(tiny_model_dir, tmp_path):
    """Its rewards then choose the training rows, so an evaluation on it is no longer held out: said once."""
    with pytest.warns(UserWarning, match="TracIn validates on `eval_dataset`") as caught:
        trainer = AgenticGRPOTrainer(
            model=tiny_model_dir,
            reward_funcs=letter_fraction,
            args=make_config(tmp_path),
            train_dataset=TRAIN,
            eval_dataset=VAL,
            peft_config=lora_config(),
        )
    assert trainer._tracin.dataset is VAL
    assert sum("TracIn validates on `eval_dataset`" in str(w.message) for w in caught) == 1


def test_trl_internals_the_tracin_step_relies_on():
    """TRL 1.16 code the mixin depends on; re-read the mixin if a TRL upgrade breaks this."""
    import inspect

    prepare = inspect.getsource(GRPOTrainer._prepare_inputs)
    # Window start, and the buffer of shuffled micro-batches that the two-pass design masks in place.
    assert "generate_every = self.args.steps_per_generation * self.num_iterations" in prepare
    assert "if self._step % generate_every == 0 or self._buffered_inputs is None:" in prepare
    assert "self._buffered_inputs = [unsplit_pixel_values_by_grid(batch) for batch in generation_batches]" in prepare
    assert "inputs = self._buffered_inputs[self._step % self.args.steps_per_generation]" in prepare
    loss = inspect.getsource(GRPOTrainer._compute_loss)
    # One model forward, through the method the fused step captures and replays.
    assert loss.count("self._get_per_token_logps_and_entropies(") == 1
    assert 'mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]' in loss
    assert 'normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes' in loss
    assert "loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)" in loss  # bnpo
    generate = inspect.getsource(GRPOTrainer._generate)
    # The validation rollouts set the group size through this attribute.
    assert "num_generations = self.num_generations if mode == " in generate
    assert "self.state.num_input_tokens_seen +=" in generate


@pytest.mark.parametrize("group_baseline", ["episodes", "all_rows"])
def test_a_negative_out_of_the_baseline_gives_no_spread_and_keeps_its_advantage(group_baseline):
    """Six episodes tied at 0.3, a snapshot segment scored with its episode's reward and a negative row: under
    `episodes` the negative is out of the statistics, so the episodes' advantages are GRPO's tie noise (zeroed), the
    snapshot's too (its episode's), and the negative keeps its own, measured from its episode; under `all_rows` the
    negative is in the statistics and gives the group a spread (nothing zeroed)."""
    from types import SimpleNamespace

    from trl_agentic.advantages import tied_rows
    from trl_agentic.batch import baseline_mask
    from trl_agentic.estimators import resolve_estimator
    from trl_agentic.rollout.types import RowKind
    from trl_agentic.tracin.trainer_mixin import TracInMixin

    kinds = [RowKind.REGULAR] * 6 + [RowKind.SNAPSHOT, RowKind.NEGATIVE] + [RowKind.REGULAR] * 2
    kinds = torch.tensor(kinds)
    rewards = torch.tensor([0.3] * 7 + [-0.5, 0.0, 1.0])
    groups = torch.tensor([0] * 8 + [1] * 2)
    args = SimpleNamespace(
        group_baseline=group_baseline, snapshot_advantage="episode", advantage_estimator="grpo", rlvcr_mode="copo"
    )
    tied = tied_rows(rewards, groups, baseline_mask(kinds, args))
    assert tied.tolist() == ([True] * 7 + [False] * 3 if group_baseline == "episodes" else [False] * 10)
    advantages = torch.tensor([3e-4] * 7 + [-0.8, -0.7, 0.7])
    padded = torch.cat([advantages, torch.zeros(2)])  # the batch's padding rows follow its local rows
    stub = SimpleNamespace(
        _augmenter=SimpleNamespace(last_tied_rows=tied),
        args=args,
        advantage_estimator=resolve_estimator("grpo"),
    )
    out = TracInMixin._tracin_zero_groups_without_spread(stub, {"advantages": padded})["advantages"]
    expected = padded.clone()
    if group_baseline == "episodes":
        expected[:7] = 0.0
    assert torch.equal(out, expected)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo"])
def test_padding_rows_leave_the_validation_gradient_unchanged(tiny_model_dir, tmp_path, loss_type):
    """V weighs every counted validation row (`bnpo`: token) as training does: zero-weight padding rows (a process with
    fewer rows) change nothing. Local row counts, padding included, scaled `grpo`'s V by rows / (rows + padding)."""
    from trl_agentic.batch import BatchAugmenter

    trainer = make_trainer(
        tiny_model_dir, tmp_path, loss_type=loss_type, per_device_train_batch_size=2, num_generations=2
    )
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    batch, _ = trainer._tracin_rollout_validation(trainer._tracin_validation_rows())
    rows = batch["prompt_ids"].size(0)
    padded = BatchAugmenter._pad_rows(dict(batch), rows + 3)  # chunks of 2: one mixes a real and a padding row
    assert padded["prompt_ids"].size(0) == rows + 3
    flat = [
        torch.cat([torch.cat([g.A.flatten(), g.B.flatten()]) for g in trainer._tracin_validation_gradient(b).values()])
        for b in (batch, padded)
    ]
    assert flat[0].abs().max() > 0
    torch.testing.assert_close(flat[1], flat[0], rtol=1e-5, atol=1e-6 * flat[0].abs().max().item())

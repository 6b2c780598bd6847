"""lora_influence_scores against brute-force per-sample backward passes (float64, LoRA dropout on)."""

import pytest
import torch

from trl_agentic.tracin import LoraGhostHooks, lora_influence_scores, lora_parameters

LOSS_TYPES = ["grpo", "dapo", "dr_grpo", "bnpo"]


def _closures(kit, loss_type, batch=None, train_seed=11):
    batch = kit.train_batch() if batch is None else batch
    n_tokens = batch.completion_mask.sum()

    def train_losses(model):
        logps = kit.completion_logps(model, batch)
        # dapo normalises by the token count of the whole generation batch, larger than this batch's.
        return kit.per_sample_policy_losses(logps, batch, loss_type, num_items=n_tokens + 17.0)

    return kit.seeded(train_seed, train_losses), kit.seeded(12, kit.grpo_val_loss)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_scores_match_per_sample_backward(kit, loss_type):
    model = kit.make_lora_model()
    per_sample_losses, val_loss = _closures(kit, loss_type)

    scores = lora_influence_scores(model, per_sample_losses, val_loss)
    expected = kit.brute_force_scores(model, per_sample_losses, val_loss)

    assert scores.shape == (8,) and scores.dtype == torch.float64
    kit.assert_close_relative(scores, expected, rtol=1e-8)
    # Non-trivial: both signs occur, and the all-padding row 5 (no completion token) scores exactly 0.
    assert (expected > 0).any() and (expected < 0).any()
    assert scores[5] == 0.0


def test_scores_match_on_llama_with_partial_targets(kit):
    model = kit.make_lora_model(arch="llama", target_modules=["q_proj", "v_proj", "down_proj"], seed=4)
    assert len(lora_parameters(model)) == 6
    per_sample_losses, val_loss = _closures(kit, "grpo")

    scores = lora_influence_scores(model, per_sample_losses, val_loss)

    kit.assert_close_relative(scores, kit.brute_force_scores(model, per_sample_losses, val_loss), rtol=1e-8)


def test_dropout_masks_enter_the_scores(kit):
    """With other dropout masks the scores change: the hooks use the post-dropout input of lora_A."""
    model = kit.make_lora_model()
    scores = lora_influence_scores(model, *_closures(kit, "grpo"))
    other_masks = lora_influence_scores(model, *_closures(kit, "grpo", train_seed=99))
    assert (scores - other_masks).abs().max() > 1e-6 * scores.abs().max()


def test_padding_tokens_contribute_nothing(kit):
    """Changing the ids of padded positions (masked keys, masked loss) leaves every score unchanged."""
    model = kit.make_lora_model()
    batch = kit.train_batch()
    garbage = batch.rows(slice(None))
    padded = torch.cat([batch.attention_mask[:, : batch.prompt_len] == 0, batch.completion_mask == 0], dim=1)
    garbage.input_ids = torch.where(padded, torch.randint(1, 64, padded.shape), batch.input_ids)
    assert (garbage.input_ids != batch.input_ids).any()

    scores = lora_influence_scores(model, *_closures(kit, "bnpo", batch))
    scores_garbage = lora_influence_scores(model, *_closures(kit, "bnpo", garbage))

    kit.assert_close_relative(scores_garbage, scores, rtol=1e-12)

    # Directly: the gradients reaching every LoRA layer are exactly 0 at every padded position.
    per_sample_losses, val_loss = _closures(kit, "bnpo", batch)
    padding = batch.attention_mask == 0
    with LoraGhostHooks(model) as hooks:
        seen = []
        probes = [
            ref.lora_B.register_full_backward_hook(lambda module, g_in, g_out: seen.append((g_in[0], g_out[0])))
            for ref in hooks.layers
        ]
        with hooks.record():
            direction = hooks.accumulate_gradient(val_loss(model))
        seen.clear()
        with hooks.record(direction=direction):
            hooks.score_rows(per_sample_losses(model).sum(), direction)
        for probe in probes:
            probe.remove()
    assert len(seen) == len(hooks.layers)
    for g_h, g_o in seen:
        assert g_o[padding].abs().max() == 0.0 and g_h[padding].abs().max() == 0.0
        assert g_o[~padding].abs().max() > 0.0


def test_param_grad_untouched(kit):
    model = kit.make_lora_model()
    params = kit.lora_param_list(model)
    preset = torch.full_like(params[0], 0.25)
    params[0].grad = preset.clone()

    lora_influence_scores(model, *_closures(kit, "grpo"))

    assert torch.equal(params[0].grad, preset)
    assert all(param.grad is None for param in params[1:])
    assert all(param.grad is None for param in model.parameters() if param is not params[0])

"""TracIn start-up refusals and mode choices: non-LoRA trainable parameters, float16, FSDP, reentrant checkpointing,
and identical dropout masks in the two passes of the two-pass design."""

from __future__ import annotations

import logging

import pytest
import torch
from test_trainer_tracin import lora_config, make_config, make_trainer

from trl_agentic import AgenticGRPOConfig


def _trainer_on(model, tmp_path):
    from test_trainer_tracin import TRAIN, VAL, letter_fraction

    from trl_agentic import AgenticGRPOTrainer

    return AgenticGRPOTrainer(
        model=model,
        reward_funcs=letter_fraction,
        args=make_config(tmp_path),
        train_dataset=TRAIN,
        tracin_eval_dataset=VAL,
    )


def _policy(model_dir, **lora_overrides):
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    # attention_bias: base layers with biases, so that `bias=...` has something to train.
    base = AutoModelForCausalLM.from_pretrained(model_dir, attention_bias=True)
    return get_peft_model(base, lora_config(**lora_overrides))


@pytest.mark.parametrize(
    ("overrides", "setting"),
    [
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"bias": "all"}, "bias='all'"),
        ({"bias": "lora_only"}, "bias='lora_only'"),
        ({"trainable_token_indices": [1, 2]}, "trainable_token_indices"),
    ],
)
def test_non_lora_trainable_parameters_are_refused_naming_the_setting(tiny_model_dir, tmp_path, overrides, setting):
    # TracIn scores and trains the LoRA A/B weights only; these settings train other weights too.
    policy = _policy(tiny_model_dir, **overrides)
    lora = {id(p) for n, p in policy.named_parameters() if "lora_A" in n or "lora_B" in n}
    assert any(p.requires_grad and id(p) not in lora for p in policy.parameters())  # the setting did train more
    with pytest.raises(ValueError, match="other parameter") as error:
        _trainer_on(policy, tmp_path)
    assert setting in str(error.value)


def test_bias_all_without_any_bias_trains_nothing_more_and_is_accepted(tiny_model_dir, tmp_path):
    # `bias='all'` on a model without biases adds no trainable parameter, so nothing would be dropped.
    trainer = make_trainer(tiny_model_dir, tmp_path, peft=lora_config(bias="all"))
    assert trainer._tracin is not None


def test_a_base_weight_unfrozen_by_hand_is_refused(tiny_model_dir, tmp_path):
    policy = _policy(tiny_model_dir)
    policy.get_base_model().model.norm.weight.requires_grad_(True)
    with pytest.raises(ValueError, match="model.norm.weight.*unfrozen outside the LoRA config"):
        _trainer_on(policy, tmp_path)


def test_fp16_and_fsdp_are_refused_in_the_config(tmp_path):
    with pytest.raises(ValueError, match="`fp16=True`"):
        AgenticGRPOConfig(output_dir=str(tmp_path), use_cpu=True, tracin_enabled=True, fp16=True)
    with pytest.raises(ValueError, match="FSDP"):
        AgenticGRPOConfig(output_dir=str(tmp_path), use_cpu=True, tracin_enabled=True, fsdp="full_shard")


def test_mode_choice_is_logged(tiny_model_dir, tmp_path, caplog):
    from transformers.utils import logging as hf_logging

    hf_logging.enable_propagation()
    try:
        with caplog.at_level(logging.INFO, logger="trl_agentic.tracin.trainer_mixin"):
            fused = make_trainer(tiny_model_dir, tmp_path / "a", gradient_checkpointing=True)
            with pytest.warns(UserWarning, match="reentrant"):
                reentrant = make_trainer(
                    tiny_model_dir,
                    tmp_path / "b",
                    gradient_checkpointing=True,
                    gradient_checkpointing_kwargs={"use_reentrant": True},
                )
    finally:
        hf_logging.disable_propagation()
    # Non-reentrant checkpointing keeps the fused step (its inputs are taken from the recompute); reentrant
    # checkpointing would make the fused step train without checkpointing, so the two-pass design is used.
    assert fused._tracin.fused and not reentrant._tracin.fused
    messages = [r.getMessage() for r in caplog.records if r.name == "trl_agentic.tracin.trainer_mixin"]
    assert any(m.startswith("TracIn: fused step") for m in messages)
    assert any(m.startswith("TracIn: two-pass step (reentrant gradient checkpointing") for m in messages)


def test_two_pass_scores_with_the_dropout_masks_it_trains_with(tiny_model_dir, tmp_path):
    trainer = make_trainer(
        tiny_model_dir,
        tmp_path,
        peft=lora_config(lora_dropout=0.5),
        steps_per_generation=2,
        gradient_accumulation_steps=2,
    )
    assert not trainer._tracin.fused
    layer = trainer.model.base_model.model.model.layers[0].mlp.down_proj
    phase = {"name": None}
    seen = {"score": [], "train": []}

    def keep_input(module, args):
        if phase["name"] and torch.is_grad_enabled():
            seen[phase["name"]].append(args[0].detach().clone())

    raw = {"score": [], "train": []}

    def keep_raw(module, args):
        if phase["name"] and torch.is_grad_enabled():
            raw[phase["name"]].append(args[0].detach().clone())

    handles = [
        layer.lora_A["default"].register_forward_pre_hook(keep_input),  # after LoRA dropout
        layer.register_forward_pre_hook(keep_raw),  # before it
    ]
    filter_buffer = trainer._tracin_filter_buffer

    def filter_and_switch(chunks):
        phase["name"] = "score"
        filter_buffer(chunks)
        phase["name"] = "train"

    trainer._tracin_filter_buffer = filter_and_switch
    trainer.train()
    for handle in handles:
        handle.remove()
    assert len(seen["score"]) == len(seen["train"]) == 2
    for scored, trained, before in zip(seen["score"], seen["train"], raw["score"]):
        assert not torch.equal(scored, before)  # dropout is on: it changed the input
        assert torch.equal(scored, trained)  # and the scoring forward drew the training forward's masks
    assert not torch.equal(seen["score"][0] != 0, seen["score"][1] != 0)  # a fresh mask per micro-batch

"""`trl_agentic.vllm_lora` without vLLM: adapter export, the fallback rules, and the TRL code the sync hooks into.

The sync itself (colocate and server) is tested with vLLM in `tests/vllm_tier` (`make test-vllm`).
"""

import inspect
import json

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

from trl_agentic.vllm_lora import (
    LoRASyncVLLMGeneration,
    adapter_state_dict,
    lora_server_command,
    lora_sync_unsupported_reason,
    lora_sync_vllm,
    save_adapter,
    vllm_max_lora_rank,
)


def _peft(tiny_model_dir, **overrides):
    values = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    values.update(overrides)
    return get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir), LoraConfig(**values))


def test_max_lora_rank_is_rounded_up_to_a_value_vllm_accepts():
    assert [vllm_max_lora_rank(r) for r in (1, 2, 8, 9, 16, 200, 300, 512)] == [1, 8, 8, 16, 16, 256, 320, 512]
    with pytest.raises(ValueError, match="above vLLM's largest"):
        vllm_max_lora_rank(513)


def _unfreeze_a_base_weight(model):
    model.get_base_model().model.norm.weight.requires_grad_(True)
    return model


# Every adapter setting the LoRA sync has to decide on: served as a vLLM LoRA adapter (None), or the reason it is
# not (then TRL's full sync on GPU; refused at start-up on vLLM's CPU backend, where that sync cannot run).
SYNC_TABLE = [
    ("plain LoRA", {}, None, None),
    ("rank rounded up (r=4 -> 8)", {"r": 4}, None, None),
    ("rank 512", {"r": 512}, None, None),
    ("rank above 512", {"r": 520}, "above vLLM's largest", None),
    ("rsLoRA", {"use_rslora": True}, None, None),
    ("some layers only", {"layers_to_transform": [0]}, None, None),
    ("DoRA", {"use_dora": True}, "DoRA", None),
    ("modules_to_save", {"modules_to_save": ["lm_head"]}, "modules_to_save", None),
    ("bias='all'", {"bias": "all"}, "biases", None),
    ("bias='lora_only'", {"bias": "lora_only"}, "biases", None),
    ("lora_bias", {"lora_bias": True}, "biases", None),
    ("rank_pattern", {"rank_pattern": {"q_proj": 2}}, "rank_pattern", None),
    ("alpha_pattern", {"alpha_pattern": {"q_proj": 2}}, "rank_pattern", None),
    ("trainable_token_indices", {"trainable_token_indices": [1, 2]}, "trainable_token_indices", None),
    ("LoRA on embeddings", {"target_modules": ["q_proj", "embed_tokens"]}, "embeddings or the LM head", None),
    ("LoRA on lm_head", {"target_modules": ["q_proj", "lm_head"]}, "embeddings or the LM head", None),
    ("base weight unfrozen by hand", {}, "outside the adapter are trainable", _unfreeze_a_base_weight),
]


@pytest.mark.parametrize(("setting", "overrides", "reason", "modify"), SYNC_TABLE, ids=[r[0] for r in SYNC_TABLE])
def test_lora_sync_table(tiny_model_dir, setting, overrides, reason, modify):
    from trl_agentic.vllm_lora import lora_sync_decision

    policy = _peft(tiny_model_dir, **overrides)
    if modify is not None:
        policy = modify(policy)
    found = lora_sync_unsupported_reason(policy)
    if reason is None:
        assert found is None, found
        assert lora_sync_decision(policy, sleep_mode=False, on_cpu=True) is None
        assert "sleep mode" in lora_sync_decision(policy, sleep_mode=True, on_cpu=False)
        return
    assert found is not None and reason in found, found
    # GPU: TRL's full sync (merge and push every weight) serves it exactly, with a warning at start-up.
    assert reason in lora_sync_decision(policy, sleep_mode=False, on_cpu=False)
    # vLLM's CPU backend: that fallback cannot run, so the set-up is refused before any engine starts.
    with pytest.raises(ValueError, match="does not run on vLLM's CPU backend") as error:
        lora_sync_decision(policy, sleep_mode=False, on_cpu=True)
    assert reason in str(error.value)


def test_other_peft_types_and_plain_models_are_not_served_as_lora(tiny_model_dir):
    from peft import IA3Config

    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert lora_sync_unsupported_reason(plain) == "the model is not a PEFT model"
    ia3 = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir),
        IA3Config(target_modules=["q_proj", "down_proj"], feedforward_modules=["down_proj"]),
    )
    assert "IA3" in lora_sync_unsupported_reason(ia3)


def test_adapter_is_exported_in_the_engine_dtype(tiny_model_dir):
    policy = _peft(tiny_model_dir)
    state32 = adapter_state_dict(policy)
    state16 = adapter_state_dict(policy, dtype=torch.bfloat16)
    assert {t.dtype for t in state32.values()} == {torch.float32}
    assert {t.dtype for t in state16.values()} == {torch.bfloat16}
    for name, tensor in state32.items():
        torch.testing.assert_close(state16[name], tensor.to(torch.bfloat16), rtol=0, atol=0)
    # Half the bytes on the way to a bfloat16 engine, which casts the adapter to bfloat16 when it loads it anyway.
    assert sum(t.nbytes for t in state16.values()) * 2 == sum(t.nbytes for t in state32.values())


def test_saved_adapter_reloads_into_the_same_policy(tiny_model_dir, tmp_path):
    policy = _peft(tiny_model_dir)
    state = adapter_state_dict(policy)
    assert state and all(t.device.type == "cpu" and t.is_contiguous() for t in state.values())
    # The names PEFT (and vLLM's LoRA loader) expect: no adapter name inside.
    assert all(".lora_A.weight" in k or ".lora_B.weight" in k for k in state)
    assert not any(".default." in k for k in state)
    folder = save_adapter(policy, str(tmp_path / "adapter"), state)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8 and config["peft_type"] == "LORA"

    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), folder)
    ids = torch.tensor([[3, 14, 15, 92, 65]])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, policy(ids).logits)
        with policy.disable_adapter():
            base = policy(ids).logits
    assert not torch.allclose(base, policy(ids).logits)  # the adapter is not a no-op, so the check above means much


def test_exported_state_is_a_copy(tiny_model_dir):
    policy = _peft(tiny_model_dir)
    state = adapter_state_dict(policy)
    name, tensor = next(iter(state.items()))
    before = tensor.clone()
    with torch.no_grad():
        for parameter in policy.parameters():
            parameter.add_(1.0)
    torch.testing.assert_close(state[name], before)


def test_lora_sync_vllm_swaps_the_class_grpo_trainer_builds_only_inside():
    import trl.trainer.grpo_trainer as grpo_module

    original = grpo_module.VLLMGeneration
    with lora_sync_vllm(True, sync_dir="/some/dir"):
        factory = grpo_module.VLLMGeneration
        assert factory.func is LoRASyncVLLMGeneration and factory.keywords == {
            "lora_sync": True,
            "sync_dir": "/some/dir",
        }
    assert grpo_module.VLLMGeneration is original
    with lora_sync_vllm(False):
        assert grpo_module.VLLMGeneration is original
    with pytest.raises(RuntimeError), lora_sync_vllm(True):
        raise RuntimeError("restored even on errors")
    assert grpo_module.VLLMGeneration is original


def test_server_command_has_trls_flags_and_lora():
    argv, env = lora_server_command("/models/policy", max_lora_rank=12, port=8123, extra_args=["--enforce-eager"])
    assert argv[1:5] == ["-m", "vllm.entrypoints.openai.api_server", "--model", "/models/policy"]
    joined = " ".join(argv)
    assert "--logprobs-mode processed_logprobs" in joined and "--max-logprobs -1" in joined
    assert "--enable-lora --max-lora-rank 16" in joined and "--port 8123" in joined and argv[-1] == "--enforce-eager"
    assert env == {"VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}


# -- TRL drift guards: the LoRA sync reuses TRL code through these exact hooks (trl==1.16.0 is pinned) -------------


def test_grpo_trainer_builds_vllm_generation_from_its_module_global():
    from trl import GRPOTrainer

    source = inspect.getsource(GRPOTrainer.__init__)
    assert "self.vllm_generation = VLLMGeneration(" in source  # looked up in trl.trainer.grpo_trainer at call time
    single_turn = inspect.getsource(GRPOTrainer._generate_single_turn)
    assert "self.vllm_generation.sync_weights()" in single_turn and "self.vllm_generation.generate(" in single_turn


def test_vllm_generation_hooks_are_where_the_lora_sync_expects_them():
    from trl.generation.vllm_generation import VLLMGeneration

    init = inspect.getsource(VLLMGeneration._init_vllm)
    # Colocate: `LLM` is read from the module at call time (so `_llm_kwargs` can add LoRA arguments) ...
    assert "self.llm = LLM(" in init and "model=model.name_or_path" in init
    # ... and server: the client and its NCCL group are created here (replaced by `_init_server`).
    assert "self.vllm_client = VLLMClient(" in init and "init_communicator(" in init
    generate = inspect.getsource(VLLMGeneration.generate)
    # Colocate generation goes through `self.llm.generate` (wrapped to add the LoRA request) ...
    assert "self.llm.generate(vllm_prompts, sampling_params=sampling_params, use_tqdm=False)" in generate
    # ... and server generation through the client, whose requests name `self.model` (set to the adapter's name).
    assert "self.vllm_client.generate(" in generate
    from trl.generation.vllm_client import VLLMClient

    assert '"model": self.model,' in inspect.getsource(VLLMClient.generate)
    assert set(inspect.signature(LoRASyncVLLMGeneration.__init__).parameters) >= {"lora_sync", "sync_dir"}

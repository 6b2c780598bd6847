"""The folder `push_to_hub` would upload: adapter, config, tokenizer and a model card naming trl-agentic's features.

Offline, so nothing is uploaded: the test checks what `save_model` + `create_model_card` (both called by TRL's
`push_to_hub`) write, and that the adapter loads back with `PeftModel.from_pretrained` and generates.
"""

import torch
from datasets import Dataset
from peft import LoraConfig, PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl_agentic import AgenticGRPOConfig, AgenticGRPOTrainer


class EchoEnv:
    def reset(self, **kwargs):
        pass

    def echo(self, text: str) -> str:
        """
        Echo the text.

        Args:
            text: What to echo.
        """
        return text


def reward(completions, **kwargs):
    return [float(len(c[-1]["content"]) % 5) for c in completions]


def test_hub_folder_has_adapter_tokenizer_and_card(tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    args = AgenticGRPOConfig(
        output_dir=str(out),
        hub_model_id="someone/calc-agent",
        use_cpu=True,
        bf16=False,
        report_to="none",
        max_steps=1,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=16,
        learning_rate=1e-2,
        save_strategy="no",
        enable_tool_rollback=True,
        save_negative_samples=True,
        enable_context_snapshots=True,
    )
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": "hi"}]] * 4})
    trainer = AgenticGRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=reward,
        args=args,
        train_dataset=dataset,
        environment_factory=EchoEnv,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"),
    )
    trainer.train()
    trainer.save_model(str(out))
    trainer.create_model_card(model_name="calc-agent")

    names = {p.name for p in out.iterdir()}
    assert {
        "adapter_config.json",
        "adapter_model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "README.md",
    } <= names
    card = (out / "README.md").read_text()
    assert "AgenticGRPOTrainer" in card and "trl-agentic" in card
    assert "| rollback |" in card and "`max_tool_retries=3`" in card
    assert "| negatives |" in card and "| snapshots |" in card and "| tracin |" not in card
    assert "Pensieve Paradigm" in card  # StateLM citation, since snapshots were on
    assert "Think Fast and Slow" not in card  # RLVCR was off

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    loaded = PeftModel.from_pretrained(base, str(out))
    trained = {k: v for k, v in trainer.model.state_dict().items() if "lora_" in k}
    reloaded = {k: v for k, v in loaded.state_dict().items() if "lora_" in k}
    assert trained.keys() == reloaded.keys() and trained
    assert all(torch.equal(trained[k], reloaded[k]) for k in trained)
    assert any(v.abs().sum() > 0 for k, v in reloaded.items() if "lora_B" in k)  # the adapter was trained
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    generated = loaded.generate(**ids, max_new_tokens=5, do_sample=False)
    assert generated.shape[1] == ids["input_ids"].shape[1] + 5 or tokenizer.eos_token_id in generated[0].tolist()

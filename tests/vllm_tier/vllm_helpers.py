"""Helpers of the vLLM tier: a tiny policy that vLLM's CPU backend serves and that calls the calculator tool, and a
recorded GRPO run through vLLM."""

import json
import os


def tool_call_text(expression: str) -> str:
    call = {"name": "calculate", "arguments": {"expression": expression}}
    return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"


# Whole turns as single tokens: a call that fails (ZeroDivisionError, rolled back), a call that succeeds, an answer.
FAILING_CALL = tool_call_text("1/0")
GOOD_CALL = tool_call_text("6*7")
ANSWER = "Answer: 42"
TURN_TOKENS = (FAILING_CALL, GOOD_CALL, ANSWER)


def build_calculator_policy(path, *, seed: int = 0, turn_tokens=TURN_TOKENS, biases=(0.9, 0.9, 0.75)) -> str:
    """A tiny random Qwen3 that vLLM's CPU backend serves and that uses the calculator, built in a second.

    The tokenizer is `trl_agentic.models.build_tiny_model`'s (byte-level, TRL's Qwen3 chat template) plus three
    tokens, each a whole turn: `FAILING_CALL` (`calculate("1/0")`), `GOOD_CALL` (`calculate("6*7")`) and `ANSWER`.
    The weights are random except for a constant channel: hidden dimension 0 of the residual stream holds the same
    value at every position (its embedding column is constant, nothing writes to it), so the matching `lm_head`
    column acts as an output bias favouring the three turn tokens and `<|im_end|>`. Sampled at temperature 1, a turn
    is then mostly one or two of these tokens and an end of turn: tool calls that fail or succeed, answers. The rest
    of the network is random and context-dependent, so a LoRA adapter on it changes the distribution. Head size is
    32, the smallest vLLM's CPU attention supports. `turn_tokens` / `biases` replace the three turns and their output
    biases (the asynchronous trainer's snapshot test adds a `delete_context` call).
    """
    import torch
    from tokenizers import AddedToken
    from transformers import AutoTokenizer, GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    from trl_agentic.models import build_tiny_model

    path = str(path)
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model(f"{path}-base"))
    tokenizer.add_tokens([AddedToken(text, normalized=False, special=False) for text in turn_tokens])
    hidden = 64
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        intermediate_size=128,
        tie_word_embeddings=False,
        max_position_embeddings=4096,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    turn_ids = [tokenizer.convert_tokens_to_ids(t) for t in turn_tokens]
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
        embed = model.model.embed_tokens.weight
        embed.normal_(0.0, 1.0)
        embed[:, 0] = 8.0  # the constant channel
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[0].zero_()
            layer.mlp.down_proj.weight[0].zero_()
        head = model.lm_head.weight
        head.normal_(0.0, 0.05)
        head[:, 0] = 0.0
        head[turn_ids, 0] = torch.tensor(list(biases))
        head[tokenizer.eos_token_id, 0] = 0.95
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


# ----------------------------------------------------------------------------------------------------------------------
# A GRPO run through vLLM, recorded


def lora_config():
    from peft import LoraConfig

    # All linear layers: vLLM packs q/k/v and gate/up into single layers, so the adapter's per-module weights are
    # re-packed on load; the test covers that mapping.
    return LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")


def agentic_config(output_dir, mode: str, **overrides):
    from trl_agentic import AgenticGRPOConfig

    values = dict(
        output_dir=str(output_dir),
        use_cpu=True,
        bf16=False,
        seed=0,
        max_steps=3,
        learning_rate=5e-2,  # so that three steps move the adapter well past vLLM's numerical noise
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=96,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        use_vllm=True,
        vllm_mode=mode,
        vllm_gpu_memory_utilization=0.1,
        vllm_max_model_length=2048,
        enable_tool_rollback=True,
        rollback_on_errors=["ZeroDivisionError"],
        max_tool_retries=2,
        save_negative_samples=True,
    )
    values.update(overrides)
    return AgenticGRPOConfig(**values)


def recording_trainer_class():
    import torch

    from trl_agentic import AgenticGRPOTrainer

    class RecordingTrainer(AgenticGRPOTrainer):
        """Keeps every scored batch (after trl-agentic's extra rows), with the adapter id that generated it."""

        def _generate_and_score_completions(self, inputs):
            output = super()._generate_and_score_completions(inputs)
            batch = {k: v.detach().clone() for k, v in output.items() if isinstance(v, torch.Tensor)}
            batch["global_step"] = self.state.global_step
            self.recorded_batches.append(batch)
            return output

    return RecordingTrainer


def build_trainer(model_dir, args, lora_sync: bool = True, **kwargs):
    from datasets import Dataset

    from trl_agentic.envs.calculator import CalculatorEnv, answer_reward, make_arithmetic_tasks, tool_use_reward
    from trl_agentic.vllm_lora import lora_sync_vllm

    tasks = make_arithmetic_tasks(16, seed=0, difficulty="easy")
    if hasattr(args, "vllm_lora_sync"):
        args.vllm_lora_sync = lora_sync  # the trainer's own switch, once trainer.py wraps its engine creation
    # Same switch from outside (needed while trainer.py does not wrap it; harmless nesting once it does).
    with lora_sync_vllm(lora_sync):
        trainer = recording_trainer_class()(
            model=str(model_dir),
            reward_funcs=[answer_reward, tool_use_reward],
            args=args,
            train_dataset=Dataset.from_list(tasks),
            environment_factory=CalculatorEnv,
            peft_config=lora_config(),
            **kwargs,
        )
    trainer.recorded_batches = []
    return trainer


def masked_logp_gaps(trainer, batch):
    """Mean |policy - vLLM| and |base model - vLLM| sampling log-prob gaps over the generated tokens of `batch`.

    The policy log-probs are TRL's `old_per_token_logps` (the adapter as it was when the batch was generated); the
    base log-probs are recomputed with the adapter switched off.
    """
    import torch

    mask = (batch["completion_mask"] * batch.get("tool_mask", torch.ones_like(batch["completion_mask"]))).bool()
    sampling = batch["sampling_per_token_logps"]
    assert torch.isfinite(sampling[mask]).all()
    with trainer.model.disable_adapter():
        base = trainer._logps_for_rows(
            trainer.model,
            batch["prompt_ids"],
            batch["prompt_mask"],
            batch["completion_ids"],
            batch["completion_mask"],
        )
    policy_gap = (batch["old_per_token_logps"] - sampling).abs()[mask].mean().item()
    base_gap = (base - sampling).abs()[mask].mean().item()
    return policy_gap, base_gap


def metric(trainer, name):
    return [h[name] for h in trainer.state.log_history if name in h]


def clean_env(**extra) -> dict:
    """This environment without the `torch.distributed` variables TRL sets in-process for a colocated engine.

    A child process inheriting `WORLD_SIZE` / `MASTER_PORT` would try to join (and collide with) this process's group.
    """
    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    return {**{k: v for k, v in os.environ.items() if k not in names}, **extra}

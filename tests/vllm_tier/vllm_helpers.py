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
    """The tiny calculator policy (`trl_agentic.bench.tool_policy.build_tool_policy`; see its docstring)."""
    from trl_agentic.bench.tool_policy import build_tool_policy

    return build_tool_policy(path, seed=seed, turn_tokens=turn_tokens, biases=biases)


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

    from trl_agentic.envs.calculator import CalculatorEnv, answer_reward, make_arithmetic_tasks, tool_call_reward
    from trl_agentic.vllm_lora import lora_sync_vllm

    tasks = make_arithmetic_tasks(16, seed=0, difficulty="easy")
    if hasattr(args, "vllm_lora_sync"):
        args.vllm_lora_sync = lora_sync  # the trainer's own switch, once trainer.py wraps its engine creation
    # Same switch from outside (needed while trainer.py does not wrap it; harmless nesting once it does).
    with lora_sync_vllm(lora_sync):
        trainer = recording_trainer_class()(
            model=str(model_dir),
            reward_funcs=[answer_reward, tool_call_reward],
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

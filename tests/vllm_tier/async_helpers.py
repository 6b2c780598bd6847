"""Helpers of the asynchronous trainer's vLLM-tier tests: configs, a recorded run, picklable environments."""

from __future__ import annotations

import json

from trl_agentic.envs.calculator import ToolCallBonusCalculatorEnv


def async_config(output_dir, url, **overrides):
    from trl_agentic.async_grpo import AsyncAgenticGRPOConfig

    values = dict(
        output_dir=str(output_dir),
        use_cpu=True,
        bf16=False,
        seed=0,
        max_steps=2,
        learning_rate=5e-2,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=96,
        max_tool_calling_iterations=4,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        gradient_checkpointing=False,
        vllm_server_base_url=url,
        token_budget=0,  # fixed-count micro-batches: per_device_train_batch_size rows each
        max_staleness=2,
        max_inflight_tasks=8,
        vllm_server_timeout=60,
        heartbeat_stale_after_s=120,
    )
    values.update(overrides)
    return AsyncAgenticGRPOConfig(**values)


def rollback_overrides(**more):
    values = dict(
        enable_tool_rollback=True,
        rollback_on_errors=["ZeroDivisionError"],
        max_tool_retries=2,
        save_negative_samples=True,
        max_negative_samples_per_group=2,
    )
    values.update(more)
    return values


def lora():
    from peft import LoraConfig

    return LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")


def calculator_dataset(n=16):
    from datasets import Dataset

    from trl_agentic.envs.calculator import make_arithmetic_tasks

    return Dataset.from_list(make_arithmetic_tasks(n, seed=0, difficulty="easy"))


def build(model_dir, args, environment_factory=ToolCallBonusCalculatorEnv, **kwargs):
    from trl_agentic.async_grpo import AsyncAgenticGRPOTrainer
    from trl_agentic.envs.calculator import answer_reward

    kwargs.setdefault("train_dataset", calculator_dataset())
    return AsyncAgenticGRPOTrainer(
        model=str(model_dir),
        reward_funcs=[answer_reward],  # the tool bonus is the environment's get_reward
        args=args,
        environment_factory=environment_factory,
        peft_config=lora(),
        **kwargs,
    )


def logged(trainer, name):
    return [h[name] for h in trainer.state.log_history if name in h]


def total(trainer, name):
    return sum(v for v in logged(trainer, name) if v is not None)


class SnapshotCalculatorEnv(ToolCallBonusCalculatorEnv):
    """The calculator whose results are long: the conversation outgrows the budget unless context is deleted."""

    def calculate(self, expression: str) -> str:
        """
        Evaluate an arithmetic expression.

        Args:
            expression: The expression, e.g. "6*7".

        Returns:
            The result.
        """
        return super().calculate(expression) + " " + "(checked) " * 8


class TwoQuestionCalculatorEnv(ToolCallBonusCalculatorEnv):
    """A calculator conversation with a second user question after the first answer (a further user turn)."""

    def reset(self, **kwargs):
        self._asked = False
        return super().reset(**kwargs)

    def _next_user_turn(self, assistant_message):
        if self._asked:
            return None
        self._asked = True
        return "Now compute it again to double-check."


def tool_call(expression: str) -> str:
    return f"<tool_call>\n{json.dumps({'name': 'calculate', 'arguments': {'expression': expression}})}\n</tool_call>"


HOST_GENERATIONS: list = []  # (adapter requested, token ids, log-probs) of `scaled_token_estimator`'s generations


def scaled_token_estimator(batch, trainer):
    """A token-level estimator for the tests: GRPO's advantage on every completion token, doubled on the row's first
    trained token. Uses the host's model to prove it is reachable (a forward of one row) and generates 3 tokens from
    the first row's prompt through the host (the server, as RLVCR's alternative thinking), recorded in
    `HOST_GENERATIONS`."""
    import torch

    from trl_agentic.estimators import grpo_estimator

    episode = grpo_estimator(batch, trainer)
    with torch.no_grad():
        trainer.model(input_ids=batch.prompt_ids[:1, -4:])
    prompt = batch.prompt_ids[0][batch.prompt_mask[0].bool()].tolist()
    model = trainer._trainer._request_model_name()
    (ids,), (logprobs,) = trainer._generate_single_turn([prompt], max_tokens=3)
    HOST_GENERATIONS.append((model, list(ids), list(logprobs)))
    weights = torch.ones_like(batch.loss_mask, dtype=torch.float32)
    first = batch.loss_mask.float().argmax(dim=1)
    weights[torch.arange(len(first)), first] = 2.0
    return episode[:, None] * weights


def delete_call(message_ids) -> str:
    call = {"name": "delete_context", "arguments": {"message_ids": message_ids}}
    return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"


# Whole turns as single tokens: a good calculator call, a deletion of message 3 (the first tool result when the
# conversation is [system, user, call, result, ...]), an answer.
SNAPSHOT_TURNS = (tool_call("6*7"), delete_call([3]), "Answer: 42")

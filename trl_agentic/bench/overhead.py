"""Trainer and rollout-engine overhead, and the cost of a rollback, on the embedded SmolLM2-135M + LoRA (CPU).

1. Features-off `AgenticGRPOTrainer` step time / TRL `GRPOTrainer` step time (goal ≤ 1.02): both trainers run the
   same seeds and batches, in alternating rounds, and the ratio of median step times is reported.
2. Rollout-engine overhead: the loop's own time (not generation, not tools) as a fraction of the loop's wall time,
   in a multi-turn calculator run with rollback on (goal ≤ 5 %).
3. Tokens generated per rollback vs the failed turn's tokens (goal ≤ 1 plus feedback): only the failed turn is
   generated again, the prefix is reused.
"""

from __future__ import annotations

import statistics
import tempfile
from collections import Counter

PEFT = dict(r=16, lora_alpha=32, target_modules="all-linear")


def _config(cls, out, steps, **extra):
    return cls(
        output_dir=out,
        use_cpu=True,
        bf16=False,
        report_to="none",
        seed=0,
        max_steps=steps,
        learning_rate=1e-5,
        per_device_train_batch_size=8,
        num_generations=8,
        max_completion_length=24,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        **extra,
    )


def _prompts(n):
    from datasets import Dataset

    from ..envs.calculator import make_arithmetic_tasks

    return Dataset.from_list(make_arithmetic_tasks(n, seed=0, difficulty="medium"))


def _length_reward(completions, **kwargs):
    return [float(len(c[-1]["content"]) % 5) for c in completions]


def _step_times(trainer) -> list[float]:
    times = [h["step_time"] for h in trainer.state.log_history if "step_time" in h]
    return times[1:] if len(times) > 1 else times  # the first step pays one-off warm-up costs


def features_off_ratio(quick: bool) -> list[dict]:
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer

    from ..config import AgenticGRPOConfig
    from ..models import resolve_model_path
    from ..trainer import AgenticGRPOTrainer

    model = resolve_model_path("smollm2-135m")
    steps, rounds = (2, 1) if quick else (4, 3)
    times = {"trl": [], "ours": []}
    for _ in range(rounds):
        for name, trainer_cls, config_cls in (
            ("trl", GRPOTrainer, GRPOConfig),
            ("ours", AgenticGRPOTrainer, AgenticGRPOConfig),
        ):
            with tempfile.TemporaryDirectory() as out:
                trainer = trainer_cls(
                    model=model,
                    reward_funcs=_length_reward,
                    args=_config(config_cls, out, steps),
                    train_dataset=_prompts(64),
                    peft_config=LoraConfig(**PEFT),
                )
                trainer.train()
                times[name] += _step_times(trainer)
    trl, ours = statistics.median(times["trl"]), statistics.median(times["ours"])
    return [
        {
            "benchmark": "features-off trainer step / TRL GRPOTrainer step",
            "value": f"{ours / trl:.3f}",
            "goal": "≤ 1.02",
            "details": f"median step {ours:.2f} s vs {trl:.2f} s over {len(times['ours'])} steps each, SmolLM2-135M + "
            f"LoRA r=16, 8 completions × 24 tokens, {rounds} alternating rounds",
        }
    ]


class _FirstTurnScript:
    """The first time a prompt is seen, answer with a scripted tool call (half of them invalid, so rollbacks
    happen); every other generation — continuations and regenerations — is the real model's."""

    def __init__(self, trainer):
        self.real = trainer._generate_single_turn
        self.tok = trainer._tokenizer
        self.seen = Counter()

    def __call__(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        first = [self.seen[tuple(ids)] == 0 and "<tool_response>" not in self.tok.decode(ids) for ids in prompt_ids]
        for ids in prompt_ids:
            self.seen[tuple(ids)] += 1
        real_idx = [i for i, f in enumerate(first) if not f]
        real_ids, real_lps = ([], None)
        if real_idx:
            real_ids, real_lps = self.real(
                [prompt_ids[i] for i in real_idx], images, multimodal_fields, num_generations, has_tool_images
            )
        out, lps, k = [], [], 0
        for i, is_first in enumerate(first):
            if is_first:
                expression = "12 * (3 + 4" if i % 2 == 0 else "12 * 7"
                text = (
                    '<tool_call>\n{"name": "calculate", "arguments": {"expression": "'
                    + expression
                    + '"}}\n</tool_call><|im_end|>'
                )
                ids = self.tok.encode(text, add_special_tokens=False)
                out.append(ids)
                lps.append([0.0] * len(ids))
            else:
                out.append(real_ids[k])
                lps.append(real_lps[k] if real_lps is not None else None)
                k += 1
        return out, (lps if real_lps is not None else None)


def rollout_overhead(quick: bool) -> list[dict]:
    from peft import LoraConfig

    from ..config import AgenticGRPOConfig
    from ..envs.calculator import CalculatorEnv, answer_reward
    from ..models import resolve_model_path
    from ..trainer import AgenticGRPOTrainer

    steps = 1 if quick else 3
    stats = []
    with tempfile.TemporaryDirectory() as out:
        args = _config(
            AgenticGRPOConfig,
            out,
            steps,
            enable_tool_rollback=True,
            save_negative_samples=True,
            rollback_on_errors=["ValueError", "ZeroDivisionError"],
            max_tool_retries=1,
            max_tool_calling_iterations=2,
        )
        args.max_completion_length = 96
        trainer = AgenticGRPOTrainer(
            model=resolve_model_path("smollm2-135m"),
            reward_funcs=answer_reward,
            args=args,
            train_dataset=_prompts(64),
            environment_factory=CalculatorEnv,
            peft_config=LoraConfig(**PEFT),
        )
        trainer._generate_single_turn = _FirstTurnScript(trainer)
        augment = trainer._augmenter

        def capture(output, inputs, rewards_per_func, loop_result):
            stats.append(loop_result.stats)
            return augment(output, inputs, rewards_per_func, loop_result)

        trainer._augmenter = capture
        trainer.train()
    loop = sum(s.loop_seconds for s in stats)
    generate = sum(s.generate_seconds for s in stats)
    tools = sum(s.tool_seconds for s in stats)
    overhead = loop - generate - tools
    rollbacks = sum(s.rollback_attempts for s in stats)
    regenerated = sum(s.regenerated_tokens for s in stats)
    failed = sum(s.failed_turn_tokens for s in stats)
    return [
        {
            "benchmark": "rollout-engine overhead / loop wall time",
            "value": f"{overhead / loop:.2%}",
            "goal": "≤ 5 %",
            "details": f"loop {loop:.1f} s = generation {generate:.1f} s + tools {tools:.2f} s + engine "
            f"{overhead:.2f} s over {steps} steps ({sum(s.generation_calls for s in stats)} batched "
            f"generation calls), SmolLM2-135M + LoRA, calculator env, rollback on",
        },
        {
            "benchmark": "tokens generated per rollback / failed turn's tokens",
            "value": f"{regenerated / failed:.2f}" if failed else "n/a",
            "goal": "≤ 1 + feedback",
            "details": f"{rollbacks} rollbacks: {regenerated} tokens regenerated for {failed} failed-turn tokens "
            "(only the failed turn is generated again; the prompt and earlier turns are reused); "
            "feedback mode 'none' adds 0 tokens",
        },
    ]


def run(quick: bool = False) -> list[dict]:
    return features_off_ratio(quick) + rollout_overhead(quick)

"""Trainer and rollout-engine overhead, and the cost of a rollback, on the embedded SmolLM2-135M + LoRA (CPU).

1. Features-off `AgenticGRPOTrainer` step time / TRL `GRPOTrainer` step time (goal ≤ 1.02): both trainers run the
   same seeds and batches, in alternating rounds, and the ratio of median step times is reported.
2. Rollout-engine overhead: the loop's own time (not the model's `generate`, not tools) as a fraction of the loop's
   wall time, in a multi-turn calculator run with rollback on (goal ≤ 5 %). The model's `generate` (transformers', as
   TRL calls it) is timed on its own inside the loop, so that trl-agentic's work around it (prefix caching's
   bookkeeping, on by default since 2026-11-27) counts as engine overhead, not generation.
3. Tokens generated per rollback vs the failed turn's tokens (goal ≤ 1 plus feedback): only the failed turn is
   generated again, the prefix is reused. Measured on the quickstart's warm-started policy, whose failed turns and
   regenerations are both its own tool calls.
"""

from __future__ import annotations

import statistics
import tempfile
import time

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


def _warm_started_policy(out: str, quick: bool):
    """The quickstart's policy before GRPO: SmolLM2 + a LoRA adapter from a short SFT warm start on calculator traces,
    half of them with a rejected call first. It makes real tool calls, some malformed, so the failed turns and their
    regenerations both come from the same policy (an untrained model's regenerations are free text that runs to the
    completion budget, which measures the model rather than the engine)."""
    import torch
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..models import resolve_model_path
    from ..tasks import TaskArguments, build_task
    from ..warmstart import run_task_warmstart

    steps = 4 if quick else 16
    task_args = TaskArguments(
        task="calculator",
        num_train_tasks=64,
        warmstart_steps=steps,
        warmstart_batch_size=4,
        warmstart_learning_rate=3e-4,
        warmstart_error_fraction=0.5,
    )
    task = build_task(task_args)
    path = resolve_model_path("smollm2-135m")
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left", truncation_side="left")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    result = run_task_warmstart(
        model,
        tokenizer,
        task,
        task_args,
        peft_config=LoraConfig(**PEFT),
        output_dir=f"{out}/warmstart",
        compact_progress=False,
    )
    return result.model, tokenizer, task


class ModelGenerateClock:
    """Wall time of `model.generate` calls made while `active` (the rollout loop runs): wraps the transformers model's
    own `generate` (under the PEFT wrapper, as both TRL's generation and the prefix cache call it)."""

    def __init__(self, model, clock=time.perf_counter):
        self.seconds, self.calls, self.active, self.clock = 0.0, 0, False, clock
        self.model = model
        original = model.generate

        def generate(*args, **kwargs):
            if not self.active:
                return original(*args, **kwargs)
            start = self.clock()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds += self.clock() - start
                self.calls += 1

        model.generate = generate

    def around(self, function):
        """`function` with this clock active while it runs."""

        def wrapped(*args, **kwargs):
            self.active = True
            try:
                return function(*args, **kwargs)
            finally:
                self.active = False

        return wrapped


def overhead_split(loop: float, generate: float, model_generate: float, tools: float) -> dict:
    """The loop's wall time split: `model.generate`, tools, and the rest (the engine's own work, our generation
    bookkeeping around `model.generate` included; `generate - model_generate` is that bookkeeping alone)."""
    engine = loop - model_generate - tools
    return {
        "engine_s": engine,
        "engine_ratio": engine / loop if loop else 0.0,
        "around_generate_s": generate - model_generate,
    }


def rollout_overhead(quick: bool) -> list[dict]:
    from ..config import AgenticGRPOConfig
    from ..trainer import AgenticGRPOTrainer

    steps = 1 if quick else 6  # 48 rollouts: enough failed turns for a stable ratio
    stats = []
    with tempfile.TemporaryDirectory() as out:
        model, tokenizer, task = _warm_started_policy(out, quick)
        args = _config(
            AgenticGRPOConfig,
            out,
            steps,
            enable_tool_rollback=True,
            save_negative_samples=True,
            # group_baseline at its default ("episodes"): it decides the advantages (hence later steps' weights), not
            # the loop's work per turn; docs/benchmarks.md's recorded row was measured with "all_rows".
            rollback_on_errors=["ValueError", "ZeroDivisionError", "TypeError", "SyntaxError", "ToolCallParseError"],
            max_tool_retries=2,
            max_tool_calling_iterations=3,
        )
        args.max_completion_length = 96
        args.temperature = 0.8  # the quickstart's sampling temperature
        trainer = AgenticGRPOTrainer(
            model=model,
            reward_funcs=task.reward_funcs,
            args=args,
            train_dataset=task.train_dataset,
            environment_factory=task.environment_factory,
            processing_class=tokenizer,
        )
        augment = trainer._augmenter

        def capture(output, inputs, rewards_per_func, loop_result):
            stats.append(loop_result.stats)
            return augment(output, inputs, rewards_per_func, loop_result)

        trainer._augmenter = capture
        inner = trainer.model.get_base_model() if hasattr(trainer.model, "get_base_model") else trainer.model
        model_generate = ModelGenerateClock(inner)
        trainer._tool_call_loop = model_generate.around(trainer._tool_call_loop)
        trainer.train()
    loop = sum(s.loop_seconds for s in stats)
    generate = sum(s.generate_seconds for s in stats)
    tools = sum(s.tool_seconds for s in stats)
    split = overhead_split(loop, generate, model_generate.seconds, tools)
    rollbacks = sum(s.rollback_attempts for s in stats)
    regenerated = sum(s.regenerated_tokens for s in stats)
    failed = sum(s.failed_turn_tokens for s in stats)
    caching = "prefix caching on" if trainer._prefix_cache is not None else "prefix caching off"
    return [
        {
            "benchmark": "rollout-engine overhead / loop wall time",
            "value": f"{split['engine_ratio']:.2%}",
            "goal": "≤ 5 %",
            "details": f"loop {loop:.1f} s = model.generate {model_generate.seconds:.1f} s ({model_generate.calls} "
            f"calls) + tools {tools:.2f} s + engine {split['engine_s']:.2f} s, of which "
            f"{split['around_generate_s']:.2f} s around model.generate (our generation path: {caching}, the "
            f"default), over {steps} steps ({sum(s.generation_calls for s in stats)} batched generation calls), "
            "SmolLM2-135M + warm-start LoRA, calculator env, rollback on, group_baseline at its default",
        },
        {
            "benchmark": "tokens generated per rollback / failed turn's tokens",
            "value": f"{regenerated / failed:.2f}" if failed else "n/a",
            "goal": "≤ 1 + feedback",
            "details": f"{rollbacks} rollbacks: {regenerated} tokens regenerated for {failed} failed-turn tokens "
            "(only the failed turn is generated again; the prompt and earlier turns are reused), warm-started policy "
            "(16 SFT steps, as in the quickstart), T=0.8; feedback mode 'none' adds 0 tokens",
        },
    ]


def run(quick: bool = False) -> list[dict]:
    return features_off_ratio(quick) + rollout_overhead(quick)

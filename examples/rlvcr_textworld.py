# Copyright the trl-agentic authors. Licensed under the Apache License, Version 2.0.
"""
RLVCR / CoPO (multi-level thinking, arXiv 2602.12662) on the household text world, with the embedded
SmolLM2-135M-Instruct and LoRA. Runs offline on CPU.

Two rollout modes (`--rollout`):

* `step` (default): one step per completion. Each prompt is a state of a text-world episode, reached by playing a
  random prefix of the shortest plan. The model answers with `<level>k</level><think>...</think><action>...</action>`.
  Rewards: `progress_reward` (1.0 when the action shortens the remaining shortest plan or completes the task) and
  `format_reward` (0.1 for a well-formed step).
* `tool`: a whole episode as a multi-turn tool rollout with `TextWorldToolEnv`. Every assistant turn is a step whose
  action is a call of the `act` tool (`rlvcr_action_tag="tool_call"`); the reward is the environment's.

Usage:

```bash
python examples/rlvcr_textworld.py --config configs/rlvcr_textworld_step.yaml
python examples/rlvcr_textworld.py --config configs/rlvcr_textworld_step.yaml --max_steps 1
python examples/rlvcr_textworld.py --config configs/rlvcr_textworld_step.yaml --rollout tool --max_completion_length 512
```
"""

import json
import os
import random
import time
from dataclasses import dataclass, field

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the model is embedded: never touch the Hub

from datasets import Dataset  # noqa: E402
from trl import ModelConfig, TrlParser, get_peft_config  # noqa: E402

from trl_agentic import AgenticGRPOConfig, AgenticGRPOTrainer  # noqa: E402
from trl_agentic.envs.textworld import TEXTWORLD_RULES, TextWorldEnv, TextWorldToolEnv  # noqa: E402
from trl_agentic.models import resolve_model_path  # noqa: E402
from trl_agentic.rlvcr import LEVEL1_THINK, LEVEL_SYSTEM_PROMPT, ParsedStep, parse_step  # noqa: E402

# A compact version of `LEVEL_SYSTEM_PROMPT` (about 130 tokens instead of 500): the prompt length drives the cost of
# every forward pass on CPU. `--full_system_prompt` uses the full one.
STEP_SYSTEM_PROMPT = f"""Before each action, choose how deeply to think: level 1 (instinct, no analysis), 2 (the \
current state and the available actions), 3 (also reflect on your past actions) or 4 (also evaluate every candidate \
action against the goal).
Answer in exactly this format, with nothing before or after it:
<level>2</level>
<think>your reasoning at that level (for level 1 exactly: {LEVEL1_THINK})</think>
<action>one valid action</action>"""

TOOL_SYSTEM_PROMPT = f"""You can think at four levels before each action: 1 (instinctive), 2 (situational \
awareness), 3 (experience integration) and 4 (strategic planning).
Each of your turns is: the level inside <level> </level> tags, your reasoning at that level inside <think> </think> \
tags (for level 1 exactly "{LEVEL1_THINK}"), then one call of the `act` tool. Example:
<level>2</level>
<think>Current state: I am in the kitchen. Available actions: go hallway, open fridge. Reasoning: the apple may be \
in the fridge.</think>
<tool_call>
{{"name": "act", "arguments": {{"action": "open fridge"}}}}
</tool_call>"""


@dataclass
class ScriptArguments:
    """
    Arguments of the text-world RLVCR example.

    Args:
        rollout (`str`, *optional*, defaults to `"step"`):
            `"step"` (one step per completion) or `"tool"` (multi-turn tool rollouts).
        num_tasks (`int`, *optional*, defaults to `64`):
            Number of training prompts.
        task_seed (`int`, *optional*, defaults to `0`):
            Seed of the task layouts and of the plan prefixes.
        env_max_steps (`int`, *optional*, defaults to `12`):
            Step budget of an episode.
        max_history (`int`, *optional*, defaults to `3`):
            Step mode: number of past (action, observation) pairs shown in the prompt.
        full_system_prompt (`bool`, *optional*, defaults to `False`):
            Step mode: use the full `LEVEL_SYSTEM_PROMPT` (with an example per level) instead of the compact one.
    """

    rollout: str = field(default="step", metadata={"help": "'step' or 'tool'.", "choices": ["step", "tool"]})
    num_tasks: int = field(default=64, metadata={"help": "Number of training prompts."})
    task_seed: int = field(default=0, metadata={"help": "Seed of the task layouts and plan prefixes."})
    env_max_steps: int = field(default=12, metadata={"help": "Step budget of an episode."})
    max_history: int = field(default=3, metadata={"help": "Step mode: past (action, observation) pairs shown."})
    full_system_prompt: bool = field(default=False, metadata={"help": "Step mode: the full LEVEL_SYSTEM_PROMPT."})


def make_step_dataset(
    num_tasks: int, seed: int, env_max_steps: int, max_history: int, full_system_prompt: bool = False
) -> Dataset:
    """Prompts at random points of the shortest plan of random tasks (the state is replayed by the reward)."""
    rng = random.Random(seed)
    env = TextWorldEnv()
    rows = []
    for task_seed in rng.sample(range(2**31), num_tasks):
        observation = env.reset(task_seed=task_seed, max_steps=env_max_steps)
        plan = env._oracle_actions()
        prefix = plan[: rng.randrange(len(plan))]
        history = []
        for action in prefix:
            history.append((action, env.step(action)))
        lines = [f"Observation: {observation}"] if not history else []
        for action, obs in history[-max_history:]:
            lines.append(f"Your action: {action}\nObservation: {obs}")
        user = "\n\n".join(lines) + "\n\nWrite your next step."
        levels = LEVEL_SYSTEM_PROMPT if full_system_prompt else STEP_SYSTEM_PROMPT
        system = f"{levels}\n\n{TEXTWORLD_RULES.format(max_steps=env_max_steps)}\n\nYour task is to: {env.goal}."
        rows.append(
            {
                "prompt": [{"role": "system", "content": system}, {"role": "user", "content": user}],
                "task_seed": task_seed,
                "prefix": json.dumps(prefix),
                "env_max_steps": env_max_steps,
            }
        )
    return Dataset.from_list(rows)


def make_tool_dataset(num_tasks: int, seed: int, env_max_steps: int) -> Dataset:
    from trl_agentic.envs.textworld import make_textworld_tasks

    rows = make_textworld_tasks(num_tasks, seed, max_steps=env_max_steps, tool_format=True)
    for row in rows:
        rules = TEXTWORLD_RULES.format(max_steps=env_max_steps)
        row["prompt"][0]["content"] = f"{TOOL_SYSTEM_PROMPT}\n\n{rules}\n\nYour task is to: {row['goal']}."
    return Dataset.from_list(rows)


def _text(completion) -> str:
    return completion[-1]["content"] if isinstance(completion, list) else completion


def progress_reward(completions, task_seed, prefix, env_max_steps, **kwargs) -> list[float]:
    """1.0 when the step's action shortens the remaining shortest plan (or completes the task), else 0.0."""
    rewards = []
    for completion, seed, done, budget in zip(completions, task_seed, prefix, env_max_steps):
        step = parse_step(_text(completion), strict=False)
        if not isinstance(step, ParsedStep):
            rewards.append(0.0)
            continue
        env = TextWorldEnv()
        env.reset(task_seed=seed, max_steps=budget + 1)  # +1: the budget must not end the episode here
        for action in json.loads(done):
            env.step(action)
        before = len(env._oracle_actions())
        env.step(step.action)
        after = 0 if env.success else len(env._oracle_actions())
        rewards.append(1.0 if after < before else 0.0)
    return rewards


def format_reward(completions, **kwargs) -> list[float]:
    """0.1 for a well-formed step (strict: nothing around the step)."""
    return [0.1 if isinstance(parse_step(_text(c)), ParsedStep) else 0.0 for c in completions]


def main(script_args: ScriptArguments, training_args: AgenticGRPOConfig, model_args: ModelConfig):
    if training_args.advantage_estimator != "rlvcr":
        raise ValueError("This example trains with `advantage_estimator: rlvcr`.")
    model_init_kwargs = dict(training_args.model_init_kwargs or {})
    model_init_kwargs.setdefault("dtype", model_args.dtype)
    training_args.model_init_kwargs = model_init_kwargs
    if script_args.rollout == "tool":
        training_args.rlvcr_action_tag = "tool_call"  # the action of a turn is its tool call
        dataset = make_tool_dataset(script_args.num_tasks, script_args.task_seed, script_args.env_max_steps)
        extra = {"environment_factory": TextWorldToolEnv}
        reward_funcs = []  # TextWorldToolEnv.get_reward is used automatically
    else:
        dataset = make_step_dataset(
            script_args.num_tasks,
            script_args.task_seed,
            script_args.env_max_steps,
            script_args.max_history,
            script_args.full_system_prompt,
        )
        extra = {}
        reward_funcs = [progress_reward, format_reward]
    trainer = AgenticGRPOTrainer(
        model=resolve_model_path(model_args.model_name_or_path or "smollm2-135m"),
        reward_funcs=reward_funcs,
        args=training_args,
        train_dataset=dataset,
        peft_config=get_peft_config(model_args),
        **extra,
    )
    start = time.perf_counter()
    trainer.train()
    elapsed = time.perf_counter() - start
    trainer.accelerator.print(f"Trained {trainer.state.global_step} steps in {elapsed:.0f} s.")
    for log in trainer.state.log_history:
        if "loss" in log:
            keys = ("reward", "rlvcr/expanded_steps", "rlvcr/invalid_format", "rlvcr/confidence_mean")
            trainer.accelerator.print(
                f"step {log['step']}: loss={log['loss']:.4f} " + " ".join(f"{k}={log.get(k)}" for k in keys)
            )
    trainer.save_model(training_args.output_dir)


if __name__ == "__main__":
    parser = TrlParser((ScriptArguments, AgenticGRPOConfig, ModelConfig))
    main(*parser.parse_args_and_config())

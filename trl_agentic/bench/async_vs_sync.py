"""Asynchronous vs synchronous agentic GRPO: steps per hour and tokens per second, features off and on.

`python -m trl_agentic.bench.async_vs_sync [--steps N] [--json FILE] [--out FILE]`, run with the vLLM venv's
interpreter (both trainers generate through one vLLM CPU server started here, LoRA enabled). Four runs, one after the
other on the same machine and server, same task, model, LoRA and batch:

- `AgenticGRPOTrainer` (TRL's `GRPOTrainer`, `vllm_mode="server"`, trl-agentic's LoRA sync), features off / on;
- `AsyncAgenticGRPOTrainer` (TRL's `AsyncGRPOTrainer`), features off / on.

Task: the calculator word problems (a tool environment: multi-turn when the model calls the tool), LoRA r=8, 8
rollouts per step (2 problems x 4, trained in 2 micro-batches of 4), `max_completion_length` 64, up to 3 tool rounds.
"Features on" is rollback + negative samples. Two policies (`--policy`): the embedded SmolLM2-135M (which, without a
warm start, does not call the tool: single-turn rollouts, realistic model cost) and the tiny calculator policy of
`tool_policy.py` (whole turns as single tokens: multi-turn conversations with failing calls, negligible model cost:
the trainers' own overheads). Tokens are the model-generated tokens of the rows trained on (completion mask times
tool mask), counted from the batches each trainer trained on. Two clocks: the whole `train()` call (the asynchronous
trainer's includes spawning its rollout worker, which re-imports torch / transformers / vLLM), and the steady state
from the end of the first step to the end of the last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

FEATURES = dict(
    enable_tool_rollback=True,
    rollback_on_errors=["ValueError", "ZeroDivisionError", "ToolCallParseError"],
    max_tool_retries=2,
    save_negative_samples=True,
    max_negative_samples_per_group=2,
    # group_baseline at its default ("episodes", what a user gets). It decides whether the negative rows enter the
    # group's baseline (the advantages, hence the weights later steps generate with), not which rows are generated
    # or trained; docs/benchmarks.md's recorded rows (2026-11-27) were measured with "all_rows".
)
COMMON = dict(
    use_cpu=True,
    bf16=False,
    seed=0,
    learning_rate=1e-4,
    per_device_train_batch_size=4,  # micro-batches of 4 rows (memory: the machine is shared) ...
    gradient_accumulation_steps=2,  # ... 2 per optimizer step: 8 rows, one GRPO generation batch (sync)
    num_generations=4,
    max_completion_length=64,
    max_tool_calling_iterations=3,
    temperature=1.0,
    logging_steps=1,
    save_strategy="no",
    report_to="none",
    disable_tqdm=True,
    gradient_checkpointing=False,
)


def _lora():
    from peft import LoraConfig

    return LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])


POLICIES = {
    "smollm2": "SmolLM2-135M + LoRA r=8 on q/k/v/o",
    "tiny": "the tiny calculator policy (`trl_agentic.bench.tool_policy`) + LoRA r=8 on q/k/v/o",
}


class _StepClock:
    def __init__(self):
        from transformers import TrainerCallback

        clock = self

        class Callback(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                clock.ends.append(time.perf_counter())

        self.ends: list[float] = []
        self.callback = Callback()


def _sync_run(model, url, dataset, steps, features, out):
    import requests
    import torch

    from trl_agentic import AgenticGRPOConfig, AgenticGRPOTrainer
    from trl_agentic.envs.calculator import CalculatorEnv, answer_reward, tool_call_reward

    args = AgenticGRPOConfig(
        output_dir=out,
        max_steps=steps,
        use_vllm=True,
        vllm_mode="server",
        vllm_server_base_url=url,
        vllm_lora_sync=True,
        **COMMON,
        **(FEATURES if features else {}),
    )
    clock = _StepClock()
    trainer = AgenticGRPOTrainer(
        model=model,
        reward_funcs=[answer_reward, tool_call_reward],
        args=args,
        train_dataset=dataset,
        environment_factory=CalculatorEnv,
        peft_config=_lora(),
        callbacks=[clock.callback],
    )
    tokens: list[float] = []
    original = trainer._generate_and_score_completions

    def counting(inputs):
        output = original(inputs)
        mask = output["completion_mask"] * output.get("tool_mask", torch.ones_like(output["completion_mask"]))
        tokens.append(float(mask.sum()))
        return output

    trainer._generate_and_score_completions = counting
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    generation = trainer.vllm_generation
    if getattr(generation, "lora_request", None) is not None:  # free the name for the next run on this server
        requests.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": generation.lora_request.lora_name})
    history = trainer.state.log_history
    return _result("sync", features, wall, clock.ends, start, tokens, history)


def _async_run(model, url, dataset, steps, features, out):
    from trl_agentic.async_grpo import AsyncAgenticGRPOConfig, AsyncAgenticGRPOTrainer
    from trl_agentic.envs.calculator import CalculatorEnv, answer_reward, tool_call_reward

    args = AsyncAgenticGRPOConfig(
        output_dir=out,
        max_steps=steps,
        vllm_server_base_url=url,
        token_budget=0,
        max_staleness=2,
        max_inflight_tasks=16,
        **COMMON,
        **(FEATURES if features else {}),
    )
    clock = _StepClock()
    trainer = AsyncAgenticGRPOTrainer(
        model=model,
        reward_funcs=[answer_reward, tool_call_reward],
        args=args,
        train_dataset=dataset,
        environment_factory=CalculatorEnv,
        peft_config=_lora(),
        callbacks=[clock.callback],
    )
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    history = trainer.state.log_history
    tokens = [h["batch/trained_tokens_per_step"] for h in history if "batch/trained_tokens_per_step" in h]
    return _result("async", features, wall, clock.ends, start, tokens, history)


def _result(kind, features, wall, ends, start, tokens, history):
    steps = len(ends)
    steady = ends[-1] - ends[0] if steps > 1 else float("nan")

    def total(name):
        return sum(h[name] for h in history if h.get(name) is not None)

    rollbacks = total("rollback/attempts") + total("rollback/attempts_total")
    calls = [h["tools/call_frequency"] for h in history if h.get("tools/call_frequency") is not None]
    return {
        "trainer": kind,
        "features": "rollback + negatives" if features else "off",
        "steps": steps,
        "wall_s": wall,
        "first_step_s": ends[0] - start if ends else float("nan"),
        "steady_s": steady,
        "tokens": sum(tokens),
        "steady_tokens": sum(tokens[1:]),
        "steps_per_hour": 3600 * steps / wall,
        "tokens_per_s": sum(tokens) / wall,
        "steady_steps_per_hour": 3600 * (steps - 1) / steady if steps > 1 else float("nan"),
        "steady_tokens_per_s": sum(tokens[1:]) / steady if steps > 1 else float("nan"),
        "rollbacks": rollbacks,
        "tool_calls_per_rollout": sum(calls) / len(calls) if calls else 0.0,
    }


def run(steps: int = 6, policy: str = "smollm2", log=print) -> dict:
    import tempfile

    from datasets import Dataset

    from ..async_grpo.server import VLLMServer
    from ..envs.calculator import make_arithmetic_tasks
    from ..models import resolve_model_path
    from .tool_policy import build_tool_policy

    tmp = tempfile.mkdtemp(prefix="trl-agentic-async-bench-")
    if policy == "tiny":
        model = build_tool_policy(os.path.join(tmp, "tiny-calculator-policy"))
    else:
        model = resolve_model_path("smollm2-135m")
    dataset = Dataset.from_list(make_arithmetic_tasks(64, seed=0, difficulty="easy"))
    runs = []
    with VLLMServer(model, max_lora_rank=8, max_loras=6, log_path=os.path.join(tmp, "server.log")) as server:
        for kind, fn in (("sync", _sync_run), ("async", _async_run)):
            for features in (False, True):
                log(f"[async-bench] {policy}: {kind}, features {'on' if features else 'off'} ...")
                runs.append(fn(model, server.url, dataset, steps, features, os.path.join(tmp, f"{kind}-{features}")))
                log(f"[async-bench] {json.dumps(runs[-1])}")
    load = os.getloadavg()
    return {"runs": runs, "steps": steps, "policy": policy, "cpus": os.cpu_count(), "load": load}


def render(data: dict, command: str, title: str = "## Asynchronous vs synchronous trainer") -> str:
    lines = [
        title,
        "",
        f"`{command}`: {POLICIES[data.get('policy', 'smollm2')]}, calculator tool task, 8 rollouts per step, "
        f"{data['steps']} steps per run, one vLLM CPU server for all four runs, {data['cpus']} CPU cores "
        f"(load average at the end {data['load'][0]:.1f} / {data['load'][1]:.1f} / {data['load'][2]:.1f}). "
        "Tokens: model-generated tokens of the rows trained on. Whole run: the `train()` call; steady: end of the "
        "first step to end of the last.",
        "",
        "| trainer | features | steps/hour (whole) | tokens/s (whole) | steps/hour (steady) | tokens/s (steady) "
        "| first step s | tool calls / rollout | rollbacks |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in data["runs"]:
        lines.append(
            f"| {r['trainer']} | {r['features']} | {r['steps_per_hour']:.0f} | {r['tokens_per_s']:.1f} | "
            f"{r['steady_steps_per_hour']:.0f} | {r['steady_tokens_per_s']:.1f} | {r['first_step_s']:.1f} | "
            f"{r['tool_calls_per_rollout']:.2f} | {r['rollbacks']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trl_agentic.bench.async_vs_sync")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--policy", choices=sorted(POLICIES), default="smollm2")
    parser.add_argument("--json", help="Write the raw results here.")
    parser.add_argument("--out", help="Write the markdown section here.")
    args = parser.parse_args(argv)
    data = run(args.steps, args.policy, log=lambda m: print(m, file=sys.stderr, flush=True))
    command = f"python -m trl_agentic.bench.async_vs_sync --steps {args.steps} --policy {args.policy}"
    section = render(data, command, title=f"### {POLICIES[args.policy]}")
    data["section"] = section
    if args.json:
        with open(args.json, "w") as f:
            json.dump(data, f, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(section)
    print(section)
    return 0


if __name__ == "__main__":
    sys.exit(main())

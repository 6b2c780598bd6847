"""The asynchronous TracIn refresh: its validation trajectories one at a time against all at once, side by side.

`python -m trl_agentic.bench.async_tracin_refresh [--policy smollm2|tiny] [--repeats N] [--json FILE]`, run with the
vLLM venv's interpreter. One vLLM CPU server (LoRA enabled) and one `AsyncAgenticGRPOTrainer` with TracIn, rollback
and negative samples on the calculator task (`ToolCallBonusCalculatorEnv`, `answer_reward`), its adapter synced to the
server once, as at the start of training. Then, alternating, `repeats` times each: the refresh's validation rollouts
(`AsyncTracIn._validation_rollouts`, `tracin_val_batch_size` 2 x `tracin_val_num_generations` 4, the recorded live
run's settings) with `ValidationRollouts.max_parallel = 1` (one trajectory after another, each request waiting for
the last, as the refresh ran before; the requests' per-turn limits are today's in both arms) and with every
trajectory at once (the default). Both arms draw the same validation prompts and request seeds (the rollout counter
is reset before each), so they ask the server for the same samples. Nothing else runs on the server: in training,
TRL's rollout worker keeps it busy beside the refresh, which this leaves out. Also left out: the refresh's forward
and V's backward (trainer-side compute the change does not touch).
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

POLICIES = {
    "smollm2": "SmolLM2-135M + LoRA r=8 on q/k/v/o (no warm start: it rarely calls the tool)",
    "tiny": "the tiny calculator policy (`trl_agentic.bench.tool_policy`) + LoRA r=8 on q/k/v/o (multi-turn)",
}
MODES = {"one at a time": 1, "all at once": None}


def _trainer(model: str, url: str, out: str):
    from datasets import Dataset
    from peft import LoraConfig

    from ..async_grpo import AsyncAgenticGRPOConfig, AsyncAgenticGRPOTrainer
    from ..envs.calculator import ToolCallBonusCalculatorEnv, answer_reward, make_arithmetic_tasks

    args = AsyncAgenticGRPOConfig(
        output_dir=out,
        use_cpu=True,
        bf16=False,
        seed=0,
        max_steps=1,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=96,
        max_tool_calling_iterations=3,
        temperature=1.0,
        report_to="none",
        disable_tqdm=True,
        gradient_checkpointing=False,
        vllm_server_base_url=url,
        token_budget=0,
        enable_tool_rollback=True,
        rollback_on_errors=["ValueError", "ZeroDivisionError", "ToolCallParseError"],
        max_tool_retries=2,
        save_negative_samples=True,
        max_negative_samples_per_group=2,
        tracin_enabled=True,
        tracin_val_batch_size=2,
        tracin_val_num_generations=4,
    )
    trainer = AsyncAgenticGRPOTrainer(
        model=model,
        reward_funcs=[answer_reward],
        args=args,
        train_dataset=Dataset.from_list(make_arithmetic_tasks(16, seed=0, difficulty="easy")),
        environment_factory=ToolCallBonusCalculatorEnv,
        peft_config=LoraConfig(
            r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]
        ),
        tracin_eval_dataset=Dataset.from_list(make_arithmetic_tasks(8, seed=1, difficulty="easy")),
    )
    # What TRL's trainer does at the start of training (its `on_train_begin`): the adapter reaches the server, so
    # that the validation requests use the current policy's adapter, as in training.
    if trainer.weight_transfer is not None:
        trainer.weight_transfer.init_weight_transfer()
    trainer._sync_weight()
    return trainer


def _measure(tracin, mode: str) -> dict:
    import numpy as np

    tracin.validation.max_parallel = MODES[mode]
    tracin.refreshes = 0  # the same validation prompts and request seeds in every measurement
    start = time.perf_counter()
    rows, rewards = tracin._validation_rollouts()
    seconds = time.perf_counter() - start
    # Model tokens of the trajectories (the completion mask is 1 on them, 0 on the prompt and the tools' tokens).
    tokens = int(sum(int(np.asarray(r["completion_mask"]).sum()) for r in rows))
    return {
        "mode": mode,
        "seconds": seconds,
        "rows": len(rows),  # validation rows: a regular row per trajectory and its negative and snapshot rows
        "tokens": tokens,
        "mean_reward": float(np.nanmean(rewards)),
    }


def run(policy: str = "smollm2", repeats: int = 3, log=print) -> dict:
    import tempfile

    from ..async_grpo.server import VLLMServer
    from ..models import resolve_model_path
    from .tool_policy import build_tool_policy

    tmp = tempfile.mkdtemp(prefix="trl-agentic-tracin-refresh-bench-")
    model = build_tool_policy(os.path.join(tmp, "tiny")) if policy == "tiny" else resolve_model_path("smollm2-135m")
    measurements = []
    with VLLMServer(model, max_lora_rank=8, max_loras=6, log_path=os.path.join(tmp, "server.log")) as server:
        tracin = _trainer(model, server.url, os.path.join(tmp, "out"))._tracin
        _measure(tracin, "all at once")  # warm-up (first requests, adapter load), not recorded
        for _ in range(repeats):
            for mode in MODES:
                measurements.append(_measure(tracin, mode))
                log(f"[tracin-refresh-bench] {policy}: {json.dumps(measurements[-1])}")
    return {
        "policy": policy,
        "repeats": repeats,
        "measurements": measurements,
        "cpus": os.cpu_count(),
        "load": os.getloadavg(),
    }


def _medians(data: dict) -> dict:
    import statistics

    return {m: statistics.median(x["seconds"] for x in data["measurements"] if x["mode"] == m) for m in MODES}


def speedup(data: dict) -> float:
    """Median seconds one at a time over median seconds all at once."""
    median = _medians(data)
    return median["one at a time"] / median["all at once"]


def render(data: dict, command: str) -> str:
    by_mode = {m: [x for x in data["measurements"] if x["mode"] == m] for m in MODES}
    median = _medians(data)
    lines = [
        f"### {POLICIES[data['policy']]}",
        "",
        f"`{command}`: {data['repeats']} measurements per mode, alternating, one vLLM CPU server, {data['cpus']} CPU "
        f"cores (load average at the end {data['load'][0]:.1f} / {data['load'][1]:.1f} / {data['load'][2]:.1f}); "
        "2 validation prompts x 4 trajectories, the same prompts and request seeds in every measurement.",
        "",
        "| validation trajectories | seconds (median) | seconds (each) | model tokens (each) | mean reward (each) |",
        "|---|---:|---|---|---|",
    ]
    for mode, xs in by_mode.items():
        seconds = ", ".join(f"{x['seconds']:.1f}" for x in xs)
        tokens = ", ".join(str(x["tokens"]) for x in xs)
        rewards = ", ".join(f"{x['mean_reward']:.3f}" for x in xs)
        lines.append(f"| {mode} | {median[mode]:.1f} | {seconds} | {tokens} | {rewards} |")
    lines += [
        "",
        f"One at a time / all at once (medians): **{speedup(data):.2f}x**.",
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trl_agentic.bench.async_tracin_refresh")
    parser.add_argument("--policy", choices=sorted(POLICIES), default="smollm2")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="Write the raw results (and the markdown section) here.")
    args = parser.parse_args(argv)
    data = run(args.policy, args.repeats, log=lambda m: print(m, file=sys.stderr, flush=True))
    command = f"python -m trl_agentic.bench.async_tracin_refresh --policy {args.policy} --repeats {args.repeats}"
    data["section"] = render(data, command)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(data, f, indent=2)
    print(data["section"])
    return 0


if __name__ == "__main__":
    sys.exit(main())

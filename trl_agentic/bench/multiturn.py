"""Benchmark: whole GRPO steps of multi-turn tool tasks with prefix caching on vs off, and with the per-turn cap.

For each task (the log search, the text world, BFCL multi-turn; their configs in `configs/`), one warm start (the
config's SFT stage, so that the policy makes tool calls as in a real run) is saved once, then each variant trains one
GRPO step from that same adapter, with the same seed, in its own subprocess:

- `off`: `transformers_prefix_caching=False`: TRL's generation, every turn from the whole conversation;
- `reuse`: prefix caching (the default): the same sampled tokens as `off` up to float rounding, only the prefill
  differs, so `off` vs `reuse` is the share of prefix reuse;
- `reuse_cap`: prefix caching plus `max_turn_tokens` (256 unless `--cap`): the share of the per-turn cap (it changes
  the rollouts: turns that would have run longer are cut and end their rollout).

Reported per variant: the wall time of the whole step (`Trainer.train` for one step: generation, tools, rewards,
loss, backward, optimizer), the time spent in generation calls and the tokens they generated (tokens per second),
and what the cache saved. Results go to a JSON file after every cell and are reused when the run is started again
(`--json`), so a long run can be resumed.

Run `python -m trl_agentic.bench.multiturn [--tasks ...] [--json FILE] [--out FILE]` (or `make bench`, section
`multiturn`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

TASKS = {
    # task: (config, overrides for the bench)
    # Warm start on 2 traces per step instead of 4: half the memory (the config's peaks at ~7 GB on this machine).
    "logsearch": ("configs/snapshots_logsearch.yaml", ["--warmstart_batch_size", "2"]),
    "textworld": ("configs/rlvcr_textworld.yaml", []),
    # The run recorded in docs/bfcl.md (8 SFT steps, bf16 autocast), no held-out evaluation.
    "bfcl": ("configs/bfcl.yaml", ["--warmstart_steps", "8", "--bf16", "true"]),
}
VARIANTS = ("reuse_cap", "reuse", "off", "vllm")
DEFAULT_VARIANTS = ("reuse_cap", "reuse", "off")
LABELS = {
    "off": "TRL generation (whole history every turn)",
    "reuse": "prefix caching",
    "reuse_cap": "prefix caching + per-turn cap",
    "vllm": "vLLM CPU build, colocate, LoRA sync",
}
# vLLM's context limit per task (prompt + whole rollout) and its CPU KV-cache size (GiB).
VLLM_CONTEXT = {"logsearch": 4096, "textworld": 2048, "bfcl": 8192}


def _root() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _parse(task: str, workdir: str, extra: list[str]):
    from ..cli import make_parser

    config, overrides = TASKS[task]
    argv = [
        "--config",
        os.path.join(_root(), config),
        *overrides,
        "--max_steps",
        "1",
        "--heldout_eval",
        "false",
        "--write_report",
        "false",
        "--output_dir",
        os.path.join(workdir, task),
        "--disable_tqdm",
        "true",
        *extra,
    ]
    return make_parser().parse_args_and_config(args=argv)


def _child_warmstart(task: str, workdir: str) -> dict:
    from trl import get_peft_config

    from ..cli import _load
    from ..models import resolve_model_path
    from ..tasks import build_task
    from ..warmstart import run_task_warmstart

    task_args, args, model_args = _parse(task, workdir, [])
    built = build_task(task_args)
    model_path = resolve_model_path(model_args.model_name_or_path)
    model, tokenizer = _load(model_path, {"dtype": model_args.dtype})
    started = time.perf_counter()
    result = run_task_warmstart(
        model,
        tokenizer,
        built,
        task_args,
        peft_config=get_peft_config(model_args),
        output_dir=os.path.join(workdir, task, "warmstart"),
        seed=args.seed,
        use_cpu=args.use_cpu,
        bf16=args.bf16,
        compact_progress=False,
    )
    adapter = os.path.join(workdir, task, "adapter")
    result.model.save_pretrained(adapter)
    losses = [e["loss"] for e in result.log_history if "loss" in e]
    return {"adapter": adapter, "seconds": time.perf_counter() - started, "losses": [losses[0], losses[-1]]}


def _child_step(task: str, workdir: str, variant: str, cap: int) -> dict:
    import torch
    from peft import PeftModel

    from ..cli import _load
    from ..models import resolve_model_path
    from ..tasks import build_task
    from ..trainer import AgenticGRPOTrainer

    extra = ["--transformers_prefix_caching", "false" if variant == "off" else "true"]
    if variant == "vllm":
        extra += ["--use_vllm", "true", "--vllm_mode", "colocate", "--vllm_gpu_memory_utilization", "0.1"]
        extra += ["--vllm_max_model_length", str(VLLM_CONTEXT[task])]
    if variant == "reuse_cap":
        extra += ["--max_turn_tokens", str(cap)]
    task_args, args, model_args = _parse(task, workdir, extra)
    args.model_init_kwargs = None
    built = build_task(task_args)
    base, tokenizer = _load(resolve_model_path(model_args.model_name_or_path), {"dtype": model_args.dtype})
    model = PeftModel.from_pretrained(base, os.path.join(workdir, task, "adapter"), is_trainable=True)
    trainer = AgenticGRPOTrainer(
        model=model,
        reward_funcs=built.reward_funcs,
        args=args,
        train_dataset=built.train_dataset,
        environment_factory=built.environment_factory,
        tools=built.tools or None,
        processing_class=tokenizer,
    )
    generation = {"seconds": 0.0, "cpu_s": 0.0, "tokens": 0, "calls": 0, "contexts": 0, "context_tokens": 0}
    original = trainer._generate_single_turn

    def timed(prompt_ids, *rest, **kwargs):
        start, start_cpu = time.perf_counter(), time.process_time()
        ids, logprobs = original(prompt_ids, *rest, **kwargs)
        generation["seconds"] += time.perf_counter() - start
        generation["cpu_s"] += time.process_time() - start_cpu
        generation["tokens"] += sum(len(x) for x in ids)
        generation["calls"] += 1
        generation["contexts"] += len(prompt_ids)
        generation["context_tokens"] += sum(len(x) for x in prompt_ids)
        return ids, logprobs

    trainer._generate_single_turn = timed
    loop_stats = []
    original_loop = trainer._tool_call_loop

    def loop(*a, **k):
        out = original_loop(*a, **k)
        if trainer._last_loop_result is not None:
            loop_stats.append(dict(vars(trainer._last_loop_result.stats)))
        return out

    trainer._tool_call_loop = loop
    cache_stats = []
    if trainer._prefix_cache is not None:
        original_log = trainer._log_prefix_cache

        def log_cache(stats):
            cache_stats.append({**vars(stats), "prefilled_tokens": stats.prefilled_tokens})
            original_log(stats)

        trainer._log_prefix_cache = log_cache
    torch.manual_seed(args.seed)
    started, started_cpu = time.perf_counter(), time.process_time()
    trainer.train()
    step, step_cpu = time.perf_counter() - started, time.process_time() - started_cpu
    logs = [h for h in trainer.state.log_history if "loss" in h]
    totals = {}
    for stats in loop_stats:
        for key, value in stats.items():
            totals[key] = totals.get(key, 0) + value
    return {
        "step_s": step,
        "step_cpu_s": step_cpu,  # CPU time of the process (all threads): less sensitive to other jobs than wall time
        "threads": torch.get_num_threads(),
        "load_during": [round(x, 1) for x in os.getloadavg()],
        "generation": generation,
        "loop": {k: totals.get(k, 0) for k in ("truncated_turns", "turn_cap_truncations", "generation_calls")},
        "cache": cache_stats,
        "caching_active": trainer._prefix_cache is not None,
        "reward": logs[-1].get("reward") if logs else None,
        "completion_length": logs[-1].get("completions/mean_length") if logs else None,
        "rollouts": args.per_device_train_batch_size * args.gradient_accumulation_steps,
    }


def _run_child(argv: list[str], log, python: str | None = None) -> dict:
    command = [python or sys.executable, "-m", "trl_agentic.bench.multiturn", *argv]
    log(f"[multiturn] {' '.join(argv)}")
    env = {**os.environ, "PYTHONPATH": _root()}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")  # vLLM on CPU: a fixed KV cache instead of a share of the RAM
    result = subprocess.run(command, capture_output=True, text=True, check=False, cwd=_root(), env=env)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed:\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def run(tasks, variants, cap: int, workdir: str, json_path: str | None, log=print, vllm_python=None) -> dict:
    data = {"cap": cap, "cells": {}}
    if json_path and os.path.exists(json_path):
        with open(json_path) as f:
            data = json.load(f)
    data.setdefault("cells", {})

    def save():
        if json_path:
            with open(json_path, "w") as f:
                json.dump(data, f, indent=1)

    for task in tasks:
        cells = data["cells"].setdefault(task, {})
        if not os.path.exists(os.path.join(workdir, task, "adapter", "adapter_config.json")):
            cells["warmstart"] = _run_child(["--child", "warmstart", "--task", task, "--workdir", workdir], log)
            save()
        for variant in variants:
            if variant in cells and "error" not in cells[variant]:
                continue
            try:
                if variant == "vllm" and not (vllm_python and os.path.exists(vllm_python)):
                    raise RuntimeError(f"no vLLM interpreter at {vllm_python!r} (`make install-vllm`)")
                cells[variant] = _run_child(
                    ["--child", "step", "--task", task, "--workdir", workdir, "--variant", variant, "--cap", str(cap)],
                    log,
                    python=vllm_python if variant == "vllm" else None,
                )
            except RuntimeError as e:
                cells[variant] = {"error": str(e)[-2000:]}
            cells[variant]["finished"] = time.strftime("%Y-%m-%d %H:%M")
            log(f"[multiturn] {task} {variant}: {json.dumps(cells[variant])[:400]}")
            save()
    load = os.getloadavg()
    data["load_at_end"] = [round(x, 1) for x in load]
    save()
    return data


def _minutes(seconds: float) -> str:
    whole = round(seconds)
    return f"{whole // 60} min {whole % 60:02d} s" if whole >= 60 else f"{whole} s"


def render(data: dict, command: str) -> str:
    cap = data.get("cap", 256)
    lines = [
        "## Multi-turn GRPO steps: prefix caching and the per-turn cap",
        "",
        f"Command: `{command}`. SmolLM2-135M + LoRA (each config's warm start, saved once, then one GRPO step per "
        "variant from that adapter, same seed, each in its own process), CPU. *Step*: `Trainer.train` for one step "
        "(generation, tools, rewards, the loss's forward and backward, the optimizer), wall and CPU time of the "
        "process; *generation*: the time inside `_generate_single_turn` (every turn of every rollout) and the "
        f"tokens it returned. Cap: `max_turn_tokens={cap}`.",
        "",
        "| task | variant | step wall | step CPU | generation wall | generation CPU | generated tokens | tokens/s "
        "(wall) | tokens/s (CPU) | prefilled / context tokens | turns cut by the cap | step CPU vs off |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for task, cells in data["cells"].items():
        off = cells.get("off", {}).get("step_cpu_s")
        for variant in VARIANTS:
            c = cells.get(variant)
            if c is None:
                continue
            if "error" in c:
                lines.append(f"| {task} | {LABELS[variant]} | failed: {c['error'][-200:]!r} | | | | | | | | |")
                continue
            g = c["generation"]
            prefilled = sum(s["prefilled_tokens"] for s in c["cache"]) if c["cache"] else g["context_tokens"]
            # vLLM's engine runs in processes of its own: this process's CPU time leaves most of its work out.
            cpu = c.get("step_cpu_s") if variant != "vllm" else None
            gen_cpu = g.get("cpu_s") if variant != "vllm" else None
            ratio = f"{cpu / off:.2f}" if off and cpu else "–"
            lines.append(
                f"| {task} | {LABELS[variant]} | {_minutes(c['step_s'])} | {_minutes(cpu) if cpu else '–'} | "
                f"{_minutes(g['seconds'])} | {_minutes(gen_cpu) if gen_cpu else '–'} | {g['tokens']} | "
                f"{g['tokens'] / max(g['seconds'], 1e-9):.1f} | "
                f"{f'{g_tps:.1f}' if (g_tps := g['tokens'] / gen_cpu if gen_cpu else None) else '–'} | "
                f"{prefilled if variant != 'vllm' else '–'} / {g['context_tokens']} | "
                f"{c['loop'].get('turn_cap_truncations', 0)} | {ratio} |"
            )
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trl_agentic.bench.multiturn", description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", nargs="+", choices=list(TASKS), default=list(TASKS))
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(DEFAULT_VARIANTS))
    parser.add_argument("--vllm-python", default=".venv-vllm/bin/python", help="Interpreter of the `vllm` variant.")
    parser.add_argument("--cap", type=int, default=256, help="max_turn_tokens of the `reuse_cap` variant.")
    parser.add_argument("--workdir", default="/tmp/trl_agentic_bench/multiturn")
    parser.add_argument("--json", help="Results file (read first: finished cells are not run again).")
    parser.add_argument("--out", help="Write the markdown section here.")
    parser.add_argument("--child", choices=("warmstart", "step"), help=argparse.SUPPRESS)
    parser.add_argument("--task", help=argparse.SUPPRESS)
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child == "warmstart":
        print(json.dumps(_child_warmstart(args.task, args.workdir)))
        return 0
    if args.child == "step":
        print(json.dumps(_child_step(args.task, args.workdir, args.variant, args.cap)))
        return 0
    os.makedirs(args.workdir, exist_ok=True)
    data = run(
        args.tasks,
        args.variants,
        args.cap,
        args.workdir,
        args.json,
        log=lambda m: print(m, file=sys.stderr),
        vllm_python=args.vllm_python,
    )
    text = render(data, "python -m trl_agentic.bench.multiturn " + " ".join(argv or sys.argv[1:]))
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

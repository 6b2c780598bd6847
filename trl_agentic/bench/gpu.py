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
  (generation, rewards, loss, backward, AdamW), stepped alternately; every step split into phases (batch:
  generate-and-score, of which `_generate_single_turn`/`model.generate`, rewards, no-grad log-probabilities; loss
  forward; backward; optimizer) by timing wrappers that synchronise the GPU, with the tokens generated; with
  `--profile`, one more step of each under `torch.profiler` (top ops, host-device syncs, the ops that differ most);
- `tracin_memory`: peak GPU memory (`torch.cuda.max_memory_allocated`) of one TracIn step at its defaults (the fused
  step, V refreshed in the window) vs a plain GRPO step, gradient checkpointing on, one synthetic batch;
- `prefix_reuse`: a multi-turn rollout (8 conversations, tool results appended after every turn) generated with
  `transformers_prefix_caching` on vs TRL's generation from the whole history, the two interleaved turn by turn
  on the same contexts, after one untimed call per path at turn 0's shapes; time (per turn too), tokens per second
  and how many turns produced the same greedy tokens;
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
# Steps of one cycle of TracIn's default schedule: V every `tracin_val_refresh_steps` (4), validation rollouts every
# `tracin_val_rollout_steps` (8); their least common multiple (the device has no TRL to read the config from: a test
# checks it against `AgenticGRPOConfig`'s defaults).
SCHEDULE_CYCLE = 8


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
    profile: bool = False  # `--profile`: one more step of each trainer in `features_off`, under `torch.profiler`

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
    """One optimizer step as `Trainer.train` runs it (generation included); wall seconds.

    With a `PhaseTimer` installed (`trainer._bench_timer`, enabled) its phases are this step's only, the optimizer
    step among them.
    """
    batch = next(trainer._bench_batches)
    timer = getattr(trainer, "_bench_timer", None)
    timer = timer if timer is not None and timer.enabled else None
    if timer is not None:
        timer.reset()
    _sync()
    start = time.perf_counter()
    trainer.training_step(trainer.model, batch, None)
    if timer is not None:
        _sync()
        optimizer_start = time.perf_counter()
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    trainer.state.global_step += 1
    _sync()
    end = time.perf_counter()
    if timer is not None:
        timer.seconds["optimizer"] = end - optimizer_start
        timer.calls["optimizer"] = 1
    return end - start


# Methods timed in `features_off` (attribute, phase): wrapped on the instance, so the outermost override of each (ours
# or TRL's) is timed once per call, whatever `super()` chain it runs. TRL 1.16's step: `training_step` ->
# `_prepare_inputs` -> `_generate_and_score_completions` -> `_generate` -> `_generate_single_turn` (-> `model.generate`),
# then `_calculate_rewards` and, when needed, no-grad log-probabilities; then `compute_loss`, `accelerator.backward`.
TIMED_METHODS = (
    ("_prepare_inputs", "prepare_inputs"),
    ("_generate_and_score_completions", "generate_and_score"),
    ("_generate_single_turn", "generate"),
    ("_calculate_rewards", "rewards"),
    ("_get_per_token_logps_and_entropies", "logps"),  # named after the phase it runs in (see `PhaseTimer.wrap`)
    ("compute_loss", "loss_forward"),
)
# The rows of the phase table: (key, label); the keys of `derive_phases`, parts indented under their whole.
PHASE_ROWS = (
    ("step", "whole step"),
    ("prepare_inputs", "batch (`_prepare_inputs`)"),
    ("generate_and_score", "&nbsp;&nbsp;`_generate_and_score_completions`"),
    ("generate", "&nbsp;&nbsp;&nbsp;&nbsp;`_generate_single_turn` (all calls)"),
    ("model_generate", "&nbsp;&nbsp;&nbsp;&nbsp;&nbsp;&nbsp;of which `model.generate`"),
    ("logps_in_generate_and_score", "&nbsp;&nbsp;&nbsp;&nbsp;no-grad log-probabilities"),
    ("rewards", "&nbsp;&nbsp;&nbsp;&nbsp;`_calculate_rewards`"),
    ("score_rest", "&nbsp;&nbsp;&nbsp;&nbsp;rest (tokenizing, decoding, advantages, augment/select)"),
    ("prepare_rest", "&nbsp;&nbsp;rest of `_prepare_inputs` (shuffle, split)"),
    ("loss_forward", "loss: `compute_loss` (forward + loss)"),
    ("logps_in_loss_forward", "&nbsp;&nbsp;of which the log-probability forward"),
    ("backward", "backward (`accelerator.backward`)"),
    ("optimizer", "optimizer step + `zero_grad`"),
    ("step_rest", "rest of the step"),
)
# Host-device synchronisations (and copies) counted in `--profile`.
SYNC_OPS = (
    "aten::_local_scalar_dense",
    "aten::item",
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaMemcpyAsync",
)


class PhaseTimer:
    """Wall seconds and calls of named trainer methods within one step, `_sync()`-ed before every clock read.

    The synchronisations make the split honest (a phase's GPU work is charged to it, not to whoever waits next);
    both trainers pay them alike. A method called within a timed call of itself is not timed again.
    """

    def __init__(self):
        self.enabled = True
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.active: list[str] = []
        self.batch = None  # the last batch `_generate_and_score_completions` returned (its token counts)

    def reset(self) -> None:
        self.seconds, self.calls, self.active, self.batch = {}, {}, [], None

    def wrap(self, owner, attribute: str, phase: str) -> None:
        """Replace `owner.attribute` (a bound method) by a timed one; `logps` is named after the enclosing phase."""
        original = getattr(owner, attribute)

        def timed(*args, **kwargs):
            name = f"{phase}_in_{self.active[-1] if self.active else 'step'}" if phase == "logps" else phase
            if not self.enabled or name in self.active:
                return original(*args, **kwargs)
            self.active.append(name)
            _sync()
            start = time.perf_counter()
            try:
                result = original(*args, **kwargs)
                _sync()
            finally:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
                self.calls[name] = self.calls.get(name, 0) + 1
                self.active.pop()
            if phase == "generate_and_score":
                self.batch = result
            return result

        setattr(owner, attribute, timed)


def install_phase_timer(trainer) -> PhaseTimer:
    """Time `TIMED_METHODS`, the model's `generate` and the accelerator's `backward` on this trainer's instances."""
    timer = PhaseTimer()
    for attribute, phase in TIMED_METHODS:
        timer.wrap(trainer, attribute, phase)
    # `unwrap_model_for_generation` yields the PEFT model itself here (one process, no DeepSpeed/FSDP).
    timer.wrap(trainer.accelerator.unwrap_model(trainer.model), "generate", "model_generate")
    timer.wrap(trainer.accelerator, "backward", "backward")
    trainer._bench_timer = timer
    return timer


def derive_phases(step_s: float, seconds: dict[str, float]) -> dict[str, float]:
    """The rows of `PHASE_ROWS` from one step's timed methods: the measured ones plus the rests (whole − parts)."""
    get = seconds.get
    phases = {"step": step_s, **seconds}
    phases["score_rest"] = get("generate_and_score", 0.0) - sum(
        get(k, 0.0) for k in ("generate", "logps_in_generate_and_score", "rewards")
    )
    phases["prepare_rest"] = get("prepare_inputs", 0.0) - get("generate_and_score", 0.0)
    phases["step_rest"] = step_s - sum(
        get(k, 0.0) for k in ("prepare_inputs", "loss_forward", "backward", "optimizer")
    )
    return phases


def batch_tokens(trainer, timer: PhaseTimer) -> dict:
    """Token counts of the step's generated batch, and TRL's own `completions/mean_length` metric."""
    batch, counts = timer.batch, {}
    if isinstance(batch, dict) and "completion_mask" in batch:
        mask = batch["completion_mask"]
        counts = {
            "rows": int(mask.shape[0]),
            "completion_tokens": int(mask.sum()),
            "completion_width": int(mask.shape[1]),  # padded: what the loss forward and backward process
        }
        if "prompt_mask" in batch:
            counts["prompt_tokens"] = int(batch["prompt_mask"].sum())
            counts["prompt_width"] = int(batch["prompt_mask"].shape[1])
    lengths = trainer._metrics["train"].get("completions/mean_length")
    if lengths:
        counts["metric_mean_length"] = float(lengths[-1])
    counts["generate_calls"] = timer.calls.get("generate", 0)
    return counts


def profile_step(trainer) -> dict:
    """One more step under `torch.profiler` (phase timers off: their syncs would count): the top ops and the syncs."""
    from torch.profiler import ProfilerActivity, profile

    on_gpu = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    timer = getattr(trainer, "_bench_timer", None)
    if timer is not None:
        timer.enabled = False
    try:
        with profile(activities=activities, record_shapes=False) as prof:
            seconds = one_step(trainer)
    finally:
        if timer is not None:
            timer.enabled = True
    start = time.perf_counter()
    try:
        events = prof.profiler.kineto_results.events()
        ops = aggregate_events(events)
    except AttributeError:  # another torch's raw events: its own (slow) averages
        events = prof.events()
        ops = {
            e.key: [e.count, e.self_cpu_time_total / 1000, getattr(e, "self_device_time_total", 0.0) / 1000]
            for e in prof.key_averages()
        }
    by = 2 if on_gpu else 1  # self CUDA time on a GPU, self CPU time otherwise

    def top(index: int) -> list[dict]:
        names = sorted(ops, key=lambda name: -ops[name][index])[:25]
        return [{"name": n, "calls": ops[n][0], "self_cpu_ms": ops[n][1], "self_cuda_ms": ops[n][2]} for n in names]

    return {
        "step_s": seconds,  # with the profiler's overhead
        "events": len(events),
        "analysis_s": time.perf_counter() - start,
        "sorted_by": "self_cuda_ms" if on_gpu else "self_cpu_ms",
        "top": top(by),
        "top_cpu": top(1),  # a GPU step can be bound by the CPU launching kernels
        "syncs": {name: ops.get(name, [0])[0] for name in SYNC_OPS},
        "self_cpu_total_ms": sum(v[1] for v in ops.values()),
        "self_cuda_total_ms": sum(v[2] for v in ops.values()),
        "ops": ops,  # every op: [calls, self CPU ms, self CUDA ms]
    }


# Not ops: the profiler's own bookkeeping (as `torch.autograd.profiler_util._filter_name` drops them).
_PROFILER_NAMES = frozenset(
    (
        "[memory]",
        "[OutOfMemory]",
        "profiler::_record_function_enter",
        "profiler::_record_function_enter_new",
        "profiler::_record_function_exit",
        "aten::is_leaf",
        "aten::output_nr",
        "aten::_version",
    )
)


def aggregate_events(events) -> dict[str, list]:
    """`{name: [calls, self CPU ms, self CUDA ms]}` from the profiler's raw events.

    `prof.key_averages()` builds a Python object per event (~40 µs each: minutes for the millions of a full-size step);
    this reads the raw events once. Self CPU time: an op's span minus its direct children's on the same thread (CUDA
    runtime calls such as `cudaLaunchKernel` are CPU events, children of the op that made them); self CUDA time: the
    span of each kernel, copy or memset, under its own name (so the CUDA total is the GPU's busy time, counted once).
    """
    from torch.autograd import DeviceType

    ops: dict[str, list] = {}
    spans: dict[int, list] = {}  # thread -> [(start, -end, name)] of its synchronous CPU events
    for event in events:
        name = event.name()
        if name in _PROFILER_NAMES or getattr(event, "is_hidden_event", lambda: False)():
            continue
        begin, end = event.start_ns(), event.end_ns()
        if event.device_type() == DeviceType.CPU:
            row = ops.setdefault(name, [0, 0.0, 0.0])
            if event.is_async() or event.start_thread_id() != event.end_thread_id():
                row[0] += 1
                row[1] += (end - begin) / 1e6  # not nested in the thread's stack
            else:  # counted below
                spans.setdefault(event.start_thread_id(), []).append((begin, -end, name))
        elif not event.is_user_annotation():  # GPU mirrors of `record_function` ranges would count kernels twice
            row = ops.setdefault(name, [0, 0.0, 0.0])
            row[0] += 1
            row[2] += (end - begin) / 1e6
    for thread_spans in spans.values():
        thread_spans.sort()  # by start, the longer (outer) first
        stack: list[list] = []  # [end, name, span, children's span]
        for begin, negative_end, name in thread_spans:
            while stack and stack[-1][0] <= begin:
                done = stack.pop()
                ops[done[1]][1] += max(done[2] - done[3], 0) / 1e6
            if stack and stack[-1][1] == name:
                continue  # an op calling its namesake (`aten::sum` -> `aten::sum`): one call, as `key_averages` says
            ops[name][0] += 1
            if stack:
                stack[-1][3] += -negative_end - begin
            stack.append([-negative_end, name, -negative_end - begin, 0])
        for done in stack:
            ops[done[1]][1] += max(done[2] - done[3], 0) / 1e6
    return ops


def profile_diff(trl: dict, ours: dict, n: int = 15) -> list[dict]:
    """The `n` ops whose self time (CPU or CUDA, whichever differs more) differs most between the two profiles."""
    rows = []
    for name in set(trl["ops"]) | set(ours["ops"]):
        a, b = trl["ops"].get(name, [0, 0.0, 0.0]), ours["ops"].get(name, [0, 0.0, 0.0])
        rows.append(
            {
                "name": name,
                "calls": [a[0], b[0]],
                "self_cpu_ms": [a[1], b[1]],
                "self_cuda_ms": [a[2], b[2]],
                "diff_ms": max(b[1] - a[1], b[2] - a[2], key=abs),
            }
        )
    return sorted(rows, key=lambda r: -abs(r["diff_ms"]))[:n]


# ----------------------------------------------------------------------------------------------------- sections


def features_off(settings: Settings, out: dict, output_dir: str, tok) -> None:
    """AgenticGRPOTrainer (features off) vs GRPOTrainer, whole steps, alternately; after one warm-up step each.

    Every step is split into phases (`PhaseTimer`, `PHASE_ROWS`) and its batch's tokens counted; with
    `settings.profile`, one more step of each trainer then runs under `torch.profiler` (`profile_step`).
    """
    trainers = {
        "trl": make_trainer("trl", settings, output_dir, tok),
        "ours": make_trainer("ours", settings, output_dir, tok),
    }
    timers = {name: install_phase_timer(trainer) for name, trainer in trainers.items()}
    out["steps"] = {name: [] for name in trainers}
    out["phases"] = {name: [] for name in trainers}
    out["calls"] = {name: [] for name in trainers}
    out["tokens"] = {name: [] for name in trainers}
    for step in range(settings.step_rounds + 1):
        order = list(trainers) if step % 2 == 0 else list(reversed(trainers))
        for name in order:
            seconds = one_step(trainers[name])
            tokens = batch_tokens(trainers[name], timers[name])
            _log(f"features_off step {step} {name}: {seconds:.2f} s, {json.dumps(tokens)}")
            if step > 0:
                out["steps"][name].append(seconds)
                out["phases"][name].append(derive_phases(seconds, timers[name].seconds))
                out["calls"][name].append(dict(timers[name].calls))
                out["tokens"][name].append(tokens)
        if step > 0:
            trl, ours = statistics.median(out["steps"]["trl"]), statistics.median(out["steps"]["ours"])
            out["median_s"] = {"trl": trl, "ours": ours}
            out["ratio"] = ours / trl
            out["phase_median_s"] = {
                name: {
                    key: statistics.median(p.get(key, 0.0) for p in out["phases"][name])
                    for key in dict.fromkeys(k for p in out["phases"][name] for k in p)
                }
                for name in trainers
            }
            out["completion_tokens_median"] = {
                name: statistics.median(t.get("completion_tokens", 0) for t in out["tokens"][name])
                for name in trainers
            }
            yield_point()
    if settings.profile:
        out["profile"] = {}
        for name in trainers:
            out["profile"][name] = profile_step(trainers[name])
            _log(f"features_off profiled step {name}: {out['profile'][name]['step_s']:.2f} s")
            yield_point()
        out["profile_diff"] = profile_diff(out["profile"]["trl"], out["profile"]["ours"])


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

    def generate(name, batch):
        if name == "reuse":
            return trainer._generate_single_turn(batch, None, {}, 1)[0]
        return GRPOTrainer._generate_single_turn(trainer, batch, None, {}, 1)[0]

    # One untimed call per arm at turn 0's shapes first (kernels, allocator, autotuning), then an empty cache: no
    # arm pays the first call at a shape, and turn 0 of the cached arm reuses nothing.
    for name in ("plain", "reuse"):
        generate(name, [list(c) for c in contexts])
        _sync()
    trainer._prefix_cache.clear()
    trainer._prefix_cache.reset_stats()
    times = {"reuse": 0.0, "plain": 0.0}
    tokens = {"reuse": 0, "plain": 0}
    out.update(turns=[], same_turns=0, compared_turns=0, warmup_calls_per_arm=1)
    for turn in range(settings.reuse_turns):
        results, turn_s = {}, {}
        for name in ("plain", "reuse") if turn % 2 == 0 else ("reuse", "plain"):
            batch = [list(c) for c in contexts]
            _sync()
            start = time.perf_counter()
            ids = generate(name, batch)
            _sync()
            turn_s[name] = time.perf_counter() - start
            times[name] += turn_s[name]
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
                "seconds": dict(turn_s),
                "generated_tokens": {name: sum(map(len, ids)) for name, ids in results.items()},
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
    if "phase_median_s" in r:
        lines += _phase_lines(r)
    if r.get("profile"):
        lines += _profile_lines(r)
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
        if r.get("warmup_calls_per_arm"):  # recorded runs before 2026-12-07 had no warm-up call (their .md as kept)
            per_turn = ", ".join(
                f"{t['seconds']['plain']:.2f} / {t['seconds']['reuse']:.2f}" for t in r["turns"] if "seconds" in t
            )
            lines += [
                f"Both paths made {r['warmup_calls_per_arm']} untimed call(s) at turn 0's shapes first (the cache "
                f"emptied after). Per turn, TRL / prefix caching (s): {per_turn}.",
                "",
            ]
    lines += _status(r)
    r = results.get("tracin_step", {})
    lines += ["### TracIn step at its defaults vs a plain GRPO step", ""]
    if "ratio" in r:
        plain_n, tracin_n = len(r["steps"]["plain"]), len(r["steps"]["tracin"])
        cycle = SCHEDULE_CYCLE  # not `tracin_steps`: `--tiny` measures 4, half a cycle
        counts = (
            f"{plain_n} steps" if plain_n == tracin_n else f"{plain_n} (`GRPOTrainer`) and {tracin_n} (TracIn) steps"
        )
        lines += [
            f"Whole optimizer steps (generation, rewards, validation rollouts, V, scoring, loss, backward, AdamW), "
            f"alternately, after one warm-up step each (the first V and validation rollouts); means of {counts} "
            f"({cycle} = one cycle of the default schedule: V every 4 steps, validation rollouts every 8).",
            "",
            "| trainer | mean step (s) | steps (s) |",
            "|---|---|---|",
            f"| `GRPOTrainer` | {r['mean_s']['plain']:.2f} | {', '.join(f'{s:.2f}' for s in r['steps']['plain'])} |",
            f"| TracIn, defaults | {r['mean_s']['tracin']:.2f} | "
            f"{', '.join(f'{s:.2f}' for s in r['steps']['tracin'])} |",
            "",
        ]
        if plain_n == tracin_n and plain_n > 0 and plain_n % cycle == 0:
            lines += [f"Ratio: **{r['ratio']:.2f}** (goal ≤ 1.3).", ""]
        else:
            # A cut-short cycle misses the steps that carry V and the validation rollouts (the last one does both).
            lines += [
                f"Ratio over an incomplete cycle ({min(plain_n, tracin_n) % cycle or cycle} of {cycle} steps): "
                f"{r['ratio']:.2f}, not "
                "comparable with the goal (≤ 1.3), which is about whole cycles.",
                "",
            ]
    lines += _status(r)
    return "\n".join(lines)


def _phase_lines(r: dict) -> list[str]:
    """The features-off phase table (medians over the measured steps) and the generated tokens."""
    trl, ours = r["phase_median_s"]["trl"], r["phase_median_s"]["ours"]
    lines = [
        "Phases of the same steps (every timed method `torch.cuda.synchronize`-d before each clock read; *rest* rows "
        "are the whole minus its timed parts); medians per phase, so they need not add up exactly:",
        "",
        "| phase | TRL median (s) | ours median (s) | ratio |",
        "|---|---|---|---|",
    ]
    for key, label in PHASE_ROWS:
        if key in trl or key in ours:
            a, b = trl.get(key, 0.0), ours.get(key, 0.0)
            ratio = f"{b / a:.3f}" if abs(a) > 1e-6 else "–"
            lines.append(f"| {label} | {a:.3f} | {b:.3f} | {ratio} |")
    lines.append("")
    tokens = {name: r["tokens"][name] for name in ("trl", "ours")}
    for name, label in (("trl", "`GRPOTrainer`"), ("ours", "ours")):
        t = tokens[name]
        generate_s = ", ".join(f"{p.get('generate', 0.0):.2f}" for p in r["phases"][name])
        lines.append(
            f"- {label}: completion tokens per step {', '.join(str(x.get('completion_tokens', '?')) for x in t)} "
            f"(padded width {', '.join(str(x.get('completion_width', '?')) for x in t)}); `_generate_single_turn` "
            f"calls per step {', '.join(str(x.get('generate_calls', '?')) for x in t)}, seconds per step "
            f"{generate_s}."
        )
    return [*lines, ""]


def _profile_lines(r: dict) -> list[str]:
    """The `--profile` tables: host-device syncs, totals, and the ops whose self time differs most."""
    p = r["profile"]
    if not {"trl", "ours"} <= set(p):
        return ["Profiled step: incomplete (see bench_gpu.json).", ""]
    trl, ours = p["trl"], p["ours"]
    lines = [
        "One more step of each trainer under `torch.profiler` (phase timers off; the profiler's overhead "
        f"included: {trl['step_s']:.2f} s TRL, {ours['step_s']:.2f} s ours).",
        "",
        "| | TRL | ours |",
        "|---|---|---|",
        f"| self CPU total (ms) | {trl['self_cpu_total_ms']:.1f} | {ours['self_cpu_total_ms']:.1f} |",
        f"| self CUDA total (ms) | {trl['self_cuda_total_ms']:.1f} | {ours['self_cuda_total_ms']:.1f} |",
    ]
    lines += [f"| `{name}` calls | {trl['syncs'][name]} | {ours['syncs'][name]} |" for name in SYNC_OPS]
    lines += [
        "",
        "Ops whose self time differs most (ours − TRL, CPU or CUDA, whichever differs more):",
        "",
        "| op | calls TRL / ours | self CPU ms TRL / ours | self CUDA ms TRL / ours | Δ ms |",
        "|---|---|---|---|---|",
    ]
    for row in r.get("profile_diff", []):
        (ca, cb), (pa, pb), (ga, gb) = row["calls"], row["self_cpu_ms"], row["self_cuda_ms"]
        name = row["name"].replace("|", "\\|")[:80]
        lines.append(f"| `{name}` | {ca} / {cb} | {pa:.1f} / {pb:.1f} | {ga:.1f} / {gb:.1f} | {row['diff_ms']:+.1f} |")
    return [*lines, ""]


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
        "--profile",
        action="store_true",
        help="features_off: one more step of each trainer under torch.profiler (top ops, host-device syncs).",
    )
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
    settings.profile = args.profile
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

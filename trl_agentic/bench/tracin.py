"""Benchmark: one TracIn-filtered GRPO step against one plain GRPO step on the same batch.

The embedded SmolLM2-135M with LoRA (r=16, all linear layers) on CPU, one synthetic batch per (completion length,
batch size): random prompt and completion tokens, random advantages, no generation (generation is identical in both
and would drown the comparison). A "step" is the loss, its backward and an AdamW step, as `training_step` does.
Modes, all on the same trainer and batch:

- `plain`: TRL's `GRPOTrainer._compute_loss`, backward, optimizer step.
- `fused`: the TracIn step used when `steps_per_generation == 1` (one forward, one backward, the selected rows'
  gradient applied through the surrogate loss).
- `two_pass`: the general TracIn design (a scoring pass over the rows, then the masked plain step).
- `val`: one refresh of the validation gradient V (forward and backward over a validation batch of the same shape),
  amortised over `tracin_val_refresh_steps` steps in the report.
- `seed`: the seed's design kept as a reference: capture activations and gradients of every training row, a
  validation forward/backward every step, inner products from the stored tensors, then a separate training
  forward/backward on the selected rows.

Times are medians over interleaved repeats in one process (the modes alternate, so a shared, noisy machine slows
them alike), as process CPU time (with one thread, a measure of work that contention from other processes barely
moves) and wall-clock time. Peak memory is the peak RSS (VmHWM, reset after set-up) of a fresh subprocess per
(configuration, mode) running the mode's steps, reported as the whole process and as the increase over the RSS after
set-up (model, optimizer and batch loaded).

Run `python -m trl_agentic.bench.tracin` (or `make bench`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field

import torch

MODES = ("plain", "fused", "two_pass", "val", "seed")
STEP_MODES = ("plain", "fused", "two_pass", "seed")


@dataclass
class BenchSettings:
    """What to run.

    Args:
        model: Builtin model name or path.
        lora_r: LoRA rank (alpha = 2r, all linear layers, no dropout).
        prompt_length: Prompt tokens per row.
        completion_lengths: Completion lengths to sweep.
        batch_sizes: Rows per step to sweep (the validation batch has as many rows).
        repeats: Timed steps per mode (after one warm-up step).
        memory_steps: Steps per memory subprocess.
        threads: torch intra-op threads (1: the process CPU time is then a contention-robust measure of work).
        refresh_steps: `tracin_val_refresh_steps` values for the amortised ratio.
        memory: Whether to run the memory subprocesses.
    """

    model: str = "smollm2-135m"
    lora_r: int = 16
    prompt_length: int = 64
    completion_lengths: list[int] = field(default_factory=lambda: [64, 128])
    batch_sizes: list[int] = field(default_factory=lambda: [4, 8])
    repeats: int = 3
    memory_steps: int = 2
    threads: int = 1
    refresh_steps: list[int] = field(default_factory=lambda: [1, 4, 16])
    memory: bool = True


# ----------------------------------------------------------------------------------------------------------- set-up


def build_trainer(settings: BenchSettings, batch_size: int, output_dir: str):
    """An `AgenticGRPOTrainer` with TracIn on (every mode runs on it) and its AdamW optimizer."""
    from datasets import Dataset
    from peft import LoraConfig

    from ..config import AgenticGRPOConfig
    from ..models import resolve_model_path
    from ..trainer import AgenticGRPOTrainer

    prompts = Dataset.from_dict({"prompt": ["Hello"] * 8})
    args = AgenticGRPOConfig(
        output_dir=output_dir,
        use_cpu=True,
        bf16=False,
        report_to="none",
        seed=0,
        per_device_train_batch_size=batch_size,
        num_generations=4,
        max_completion_length=max(settings.completion_lengths),
        gradient_checkpointing=False,
        learning_rate=1e-5,
        save_strategy="no",
        tracin_enabled=True,
        tracin_val_num_generations=4,
        tracin_val_batch_size=batch_size // 4,
    )
    trainer = AgenticGRPOTrainer(
        model=resolve_model_path(settings.model),
        reward_funcs=lambda completions, **kwargs: [0.0] * len(completions),
        args=args,
        train_dataset=prompts,
        tracin_eval_dataset=prompts,
        peft_config=LoraConfig(
            r=settings.lora_r, lora_alpha=2 * settings.lora_r, lora_dropout=0.0, target_modules="all-linear"
        ),
    )
    trainer.create_optimizer()
    trainer.current_gradient_accumulation_steps = 1  # set by the training loop, read by `_compute_loss`
    trainer.model.train()
    # PEFT starts B at zero; move it so that scores, selection and the lora_A terms are not trivially zero.
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in trainer.model.named_parameters():
            if "lora_B" in name:
                param.copy_(1e-3 * torch.randn(param.shape, generator=generator))
    return trainer


def make_batch(
    trainer, batch_size: int, prompt_length: int, completion_length: int, seed: int, group_size: int = 4
) -> dict:
    """A generation batch as `_generate_and_score_completions` returns it (one group per `group_size` rows)."""
    generator = torch.Generator().manual_seed(seed)
    vocab = trainer.model.config.vocab_size
    completion_mask = torch.ones(batch_size, completion_length, dtype=torch.long)
    # Ragged completions: every other row stops early, as real completions do.
    for row in range(1, batch_size, 2):
        completion_mask[row, completion_length // 2 + row :] = 0
    advantages = torch.randn(batch_size, generator=generator)
    return {
        "prompt_ids": torch.randint(3, vocab, (batch_size, prompt_length), generator=generator),
        "prompt_mask": torch.ones(batch_size, prompt_length, dtype=torch.long),
        "completion_ids": torch.randint(3, vocab, (batch_size, completion_length), generator=generator),
        "completion_mask": completion_mask,
        "advantages": advantages - advantages.view(-1, group_size).mean(1).repeat_interleave(group_size),
        "num_items_in_batch": completion_mask.sum(),
        "group_id": torch.arange(batch_size) // group_size,
        "row_kind": torch.zeros(batch_size, dtype=torch.long),
    }


# ----------------------------------------------------------------------------------------------------------- modes


def _optimizer_step(trainer, loss) -> None:
    trainer.accelerator.backward(loss)
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)


def plain_step(trainer, batch: dict, val_batch: dict) -> None:
    from trl import GRPOTrainer

    _optimizer_step(trainer, GRPOTrainer._compute_loss(trainer, trainer.model, batch))


def fused_step(trainer, batch: dict, val_batch: dict) -> None:
    _optimizer_step(trainer, trainer._tracin_fused_loss(trainer.model, batch))


def two_pass_step(trainer, batch: dict, val_batch: dict) -> None:
    from trl import GRPOTrainer

    masked = dict(batch)
    trainer._tracin_filter_buffer([masked])
    _optimizer_step(trainer, GRPOTrainer._compute_loss(trainer, trainer.model, masked))


def val_refresh(trainer, batch: dict, val_batch: dict) -> None:
    from ..tracin.lora_gradient import is_zero

    direction = trainer._tracin_validation_gradient(val_batch)
    trainer._tracin.direction, trainer._tracin.direction_is_zero = direction, is_zero(direction)


class SeedGhost:
    """The seed's three-pass design (reference only): store every row's LoRA activations and gradients.

    Part I records `x`, `h` (forward of `lora_A`) and `g_h`, `g_o` (full backward of `lora_B`) of every training
    row with an ordinary backward whose parameter gradients are then discarded; part II does the same on the
    validation batch; part III rebuilds per-row gradients from the stored tensors and takes their inner products
    with the summed validation gradient; part IV trains on the rows with a positive score with a third forward and
    backward.
    """

    def __init__(self, trainer):
        from ..tracin.layers import find_lora_layers

        self.trainer = trainer
        self.recording = False
        self.buffers: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
        self.handles = []
        for ref in find_lora_layers(trainer.model):
            self.handles.append(ref.lora_A.register_forward_hook(self._forward(ref.name)))
            self.handles.append(ref.lora_B.register_full_backward_hook(self._backward(ref.name)))

    def _forward(self, name):
        def hook(module, args, output):
            if self.recording:
                self.buffers[name]["x"].append(args[0].detach().clone())
                self.buffers[name]["h"].append(output.detach().clone())

        return hook

    def _backward(self, name):
        def hook(module, grad_input, grad_output):
            if self.recording:
                self.buffers[name]["g_h"].append(grad_input[0].detach().clone())
                self.buffers[name]["g_o"].append(grad_output[0].detach().clone())

        return hook

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()

    def _capture(self, batch: dict) -> dict[str, dict[str, torch.Tensor]]:
        from trl import GRPOTrainer

        trainer = self.trainer
        self.buffers.clear()
        self.recording = True
        loss = GRPOTrainer._compute_loss(trainer, trainer.model, batch)
        trainer.accelerator.backward(loss)
        self.recording = False
        trainer.optimizer.zero_grad(set_to_none=True)  # the seed's "ghost mode": gradients only for the hooks
        return {name: {k: torch.cat(v) for k, v in tensors.items()} for name, tensors in self.buffers.items()}

    def step(self, batch: dict, val_batch: dict) -> torch.Tensor:
        from trl import GRPOTrainer

        train = self._capture(batch)  # part I
        val = self._capture(val_batch)  # part II
        scores = torch.zeros(batch["prompt_ids"].size(0))
        for name, t in train.items():  # part III
            v = val[name]
            val_A = torch.einsum("nsr,nsd->rd", v["g_h"], v["x"])
            val_B = torch.einsum("nso,nsr->or", v["g_o"], v["h"])
            train_A = torch.einsum("nsr,nsd->nrd", t["g_h"], t["x"])
            train_B = torch.einsum("nso,nsr->nor", t["g_o"], t["h"])
            scores += (train_A * val_A).sum((1, 2)) + (train_B * val_B).sum((1, 2))
        del train, val
        selected = scores > 0  # part IV
        masked = dict(batch)
        masked["tool_mask"] = batch["completion_mask"] * selected.unsqueeze(1)
        masked["num_items_in_batch"] = masked["tool_mask"].sum()
        _optimizer_step(self.trainer, GRPOTrainer._compute_loss(self.trainer, self.trainer.model, masked))
        return scores


def run_mode(mode: str, trainer, batch: dict, val_batch: dict, seed: SeedGhost | None) -> None:
    if mode == "seed":
        seed.step(batch, val_batch)
    else:
        {"plain": plain_step, "fused": fused_step, "two_pass": two_pass_step, "val": val_refresh}[mode](
            trainer, batch, val_batch
        )


# ----------------------------------------------------------------------------------------------------------- measure


def _status_kb(field_name: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field_name} not in /proc/self/status")


def _reset_peak_rss() -> None:
    # Resets VmHWM (Linux >= 4.0); ru_maxrss cannot be reset and would keep the set-up's peak (model loading).
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _setup(settings: BenchSettings, batch_size: int, length: int, output_dir: str):
    torch.manual_seed(0)
    trainer = build_trainer(settings, batch_size, output_dir)
    batch = make_batch(trainer, batch_size, settings.prompt_length, length, seed=1)
    val_batch = make_batch(trainer, batch_size, settings.prompt_length, length, seed=2)
    return trainer, batch, val_batch


def time_modes(settings: BenchSettings, batch_size: int, length: int, output_dir: str, log=None) -> dict[str, dict]:
    """Median CPU and wall seconds per mode, modes interleaved, in this process."""
    trainer, batch, val_batch = _setup(settings, batch_size, length, output_dir)
    cpu: dict[str, list[float]] = defaultdict(list)
    wall: dict[str, list[float]] = defaultdict(list)
    val_refresh(trainer, batch, val_batch)
    for round_ in range(settings.repeats + 1):
        # Rotate the order so that no mode always runs right after the same one.
        order = MODES[round_ % len(MODES) :] + MODES[: round_ % len(MODES)]
        for mode in order:
            # The seed's hooks exist only around its own step: registered, they put BackwardHook nodes into every
            # other mode's graph too (setting up and removing them is inside the seed's timing, a cost it has).
            start, start_cpu = time.perf_counter(), time.process_time()
            seed = SeedGhost(trainer) if mode == "seed" else None
            try:
                run_mode(mode, trainer, batch, val_batch, seed)
            finally:
                if seed is not None:
                    seed.remove()
            elapsed, elapsed_cpu = time.perf_counter() - start, time.process_time() - start_cpu
            if round_ > 0:  # round 0 warms up
                wall[mode].append(elapsed)
                cpu[mode].append(elapsed_cpu)
            if log is not None:
                log(f"[tracin bench]   round {round_} {mode}: cpu {elapsed_cpu:.2f} s, wall {elapsed:.2f} s")
    return {
        "cpu": {mode: statistics.median(values) for mode, values in cpu.items()},
        "wall": {mode: statistics.median(values) for mode, values in wall.items()},
    }


def memory_child(settings: BenchSettings, mode: str, batch_size: int, length: int, output_dir: str) -> dict:
    """Peak RSS of `memory_steps` steps of one mode (run in a fresh process)."""
    trainer, batch, val_batch = _setup(settings, batch_size, length, output_dir)
    seed = SeedGhost(trainer) if mode == "seed" else None
    _reset_peak_rss()
    baseline = _status_kb("VmRSS")
    if mode in ("fused", "two_pass"):
        val_refresh(trainer, batch, val_batch)  # V is part of TracIn's memory
    for _ in range(settings.memory_steps):
        run_mode(mode, trainer, batch, val_batch, seed)
    peak = _status_kb("VmHWM")
    return {"baseline_mb": baseline / 1024, "peak_mb": peak / 1024}


def measure_memory(settings: BenchSettings, mode: str, batch_size: int, length: int, output_dir: str) -> dict:
    command = [
        sys.executable,
        "-m",
        "trl_agentic.bench.tracin",
        "--memory-child",
        json.dumps({"settings": asdict(settings), "mode": mode, "batch_size": batch_size, "length": length}),
        "--output-dir",
        output_dir,
    ]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"memory subprocess failed for {mode}:\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def run(settings: BenchSettings, output_dir: str, log=print, on_row=None) -> list[dict]:
    """Every configuration: times (in-process) and peak memory (subprocesses); `on_row(rows)` after each one."""
    torch.set_num_threads(settings.threads)
    rows = []
    for length in settings.completion_lengths:
        for batch_size in settings.batch_sizes:
            log(f"[tracin bench] completion length {length}, batch size {batch_size}: timing ...")
            row = {
                "length": length,
                "batch_size": batch_size,
                "time": time_modes(settings, batch_size, length, output_dir),
            }
            if settings.memory:
                row["memory"] = {}
                for mode in MODES:
                    log(f"[tracin bench]   memory of {mode} ...")
                    row["memory"][mode] = measure_memory(settings, mode, batch_size, length, output_dir)
            log(f"[tracin bench]   {json.dumps(row)}")
            rows.append(row)
            if on_row is not None:
                on_row(rows)
    return rows


# ----------------------------------------------------------------------------------------------------------- report


def _ratio(value: float, reference: float) -> str:
    return f"{value / reference:.2f}"


def render(settings: BenchSettings, rows: list[dict], command: str, quoted: bool = False) -> str:
    """Markdown tables of the results (`command` already in backquotes when `quoted`)."""
    lines = [
        "## TracIn step vs plain GRPO step",
        "",
        f"Command: {command if quoted else f'`{command}`'}. Model `{settings.model}` + LoRA r={settings.lora_r} "
        "(all linear layers), float32, "
        f"CPU, {settings.threads} thread(s), prompt {settings.prompt_length} tokens, half the rows with shorter "
        f"completions. Times: median of {settings.repeats} interleaved steps (loss, backward, AdamW step; no "
        "generation). `val` = one refresh of the validation gradient on a validation batch of the same shape; "
        "`fused + val/k` = the TracIn step with `tracin_val_refresh_steps=k`.",
        "",
    ]
    refresh = settings.refresh_steps
    for clock, title in (("cpu", "Process CPU time"), ("wall", "Wall-clock time")):
        header = ["completion", "batch", "plain (s)", "fused", "two-pass", "val"]
        header += [f"fused + val/{k}" for k in refresh] + ["seed (3-pass)"]
        lines += [f"{title}, as a ratio to the plain step:", "", "| " + " | ".join(header) + " |"]
        lines.append("|" + "---|" * len(header))
        for row in rows:
            t = row["time"][clock]
            cells = [str(row["length"]), str(row["batch_size"]), f"{t['plain']:.2f}"]
            cells += [_ratio(t[m], t["plain"]) for m in ("fused", "two_pass", "val")]
            cells += [_ratio(t["fused"] + t["val"] / k, t["plain"]) for k in refresh]
            cells.append(_ratio(t["seed"], t["plain"]))
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    if rows and "memory" in rows[0]:
        lines += [
            "Peak memory (fresh process per cell): peak RSS in MB, and in parentheses the ratio to the plain step of "
            "the whole process / of the increase over the RSS after set-up (model, optimizer, batch loaded). TracIn "
            "cells include one refresh of V in the same process.",
            "",
        ]
        header = ["completion", "batch", "plain (MB)", "fused", "two-pass", "val", "seed (3-pass)"]
        lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for row in rows:
            m = row["memory"]
            base = m["plain"]
            plain_increase = max(base["peak_mb"] - base["baseline_mb"], 1e-9)
            cells = [str(row["length"]), str(row["batch_size"]), f"{base['peak_mb']:.0f} (+{plain_increase:.0f})"]
            for mode in ("fused", "two_pass", "val", "seed"):
                peak, increase = m[mode]["peak_mb"], m[mode]["peak_mb"] - m[mode]["baseline_mb"]
                cells.append(f"{peak:.0f} ({peak / base['peak_mb']:.2f} / {increase / plain_increase:.2f})")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="Write the markdown report here (default: print it).")
    parser.add_argument("--json", help="Also write the raw results as JSON here.")
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-memory", action="store_true", help="Skip the peak-memory subprocesses.")
    parser.add_argument("--output-dir", default="/tmp/trl_agentic_bench")
    parser.add_argument(
        "--render",
        nargs="+",
        metavar="JSON",
        help="Only render the report from the --json files of earlier runs (their rows concatenated).",
    )
    parser.add_argument("--memory-child", help=argparse.SUPPRESS)
    parser.add_argument(
        "--section",
        choices=["micro", "e2e", "staleness"],
        default="micro",
        help="micro: the step-level comparison below; e2e: whole steps at the defaults vs TRL; staleness: V quality.",
    )
    parser.add_argument("--steps", type=int, default=None, help="e2e / staleness: measured steps.")
    parser.add_argument("--learning-rate", type=float, default=None, help="e2e / staleness: learning rate.")
    return parser


def report(argv: list[str], prog: str = "python -m trl_agentic.bench.tracin") -> str:
    """Run the benchmark with command-line style arguments and return its markdown report."""
    args = _parser(prog).parse_args(argv)
    if args.render:
        runs = []
        for path in args.render:
            with open(path) as f:
                runs.append(json.load(f))
        settings = BenchSettings(**runs[0]["settings"])
        rows = [row for run_ in runs for row in run_["rows"]]
        commands = " and ".join(f"`{run_['command']}`" for run_ in runs)
        return render(settings, rows, commands, quoted=True)
    command = f"{prog} {' '.join(argv)}".strip()
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    if args.section == "e2e":
        e2e = EndToEndSettings(threads=args.threads)
        if args.steps is not None:
            e2e.steps = args.steps
        if args.learning_rate is not None:
            e2e.learning_rate = args.learning_rate
        result = end_to_end(e2e, args.output_dir, log=log)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"settings": asdict(e2e), "result": result}, f, indent=1)
        return render_end_to_end(e2e, result, command)
    if args.section == "staleness":
        lr = 3e-4 if args.learning_rate is None else args.learning_rate
        records = staleness(args.steps or 16, lr, args.output_dir, threads=args.threads, log=log)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"learning_rate": lr, "records": records}, f, indent=1)
        return render_staleness(records, lr, command)
    settings = BenchSettings(
        completion_lengths=args.lengths,
        batch_sizes=args.batch_sizes,
        repeats=args.repeats,
        threads=args.threads,
        memory=not args.no_memory,
    )

    def save(rows):  # after every configuration, so an interrupted run keeps its results
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"settings": asdict(settings), "command": command, "rows": rows}, f, indent=1)

    rows = run(settings, args.output_dir, log=lambda msg: print(msg, file=sys.stderr, flush=True), on_row=save)
    return render(settings, rows, command)


def main(argv: list[str] | None = None, prog: str = "python -m trl_agentic.bench.tracin") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser(prog).parse_args(argv)
    if args.memory_child:
        spec = json.loads(args.memory_child)
        settings = BenchSettings(**spec["settings"])
        torch.set_num_threads(settings.threads)
        result = memory_child(settings, spec["mode"], spec["batch_size"], spec["length"], args.output_dir)
        print(json.dumps(result))
        return 0
    text = report(argv, prog)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)
    return 0


# ----------------------------------------------------------------------------------------------------------- end to end


@dataclass
class EndToEndSettings:
    """The end-to-end comparison: whole training steps (generation, rewards, V, scoring, training), TracIn at its
    defaults vs TRL's `GRPOTrainer`, stepped alternately in one process.

    Args:
        steps: Measured steps per trainer after one warm-up step (8 = one cycle of the default schedule: V every 4
            steps, validation rollouts every 8).
        old_default_steps: Measured steps of TracIn at the former defaults (4 prompts x 4 generations rolled out and
            V computed every step); 0 skips it.
        completion_length: `max_completion_length`.
        threads: torch intra-op threads.
        learning_rate: Learning rate of both runs.
    """

    steps: int = 8
    old_default_steps: int = 2
    completion_length: int = 24
    threads: int = 1
    learning_rate: float = 1e-5


OLD_DEFAULTS = dict(tracin_val_batch_size=4, tracin_val_refresh_steps=1, tracin_val_rollout_steps=1)


def _e2e_trainer(kind: str, settings: EndToEndSettings, output_dir: str, **tracin):
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer

    from ..config import AgenticGRPOConfig
    from ..models import resolve_model_path
    from ..trainer import AgenticGRPOTrainer
    from .overhead import PEFT, _length_reward, _prompts

    common = dict(
        output_dir=output_dir,
        use_cpu=True,
        bf16=False,
        report_to="none",
        seed=0,
        max_steps=1000,
        learning_rate=settings.learning_rate,
        per_device_train_batch_size=8,
        num_generations=8,
        max_completion_length=settings.completion_length,
        save_strategy="no",
        disable_tqdm=True,
    )
    kwargs = dict(
        model=resolve_model_path("smollm2-135m"),
        reward_funcs=_length_reward,
        train_dataset=_prompts(64),
        peft_config=LoraConfig(**PEFT),
    )
    if kind == "plain":
        trainer = GRPOTrainer(args=GRPOConfig(**common), **kwargs)
    else:
        args = AgenticGRPOConfig(**common, tracin_enabled=True, **tracin)
        trainer = AgenticGRPOTrainer(args=args, tracin_eval_dataset=_prompts(64).select(range(32, 64)), **kwargs)
    trainer.create_optimizer()
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()
    trainer._bench_batches = iter(trainer.get_train_dataloader())
    return trainer


def _one_step(trainer) -> tuple[float, float]:
    """One optimizer step as `Trainer.train` runs it (generation included); returns (wall, process CPU) seconds."""
    batch = next(trainer._bench_batches)
    start, start_cpu = time.perf_counter(), time.process_time()
    trainer.training_step(trainer.model, batch, None)
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    trainer.state.global_step += 1
    return time.perf_counter() - start, time.process_time() - start_cpu


def _timed(trainer, name: str, bucket: dict) -> None:
    """Add the wall time of `trainer.<name>` calls to `bucket[name]`."""
    original = getattr(trainer, name)

    def wrapped(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            bucket[name] += time.perf_counter() - start

    setattr(trainer, name, wrapped)


def end_to_end(settings: EndToEndSettings, output_dir: str, log=print) -> dict:
    """Per-step wall and CPU times of plain / TracIn (defaults) / TracIn (former defaults), stepped alternately."""
    torch.set_num_threads(settings.threads)
    trainers = {
        "plain": _e2e_trainer("plain", settings, output_dir),
        "tracin": _e2e_trainer("tracin", settings, output_dir),
    }
    if settings.old_default_steps:
        trainers["tracin_old"] = _e2e_trainer("tracin", settings, output_dir, **OLD_DEFAULTS)
    parts = {name: defaultdict(float) for name in trainers if name != "plain"}
    for name, bucket in parts.items():
        for method in ("_tracin_rollout_validation", "_tracin_validation_gradient"):
            _timed(trainers[name], method, bucket)
    times = {name: {"wall": [], "cpu": []} for name in trainers}
    for step in range(settings.steps + 1):
        names = list(trainers) if step % 2 == 0 else list(reversed(trainers))  # alternate who goes first
        if step == 1:  # the warm-up steps (first V and rollouts) are not counted; once, before any step-1 part
            for bucket in parts.values():
                bucket.clear()
        for name in names:
            if name == "tracin_old" and step > settings.old_default_steps:
                continue
            wall, cpu = _one_step(trainers[name])
            log(f"[tracin e2e] step {step} {name}: wall {wall:.2f} s, cpu {cpu:.2f} s")
            if step > 0:
                times[name]["wall"].append(wall)
                times[name]["cpu"].append(cpu)
    return {
        "times": times,
        "parts": {name: dict(bucket) for name, bucket in parts.items()},
        "val_rows": {
            name: t.args.tracin_val_batch_size * t.args.tracin_val_num_generations
            for name, t in trainers.items()
            if name != "plain"
        },
        "schedule": {name: schedule(t.args) for name, t in trainers.items() if name != "plain"},
    }


def schedule(args) -> dict:
    """TracIn's validation schedule as the trainer's args set it (rendered in the report's header)."""
    return {
        key: getattr(args, f"tracin_{key}", None)
        for key in ("val_batch_size", "val_num_generations", "val_rollout_steps", "val_refresh_steps")
    }


def _every(steps) -> str:
    return "every step" if steps == 1 else f"every {steps} steps"


def schedule_text(result: dict, name: str = "tracin") -> str:
    """ "8 validation rows (2 prompts × 4 generations) rolled out every 8 steps, V recomputed ... every 4 steps", from
    the trainer's args (a result without them, from before they were recorded, gives the row count only)."""
    rows = result["val_rows"][name]
    s = result.get("schedule", {}).get(name)
    if not s:
        return f"{rows} validation rows, fused step"
    return (
        f"{rows} validation rows ({s['val_batch_size']} prompts × {s['val_num_generations']} generations) rolled out "
        f"{_every(s['val_rollout_steps'])}, V recomputed at the current weights {_every(s['val_refresh_steps'])}, "
        "fused step"
    )


def whole_cycle(result: dict) -> bool:
    """Whether TracIn's measured steps (defaults) include its validation rollouts and V, as a whole cycle does; a
    shorter window (`--quick`) measures neither and is not what the ≤ 1.3× goal is about."""
    parts = result["parts"].get("tracin", {})
    return parts.get("_tracin_rollout_validation", 0.0) > 0 and parts.get("_tracin_validation_gradient", 0.0) > 0


def render_end_to_end(settings: EndToEndSettings, result: dict, command: str) -> str:
    times, parts = result["times"], result["parts"]

    def mean(name, clock):
        values = times[name][clock]
        return sum(values) / len(values)

    lines = [
        "## TracIn end-to-end step at the defaults vs a plain GRPO step",
        "",
        f"Command: `{command}`. SmolLM2-135M + LoRA r=16 (all linear layers), float32, CPU, {settings.threads} "
        f"thread(s); 8 rows per step (1 prompt × 8 generations), up to {settings.completion_length} completion tokens, "
        f"learning rate {settings.learning_rate}. Whole optimizer steps as `Trainer.train` runs them (generation, "
        "rewards, validation rollouts, V, scoring, loss, backward, AdamW), the trainers stepped alternately in one "
        "process (who goes first alternates), after one warm-up step each. TracIn at its defaults: "
        f"{schedule_text(result)}. Means over "
        f"{settings.steps} steps"
        + (
            " = one whole cycle of that schedule."
            if whole_cycle(result)
            else ": no validation rollouts or V measured."
        ),
        "",
        "| trainer | steps | mean wall (s) | wall / plain | mean CPU (s) | CPU / plain | validation rollouts (wall) | "
        "V (wall) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    plain_wall, plain_cpu = mean("plain", "wall"), mean("plain", "cpu")
    labels = {"plain": "TRL `GRPOTrainer`", "tracin": "TracIn, defaults", "tracin_old": "TracIn, former defaults"}
    for name in times:
        n = len(times[name]["wall"])
        wall, cpu = mean(name, "wall"), mean(name, "cpu")
        rollout = parts.get(name, {}).get("_tracin_rollout_validation")
        grad = parts.get(name, {}).get("_tracin_validation_gradient")
        cells = [
            labels[name],
            str(n),
            f"{wall:.2f}",
            f"{wall / plain_wall:.2f}",
            f"{cpu:.2f}",
            f"{cpu / plain_cpu:.2f}",
            "–" if rollout is None else f"{rollout / n:.2f} s/step",
            "–" if grad is None else f"{grad / n:.2f} s/step",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    ratio = mean("tracin", "wall") / plain_wall
    lines += [
        "",
        f"Goal ≤ 1.3×: {'met' if ratio <= 1.3 else 'missed'} ({ratio:.2f}× wall, "
        f"{mean('tracin', 'cpu') / plain_cpu:.2f}× CPU)"
        + ("" if whole_cycle(result) else ", but over less than a whole cycle: not comparable with the goal")
        + ". The former defaults are measured over their first "
        f"{len(times.get('tracin_old', {}).get('wall', []))} steps (every step of theirs costs the same).",
        "",
    ]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------- staleness


def staleness(steps: int, learning_rate: float, output_dir: str, threads: int = 1, log=print) -> list[dict]:
    """At every step of a TracIn run at the defaults, score the training rows against the V the step used and against
    two V computed afresh (new validation rollouts of the same size, at the current weights), and compare selections.

    The two fresh V differ only by their random validation prompts and rollouts: their agreement is the noise floor
    that staleness has to be compared with.
    """
    from .. import tracin as tracin_module

    torch.set_num_threads(threads)
    settings = EndToEndSettings(learning_rate=learning_rate)
    trainer = _e2e_trainer("tracin", settings, output_dir)
    state = trainer._tracin
    fused = trainer._tracin_fused_loss
    records = []

    def fresh_direction(offset):
        saved = state.refreshes
        state.refreshes = 10_000 * offset + trainer.state.global_step  # another draw of validation prompts
        try:
            rows = trainer._tracin_validation_rows()
        finally:
            state.refreshes = saved
        batch, _ = trainer._tracin_rollout_validation(rows)
        return trainer._tracin_validation_gradient(batch)

    def scores_for(inputs, direction):
        with trainer._tracin_hooks() as hooks, trainer._tracin_quiet():
            with hooks.record(direction=direction):
                loss = trainer._tracin_base_loss(trainer.model, inputs)
            return hooks.score_rows(loss, direction).double()

    def compare(model, inputs):
        used = scores_for(inputs, state.direction)
        fresh = [scores_for(inputs, fresh_direction(k)) for k in (1, 2)]
        valid = (inputs["completion_mask"].sum(1) > 0).cpu()

        def select(s):
            return tracin_module.select_rows(s.cpu(), valid, mode=trainer.args.tracin_selection, min_selected=1)

        def corr(a, b):
            a, b = a[valid] - a[valid].mean(), b[valid] - b[valid].mean()
            return float((a * b).sum() / (a.square().sum() * b.square().sum()).sqrt())

        sel_used, sel_f1, sel_f2 = select(used), select(fresh[0]), select(fresh[1])
        record = {
            "step": trainer.state.global_step,
            "steps_since_v": trainer.state.global_step - state.refreshed_at,
            "steps_since_rollouts": trainer.state.global_step - state.rolled_out_at,
            "agree_used_fresh": float((sel_used == sel_f1)[valid].double().mean()),
            "agree_used_fresh2": float((sel_used == sel_f2)[valid].double().mean()),
            "agree_fresh_fresh": float((sel_f1 == sel_f2)[valid].double().mean()),
            "corr_used_fresh": (corr(used, fresh[0]) + corr(used, fresh[1])) / 2,
            "corr_fresh_fresh": corr(fresh[0], fresh[1]),
            "selected": float(sel_used[valid].double().mean()),
        }
        records.append(record)
        log(f"[tracin staleness] {json.dumps(record)}")
        return fused(model, inputs)

    trainer._tracin_fused_loss = compare
    for _ in range(steps):
        _one_step(trainer)
    return records


def render_staleness(records: list[dict], learning_rate: float, command: str) -> str:
    def mean(key, rows):
        return sum(r[key] for r in rows) / len(rows) if rows else float("nan")

    fresh_v = [r for r in records if r["steps_since_v"] == 0 and r["steps_since_rollouts"] == 0]
    stale_v = [r for r in records if r["steps_since_v"] > 0]
    reused = [r for r in records if r["steps_since_rollouts"] > 0 and r["steps_since_v"] == 0]
    lines = [
        "## Staleness of the default validation direction",
        "",
        f"Command: `{command}`. A TracIn run at the defaults (SmolLM2-135M + LoRA r=16, 8 rows per step, learning "
        f"rate {learning_rate}, {len(records)} steps). At every step the training rows are also scored against two "
        "V computed afresh at the current weights from new validation rollouts of the same size (8 rows); "
        "*agreement* = fraction of rows on which two selections (`positive`) agree, *correlation* = Pearson "
        "correlation of the scores. Fresh vs fresh is the noise floor: two equally fresh V that differ only by "
        "their random validation prompts and rollouts.",
        "",
        "| steps | used V vs fresh V: agreement | correlation | fresh vs fresh: agreement | correlation |",
        "|---|---|---|---|---|",
    ]
    for label, rows in (
        ("all", records),
        ("V and rollouts of this step", fresh_v),
        ("V recomputed this step on reused rollouts", reused),
        ("V from an earlier step", stale_v),
    ):
        if not rows:
            continue
        agree = (mean("agree_used_fresh", rows) + mean("agree_used_fresh2", rows)) / 2
        lines.append(
            f"| {label} ({len(rows)}) | {agree:.2f} | {mean('corr_used_fresh', rows):.2f} | "
            f"{mean('agree_fresh_fresh', rows):.2f} | {mean('corr_fresh_fresh', rows):.2f} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())

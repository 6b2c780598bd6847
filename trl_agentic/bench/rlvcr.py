"""Benchmark: the extra model calls of the RLVCR / CoPO advantage estimator per training step.

`AgenticGRPOTrainer` runs the same few steps (same seed, data, reward and config) three times, changing only the
advantage estimator: `advantage_estimator="grpo"`, `"rlvcr"` (`rlvcr_mode="copo"`) and `"rlvcr"` with
`rlvcr_expand=True`. Every model call is counted, not estimated, by wrapping on each trainer instance:

- `trainer.advantage_estimator`: marks the calls made by the estimator (everything else is the normal step);
- `trainer._generate_single_turn` (TRL's batched generation) and the model's `generate`: generation calls, the
  prompts they carry and the tokens they return;
- `trainer._get_per_token_logps_and_entropies`: scoring calls, their rows and their non-padding input tokens;
- a forward hook on the model: actual forward passes (generation runs one per new token).

The policy must write the step format `<level>k</level><think>...</think><action>...</action>`, otherwise RLVCR finds
no step to expand and costs nothing. The embedded SmolLM2 never writes it zero-shot, so the policy is
`trl_agentic.models.build_tiny_step_model`: the tiny 2-layer random Qwen3 of the tests, fine-tuned for a few seconds
to answer one step with a random level (1-4) and a random action ("go north" / "go south"); the reward is 1 for a
well-formed step whose action is "go north". The counts are the point of this benchmark; the times are those of a
36k-parameter model on a CPU (framework overhead dominates) and say little about a real model.

Run `python -m trl_agentic.bench --only rlvcr` (or `make bench`); `--quick` runs fewer, smaller steps.
"""

from __future__ import annotations

import math
import statistics
import tempfile
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass

import torch

VARIANTS = (
    ("grpo", {"advantage_estimator": "grpo"}),
    ("rlvcr (copo)", {"advantage_estimator": "rlvcr", "rlvcr_mode": "copo"}),
    ("rlvcr (copo, expand)", {"advantage_estimator": "rlvcr", "rlvcr_mode": "copo", "rlvcr_expand": True}),
)
COMMAND = "python -m trl_agentic.bench --only rlvcr"


@dataclass
class RLVCRBenchSettings:
    """What to run.

    Args:
        steps: Training steps per estimator (the first one is left out of the step-time medians: warm-up).
        batch_size: Rollouts per step (`per_device_train_batch_size`).
        num_generations: Rollouts per prompt.
        max_completion_length: Generation budget of a rollout (tokens; the byte-level step is about 95).
        model_train_steps: Fine-tuning steps of the step-format model.
        threads: torch intra-op threads during the runs (the tiny model runs faster on one).
        seed: Seed of the model and of every run.
    """

    steps: int = 4
    batch_size: int = 16
    num_generations: int = 4
    max_completion_length: int = 128
    model_train_steps: int = 250
    threads: int = 1
    seed: int = 0

    @classmethod
    def quick(cls) -> RLVCRBenchSettings:
        return cls(steps=2, batch_size=8)


def north_reward(completions, **kwargs) -> list[float]:
    """1 for a well-formed step whose action is "go north", else 0."""
    from ..rlvcr.parsing import ParsedStep, parse_step

    rewards = []
    for completion in completions:
        text = completion[-1]["content"] if isinstance(completion, list) else completion
        parsed = parse_step(text)
        rewards.append(float(isinstance(parsed, ParsedStep) and parsed.action == "go north"))
    return rewards


class CallCounter:
    """Counts, per training step, the generation and scoring calls and forward passes, split into those made by the
    advantage estimator and the rest of the step. Installed by wrapping methods on one trainer instance."""

    def __init__(self, trainer):
        self.steps: list[dict] = []
        self.in_estimator = False
        self.in_generate = False
        self._wrap(trainer)

    def new_step(self) -> None:
        self.steps.append(defaultdict(float))

    @property
    def step(self) -> dict:
        if not self.steps:
            self.new_step()
        return self.steps[-1]

    def _where(self) -> str:
        return "est" if self.in_estimator else "step"

    @contextmanager
    def _flag(self, name: str):
        old = getattr(self, name)
        setattr(self, name, True)
        try:
            yield
        finally:
            setattr(self, name, old)

    def _wrap(self, trainer) -> None:
        counter = self
        estimator = trainer.advantage_estimator
        generate_single_turn = trainer._generate_single_turn
        logps = trainer._get_per_token_logps_and_entropies
        augmenter = trainer._augmenter
        model = trainer.model
        model_generate = model.generate

        def counted_estimator(batch, t):
            start = time.perf_counter()
            with counter._flag("in_estimator"):
                result = estimator(batch, t)
            counter.step["est_seconds"] += time.perf_counter() - start
            counter.step["est_calls"] += 1
            return result

        def counted_generate_single_turn(prompt_ids, *args, **kwargs):
            ids, lps = generate_single_turn(prompt_ids, *args, **kwargs)
            where = counter._where()
            counter.step[f"{where}_gen_calls"] += 1
            counter.step[f"{where}_gen_prompts"] += len(prompt_ids)
            counter.step[f"{where}_gen_tokens"] += sum(len(x) for x in ids)
            return ids, lps

        def counted_model_generate(*args, **kwargs):
            counter.step[f"{counter._where()}_hf_generate"] += 1
            with counter._flag("in_generate"):
                return model_generate(*args, **kwargs)

        def counted_logps(m, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
            where = counter._where()
            counter.step[f"{where}_score_calls"] += 1
            counter.step[f"{where}_score_rows"] += input_ids.size(0)
            counter.step[f"{where}_score_tokens"] += int(attention_mask.sum())
            return logps(m, input_ids, attention_mask, logits_to_keep, *args, **kwargs)

        def counted_augmenter(*args, **kwargs):
            batch = augmenter(*args, **kwargs)
            from ..rollout.types import RowKind

            kinds = batch["row_kind"]
            counter.step["rows"] += int((kinds != RowKind.PADDING).sum())
            counter.step["expansion_rows"] += int((kinds == RowKind.EXPANSION).sum())
            return batch

        def forward_hook(module, inputs, output):
            kind = "gen" if counter.in_generate else "score"
            counter.step[f"{counter._where()}_{kind}_forwards"] += 1
            counter.step["forwards"] += 1

        trainer.advantage_estimator = counted_estimator
        trainer._generate_single_turn = counted_generate_single_turn
        trainer._get_per_token_logps_and_entropies = counted_logps
        trainer._augmenter = counted_augmenter
        model.generate = counted_model_generate
        model.register_forward_hook(forward_hook)


def _run_variant(name: str, extra: dict, model_dir: str, settings: RLVCRBenchSettings) -> dict:
    from datasets import Dataset
    from transformers import TrainerCallback

    from ..config import AgenticGRPOConfig
    from ..models import STEP_MODEL_PROMPTS
    from ..rlvcr.parsing import ParsedStep, parse_step
    from ..trainer import AgenticGRPOTrainer

    formats = []

    def reward(completions, **kwargs):
        for completion in completions:
            text = completion[-1]["content"] if isinstance(completion, list) else completion
            formats.append(isinstance(parse_step(text), ParsedStep))
        return north_reward(completions)

    prompts = [[{"role": "user", "content": p}] for p in STEP_MODEL_PROMPTS]
    num_prompts = settings.steps * settings.batch_size // settings.num_generations
    dataset = Dataset.from_dict({"prompt": [prompts[i % len(prompts)] for i in range(num_prompts)]})
    with tempfile.TemporaryDirectory() as out:
        args = AgenticGRPOConfig(
            output_dir=out,
            use_cpu=True,
            bf16=False,
            report_to="none",
            seed=settings.seed,
            max_steps=settings.steps,
            learning_rate=1e-4,
            per_device_train_batch_size=settings.batch_size,
            num_generations=settings.num_generations,
            max_completion_length=settings.max_completion_length,
            logging_steps=1,
            save_strategy="no",
            disable_tqdm=True,
            **extra,
        )
        trainer = AgenticGRPOTrainer(model=model_dir, reward_funcs=reward, args=args, train_dataset=dataset)
        counter = CallCounter(trainer)

        class NewStep(TrainerCallback):
            def on_step_begin(self, *args, **kwargs):
                counter.new_step()

        trainer.add_callback(NewStep())
        trainer.train()
    logs = trainer.state.log_history
    step_times = [h["step_time"] for h in logs if "step_time" in h]
    expanded = [h["rlvcr/expanded_steps"] for h in logs if "rlvcr/expanded_steps" in h]
    failed = [h["rlvcr/failed_alternatives"] for h in logs if "rlvcr/failed_alternatives" in h]
    return {
        "name": name,
        "steps": counter.steps,
        "step_times": step_times,
        "expanded": expanded,
        "failed_alternatives": failed,
        "well_formed": sum(formats) / len(formats) if formats else math.nan,
        "rollouts": len(formats),
    }


def run(quick: bool = False, settings: RLVCRBenchSettings | None = None) -> dict:
    """Build the step-format model and run every variant; returns the raw per-step counts and times."""
    from ..models import build_tiny_step_model

    settings = settings or (RLVCRBenchSettings.quick() if quick else RLVCRBenchSettings())
    threads = torch.get_num_threads()
    torch.set_num_threads(settings.threads)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            start = time.perf_counter()
            model_dir = build_tiny_step_model(
                f"{tmp}/model", seed=settings.seed, train_steps=settings.model_train_steps
            )
            build_seconds = time.perf_counter() - start
            results = [_run_variant(name, extra, model_dir, settings) for name, extra in VARIANTS]
    finally:
        torch.set_num_threads(threads)
    return {"settings": settings, "build_seconds": build_seconds, "results": results}


def _mean(steps: list[dict], key: str) -> float:
    return sum(s.get(key, 0.0) for s in steps) / len(steps) if steps else math.nan


def _fmt(x: float) -> str:
    if isinstance(x, float) and math.isnan(x):
        return "–"
    return f"{x:.0f}" if float(x).is_integer() else f"{x:.1f}"


def _median_time(times: list[float]) -> float:
    times = times[1:] if len(times) > 1 else times  # the first step pays one-off warm-up costs
    return statistics.median(times) if times else math.nan


def summarize(raw: dict) -> list[dict]:
    """Per-variant means per step of the counted calls, and the step-time ratio to the grpo run."""
    rows = []
    base = _median_time(raw["results"][0]["step_times"])
    for r in raw["results"]:
        steps = r["steps"]
        median = _median_time(r["step_times"])
        rows.append(
            {
                "estimator": r["name"],
                "steps": len(steps),
                "well_formed": r["well_formed"],
                "rollout_gen_calls": _mean(steps, "step_gen_calls"),
                "extra_gen_calls": _mean(steps, "est_gen_calls"),
                "extra_hf_generate": _mean(steps, "est_hf_generate"),
                "extra_gen_prompts": _mean(steps, "est_gen_prompts"),
                "extra_gen_tokens": _mean(steps, "est_gen_tokens"),
                "extra_gen_forwards": _mean(steps, "est_gen_forwards"),
                "extra_score_calls": _mean(steps, "est_score_calls"),
                "extra_score_forwards": _mean(steps, "est_score_forwards"),
                "extra_score_rows": _mean(steps, "est_score_rows"),
                "extra_score_tokens": _mean(steps, "est_score_tokens"),
                "expanded_steps": sum(r["expanded"]) / len(r["expanded"]) if r["expanded"] else 0.0,
                "failed_alternatives": sum(r["failed_alternatives"]),
                "expansion_rows": _mean(steps, "expansion_rows"),
                "rows": _mean(steps, "rows"),
                "forwards": _mean(steps, "forwards"),
                "estimator_seconds": _mean(steps, "est_seconds"),
                "step_seconds": median,
                "ratio": median / base if base else math.nan,
                "totals": {k: sum(s.get(k, 0.0) for s in steps) for k in sorted({k for s in steps for k in s})},
            }
        )
    return rows


def render(raw: dict, quick: bool = False, seconds: float | None = None) -> str:
    """The markdown section of `python -m trl_agentic.bench` for the results of [`run`]."""
    s = raw["settings"]
    rows = summarize(raw)
    failed = sum(r["failed_alternatives"] for r in rows)
    table = [
        ("well-formed rollouts", lambda r: f"{r['well_formed']:.0%}"),
        ("rollout generation calls", lambda r: _fmt(r["rollout_gen_calls"])),
        (
            "**extra generation calls** (`_generate_single_turn` / `generate`)",
            lambda r: f"**{_fmt(r['extra_gen_calls'])}** / {_fmt(r['extra_hf_generate'])}",
        ),
        ("extra prompts generated (alternative thinkings)", lambda r: _fmt(r["extra_gen_prompts"])),
        ("extra tokens generated", lambda r: _fmt(r["extra_gen_tokens"])),
        (
            "tokens per alternative thinking (cap 128)",
            lambda r: _fmt(r["extra_gen_tokens"] / r["extra_gen_prompts"]) if r["extra_gen_prompts"] else "–",
        ),
        ("extra generation forwards (decode steps)", lambda r: _fmt(r["extra_gen_forwards"])),
        ("**extra scoring forwards**", lambda r: f"**{_fmt(r['extra_score_forwards'])}**"),
        ("rows scored", lambda r: _fmt(r["extra_score_rows"])),
        ("tokens scored (non-padding input)", lambda r: _fmt(r["extra_score_tokens"])),
        ("**expanded steps** (`rlvcr/expanded_steps`)", lambda r: f"**{_fmt(r['expanded_steps'])}**"),
        ("expansion rows in the training batch", lambda r: _fmt(r["expansion_rows"])),
        ("training rows", lambda r: _fmt(r["rows"])),
        ("all model forwards", lambda r: _fmt(r["forwards"])),
        ("estimator time", lambda r: f"{r['estimator_seconds'] * 1000:.0f} ms"),
        ("median step time", lambda r: f"{r['step_seconds']:.2f} s"),
        ("**step time / grpo**", lambda r: f"**{r['ratio']:.2f}**"),
    ]
    lines = [
        "## RLVCR extra model calls per step",
        "",
        f"`{COMMAND}{' --quick' if quick else ''}`: {s.steps} `AgenticGRPOTrainer` steps per estimator with the same "
        f"seed ({s.seed}), prompts, reward and config; only the advantage estimator changes. {s.batch_size} rollouts "
        f"per step ({s.num_generations} per prompt), up to {s.max_completion_length} completion tokens, RLVCR "
        "defaults otherwise (`rlvcr_expand_steps='successful_varied'`, `rlvcr_score_batch_size=16`, "
        "`rlvcr_max_thinking_tokens=128`).",
        "",
        "Model: the tiny 2-layer random Qwen3 of the tests (byte-level tokenizer, ~36k parameters) fine-tuned by "
        f"`trl_agentic.models.build_tiny_step_model` ({s.model_train_steps} steps, {raw['build_seconds']:.0f} s "
        "here) to answer in the step format `<level>k</level><think>…</think><action>…</action>` with a random "
        "level and action; the reward is 1 for a well-formed step whose action is `go north`. The embedded SmolLM2 "
        "never writes the format zero-shot, and without well-formed steps RLVCR expands nothing. **The call counts "
        "are the point of this section**; they are counted, not estimated, by wrapping the trainer's "
        "`advantage_estimator`, `_generate_single_turn` and `_get_per_token_logps_and_entropies`, the model's "
        "`generate`, and with a forward hook on the model. The times are those of a tiny model on a shared CPU, "
        "where fixed framework costs dominate, and say little about a real model.",
        "",
        "Means per training step; *extra* = made inside the advantage estimator:",
        "",
        "| per step | " + " | ".join(r["estimator"] for r in rows) + " |",
        "|---" * (len(rows) + 1) + "|",
    ]
    for label, cell in table:
        lines.append(f"| {label} | " + " | ".join(cell(r) for r in rows) + " |")
    lines += [
        "",
        "RLVCR makes one batched generation call per step that has an expanded step (none otherwise): one prompt "
        "per expanded step and level in {2, 3, 4} other than the step's own (2 or 3 per step). It then scores the "
        "step's own action under each of the 4 levels' thinking in ceil(4 × expanded steps / "
        "`rlvcr_score_batch_size`) no-grad forward passes. A generation forward is one new token for the whole "
        "batch. The tiny model was only trained on short prompts and does not end its thinking inside the long "
        "level-forcing prompt, so almost every alternative thinking runs to the `rlvcr_max_thinking_tokens` cap: "
        "extra tokens and generation forwards here are close to their upper bound (a model that ends its thinking "
        f"and its turn stops earlier; alternatives cut to nothing and left unscored: {failed:.0f}). Expansion rows: `RowKind.EXPANSION` rows added to the "
        "training batch (3 per expanded step with `rlvcr_expand=True`), which the loss forward and backward also "
        "process. Step time: TRL's `step_time`, which times `training_step` (generation, estimator, loss, backward; "
        "the optimizer step is not included), median over the "
        "steps after the first; the runs diverge after the first step (different advantages and random streams), "
        "so later steps do not have the same rollouts."
        + (f" Section time {seconds:.0f} s." if seconds is not None else ""),
        "",
    ]
    return "\n".join(lines)


def report(quick: bool = False, settings: RLVCRBenchSettings | None = None) -> str:
    """Run the benchmark and return its markdown section."""
    start = time.perf_counter()
    raw = run(quick=quick, settings=settings)
    return render(raw, quick=quick, seconds=time.perf_counter() - start)


if __name__ == "__main__":
    import sys

    print(report(quick="--quick" in sys.argv[1:]))

"""The training script of `tests/distributed`, run under `accelerate launch` (or alone for one process).

It trains `AgenticGRPOTrainer` on the tiny model with a counter environment, generation replaced by
`ScriptedGeneration`: a rollout's answers depend only on its *global* row index (rank * rows per rank + position),
never on the rank, the batch it shares or the order of calls, so a 2-process run and a 1-process run over the same
generation batch produce the same trajectories. `--scenario` picks which rollouts fail their tool calls (rollback,
negative rows) and which delete context (snapshots). Each rank writes `rank{k}.json`: every training batch (before
TRL shuffles and splits it), the loop counters, the per-micro-step losses and the generation call counts; with
`--record_grads` also the gradients at the first optimizer step, with `--lora` the initial state (gathered) and the
saved adapter. `DONE` marks a run in which every rank got to the end.
"""

from __future__ import annotations

import argparse
import faulthandler
import importlib
import json
import re
import traceback
from collections import Counter
from pathlib import Path

import torch
from datasets import Dataset
from transformers import TrainerCallback

from trl_agentic import AgenticGRPOConfig, AgenticGRPOTrainer
from trl_agentic.rollout import loop as loop_module

ROW_MARK = re.compile(r"\[row (\d+)\]")


class CounterEnv:
    """A stateful tool environment: `add` raises `TypeError` on a non-integer (a model error that rolls back)."""

    def reset(self, **kwargs):
        self.total = 0

    def add(self, n: int) -> str:
        """
        Add a number to the total.

        Args:
            n: The number to add.
        """
        if not isinstance(n, int):
            raise TypeError(f"n must be an integer, got {type(n).__name__}")
        self.total += n
        return str(self.total)


class FailingConversationEnv(CounterEnv):
    """`--fail_on_rank k --fail_in loop`: its user-turn hook (called inside the rollout loop) raises on rank k only."""

    def _next_user_turn(self, assistant_message):
        import torch.distributed as dist

        if dist.is_initialized() and dist.get_rank() == FAIL["rank"]:
            raise RuntimeError(f"environment hook failed on rank {FAIL['rank']}")
        return None


FAIL = {"rank": -1}


class ConversationCounterEnv(CounterEnv):
    """`--user_turns`: rank 0's rollouts get two further user requests each, rank 1's none (different numbers of
    user turns, hence of generation rounds, per rank)."""

    def reset(self, **kwargs):
        import torch.distributed as dist

        super().reset(**kwargs)
        self.requests = ["Add one more.", "And another."] if dist.get_rank() == 0 else []

    def _next_user_turn(self, assistant_message):
        return self.requests.pop(0) if self.requests else None


def failing_segment_reward(segment: dict) -> float:
    """`--fail_in augment`: a per-segment reward term (called in the batch augmentation) that raises on one rank."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_rank() == int(__import__("os").environ.get("FAIL_ON_RANK", "-1")):
        raise RuntimeError(f"segment reward failed on rank {dist.get_rank()}")
    return 0.0


def _failing_rank() -> bool:
    import torch.distributed as dist

    return dist.is_initialized() and dist.get_rank() == int(__import__("os").environ.get("FAIL_ON_RANK", "-1"))


def estimator_bad_width(batch, trainer):
    """`--fail_in estimator_shape`: GRPO, but token-level advantages one column too wide on one rank."""
    from trl_agentic.estimators import grpo_estimator

    advantages = grpo_estimator(batch, trainer)
    if _failing_rank():
        return advantages[:, None].expand(-1, batch.completion_ids.size(1) + 1)
    return advantages


def estimator_missing_row_advantages(batch, trainer):
    """`--fail_in estimator_rows`: on one rank an `EstimatorResult` with an extra row but no advantage for it."""
    from trl_agentic.estimators import EstimatorResult, grpo_estimator
    from trl_agentic.rollout.types import ExtraRow, RowKind

    advantages = grpo_estimator(batch, trainer)
    if not _failing_rank():
        return advantages
    row = ExtraRow(
        kind=RowKind.EXPANSION,
        parent=0,
        prompt_ids=batch.prompt_ids[0][batch.prompt_mask[0].bool()].tolist(),
        completion_ids=batch.completion_ids[0][batch.completion_mask[0].bool()].tolist(),
        tool_mask=batch.tool_mask[0][batch.completion_mask[0].bool()].tolist(),
        logprobs=None,
    )
    return EstimatorResult(advantages=advantages, extra_rows=[row], extra_advantages=None)


def _break_rlvcr_step_parsing() -> None:
    """`--fail_in rlvcr`: RLVCR's step parsing (before its own first collective) raises on one rank."""
    from trl_agentic.rlvcr import estimator

    original = estimator.find_steps

    def find_steps(*args, **kwargs):
        if _failing_rank():
            raise RuntimeError("RLVCR step parsing failed on rank 1")
        return original(*args, **kwargs)

    estimator.find_steps = find_steps


def total_reward(environments, **kwargs):
    return [float(env.total) for env in environments]


def call(name: str, **arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call><|im_end|>"


GOOD = call("add", n=1)
BAD = call("add", n="x")  # TypeError in the tool -> rollback (and a negative row)
DELETE = call("delete_context", message_ids=[2])  # the first tool result; the marked first turn stays
DONE = "Done.<|im_end|>"


def _scenario(name: str, rows_per_rank: int):
    """`plan(g)`: the answers of global rollout `g` after its first turn, in order (then `DONE` forever)."""
    if name == "parity":
        # Different numbers of failures per rank (rank 0: rows 0-5, rank 1: rows 6-11 with 6 rows per rank) and a
        # group (rows 4-7) split across the ranks with a failure on each side. Row 1 exhausts its retries.
        failures = {0: 1, 1: 3, 4: 1, 7: 1, 9: 1}
        return lambda g: [BAD] * failures.get(g, 0) + [GOOD, DONE]
    if name == "rank0_fails":
        # Only rank 0's tools fail: rank 0 rolls back and regenerates, rank 1 idles (dummy generation calls).
        return lambda g: [BAD, BAD, GOOD, DONE] if g < rows_per_rank else [DONE]
    if name == "rank0_retries_snapshots":
        # Rank 0: three retries of one turn, then two context deletions (snapshots); rank 1: one tool round only.
        return lambda g: [BAD, BAD, BAD, DELETE, GOOD, DELETE, GOOD, DONE] if g < rows_per_rank else [DONE]
    if name == "all_features":
        # Both ranks roll back and take snapshots, different amounts on each.
        def plan(g):
            if g % 3 == 0:
                return [BAD, GOOD, DELETE, GOOD, DONE]
            if g % 3 == 1 and g < rows_per_rank:
                return [BAD, BAD, DELETE, DELETE, GOOD, DONE]
            return [GOOD, DONE]

        return plan
    raise ValueError(f"unknown scenario {name!r}")


class ScriptedGeneration:
    """Stands in for `GRPOTrainer._generate_single_turn`.

    The first call of a generation round answers row `pos` of this rank with `[row g] <add(g + 1)>`, `g` the global
    row index; every later context is attributed to its rollout by that marker and gets the rollout's next planned
    answer. With `exercise_model`, TRL's real generation also runs (2 new tokens, output discarded) on every call, so
    calls stay collectives under ZeRO-3 exactly as in a real run and unmatched calls would hang.
    """

    def __init__(self, trainer, plan, exercise_model: bool, level_steps: bool = False):
        self.trainer = trainer
        self.tok = trainer._tokenizer
        self.real = trainer._generate_single_turn
        self.plan = plan
        self.exercise_model = exercise_model
        self.level_steps = level_steps
        self.new_round = False
        self.served = Counter()
        self.calls = 0
        self.dummy_calls = 0
        self.forcing_calls = 0
        self.in_dummy = False
        self.in_loop = False

    def first_turn(self, g: int) -> str:
        action = call("add", n=g + 1)
        if self.level_steps and DELETE not in self.plan(g):
            # An RLVCR step (`rlvcr_action_tag="tool_call"`), the marker inside the thinking. Rollouts that delete
            # context keep the plain form: their marker must survive the re-rendering of the conversation.
            return f"<level>2</level>\n<think>[row {g}] Adding.</think>\n{action}"
        return f"[row {g}] {action}"

    def start_round(self):
        self.new_round = True
        self.served.clear()

    def __call__(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        self.calls += 1
        if self.exercise_model:
            config = self.trainer.generation_config
            saved = config.max_new_tokens
            config.max_new_tokens = 2
            try:
                self.real(prompt_ids, images, multimodal_fields, num_generations, has_tool_images)
            finally:
                config.max_new_tokens = saved
        if self.in_dummy:
            self.dummy_calls += 1
            texts = [DONE] * len(prompt_ids)
        elif self.new_round:
            self.new_round = False
            rank, n = self.trainer.accelerator.process_index, len(prompt_ids)
            texts = [self.first_turn(rank * n + pos) for pos in range(n)]
        elif not self.in_loop:  # RLVCR's alternative thinking (level-forcing prompts), after the rollouts
            self.forcing_calls += 1
            texts = ["Forced thinking.</think>\n<tool_call>\n{}\n</tool_call><|im_end|>"] * len(prompt_ids)
        else:
            texts = []
            for ids in prompt_ids:
                match = ROW_MARK.search(self.tok.decode(ids))
                if match is None:
                    raise AssertionError("a non-dummy continuation without a row marker")
                g = int(match.group(1))
                k = self.served[g]
                self.served[g] += 1
                answers = self.plan(g)
                texts.append(answers[k] if k < len(answers) else DONE)
        return [self.tok.encode(t, add_special_tokens=False) for t in texts], None


def _row_record(batch: dict, k: int, pad_id: int) -> dict:
    prompt = batch["prompt_ids"][k][batch["prompt_mask"][k].bool()].tolist()
    completion = batch["completion_ids"][k].tolist()
    while completion and completion[-1] == pad_id:
        completion.pop()
    mask = (batch["completion_mask"][k] * batch["tool_mask"][k]).tolist()[: len(completion)]
    advantage = batch["advantages"][k]
    return {
        "prompt": prompt,
        "completion": completion,
        "loss_mask": mask,
        "kind": int(batch["row_kind"][k]),
        "group": int(batch["group_id"][k]),
        "advantage": advantage.tolist() if advantage.dim() else float(advantage),
    }


class Recorder(TrainerCallback):
    """Records batches, loop counters, losses and (optionally) gradients of this rank."""

    def __init__(self, trainer, generation: ScriptedGeneration, out_dir: Path, record_grads: bool):
        self.trainer = trainer
        self.generation = generation
        self.out_dir = out_dir
        self.record_grads = record_grads
        self.batches, self.losses, self.loop_stats = [], [], []
        self.tracin_rows = []  # per scored row: content, TracIn score and selection
        self.validation_batches = 0
        self.in_validation = False
        self.grads = None
        original_gen = trainer._generate_and_score_completions
        original_loss = trainer.compute_loss
        pad_id = trainer._tokenizer.pad_token_id

        def generate_and_score(inputs):
            generation.start_round()
            batch = original_gen(inputs)
            if self.in_validation:  # TracIn's validation rollouts go through the same path
                self.validation_batches += 1
                return batch
            rows = batch["prompt_ids"].size(0)
            self.batches.append(
                {
                    "rows": [_row_record(batch, k, pad_id) for k in range(rows)],
                    "num_items_in_batch": float(batch["num_items_in_batch"]),
                    "local_loss_tokens": float((batch["completion_mask"] * batch["tool_mask"]).sum()),
                }
            )
            result = trainer._last_loop_result
            self.loop_stats.append(vars(result.stats).copy() if result is not None else None)
            return batch

        def compute_loss(model, inputs, *args, **kwargs):
            loss = original_loss(model, inputs, *args, **kwargs)
            self.losses.append(float(loss.detach()))
            return loss

        trainer._generate_and_score_completions = generate_and_score
        trainer.compute_loss = compute_loss
        if getattr(trainer, "_tracin", None) is not None:
            original_validation = trainer._tracin_rollout_validation

            def rollout_validation(rows):
                self.in_validation = True
                try:
                    return original_validation(rows)
                finally:
                    self.in_validation = False

            trainer._tracin_rollout_validation = rollout_validation
            original_select = trainer._tracin_select

            def tracin_select(scores, batches):
                mine = original_select(scores, batches)
                local = trainer._tracin.last["scores"]  # this process's share of the global objective's scores
                rows = [_row_record(b, k, pad_id) for b in batches for k in range(b["prompt_ids"].size(0))]
                for row, score, chosen in zip(rows, local.tolist(), mine.tolist(), strict=True):
                    if row["kind"] != 3:  # padding rows are never selected and have no counterpart in 1 process
                        self.tracin_rows.append({**row, "score": score, "selected": bool(chosen)})
                return mine

            trainer._tracin_select = tracin_select

        # Tell the scripted generation which calls are the loop's dummy ones (observation only).
        original_loop_generate = loop_module.AgenticRolloutLoop._generate

        def loop_generate(loop, rollouts, queued):
            generation.in_dummy, generation.in_loop = not queued, True
            try:
                return original_loop_generate(loop, rollouts, queued)
            finally:
                generation.in_dummy, generation.in_loop = False, False

        loop_module.AgenticRolloutLoop._generate = loop_generate

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.record_grads and self.grads is None:  # the first optimizer step: gradients all-reduced by DDP
            model = self.trainer.accelerator.unwrap_model(self.trainer.model_wrapped)
            self.grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}

    def _tracin_selected(self):
        state = getattr(self.trainer, "_tracin", None)
        last = getattr(state, "last", None) if state is not None else None
        if not last or "selected" not in last:
            return None
        return [bool(x) for x in torch.as_tensor(last["selected"]).flatten().tolist()]

    def _tracin_direction(self):
        """The validation gradient V, flattened (None without TracIn)."""
        state = getattr(self.trainer, "_tracin", None)
        if state is None or not state.direction:
            return None
        return torch.cat([torch.cat([g.A.flatten(), g.B.flatten()]) for g in state.direction.values()]).tolist()

    def dump(self, extra: dict | None = None) -> None:
        rank = self.trainer.accelerator.process_index
        record = {
            "rank": rank,
            "num_processes": self.trainer.accelerator.num_processes,
            "distributed_type": str(self.trainer.accelerator.distributed_type),
            "batches": self.batches,
            "losses": self.losses,
            "loop_stats": self.loop_stats,
            "generation_calls": self.generation.calls,
            "scripted_dummy_calls": self.generation.dummy_calls,
            "forcing_calls": self.generation.forcing_calls,
            "validation_batches": self.validation_batches,
            "tracin_selected": self._tracin_selected(),
            "tracin_rows": self.tracin_rows,
            "tracin_direction": self._tracin_direction(),
            "log_history": self.trainer.state.log_history,
            **(extra or {}),
        }
        (self.out_dir / f"rank{rank}.json").write_text(json.dumps(record))
        if self.grads is not None:
            torch.save(self.grads, self.out_dir / f"grads_rank{rank}.pt")


class InitialState(TrainerCallback):
    """Saves (rank 0) the full state dict once the engine exists, gathered under ZeRO-3 (a collective on all ranks)."""

    def __init__(self, trainer, path: Path):
        self.trainer, self.path = trainer, path

    def on_train_begin(self, args, state, control, **kwargs):
        accelerator = self.trainer.accelerator
        state_dict = accelerator.get_state_dict(self.trainer.model_wrapped)
        if accelerator.is_main_process:
            torch.save({k: v.detach().clone().float() for k, v in state_dict.items()}, self.path)


def parse_args(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--scenario", required=True)
    p.add_argument("--per_device_train_batch_size", type=int, default=2)
    p.add_argument("--rows_per_rank", type=int, required=True, help="rollouts per rank in the 2-process layout")
    p.add_argument("--num_generations", type=int, default=2)
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument("--steps_per_generation", type=int, default=None)
    p.add_argument("--max_steps", type=int, default=1)
    p.add_argument("--lora", action="store_true")
    p.add_argument("--snapshots", action="store_true")
    p.add_argument("--beta", type=float, default=0.0)
    p.add_argument("--max_tool_retries", type=int, default=2)
    p.add_argument("--max_negative_samples_per_group", type=int, default=2)
    p.add_argument("--exercise_model", action="store_true")
    p.add_argument("--record_grads", action="store_true")
    p.add_argument("--optim", default="adamw_torch")
    p.add_argument("--loss_type", default="dapo")
    p.add_argument("--fail_on_rank", type=int, default=-1, help="inject an exception on this rank only")
    p.add_argument("--user_turns", action="store_true", help="conversations with further user turns on rank 0")
    p.add_argument(
        "--fail_in", default="loop", choices=["loop", "augment", "estimator_shape", "estimator_rows", "rlvcr"]
    )
    p.add_argument("--learning_rate", type=float, default=1e-2)
    p.add_argument("--rlvcr", action="store_true", help="RLVCR (CoPO) advantages with expansion rows")
    p.add_argument("--tracin", action="store_true", help="TracIn-filtered training (needs --lora)")
    p.add_argument("--tracin_val_batch_size", type=int, default=1, help="validation prompts per process")
    p.add_argument("--tracin_selection", default="positive")
    p.add_argument("--tracin_top_fraction", type=float, default=0.5)
    p.add_argument("--tracin_min_selected", type=int, default=1)
    p.add_argument(
        "--stack_dump_after", type=float, default=0.0, help="print every thread's stack and exit after this many s"
    )
    return p.parse_args(argv)


def prompts(n: int) -> Dataset:
    # Equal token lengths: no left padding, so a row's log-probs do not depend on the other prompts of its batch.
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": f"Add up to {k:02d}."}] for k in range(n)]})


def build(args):
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    peft_config = None
    if args.lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0)
    extra = {}
    if args.rlvcr:
        extra.update(advantage_estimator="rlvcr", rlvcr_mode="copo", rlvcr_action_tag="tool_call", rlvcr_expand=True)
    environment = ConversationCounterEnv if args.user_turns else CounterEnv
    if args.fail_on_rank >= 0:
        FAIL["rank"] = args.fail_on_rank
        __import__("os").environ["FAIL_ON_RANK"] = str(args.fail_on_rank)
        # The script's own module is importable: tests/distributed/scripts is on the path of `python script.py`.
        if args.fail_in == "loop":
            environment = FailingConversationEnv
        elif args.fail_in == "augment":
            extra.update(snapshot_reward_func="train_scripted:failing_segment_reward")
        elif args.fail_in == "estimator_shape":
            extra.update(advantage_estimator="train_scripted:estimator_bad_width")
        elif args.fail_in == "estimator_rows":
            extra.update(advantage_estimator="train_scripted:estimator_missing_row_advantages")
        else:
            _break_rlvcr_step_parsing()
    if args.tracin:
        extra.update(
            tracin_enabled=True,
            tracin_val_num_generations=2,
            tracin_val_batch_size=args.tracin_val_batch_size,
            tracin_selection=args.tracin_selection,
            tracin_top_fraction=args.tracin_top_fraction,
            tracin_min_selected=args.tracin_min_selected,
        )
    config = AgenticGRPOConfig(
        output_dir=str(out / "trainer"),
        use_cpu=True,
        bf16=False,
        report_to="none",
        seed=0,
        max_steps=args.max_steps,
        learning_rate=args.learning_rate,
        optim=args.optim,
        max_grad_norm=0.0,  # no clipping: the 1- and 2-process gradients compare directly
        per_device_train_batch_size=args.per_device_train_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        steps_per_generation=args.steps_per_generation,
        num_generations=args.num_generations,
        max_completion_length=512,
        max_tool_calling_iterations=8,
        loss_type=args.loss_type,
        beta=args.beta,
        logging_steps=1,
        save_strategy="no",
        gradient_checkpointing=False,
        enable_tool_rollback=True,
        save_negative_samples=True,
        max_tool_retries=args.max_tool_retries,
        max_negative_samples_per_group=args.max_negative_samples_per_group,
        negative_sample_reward=-1.0,
        enable_context_snapshots=args.snapshots,
        max_snapshots_per_episode=4,
        **extra,
    )
    trainer = AgenticGRPOTrainer(
        model=args.model,
        reward_funcs=total_reward,
        args=config,
        train_dataset=prompts(64),
        environment_factory=environment,
        peft_config=peft_config,
        tracin_eval_dataset=prompts(4) if args.tracin else None,
    )
    plan = _scenario(args.scenario, args.rows_per_rank)
    generation = ScriptedGeneration(trainer, plan, args.exercise_model, level_steps=args.rlvcr)
    trainer._generate_single_turn = generation
    recorder = Recorder(trainer, generation, out, args.record_grads)
    trainer.add_callback(recorder)
    return trainer, recorder, out


def run(argv=None) -> None:
    args = parse_args(argv)
    if args.stack_dump_after > 0:  # a hang shows where each rank waits, then the rank exits (the test fails fast)
        faulthandler.dump_traceback_later(args.stack_dump_after, exit=True)
    _no_shm_kernel()  # before the config starts the distributed state
    trainer, recorder, out = build(args)
    rank = trainer.accelerator.process_index
    try:
        if args.lora:
            trainer.add_callback(InitialState(trainer, out / "initial_state.pt"))
        trainer.train()
        extra = {}
        if args.lora:
            trainer.save_model(str(out / "final"))
        elif trainer.accelerator.is_main_process:
            model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
            torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, out / "final_state.pt")
        recorder.dump(extra)
        trainer.accelerator.wait_for_everyone()
        if trainer.accelerator.is_main_process:
            (out / "DONE").write_text("ok")
    except BaseException:
        (out / f"error_rank{rank}.txt").write_text(traceback.format_exc())
        _shutdown_distributed()
        raise
    _shutdown_distributed()  # then a normal interpreter exit: the trainer registered trl_agentic.gloo_exit's pause


def _shutdown_distributed() -> None:
    """Same teardown as the CLI (`trl_agentic.cli._shutdown_distributed`): without it a finished rank can abort at exit."""
    from trl_agentic.cli import _shutdown_distributed as shutdown

    faulthandler.cancel_dump_traceback_later()
    shutdown()


def _no_shm_kernel() -> None:
    """Keep DeepSpeed on torch.distributed's gloo collectives.

    DeepSpeed's CPU accelerator JIT-compiles a shared-memory all-reduce kernel when its communication backend starts
    (minutes of g++ on a fresh machine). It is a CPU-only speed-up that GPU runs never use.
    """
    try:
        # Not `import deepspeed.comm.torch as ...`: the package attribute `torch` is the torch module itself.
        ds_comm = importlib.import_module("deepspeed.comm.torch")
    except ImportError:
        return
    ds_comm.build_shm_op = lambda: None


if __name__ == "__main__":
    run()

"""Features-off parity on several processes: TRL's `GRPOTrainer`, then `AgenticGRPOTrainer`, in the same launch.

Run under `accelerate launch` (DDP on gloo, or DeepSpeed ZeRO-2) by `tests/distributed/test_distributed.py`. Both
trainers train the tiny model from the same start with real generation (sampling), the same seed and settings, and
every rank saves, per trainer, `{trainer}_rank{k}.pt`: the gathered rewards of every reward function, every batch it
trained on (TRL's keys, before TRL shuffles and splits it), every micro-step loss, the logged metrics and the weights
after training. The test compares them bit for bit. Each rank also writes `parity_rank{k}.json` (its layout) and rank
0 writes `DONE` once every rank got to the end.

GRPOTrainer runs first: if running two trainers in one process changed anything, it would change the second run, i.e.
ours, and the comparison would fail rather than pass by accident.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import random
import sys
import traceback
from pathlib import Path

import torch
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_scripted import _no_shm_kernel, _shutdown_distributed  # noqa: E402

from trl_agentic import AgenticGRPOConfig, AgenticGRPOTrainer  # noqa: E402


def reward_text(completions, **kwargs):
    # A pseudo-random real number per completion text, the same in every process and run.
    return [random.Random(c[0]["content"]).uniform(-1.0, 2.0) for c in completions]


def reward_vowels(completions, **kwargs):
    return [sum(ch in "aeiou" for ch in c[0]["content"]) / 7.0 for c in completions]


WORDS = ["cats", "rain", "tea", "jazz", "maps", "salt", "owls", "glue", "iron", "moss", "pine", "wax"]


def parse_args(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--num_generations", type=int, default=6)
    p.add_argument("--per_device_train_batch_size", type=int, default=3)
    p.add_argument("--steps_per_generation", type=int, default=2)
    p.add_argument("--loss_type", default="grpo")
    p.add_argument("--max_steps", type=int, default=4)
    p.add_argument("--stack_dump_after", type=float, default=0.0)
    return p.parse_args(argv)


def train(trainer_cls, config_cls, args, out: Path) -> int:
    config = config_cls(
        output_dir=str(out / trainer_cls.__name__),
        use_cpu=True,
        bf16=False,
        report_to="none",
        seed=7,
        max_steps=args.max_steps,
        learning_rate=1e-2,
        max_completion_length=12,
        num_generations=args.num_generations,
        per_device_train_batch_size=args.per_device_train_batch_size,
        steps_per_generation=args.steps_per_generation,
        loss_type=args.loss_type,
        logging_steps=1,
        save_strategy="no",
    )
    dataset = Dataset.from_dict(
        {"prompt": [[{"role": "user", "content": f"Say something about {w}."}] for w in WORDS]}
    )
    trainer = trainer_cls(
        model=args.model, reward_funcs=[reward_text, reward_vowels], args=config, train_dataset=dataset
    )
    record = {"rewards": [], "batches": [], "losses": []}
    calculate, generate, compute = (
        trainer._calculate_rewards,
        trainer._generate_and_score_completions,
        trainer._compute_loss,
    )

    def calculate_rewards(*a, **k):
        rewards = calculate(*a, **k)
        record["rewards"].append(rewards.detach().cpu().clone())
        return rewards

    def generate_and_score(inputs):
        batch = generate(inputs)
        record["batches"].append(
            {k: v.detach().cpu().clone() for k, v in batch.items() if isinstance(v, torch.Tensor)}
        )
        return batch

    def compute_loss(model, inputs):
        loss = compute(model, inputs)
        record["losses"].append(loss.detach().cpu().clone())
        return loss

    trainer._calculate_rewards = calculate_rewards
    trainer._generate_and_score_completions = generate_and_score
    trainer._compute_loss = compute_loss
    trainer.train()
    rank = trainer.accelerator.process_index
    record["history"] = [
        {k: v for k, v in h.items() if k not in ("step_time", "train_runtime", "train_samples_per_second")}
        for h in trainer.state.log_history
    ]
    model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    record["weights"] = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    torch.save(record, out / f"{trainer_cls.__name__}_rank{rank}.pt")
    layout = {
        "rank": rank,
        "num_processes": trainer.accelerator.num_processes,
        "distributed_type": str(trainer.accelerator.distributed_type),
    }
    (out / f"parity_rank{rank}.json").write_text(json.dumps(layout))
    trainer.accelerator.wait_for_everyone()
    return rank


def run(argv=None) -> None:
    args = parse_args(argv)
    if args.stack_dump_after > 0:  # a hang shows where each rank waits, then the rank exits (the test fails fast)
        faulthandler.dump_traceback_later(args.stack_dump_after, exit=True)
    _no_shm_kernel()
    out = Path(args.out)
    rank = 0
    try:
        train(GRPOTrainer, GRPOConfig, args, out)
        rank = train(AgenticGRPOTrainer, AgenticGRPOConfig, args, out)
        if rank == 0:
            (out / "DONE").write_text("ok")
    except BaseException:
        import os

        (out / f"error_rank{os.environ.get('RANK', rank)}.txt").write_text(traceback.format_exc())
        _shutdown_distributed()
        raise
    _shutdown_distributed()


if __name__ == "__main__":
    run()

"""A deterministic tiny-model LoRA run with rollback, negatives, snapshots and TracIn, used by the kill-and-resume test.

usage: python resumable_run.py MODEL_DIR OUTPUT_DIR MAX_STEPS [RESUME_CHECKPOINT]
Writes OUTPUT_DIR/losses-<pid>.jsonl with one line per optimizer step: {"step", "loss", "tracin": the logged
`tracin/*` metrics, "tracin_v": a SHA-256 of the validation gradient V the step used, "tracin_refreshes"}, and
OUTPUT_DIR/saved-<step> (atomically) once checkpoint-<step> is completely written.
"""

import hashlib
import json
import os
import sys

import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoTokenizer, TrainerCallback

from trl_agentic import AgenticGRPOConfig, AgenticGRPOTrainer


class Env:
    def reset(self, **kwargs):
        self.total = 0

    def add(self, n: int) -> str:
        """
        Add a number.

        Args:
            n: The number.
        """
        if n % 3 == 0:
            raise NameError(f"name 'n{n}' is not defined")  # a model error: rollback + negative
        self.total += n
        return "ok " + "lorem ipsum " * 20  # long, so deleting it frees context


def reward(environments, **kwargs):
    return [float(e.total % 5) for e in environments]


def call(name, **arguments):
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call><|im_end|>"


class Script:
    """Random choices from torch's RNG, which checkpoints save and resume restores."""

    def __init__(self, tok):
        self.tok = tok

    def __call__(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        out = []
        for ids in prompt_ids:
            text = self.tok.decode(ids)
            rounds = text.count("<tool_response>")
            draw = int(torch.randint(0, 6, (1,)).item())
            if rounds >= 2:
                out.append(f"Done {draw}.<|im_end|>")
            elif rounds == 1 and draw == 0 and "[deleted]" not in text:
                out.append(call("delete_context", message_ids=[2]))
            else:
                out.append(call("add", n=draw + 1))
        return [self.tok.encode(s, add_special_tokens=False) for s in out], None


def digest(direction) -> str:
    """SHA-256 of V's exact bytes, layer by layer in name order (equal digests: bitwise-equal V)."""
    sha = hashlib.sha256()
    for name in sorted(direction):
        sha.update(name.encode())
        for tensor in direction[name]:
            sha.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return sha.hexdigest()


class LossFile(TrainerCallback):
    def __init__(self, path):
        self.path = path
        self.trainer = None

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            tracin = self.trainer._tracin  # V is refreshed at the start of a step, so this is the step's V
            record = {
                "step": state.global_step,
                "loss": logs["loss"],
                "tracin": {k: v for k, v in logs.items() if k.startswith("tracin/")},
                "tracin_v": digest(tracin.direction),
                "tracin_refreshes": tracin.refreshes,
            }
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")


class SavedMarker(TrainerCallback):
    """Writes OUTPUT_DIR/saved-<step> once checkpoint-<step> is complete (`on_save` runs after the whole save),
    atomically: a reader never sees a half-written marker, and the marker never precedes the checkpoint."""

    def on_save(self, args, state, control, **kwargs):
        path = os.path.join(args.output_dir, f"saved-{state.global_step}")
        with open(path + ".tmp", "w") as f:
            f.write(os.path.join(args.output_dir, f"checkpoint-{state.global_step}"))
            f.flush()
            os.fsync(f.fileno())
        os.replace(path + ".tmp", path)


def main():
    model_dir, out, max_steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    resume = sys.argv[4] if len(sys.argv) > 4 else None
    prompts = [[{"role": "user", "content": f"Task {i}: add numbers."}] for i in range(8)]
    val_prompts = [[{"role": "user", "content": f"Check {i}: add numbers."}] for i in range(6)]
    args = AgenticGRPOConfig(
        output_dir=out,
        use_cpu=True,
        bf16=False,
        report_to="none",
        seed=7,
        max_steps=max_steps,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=4096,
        learning_rate=5e-2,
        logging_steps=1,
        save_strategy="steps",
        save_steps=2,
        data_seed=7,
        enable_tool_rollback=True,
        save_negative_samples=True,
        max_tool_retries=2,
        max_negative_samples_per_group=2,
        enable_context_snapshots=True,
        tracin_enabled=True,
        tracin_val_batch_size=2,
        tracin_val_num_generations=2,
        # V is refreshed at steps 1 and 4: the resumed run's first step (3) must reuse the V saved in checkpoint-2.
        tracin_val_refresh_steps=3,
    )
    loss_file = LossFile(os.path.join(out, f"losses-{os.getpid()}.jsonl"))
    trainer = AgenticGRPOTrainer(
        model=model_dir,
        reward_funcs=reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        environment_factory=Env,
        tracin_eval_dataset=Dataset.from_dict({"prompt": val_prompts}),
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"),
        callbacks=[loss_file, SavedMarker()],
    )
    loss_file.trainer = trainer
    trainer._generate_single_turn = Script(AutoTokenizer.from_pretrained(model_dir))
    trainer.train(resume_from_checkpoint=resume)


if __name__ == "__main__":
    main()

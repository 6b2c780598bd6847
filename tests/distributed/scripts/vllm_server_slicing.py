"""Unequal generation calls through TRL's vLLM server-mode code path, with the vLLM server replaced by a function.

Run under `accelerate launch` with 2 processes. Rank 0 sends 3 contexts and rank 1 sends 1, as the rollout loop does
when rank 0 has more rollouts to continue. TRL's `VLLMGeneration.generate` (server mode, the real code) gathers the
prompts, "generates" on the main process (the fake client answers `[1000 + len(p), p[-1]]` for prompt `p`) and hands
process k the slice `[k * n, (k + 1) * n)` of the outputs. Each rank writes `slicing_rank{k}.json` with whether the
outputs it got belong to its own contexts, through `_generate_single_turn` directly, through `TrainerBackend` and
through `generate_single_turn`.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
from pathlib import Path
from types import SimpleNamespace

from accelerate import Accelerator
from trl.generation.vllm_generation import VLLMGeneration

from trl_agentic.rollout.trl_backend import TrainerBackend, generate_single_turn


class FakeVLLMClient:
    def generate(self, prompts, features=None, n=1, **sampling_params):
        assert n == 1
        completions = [[1000 + len(p), p[-1]] for p in prompts]
        return {
            "prompt_ids": prompts,
            "completion_ids": completions,
            "logprobs": [[[-0.5], [-0.25]] for _ in completions],
        }


def expected(context: list[int]) -> list[int]:
    return [1000 + len(context), context[-1]]


class FakeServerTrainer:
    """The attributes `TrainerBackend` reads, and TRL 1.16's vLLM branch of `_generate_single_turn`."""

    use_vllm = True
    vllm_mode = "server"
    _is_vlm = False
    max_completion_length = 16
    max_tool_calling_iterations = 4
    environment_factories = None
    tools = []

    def __init__(self, accelerator):
        self.accelerator = accelerator
        self._tokenizer = SimpleNamespace(eos_token_id=2, pad_token_id=0)
        self.eos_token_ids = [2]
        self.model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=64))
        generation = object.__new__(VLLMGeneration)  # no vLLM engine: only the server-mode path runs
        generation.__dict__.update(
            accelerator=accelerator,
            mode="server",
            vllm_client=FakeVLLMClient(),
            temperature=1.0,
            top_p=1.0,
            top_k=-1,
            min_p=None,
            repetition_penalty=1.0,
            max_completion_length=self.max_completion_length,
            logprobs=0,
            structured_outputs_regex=None,
            generation_kwargs={},
            enable_sleep_mode=False,
        )
        self.vllm_generation = generation

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        # grpo_trainer.py (1.16) `_generate_single_turn`, vLLM branch, minus the weight sync.
        _, completion_ids, logprobs, _ = self.vllm_generation.generate(
            prompts=prompt_ids, images=images, num_generations=num_generations
        )
        return completion_ids, [[lp[0] for lp in seq] for seq in logprobs]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--stack_dump_after", type=float, default=0.0)
    args = parser.parse_args()
    if args.stack_dump_after > 0:
        faulthandler.dump_traceback_later(args.stack_dump_after, exit=True)
    accelerator = Accelerator(cpu=True)
    rank = accelerator.process_index
    contexts = [[5, 6, 7], [8, 9], [10]] if rank == 0 else [[11, 12, 13, 14]]
    trainer = FakeServerTrainer(accelerator)

    raw, _ = trainer._generate_single_turn(contexts, None, {}, num_generations=1)
    backend = TrainerBackend(trainer)
    fixed, fixed_logprobs = backend.generate(contexts)
    helper, _ = generate_single_turn(trainer, contexts)  # the same padding, for callers outside the rollout loop
    record = {
        "rank": rank,
        "num_processes": accelerator.num_processes,
        "equal_counts": backend.equal_counts,
        "raw_ok": [list(x) for x in raw] == [expected(c) for c in contexts],
        "fixed": [list(x) for x in fixed],
        "fixed_ok": [list(x) for x in fixed] == [expected(c) for c in contexts],
        "helper_ok": [list(x) for x in helper] == [expected(c) for c in contexts],
        "fixed_logprobs": fixed_logprobs,
    }
    out = Path(args.out)
    (out / f"slicing_rank{rank}.json").write_text(json.dumps(record))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (out / "DONE").write_text("ok")
    from trl_agentic.cli import _shutdown_distributed  # the CLI's teardown, with trl_agentic.gloo_exit's exit pause

    faulthandler.cancel_dump_traceback_later()
    _shutdown_distributed()


if __name__ == "__main__":
    main()

"""Fault injection: tools that raise, hang, flood, crash or leak state; training completes, every fault is counted,
no rollout is lost or duplicated, and the loss stays finite."""

import json
import math
import random
import threading

import torch
from datasets import Dataset

from trl_agentic import AgenticGRPOConfig, AgenticGRPOTrainer
from trl_agentic.errors import InfrastructureError
from trl_agentic.rollout.types import RowKind

FAULTS = ("ok", "ok", "raise", "hang", "huge", "crash", "model_error", "leak")


class ServiceDown(InfrastructureError):
    """The tool's backend is unreachable: not the model's fault (retried in place, never trained on)."""


class FaultyEnv:
    """Each call draws a fault from a seeded RNG and records it in a class-level ledger (outside the env state, so
    restores and pooling cannot hide a fault from the test)."""

    ledger: list[str] = []
    rng = random.Random(0)
    leaked = 0  # class-level on purpose: state that leaks between episodes
    clock = None  # the test's `tool_clock`: a hanging call declares itself hung to it, then blocks until released
    release = threading.Event()

    def reset(self, **kwargs):
        self.calls = 0

    def work(self, x: int) -> str:
        """
        Do some work.

        Args:
            x: Input.
        """
        fault = FaultyEnv.rng.choice(FAULTS)
        FaultyEnv.ledger.append(fault)
        self.calls += 1
        if fault == "raise":
            raise RuntimeError("tool exploded")
        if fault == "hang":
            FaultyEnv.clock.hang()
            FaultyEnv.release.wait()
            return "late"
        if fault == "huge":
            return "y" * 3_000_000
        if fault == "crash":
            raise ServiceDown("the tool service is down")
        if fault == "model_error":
            raise NameError(f"name 'v{x}' is not defined")
        if fault == "leak":
            FaultyEnv.leaked += 1
        return str(x * 2)


def reward(completions, **kwargs):
    return [float(sum(m["role"] == "tool" for m in c)) for c in completions]


def _call(x):
    return f"<tool_call>\n{json.dumps({'name': 'work', 'arguments': {'x': x}})}\n</tool_call><|im_end|>"


class Script:
    """Up to three tool rounds per rollout, then an answer; decided from the context so it needs no state."""

    def __init__(self, tok):
        self.tok = tok

    def __call__(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        out = []
        for ids in prompt_ids:
            rounds = self.tok.decode(ids).count("<tool_response>")
            out.append(_call(rounds + 1) if rounds < 3 else "Finished.<|im_end|>")
        return [self.tok.encode(s, add_special_tokens=False) for s in out], None


def test_many_faulty_rollouts_complete_counted_and_finite(tiny_model_dir, tiny_tokenizer, tmp_path, tool_clock):
    FaultyEnv.ledger, FaultyEnv.rng, FaultyEnv.leaked = [], random.Random(0), 0
    FaultyEnv.clock, FaultyEnv.release = tool_clock, threading.Event()
    n_prompts, group = 4, 4
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"task {i}"}] for i in range(n_prompts)] * 3})
    args = AgenticGRPOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        report_to="none",
        seed=0,
        max_steps=3,
        per_device_train_batch_size=n_prompts * group,
        num_generations=group,
        max_completion_length=2048,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no",
        enable_tool_rollback=True,
        save_negative_samples=True,
        max_negative_samples_per_group=2,
        max_tool_retries=1,
        rollback_on_errors=["NameError"],
        tool_timeout=30.0,  # never reached: `tool_clock` times out exactly the hanging calls
        max_tool_output_chars=2000,
        max_infra_retries=1,
    )
    trainer = AgenticGRPOTrainer(
        model=tiny_model_dir, reward_funcs=reward, args=args, train_dataset=dataset, environment_factory=FaultyEnv
    )
    trainer._generate_single_turn = Script(tiny_tokenizer)
    seen = []
    original = trainer._augmenter

    def capture(output, inputs, rewards_per_func, loop_result):
        batch = original(output, inputs, rewards_per_func, loop_result)
        seen.append((len(inputs), loop_result, batch))
        return batch

    trainer._augmenter = capture
    try:
        trainer.train()
    finally:
        FaultyEnv.release.set()  # let the abandoned calls end

    assert len(seen) == 3
    injected = {f: FaultyEnv.ledger.count(f) for f in FAULTS}
    assert all(injected[f] > 0 for f in ("raise", "hang", "huge", "crash", "model_error", "leak"))
    failures = sum(r.stats.tool_failures for _, r, _ in seen)
    infra_retries = sum(r.stats.infra_retries for _, r, _ in seen)
    calls = sum(r.stats.tool_calls for _, r, _ in seen)
    rollbacks = sum(r.stats.rollback_attempts for _, r, _ in seen)
    truncated = sum(r.stats.truncated_outputs for _, r, _ in seen)
    retired = sum(r.stats.retired_environments for _, r, _ in seen)
    # Every executed call is in the ledger once; every faulty execution is either retried (infra) or counted.
    assert len(FaultyEnv.ledger) == calls + infra_retries
    counted_faults = injected["raise"] + injected["hang"] + injected["crash"] + injected["model_error"]
    assert failures + infra_retries == counted_faults
    assert rollbacks > 0
    # Every call that hung past tool_timeout left its environment behind (a fresh restored one took its place).
    assert retired == injected["hang"] > 0
    # Every huge output was cut (and counted); nothing else was that long.
    assert truncated == injected["huge"]
    # Leaked class-level state is invisible to the trainer by construction (the built-in Python sandbox prevents it by
    # running each episode in a fresh process); here it must not have cost or duplicated a row (checked below).
    assert FaultyEnv.leaked == injected["leak"]
    for n_inputs, result, batch in seen:
        kinds = batch["row_kind"]
        # No rollout lost or duplicated: one regular row per input, each prompt group complete.
        assert (kinds == RowKind.REGULAR).sum().item() == n_inputs
        groups = batch["group_id"][kinds == RowKind.REGULAR]
        assert sorted(torch.bincount(groups).tolist()) == [group] * n_prompts
        assert (kinds == RowKind.NEGATIVE).sum().item() == len(result.extra_rows)
        # Rollouts lost to infrastructure failures are kept out of the loss.
        lost = torch.tensor(result.infra_failed)
        loss_mask = batch["completion_mask"] * batch["tool_mask"]
        assert loss_mask[:n_inputs][lost].sum().item() == 0
        # Huge tool outputs were truncated before reaching the model.
        assert batch["completion_ids"].shape[1] < 2048 + 64
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    failure_metrics = [
        h["tools/failure_frequency"] for h in trainer.state.log_history if "tools/failure_frequency" in h
    ]
    assert len(failure_metrics) == 3 and all(0 < f <= 1 for f in failure_metrics)
    logged_truncated = [
        h["tools/truncated_outputs"] for h in trainer.state.log_history if "tools/truncated_outputs" in h
    ]
    assert len(logged_truncated) == 3 and sum(logged_truncated) == injected["huge"]

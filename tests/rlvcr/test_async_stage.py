"""RLVCR through the asynchronous trainer's estimator stage (`trl_agentic.async_grpo.stage`), no vLLM needed.

A group arrives as TRL rows (`input_ids` + `completion_mask`); the stage builds the `AdvantageBatch`, calls
`rlvcr_estimator` with its `EstimatorHost`, and turns the `(B, T)` result into per-token arrays over each row's
`input_ids`. Compared with `rlvcr_estimator` called the synchronous way on the same rows (`make_batch`, the estimator
tests' independent batch builder), with the same scripted generation and confidences (`FakeTrainer`).
"""

from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace

import numpy as np
import torch

from trl_agentic.rlvcr.estimator import rlvcr_estimator
from trl_agentic.rollout.types import RowKind

from .test_estimator import PROMPT, STEP_FAIL, STEP_LOOK, STEP_TAKE, TOOL, FakeTrainer, make_batch, rlvcr_args


def _samples(tok, rows, rewards):
    from trl_agentic.async_grpo.worker import AgenticRolloutSample

    out = []
    for k, (segments, reward) in enumerate(zip(rows, rewards)):
        prompt = tok.encode(PROMPT)
        ids, mask = list(prompt), [0] * len(prompt)
        for text, is_model in segments:
            piece = tok.encode(text)
            ids += piece
            mask += [int(is_model)] * len(piece)
        out.append(
            AgenticRolloutSample(
                prompt=[],
                completion=[],
                input_ids=np.asarray(ids),
                completion_mask=np.asarray(mask),
                old_log_probs=np.zeros(len(ids), dtype=np.float32),
                advantage=0.0,
                model_version=0,
                group_id=7,
                metrics={},
                row_kind=int(RowKind.REGULAR),
                reward=reward,
                episode=k,
                group_rows=len(rows),
            )
        )
    return out


def test_rlvcr_token_advantages_through_the_async_stage(tiny_tokenizer):
    from trl_agentic.async_grpo.stage import AgenticRolloutQueue

    tok = tiny_tokenizer
    rows = [[(STEP_LOOK, True), (TOOL, False), (STEP_TAKE, True)], [(STEP_FAIL, True)]]
    rewards = [1.0, 0.0]
    args = rlvcr_args(
        group_baseline="all_rows", snapshot_advantage="episode", scale_rewards="group", advantage_std_floor=0.1
    )
    expected = rlvcr_estimator(make_batch(tok, rows, rewards, [0, 0]), FakeTrainer(tok, args))
    assert expected.dim() == 2

    fake = FakeTrainer(tok, args)
    trainer = SimpleNamespace(
        args=SimpleNamespace(**vars(args), temperature=1.0, chat_template_kwargs=None),
        processing_class=tok,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        accelerator=SimpleNamespace(device=torch.device("cpu"), unwrap_model=lambda m: m),
        model=fake.model,
    )
    stage = AgenticRolloutQueue(trainer, inner=None, estimator=rlvcr_estimator)
    # The host's server generation and model scoring replaced by the same scripted ones as the synchronous call.
    stage._host._generate_single_turn = lambda prompts, images=None, mm=None, num_generations=1, **_: (
        fake._generate_single_turn(prompts, None, {}, 1)
    )
    stage._host._get_per_token_logps_and_entropies = fake._get_per_token_logps_and_entropies
    stage._host.accelerator = fake.accelerator
    group = _samples(tok, rows, rewards)
    out = stage._estimate(group)
    assert len(out) == 2
    for k, sample in enumerate(out):
        prompt_len = len(tok.encode(PROMPT))
        completion_len = len(sample.input_ids) - prompt_len
        assert isinstance(sample.advantage, np.ndarray) and sample.advantage.shape == (len(sample.input_ids),)
        assert (sample.advantage[:prompt_len] == 0).all()
        np.testing.assert_allclose(sample.advantage[prompt_len:], expected[k, :completion_len].numpy(), rtol=1e-6)
    # Token-level: the expanded successful row's weights differ between its two steps (not a constant advantage).
    values = out[0].advantage[np.asarray(out[0].completion_mask) == 1]
    assert len(set(np.round(values, 6).tolist())) > 1 and not any(math.isnan(v) for v in values)

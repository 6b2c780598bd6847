"""RLVCR on the asynchronous TracIn filter's validation rows (`async_grpo.validation.ValidationRollouts` with
`advantage_estimator="rlvcr"`), no vLLM needed: scripted trajectories (`test_async_tracin_validation._script`) and
the estimator tests' scripted generation and confidences (`FakeTrainer`). Compared with `rlvcr_estimator` called the
synchronous way on the same rows (`make_batch`, the estimator tests' independent batch builder)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_async_tracin_validation import _row, _script, _tracin, _trainer

from trl_agentic.advantages import group_advantages
from trl_agentic.rlvcr.estimator import rlvcr_estimator
from trl_agentic.rollout.types import RowKind

from .test_estimator import PROMPT, STEP_FAIL, STEP_LOOK, STEP_TAKE, TOOL, FakeTrainer, make_batch

ROWS = [[(STEP_LOOK, True), (TOOL, False), (STEP_TAKE, True)], [(STEP_FAIL, True)]]


def _tokens(tok, segments):
    ids = tok.encode(PROMPT)
    mask = [0] * len(ids)
    for text, is_model in segments:
        piece = tok.encode(text)
        ids, mask = ids + piece, mask + [int(is_model)] * len(piece)
    return ids, mask


@pytest.mark.parametrize("mode", ["copo", "additive"])
@pytest.mark.parametrize("rewards", [[1.0, 0.0], [0.3] * 6], ids=["spread", "tie"])
def test_validation_rows_carry_rlvcrs_token_advantages(tiny_tokenizer, mode, rewards):
    """A validation group of a two-step success and a one-step failure gets RLVCR's token advantages, those of the
    synchronous call on the same rows, rather than the worker's group advantages. Without a reward spread (six
    rollouts of 0.3, alternating the two rows: TRL's float32 group advantages are noise of one sign, the control) both
    rules give exactly 0 (the episode advantage is 0 there and no step of a tied group is expanded by default), so V
    would be exactly 0."""
    tok = tiny_tokenizer
    trainer = _trainer(
        None, tok, advantage_estimator="rlvcr", rlvcr_mode=mode, rlvcr_step_advantage_w=0.5, advantage_std_floor=0.1,
        tracin_val_num_generations=len(rewards),
    )  # fmt: skip
    fake = FakeTrainer(tok, trainer.args)
    trainer.model = fake.model
    trainer.advantage_estimator = rlvcr_estimator
    segments = [ROWS[k % 2] for k in range(len(rewards))]
    expected = rlvcr_estimator(make_batch(tok, segments, rewards, [0] * len(rewards)), FakeTrainer(tok, trainer.args))
    assert expected.dim() == 2

    tracin = _tracin(trainer, ["p"])
    host = tracin.validation._estimator_host
    host._generate_single_turn = lambda prompts, images=None, mm=None, num_generations=1, **_: (
        fake._generate_single_turn(prompts, None, {}, 1)
    )
    host._get_per_token_logps_and_entropies = fake._get_per_token_logps_and_entropies
    host.accelerator = fake.accelerator
    tokens = [_tokens(tok, s) for s in segments]
    _script(tracin, lambda prompt, k: (str(rewards[k]), [_row(*tokens[k])]))
    rows, conversation_rewards = tracin.validation.run([{"prompt": "p"}], seed=0)

    assert conversation_rewards == rewards
    assert [r["kind"] for r in rows] == [RowKind.REGULAR] * len(rewards)
    prompt_len = len(tok.encode(PROMPT))
    tied = len(set(rewards)) == 1
    for k, row in enumerate(rows):
        assert row["input_ids"].tolist() == tokens[k][0]
        advantage = row["advantage"]
        assert isinstance(advantage, np.ndarray) and advantage.shape == (len(tokens[k][0]),)
        assert (advantage[:prompt_len] == 0).all()
        want = expected[k, : len(tokens[k][0]) - prompt_len].numpy()
        np.testing.assert_allclose(advantage[prompt_len:], want, rtol=1e-6, atol=1e-7)
    if tied:
        assert all((r["advantage"] == 0).all() for r in rows)
        noise = group_advantages(torch.tensor(rewards), torch.zeros(len(rewards), dtype=torch.long))
        assert bool((noise != 0).all())  # the case is real
    else:
        # Token-level: the two-step row's steps get different advantages (not one per row).
        values = rows[0]["advantage"][np.asarray(tokens[0][1]) == 1]
        assert len(set(np.round(values, 6).tolist())) > 1
    # The estimator's metrics stay out of training's (the synchronous trainer keeps validation's out too).
    assert not any(name.startswith("rlvcr") for name in trainer._metrics["train"])
    assert torch.isfinite(torch.as_tensor(np.concatenate([r["advantage"] for r in rows]))).all()


@pytest.mark.parametrize("mode", ["copo", "additive"])
def test_the_tie_rule_zeroes_copos_token_arrays_and_keeps_the_additive_rules(tiny_tokenizer, monkeypatch, mode):
    """The validation rule beside RLVCR's own zeroing (`estimators.zero_without_reward_spread`), with RLVCR made to
    return the float32 noise of a tied group (as it did before its episode advantage was zeroed): CoPO's token
    arrays are set to 0; the additive rule's are kept as RLVCR returned them, as the synchronous trainer keeps them."""
    import trl_agentic.rlvcr.estimator as rlvcr

    monkeypatch.setattr(rlvcr, "tied_rows", lambda rewards, groups, baseline: torch.zeros_like(rewards, dtype=bool))
    tok = tiny_tokenizer
    rewards = [0.3] * 6
    trainer = _trainer(
        None, tok, advantage_estimator="rlvcr", rlvcr_mode=mode, tracin_val_num_generations=6,
    )  # fmt: skip
    fake = FakeTrainer(tok, trainer.args)
    trainer.model = fake.model
    trainer.advantage_estimator = rlvcr_estimator
    segments = [ROWS[k % 2] for k in range(6)]
    expected = rlvcr_estimator(make_batch(tok, segments, rewards, [0] * 6), FakeTrainer(tok, trainer.args))
    assert bool((expected[:, 0] != 0).all())  # the noise, on every row
    tracin = _tracin(trainer, ["p"])
    host = tracin.validation._estimator_host
    host._get_per_token_logps_and_entropies = fake._get_per_token_logps_and_entropies
    host.accelerator = fake.accelerator
    tokens = [_tokens(tok, s) for s in segments]
    _script(tracin, lambda prompt, k: ("0.3", [_row(*tokens[k])]))
    rows, _ = tracin.validation.run([{"prompt": "p"}], seed=0)
    prompt_len = len(tok.encode(PROMPT))
    for k, row in enumerate(rows):
        want = expected[k, : len(tokens[k][0]) - prompt_len].numpy()
        if mode == "copo":
            assert isinstance(row["advantage"], np.ndarray) and (row["advantage"] == 0).all()
        else:
            np.testing.assert_allclose(row["advantage"][prompt_len:], want, rtol=1e-6)

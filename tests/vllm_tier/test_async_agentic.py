"""`AsyncAgenticGRPOTrainer` in real asynchronous runs against a real vLLM CPU server started here.

The policy is the vLLM tier's tiny calculator policy (`vllm_helpers.build_calculator_policy`: whole turns as single
tokens, a failing call `1/0`, a good call, an answer), so rollbacks happen in every step; the embedded SmolLM2 is used
by the example and the benchmark (docs/async.md says why: it never calls the tool before a warm start).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def server(calculator_policy_dir, tmp_path_factory):
    from trl_agentic.async_grpo.server import VLLMServer

    log = tmp_path_factory.mktemp("async-vllm") / "server.log"
    with VLLMServer(calculator_policy_dir, max_lora_rank=8, max_loras=6, log_path=str(log)) as s:
        yield s


def _negatives(rows):
    from trl_agentic.rollout.types import RowKind

    return [r for r in rows if r["kind"] == RowKind.NEGATIVE]


def test_rollback_and_negative_rows_fire_in_an_async_run(server, calculator_policy_dir, tmp_path):
    from async_helpers import async_config, build, logged, rollback_overrides, total

    from trl_agentic.advantages import group_advantages, negative_sample_rewards
    from trl_agentic.rollout.types import RowKind

    args = async_config(tmp_path / "out", server.url, **rollback_overrides())
    trainer = build(calculator_policy_dir, args)
    trainer.train()
    rows = trainer._observed_rows
    assert trainer.state.global_step == 2
    # Rollbacks ran in the worker and produced negative rows that reached the trainer.
    assert total(trainer, "rollback/attempts_total") > 0
    negatives = _negatives(rows)
    assert negatives, "no negative row reached the trainer"
    penalty = negative_sample_rewards([["ZeroDivisionError"]], args.negative_sample_reward, None)[0]
    assert all(r["reward"] == penalty and r["advantage"] <= 0.0 for r in negatives)
    # Variable-size groups: a group with a negative row has more rows than conversations.
    by_group: dict[int, list] = {}
    for r in rows:
        by_group.setdefault(r["group_id"], []).append(r)
    complete = [g for g in by_group.values() if len(g) == g[0].get("group_rows", len(g))]
    assert any(len([r for r in g if r["kind"] == RowKind.NEGATIVE]) for g in by_group.values())
    # The advantages are the synchronous trainer's: group_advantages over (episodes + negatives) of each full group.
    for g in complete:
        regular = [r for r in g if r["kind"] == RowKind.REGULAR]
        if len(regular) != args.num_generations:
            continue  # a group split across steps by the stale-drop or the step boundary is not checked here
        rewards = [r["reward"] for r in g]
        import torch

        expected = group_advantages(torch.tensor(rewards), torch.zeros(len(g), dtype=torch.long))
        expected = [min(e, 0.0) if r["kind"] == RowKind.NEGATIVE else e for e, r in zip(expected.tolist(), g)]
        assert [r["advantage"] for r in g] == pytest.approx(expected, abs=1e-5)
    # A negative row trains its failed turn only: one run of model tokens, then the masked error result.
    for r in negatives:
        trained = np.nonzero(r["completion_mask"])[0]
        assert len(trained) >= 1 and (np.diff(trained) == 1).all()
        assert trained[-1] < len(r["completion_mask"]) - 1  # the tool's error message follows, untrained
    # Staleness per row kind is logged, and every row kind obeys max_staleness.
    assert logged(trainer, "sample/staleness_negative_max")
    assert all(r["staleness"] <= args.max_staleness for r in rows)
    assert all(r["model_version"] <= r["policy_versions"][0] for r in rows)


def test_adapter_names_are_versioned_on_every_sync(server, calculator_policy_dir, tmp_path):
    """vLLM #42125: an adapter reloaded under the same name reuses the old adapter's prefix-cache blocks."""
    import requests
    from async_helpers import async_config, build, rollback_overrides

    args = async_config(tmp_path / "out", server.url, max_steps=3, **rollback_overrides())
    trainer = build(calculator_policy_dir, args)
    calls = []
    original = trainer.vllm_client.load_lora_adapter

    def recording(name, path, *a, **k):
        calls.append(name)
        return original(name, path, *a, **k)

    trainer.vllm_client.load_lora_adapter = recording
    trainer.train()
    base = trainer._lora_name
    assert base.startswith("trl-policy-") and base != "trl-policy"
    # One cold sync at train begin, then one per step: every one a new name.
    assert calls == [f"{base}-v{n}" for n in range(1, 5)]
    served = {m["id"] for m in requests.get(f"{server.url}/v1/models", timeout=10).json()["data"]}
    assert f"{base}-v4" in served
    # Requests named the versioned adapter of their policy: the rows' policy versions are among the synced ones.
    assert {r["policy_versions"][0] for r in trainer._observed_rows} <= set(range(1, 5))
    assert not math.isnan(trainer.state.log_history[-1].get("train_loss", math.nan))

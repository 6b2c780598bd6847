"""Features off, `AsyncAgenticGRPOTrainer` trains exactly like TRL's `AsyncGRPOTrainer` (no vLLM needed).

Both trainers get the same scripted rollouts through TRL's `RolloutWorkerProtocol` (an in-process worker whose queue
holds fixed `RolloutSample`s: token rows, masks, sampling log-probs, advantages) and a no-op weight transfer, and
train two steps from the same seed. Compared: the rows each trainer consumed, every logged loss, and the LoRA weights
after training, bit for bit. TRL's trainer runs with the two CPU fixes of `compat.py` applied by hand (it cannot run on
a CPU otherwise); those fixes are checked against an unpacked forward in `test_async_compat.py`.
"""

from __future__ import annotations

import queue

import numpy as np
import pytest
import torch


class ScriptedWorker:
    """`RolloutWorkerProtocol` with a queue prefilled with fixed samples (two groups per step)."""

    def __init__(self, samples):
        self.rollout_buffer = queue.Queue()
        self.metrics_queue = queue.Queue()
        for s in samples:
            self.rollout_buffer.put(s)
        self.versions = []

    def start(self):
        pass

    def stop(self):
        pass

    def update_model_version(self, version):
        self.versions.append(version)

    def check_health(self, stale_after_s):
        raise RuntimeError("the scripted queue ran dry")


class NoWeightTransfer:
    def init_weight_transfer(self):
        pass

    def pause(self):
        pass

    def send_weights(self, iterator):
        for _ in iterator:
            pass

    def resume(self):
        pass

    def destroy(self):
        pass


def _samples(agentic: bool = False):
    from trl_agentic.async_grpo.compat import worker_module
    from trl_agentic.async_grpo.worker import AgenticRolloutSample

    rollout_sample = worker_module().RolloutSample
    rng = np.random.default_rng(0)
    samples = []
    for group in range(6):  # two steps of 8 rows, and the batch accelerate prefetches
        prompt = rng.integers(5, 250, size=6).tolist()
        for k in range(4):
            completion = rng.integers(5, 250, size=3 + k).tolist()
            ids = prompt + completion
            mask = [0] * len(prompt) + [1] * len(completion)
            # What the agentic worker adds: a group's size, each row's conversation and reward.
            extra = dict(reward=float(k), episode=k, group_rows=4, baseline_rows=4) if agentic else {}
            samples.append(
                (AgenticRolloutSample if agentic else rollout_sample)(
                    **extra,
                    prompt=[{"role": "user", "content": "q"}],
                    completion=[{"role": "assistant", "content": "a"}],
                    input_ids=np.asarray(ids, dtype=np.int64),
                    completion_mask=np.asarray(mask, dtype=np.int64),
                    old_log_probs=np.asarray(
                        [0.0] * len(prompt) + (-rng.random(len(completion)) * 5).tolist(), dtype=np.float32
                    ),
                    advantage=float(k - 1.5),
                    model_version=0,
                    group_id=group,
                    metrics={"reward": float(k)},
                )
            )
    return samples


def _train(
    trainer_cls,
    config_cls,
    model_dir,
    out,
    trainer_kwargs=None,
    samples=None,
    trainer_hook=None,
    lora_dropout=0.0,
    **extra,
):
    from datasets import Dataset
    from peft import LoraConfig

    from trl_agentic.async_grpo.compat import cpu_peak_flops, register_cpu_tree_attention

    args = config_cls(
        output_dir=str(out),
        use_cpu=True,
        bf16=False,
        seed=0,
        max_steps=2,
        learning_rate=1e-2,
        per_device_train_batch_size=8,
        num_generations=4,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        gradient_checkpointing=False,
        token_budget=0,
        max_staleness=4,
        **extra,
    )
    worker = ScriptedWorker(samples or _samples())
    peft = LoraConfig(
        r=4, lora_alpha=8, lora_dropout=lora_dropout, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"
    )
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": "q"}]}] * 4)
    with cpu_peak_flops():
        trainer = trainer_cls(
            model=str(model_dir),
            reward_funcs=_reward,
            args=args,
            train_dataset=dataset,
            peft_config=peft,
            rollout_worker=worker,
            weight_transfer=NoWeightTransfer(),
            **(trainer_kwargs or {}),
        )
    register_cpu_tree_attention()
    if trainer_hook is not None:
        trainer_hook(trainer)
    consumed = []
    original = trainer.compute_loss

    def recording(model, inputs, *a, **k):
        consumed.append({key: v.clone() for key, v in inputs.items() if isinstance(v, torch.Tensor)})
        return original(model, inputs, *a, **k)

    trainer.compute_loss = recording
    trainer.train()
    weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" in n}
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return consumed, losses, weights, worker.versions


def _reward(completions, **kwargs):
    return [0.0] * len(completions)


def test_features_off_trains_exactly_like_trl_async_grpo(tiny_model_dir, tmp_path):
    from trl_agentic.async_grpo import AsyncAgenticGRPOConfig, AsyncAgenticGRPOTrainer
    from trl_agentic.async_grpo.compat import AsyncGRPOConfig, AsyncGRPOTrainer

    ref = _train(AsyncGRPOTrainer, AsyncGRPOConfig, tiny_model_dir, tmp_path / "trl")
    ours = _train(AsyncAgenticGRPOTrainer, AsyncAgenticGRPOConfig, tiny_model_dir, tmp_path / "ours")
    ref_batches, ref_losses, ref_weights, ref_versions = ref
    batches, losses, weights, versions = ours
    assert len(ref_batches) == len(batches) == 2
    for a, b in zip(ref_batches, batches):
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), key  # same rows, loss terms, advantages, old log-probs
    assert losses == ref_losses and len(losses) == 2 and all(loss != 0 for loss in losses)
    assert ref_weights.keys() == weights.keys() and weights
    for name in weights:
        assert torch.equal(ref_weights[name], weights[name]), name
    assert versions == ref_versions == [1, 2, 3]


def test_a_feature_on_changes_the_advantage_rule_only_through_the_worker(tiny_model_dir, tmp_path):
    """The trainer side alone (queue stage + packing) leaves GRPO rows untouched: with rollback on but an in-process
    worker (the agentic loop lives in TRL's spawned worker, which is not used here), the same rows and weights come
    out."""
    from trl_agentic.async_grpo import AsyncAgenticGRPOConfig, AsyncAgenticGRPOTrainer

    plain = _train(AsyncAgenticGRPOTrainer, AsyncAgenticGRPOConfig, tiny_model_dir, tmp_path / "a")
    rollback = dict(enable_tool_rollback=True, rollback_on_errors=["ValueError"])
    on = _train(AsyncAgenticGRPOTrainer, AsyncAgenticGRPOConfig, tiny_model_dir, tmp_path / "b", **rollback)
    for a, b in zip(plain[0], on[0]):
        for key in a:
            assert torch.equal(a[key], b[key]), key
    for name in plain[2]:
        assert torch.equal(plain[2][name], on[2][name]), name


def _three(batch, trainer):
    return torch.full((batch.local_index.numel(),), 3.0)


def test_an_estimator_passed_to_the_trainer_gives_the_advantages_trained_on(tiny_model_dir, tmp_path):
    """`advantage_estimator=` given to the trainer (the config left at "grpo", no other feature) replaces the
    worker's advantages, as it does in the synchronous trainer and as the same estimator named in the config does:
    every trained token gets the estimator's 3.0, none the worker's -1.5 ... 1.5."""
    from trl_agentic.async_grpo import AsyncAgenticGRPOConfig, AsyncAgenticGRPOTrainer

    kwargs = {"advantage_estimator": _three}
    samples = _samples(agentic=True)
    batches = _train(AsyncAgenticGRPOTrainer, AsyncAgenticGRPOConfig, tiny_model_dir, tmp_path, kwargs, samples)[0]
    assert len(batches) == 2
    trained = torch.cat([b["advantages"][b["token_index"] >= 0] for b in batches])
    assert trained.numel() > 0 and torch.equal(trained, torch.full_like(trained, 3.0))


def test_tracin_selects_a_micro_batch_at_the_weights_it_trains_with(tiny_model_dir, tmp_path, monkeypatch):
    """accelerate's dispatcher collates micro-batch k+1 before micro-batch k trains: the TracIn filter runs when TRL
    trains a micro-batch, so it scores (and refreshes V) at the step and the weights the micro-batch trains with."""
    from datasets import Dataset

    from trl_agentic.async_grpo import AsyncAgenticGRPOConfig, AsyncAgenticGRPOTrainer
    from trl_agentic.async_grpo.tracin import AsyncTracIn

    seen = {"select": [], "loss": []}

    def state(trainer):
        model = trainer.accelerator.unwrap_model(trainer.model)
        lora = [p.detach().clone() for n, p in model.named_parameters() if "lora_" in n]
        return trainer.state.global_step, lora

    def select(self, samples):
        seen["select"].append(state(self.trainer))
        return torch.ones(len(samples), dtype=torch.bool)

    compute_loss = AsyncAgenticGRPOTrainer.compute_loss

    def recording(self, model, inputs, *args, **kwargs):
        seen["loss"].append(state(self))
        return compute_loss(self, model, inputs, *args, **kwargs)

    monkeypatch.setattr(AsyncTracIn, "select", select)
    monkeypatch.setattr(AsyncAgenticGRPOTrainer, "compute_loss", recording)
    validation = Dataset.from_list([{"prompt": [{"role": "user", "content": "v"}]}] * 2)
    kwargs = {"tracin_eval_dataset": validation}
    samples = _samples(agentic=True)
    _train(
        AsyncAgenticGRPOTrainer, AsyncAgenticGRPOConfig, tiny_model_dir, tmp_path, kwargs, samples, tracin_enabled=True
    )
    assert len(seen["loss"]) == len(seen["select"]) == 2
    assert [s[0] for s in seen["select"]] == [s[0] for s in seen["loss"]] == [0, 1]
    for (_, scored), (_, trained) in zip(seen["select"], seen["loss"]):
        assert all(torch.equal(a, b) for a, b in zip(scored, trained))
    assert not all(torch.equal(a, b) for a, b in zip(seen["loss"][0][1], seen["loss"][1][1]))  # a step moved them

    # No row selected (`tracin_min_selected=0`): the micro-batches are not trained at all, so the adapter does not move
    # (no gradient, and no optimizer update of momentum or weight decay either).
    seen["select"].clear(), seen["loss"].clear()

    def select_none(self, samples):
        seen["select"].append(state(self.trainer))
        return torch.zeros(len(samples), dtype=torch.bool)

    monkeypatch.setattr(AsyncTracIn, "select", select_none)
    extra = dict(tracin_enabled=True, tracin_min_selected=0, weight_decay=0.1)
    samples = _samples(agentic=True)
    out = _train(
        AsyncAgenticGRPOTrainer, AsyncAgenticGRPOConfig, tiny_model_dir, tmp_path / "none", kwargs, samples, **extra
    )
    assert seen["loss"] == [] and [s[0] for s in seen["select"]] == [0, 1]  # TRL's loss never ran
    first = seen["select"][0][1]
    final = list(out[2].values())
    assert len(first) == len(final) and all(torch.equal(a, b) for a, b in zip(first, final))


@pytest.mark.parametrize("token_level", [False, True])
def test_pack_with_token_advantages_matches_a_plain_loop(token_level):
    from trl_agentic.async_grpo.compat import trainer_module
    from trl_agentic.async_grpo.stage import pack_with_token_advantages

    rng = np.random.default_rng(1)
    row = trainer_module().TreeRow()
    expected = []
    for k in range(3):
        ids = [7, 8, 9] + rng.integers(10, 50, size=4 + k).tolist()
        mask = [0, 0, 0] + [1, 0, 1, 1] + [1] * k
        adv = rng.normal(size=len(ids)).astype(np.float32) if token_level else float(k) - 1
        sample = {
            "input_ids": np.asarray(ids),
            "completion_mask": np.asarray(mask),
            "old_log_probs": np.zeros(len(ids), dtype=np.float32),
            "advantage": adv,
            "group_id": 0,
        }
        row.add(sample)
        for p in range(1, len(ids)):  # TRL's loss terms: the target at p is trained when mask[p]
            if mask[p]:
                expected.append(adv[p] if token_level else adv)
    packed = pack_with_token_advantages(row)
    torch.testing.assert_close(packed["advantages"], torch.tensor(expected, dtype=torch.float32))
    assert packed["token_index"].numel() == len(expected)


def test_max_staleness_drops_extra_rows_like_regular_ones():
    """TRL's `RolloutQueueDataset` reading through trl-agentic's queue stage: a negative or snapshot row of a stale
    group is dropped exactly like its regular rows, and the per-kind metrics count what was dropped."""
    from collections import defaultdict
    from types import SimpleNamespace

    from accelerate import PartialState

    from trl_agentic.async_grpo.compat import trainer_module
    from trl_agentic.async_grpo.stage import AgenticRolloutQueue
    from trl_agentic.async_grpo.worker import AgenticRolloutSample
    from trl_agentic.rollout.types import RowKind

    PartialState()  # TRL's dataset logs through accelerate's logger
    inner = queue.Queue()
    kinds = [RowKind.REGULAR, RowKind.NEGATIVE, RowKind.SNAPSHOT]
    # Groups started at versions 1..4; the trainer is at version 5 with max_staleness 2: versions 1 and 2 are stale.
    for version in (1, 2, 3, 4):
        for kind in kinds:
            inner.put(
                AgenticRolloutSample(
                    prompt=[],
                    completion=[],
                    input_ids=np.arange(4),
                    completion_mask=np.array([0, 0, 1, 1]),
                    old_log_probs=np.zeros(4, dtype=np.float32),
                    advantage=0.0,
                    model_version=version,
                    group_id=version,
                    metrics={},
                    row_kind=int(kind),
                    group_rows=3,
                )
            )
    metrics = defaultdict(list)
    trainer = SimpleNamespace(
        model_version=5, args=SimpleNamespace(max_staleness=2), _metrics={"train": metrics}, _observed_rows=[]
    )
    stage = AgenticRolloutQueue(trainer, inner)
    dataset = trainer_module().RolloutQueueDataset(
        rollout_queue=stage,
        model_version_fn=lambda: trainer.model_version,
        check_health_fn=lambda s: None,
        stale_after_s=10,
        metrics=metrics,
        max_staleness=2,
        poll_interval_s=0.01,
    )
    it = iter(dataset)
    kept = [next(it) for _ in range(6)]
    assert sorted({k["group_id"] for k in kept}) == [3, 4]  # every kind of the two fresh groups, none of the stale
    assert len(metrics["sample/dropped_stale_total"]) == 6  # TRL's own count: 3 rows x 2 stale groups
    for name in ("regular", "negative", "snapshot"):
        assert sum(metrics[f"sample/dropped_stale_{name}_total"]) == 2
        assert max(metrics[f"sample/staleness_{name}_max"]) == 4


def scripted_async_trainer(
    model_dir, tmp_path, monkeypatch, config: dict | None = None, server_ready: bool = True, **trainer_kwargs
):
    """An `AsyncAgenticGRPOTrainer` on TRL's rollout worker class with scripted samples and no vLLM server (the
    client's readiness and context length answered here, unless `server_ready` is False: the caller's own stub
    then answers): for set-up checks. `config` overrides the config's fields; `trainer_kwargs` go to the trainer
    (e.g. `environment_factory`, `advantage_estimator`)."""
    from datasets import Dataset
    from peft import LoraConfig
    from trl.experimental.async_grpo import vllm_client

    from trl_agentic.async_grpo import AsyncAgenticGRPOConfig, AsyncAgenticGRPOTrainer
    from trl_agentic.async_grpo.compat import cpu_peak_flops, trainer_module, worker_module

    if server_ready:
        monkeypatch.setattr(vllm_client.VLLMClient, "wait_for_server_ready", lambda self, *a, **k: None)
    monkeypatch.setattr(vllm_client.VLLMClient, "get_max_model_len", lambda self: 4096)

    class TRLWorker(ScriptedWorker, trainer_module().AsyncRolloutWorker):
        def __init__(self, samples):
            ScriptedWorker.__init__(self, samples)
            self._loop_cls, self._loop_kwargs = worker_module()._AsyncRolloutLoop, {}

    args = AsyncAgenticGRPOConfig(
        output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", max_steps=1,
        per_device_train_batch_size=8, num_generations=4, **(config or {}),
    )  # fmt: skip
    with cpu_peak_flops():
        return AsyncAgenticGRPOTrainer(
            model=str(model_dir),
            reward_funcs=_reward,
            args=args,
            train_dataset=Dataset.from_list([{"prompt": [{"role": "user", "content": "q"}]}] * 4),
            peft_config=LoraConfig(r=4, target_modules=["q_proj"], task_type="CAUSAL_LM"),
            rollout_worker=TRLWorker(_samples(agentic=True)),
            weight_transfer=NoWeightTransfer(),
            **trainer_kwargs,
        )

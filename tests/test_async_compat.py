"""The import shim and the CPU pieces of `trl_agentic.async_grpo.compat` (no vLLM needed)."""

import sys
import types

import numpy as np
import pytest
import torch


def _packed_logps(model, samples):
    """Log-probs of each sample's trained tokens from TRL's packed tree forward (TreeRow + fused LM head)."""
    from trl_agentic.async_grpo.compat import trainer_module

    row = trainer_module().TreeRow()
    for s in samples:
        row.add(s)
    p = row.pack()
    tree = {k: p[k] for k in ("tree_kv_index", "tree_cu_seqlens_q", "tree_cu_seqlens_k")}
    tree["tree_max_seqlen_q"], tree["tree_max_seqlen_k"] = p["tree_max_seqlens"].tolist()
    out = model(
        input_ids=p["input_ids"][None],
        position_ids=p["position_ids"][None],
        shift_labels=p["shift_labels"][None],
        fused_lm_head=True,
        **tree,
    )
    return out.log_probs.flatten()[p["token_index"]], p["segment_id"]


def _plain_logps(model, sample):
    """The same log-probs from an ordinary one-sample forward with eager attention (independent of tree packing)."""
    ids = torch.tensor(sample["input_ids"])[None]
    logits = model(input_ids=ids).logits[0, :-1].float()
    logps = torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])[:, 0]
    return logps[torch.tensor(sample["completion_mask"][1:]).bool()]


def test_cpu_tree_attention_matches_unpacked_forward(tiny_model_dir):
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    from trl_agentic.async_grpo.compat import register_cpu_tree_attention, trainer_module

    register_cpu_tree_attention()
    torch.manual_seed(0)
    tree_model = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, attn_implementation=trainer_module().TREE_ATTENTION
    )
    add_fused_lm_head(tree_model, outputs=("log_probs", "entropy"))
    eager = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="eager")
    prompt = [5, 6, 7, 8, 9]
    # Two samples sharing a prompt (a trie branch), one sharing a longer prefix, one unrelated (two roots).
    token_lists = [prompt + [10, 11, 12], prompt + [13, 14], prompt + [10, 11, 20, 21], [30, 31, 32, 33]]
    masks = [[0] * 5 + [1] * 3, [0] * 5 + [1] * 2, [0] * 5 + [1, 0, 1, 1], [0, 0, 1, 1]]
    samples = [
        {
            "input_ids": np.array(t),
            "completion_mask": np.array(m),
            "old_log_probs": np.zeros(len(t), dtype=np.float32),
            "advantage": 1.0,
            "group_id": 0,
        }
        for t, m in zip(token_lists, masks)
    ]
    with torch.no_grad():
        packed, segment = _packed_logps(tree_model, samples)
        for i, s in enumerate(samples):
            expected = _plain_logps(eager, {k: list(s[k]) for k in ("input_ids", "completion_mask")})
            torch.testing.assert_close(packed[segment == i], expected, rtol=1e-5, atol=1e-5)


def test_plain_padded_forward_through_the_tree_attention_name(tiny_model_dir):
    """The estimators and TracIn forward ordinary left-padded batches through the trainer's model."""
    from transformers import AutoModelForCausalLM

    from trl_agentic.async_grpo.compat import register_cpu_tree_attention, trainer_module

    register_cpu_tree_attention()
    tree_model = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, attn_implementation=trainer_module().TREE_ATTENTION
    )
    eager = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="eager")
    ids = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    with torch.no_grad():
        got = tree_model(input_ids=ids, attention_mask=mask).logits
        alone = eager(input_ids=ids[:1, 2:]).logits
        full = eager(input_ids=ids[1:]).logits
    torch.testing.assert_close(got[0, 2:], alone[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], full[0], rtol=1e-5, atol=1e-5)


def test_cpu_peak_flops_is_none_on_cpu_and_restored():
    from accelerate import Accelerator

    from trl_agentic.async_grpo import compat

    module = compat.trainer_module()
    original = module.get_peak_flops_per_device
    with pytest.raises((AssertionError, RuntimeError)):  # TRL 1.16 asks CUDA for the device name
        original(Accelerator(cpu=True), "float32")
    with compat.cpu_peak_flops():
        assert module.get_peak_flops_per_device(Accelerator(cpu=True), "float32") is None
    assert module.get_peak_flops_per_device is original


def test_shim_prefers_top_level_trl(monkeypatch):
    """TRL >= 1.18 exports the trainer at the top level (the experimental module is gone there): the shim takes it."""
    import trl

    from trl_agentic.async_grpo import compat

    fake_trainer = type("AsyncGRPOTrainer", (), {})
    fake_config = type("AsyncGRPOConfig", (), {})
    monkeypatch.setattr(trl, "AsyncGRPOTrainer", fake_trainer, raising=False)
    monkeypatch.setattr(trl, "AsyncGRPOConfig", fake_config, raising=False)
    monkeypatch.setitem(sys.modules, "trl.experimental.async_grpo", types.ModuleType("removed"))
    assert compat._load() == (fake_trainer, fake_config)
    monkeypatch.undo()
    from trl.experimental.async_grpo import AsyncGRPOTrainer

    assert compat._load()[0] is AsyncGRPOTrainer


def test_stopping_a_worker_whose_child_already_exited_returns(monkeypatch, tmp_path):
    """TRL's `AsyncRolloutWorker.stop` blocks forever once the child exited while its stop watcher waited on the event
    (`multiprocessing.Condition.notify` waits for the dead sleeper to acknowledge); `stop_rollout_worker` returns and
    leaves no process behind. The child is TRL's real `_child_main` in a real spawned process."""
    import threading

    from accelerate.state import PartialState
    from async_stop_helpers import ExitWhenToldLoop

    from trl_agentic.async_grpo.compat import install_stop, worker_module

    PartialState()  # TRL's worker logs through accelerate's logger (its trainer has set this up)

    module = worker_module()
    monkeypatch.setattr(module, "is_vllm_available", lambda: True)
    monkeypatch.setattr(module, "is_aiohttp_available", lambda: True)

    def started_worker(name):
        worker = module.AsyncRolloutWorker(child_ready_timeout=300)
        worker._loop_cls = ExitWhenToldLoop
        exit_now = tmp_path / name
        worker._loop_kwargs = {"exit_now": str(exit_now)}
        worker.start()
        # The child's stop watcher has gone to sleep on the stop event (the count is a shared semaphore) ...
        while worker._stop_event_mp._cond._sleeping_count.get_value() < 1:
            threading.Event().wait(0.05)
        exit_now.touch()  # ... and then the child exits, as it does when its rollout loop fails.
        worker._process.join()
        assert worker._process.exitcode == 0
        return worker

    # The defect in the installed TRL: its stop() is still blocked after 10 s (it never returns).
    trl_worker = started_worker("trl")
    blocked = threading.Thread(target=trl_worker.stop, daemon=True)
    blocked.start()
    blocked.join(timeout=10)
    assert blocked.is_alive(), "TRL's AsyncRolloutWorker.stop returned: the workaround in compat.py may be obsolete"

    worker = started_worker("ours")
    child = worker._process
    install_stop(worker)
    done = threading.Thread(target=worker.stop, daemon=True)
    done.start()
    done.join(timeout=120)  # a hang detector only: it returns in well under a second
    assert not done.is_alive()
    assert worker._process is None and not child.is_alive()


def test_trl_worker_stop_is_the_version_stop_rollout_worker_replaces():
    """Drift guard: `stop_rollout_worker` re-implements TRL 1.16.0's `AsyncRolloutWorker.stop` (set the stop event,
    join 15 s, terminate, join 5 s, kill) without its hang. If TRL changes that method, this fails: re-read it and
    update (or drop) the replacement."""
    import hashlib
    import inspect

    from trl_agentic.async_grpo.compat import worker_module

    source = inspect.getsource(worker_module().AsyncRolloutWorker.stop)
    assert hashlib.sha256(source.encode()).hexdigest()[:16] == "e53629230ba4d6eb", source

"""Where TRL's asynchronous GRPO lives, and the two things it needs to run on a CPU.

**Import shim.** TRL 1.16 ships `AsyncGRPOTrainer` as `trl.experimental.async_grpo`; the TRL 1.18 release notes move
it to the top level (`from trl import AsyncGRPOTrainer, AsyncGRPOConfig`) and remove the experimental submodules.
`AsyncGRPOTrainer` and `AsyncGRPOConfig` are taken from the top level when TRL exports them there, from the
experimental package otherwise. The rollout worker's classes (`AsyncRolloutWorker`, `_AsyncRolloutLoop`,
`RolloutSample`, `TrainingSequence`, ...) are then read from the module namespaces the trainer itself was defined
in (`sys.modules[AsyncGRPOTrainer.__module__]` and the worker class's module), never from a hard-coded path, so a
package move does not break the import. Only TRL 1.16 could be installed and tried here (1.16.0 is the newest TRL on
the package registry this project can reach); the 1.18 branch is exercised by `tests/test_async_compat.py` with a fake
top-level `trl` module only.

**CPU.** Two places of TRL 1.16's `AsyncGRPOTrainer` assume a CUDA device:

- `trl/trainer/utils.py`, `get_peak_flops_per_device` (line 1824 in TRL 1.16.0), called from
  `AsyncGRPOTrainer.__init__` (`async_grpo_trainer.py` line 1240): `torch.cuda.get_device_name(accelerator.device)`
  raises `AssertionError: Torch not compiled with CUDA enabled` on a CPU build of torch. `cpu_peak_flops` wraps the
  trainer's construction so that a non-CUDA device has unknown peak FLOPs (`None`: TRL then only skips its MFU
  metrics, as it does for an unknown GPU).
- `trl/experimental/async_grpo/packing.py`, `tree_attention` (line 187) calls `_flash_attn()` (line 161), which loads
  the FlashAttention-3 kernel from the Hub with the `kernels` package (`ModuleNotFoundError: No module named
  'kernels'` here; the kernel is CUDA/ROCm only and needs the Hub anyway). `register_cpu_tree_attention` registers,
  under TRL's attention name, a function that runs TRL's kernel on a CUDA device and, elsewhere, the same tree
  attention in plain PyTorch (`sdpa_tree_attention`: one scaled-dot-product attention over the packed row with a
  boolean mask that lets each segment see its root-to-segment path, causally). A forward without tree inputs (a plain
  padded batch, as the estimators and TracIn scoring use) runs transformers' SDPA attention.

**Stopping the rollout worker.** `AsyncRolloutWorker.stop` (`async_rollout_worker.py` line 1274) calls
`multiprocessing.Event.set()` on the stop event the child's watcher thread waits on. CPython's
`multiprocessing.Condition.notify` then blocks until every thread counted as sleeping acknowledges the wake-up; a child
that has already exited (it failed, so TRL's `check_health` is raising, or it was killed) never does, and `set()` blocks
forever: training hangs in its `finally` instead of raising the child's error. `stop_rollout_worker` sets the event
from a daemon thread, waits for it only while the child is alive, then joins, terminates and kills the child as TRL
does; `AsyncAgenticGRPOTrainer` installs it on TRL's worker.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import threading
import types

import torch

__all__ = [
    "AsyncGRPOConfig",
    "AsyncGRPOTrainer",
    "cpu_peak_flops",
    "register_cpu_tree_attention",
    "sdpa_tree_attention",
    "install_stop",
    "stop_rollout_worker",
    "trainer_module",
    "worker_module",
]


def _load():
    import trl

    if hasattr(trl, "AsyncGRPOTrainer"):  # TRL >= 1.18 (top-level, stable)
        return trl.AsyncGRPOTrainer, trl.AsyncGRPOConfig
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer  # TRL 1.16 / 1.17

    return AsyncGRPOTrainer, AsyncGRPOConfig


AsyncGRPOTrainer, AsyncGRPOConfig = _load()


def trainer_module():
    """The module `AsyncGRPOTrainer` was defined in (its dataset, collator, worker and LoRA-sync helpers)."""
    return sys.modules[AsyncGRPOTrainer.__module__]


def worker_module():
    """The module the rollout worker was defined in (`_AsyncRolloutLoop`, `RolloutSample`, `TrainingSequence`)."""
    return sys.modules[trainer_module().AsyncRolloutWorker.__module__]


def stop_rollout_worker(worker) -> None:
    """`AsyncRolloutWorker.stop` that returns when the child has already exited (module docstring); [`install_stop`]
    puts it on a worker."""
    process = worker._process
    if process is None:
        return
    # The setter blocks for good when a dead child was waiting on the event; it holds only that event's lock.
    setter = threading.Thread(target=worker._stop_event_mp.set, daemon=True, name="grpo-rollout-worker-stop")
    setter.start()
    if process._popen is not None:  # None when start() failed while spawning
        while setter.is_alive() and process.is_alive():
            setter.join(timeout=0.1)
        process.join(timeout=15)
        if process.is_alive():
            process.terminate()
            process.join(timeout=5)
        if process.is_alive():
            process.kill()
            process.join()
    worker._process = None


def install_stop(worker) -> None:
    """Replace TRL's `worker.stop` with `stop_rollout_worker` on this worker instance."""
    worker.stop = types.MethodType(stop_rollout_worker, worker)


def _packing_module():
    return importlib.import_module(trainer_module().TreeRow.__module__)


@contextlib.contextmanager
def cpu_peak_flops():
    """While active, TRL's peak-FLOPs lookup returns `None` on a non-CUDA device instead of raising (module doc)."""
    module = trainer_module()
    original = module.get_peak_flops_per_device

    def peak_flops(accelerator, dtype):
        if accelerator.device.type != "cuda":
            return None
        return original(accelerator, dtype)

    module.get_peak_flops_per_device = peak_flops
    try:
        yield
    finally:
        module.get_peak_flops_per_device = original


def tree_attention_mask(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, kv_index: torch.Tensor, n: int):
    """`(n, n)` boolean mask of packed position -> packed positions it attends, from TRL's tree layout.

    Segment `s` holds the queries `[cu_q[s], cu_q[s+1])` and attends the keys `kv_index[cu_k[s]:cu_k[s+1]]` (its
    root-to-segment path, the segment itself last). Causality is bottom-right aligned, as in FlashAttention's varlen
    kernel with `seqlen_k >= seqlen_q`: query `i` of the segment sees the first `len_k - len_q + i + 1` path keys.
    """
    mask = torch.zeros(n, n, dtype=torch.bool, device=kv_index.device)
    q_bounds, k_bounds = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for s in range(len(q_bounds) - 1):
        qa, qb, ka, kb = q_bounds[s], q_bounds[s + 1], k_bounds[s], k_bounds[s + 1]
        keys = kv_index[ka:kb]
        len_q, len_k = qb - qa, kb - ka
        visible = torch.arange(len_k, device=kv_index.device)[None, :] <= (
            torch.arange(len_q, device=kv_index.device)[:, None] + (len_k - len_q)
        )
        rows = torch.arange(qa, qb, device=kv_index.device)
        mask[rows[:, None], keys[None, :]] = visible
    return mask


def sdpa_tree_attention(
    module,
    query,
    key,
    value,
    attention_mask,
    *,
    tree_kv_index=None,
    tree_cu_seqlens_q=None,
    tree_cu_seqlens_k=None,
    tree_max_seqlen_q=None,
    tree_max_seqlen_k=None,
    scaling=None,
    sliding_window=None,
    softcap=None,
    **kwargs,
):
    """TRL's tree attention in plain PyTorch (any device); a plain padded forward falls back to SDPA attention."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if tree_kv_index is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, sliding_window=sliding_window, **kwargs
        )
    if sliding_window or softcap:
        raise NotImplementedError("The CPU tree attention supports neither sliding windows nor logit soft-capping.")
    # (1, heads, N, d): one packed row.
    n = query.size(2)
    mask = tree_attention_mask(tree_cu_seqlens_q, tree_cu_seqlens_k, tree_kv_index, n)
    groups = query.size(1) // key.size(1)
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key.to(query.dtype), value.to(query.dtype), attn_mask=mask[None, None], scale=scaling
    )
    return out.transpose(1, 2).contiguous(), None


_registered = False


def _tree_or_padding_mask(*args, attention_mask=None, **kwargs):
    """No mask for TRL's tree forward (it passes no attention mask; the tree inputs define the attention, as in TRL's
    own registration); the usual causal + padding SDPA mask for a plain padded forward."""
    if attention_mask is None:
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


def register_cpu_tree_attention() -> None:
    """Register, under TRL's tree-attention name, TRL's kernel on CUDA and `sdpa_tree_attention` elsewhere."""
    global _registered
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    packing = _packing_module()
    trl_tree_attention = packing.tree_attention

    def tree_attention(module, query, key, value, attention_mask, **kwargs):
        if query.device.type == "cuda" and kwargs.get("tree_kv_index") is not None:
            return trl_tree_attention(module, query, key, value, attention_mask, **kwargs)
        return sdpa_tree_attention(module, query, key, value, attention_mask, **kwargs)

    packing.register_tree_attention()  # TRL's own registration first (its mask function), then ours on top
    AttentionInterface.register(packing.TREE_ATTENTION, tree_attention)
    AttentionMaskInterface.register(packing.TREE_ATTENTION, _tree_or_padding_mask)
    _registered = True

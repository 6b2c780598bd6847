"""`AsyncAgenticGRPOTrainer`: TRL's asynchronous GRPO trainer with trl-agentic's features.

Built on TRL's `AsyncGRPOTrainer` (`trl.experimental.async_grpo` in TRL 1.16, top-level `trl` from 1.18; see
`compat.py`). With every feature of `AsyncAgenticGRPOConfig` off it is `AsyncGRPOTrainer` unchanged (plus the two CPU
fixes of `compat.py`, which change nothing on a GPU, and TRL's rollout loop spawned as `worker.TRLRolloutLoop`, which
only makes the worker's child die with the trainer). `mask_truncated_completions`, which TRL's asynchronous config
lacks, masks a truncated conversation's rows as `GRPOTrainer` does (`worker.AgenticAsyncRolloutLoop`, also with every
feature off). With a feature on:

- the rollout worker's child process runs `worker.AgenticAsyncRolloutLoop` (TRL's loop class, two methods
  overridden): trl-agentic's rollout loop per trajectory (rollback, negatives, snapshots, further user turns) and the
  synchronous trainer's group advantage rules;
- the main process reads the worker's queue through `stage.AgenticRolloutQueue` (staleness per row kind; the
  estimator stage for `advantage_estimator != "grpo"`), and packs rows with per-token advantages when an estimator
  gives them;
- `tracin_enabled` filters each micro-batch's rows by their TracIn score when TRL trains it (`training_step`,
  `tracin.AsyncTracIn`).

Adapter names stay TRL's versioned names, `{lora_name}-v{N}` with a new `N` at every sync (vLLM #42125: an adapter
reloaded under the same name would reuse the old adapter's cached prefix blocks); `lora_name` is
`trl-policy-<8 hex digits>`, fresh for each trainer, so two runs against one server never collide (TRL's fixed
`trl-policy` makes a second run against the same server fail with HTTP 400 "already been loaded").
"""

from __future__ import annotations

import collections
import functools
import inspect
import os
import uuid
import warnings

import torch
from transformers.utils import logging

from ..batch import snapshot_reward
from ..config import AGENTIC_LOOP_FIELDS
from ..envs.protocol import check_checkpointable, has_user_turns
from ..estimators import resolve_estimator
from ..model_card import ModelCardMixin
from ..rollout.context import delete_context
from ..rollout.loop import LoopConfig
from ..trainer import _check_tool_names
from .compat import (
    AsyncGRPOTrainer,
    cpu_peak_flops,
    install_stop,
    register_cpu_tree_attention,
    trainer_module,
    worker_module,
)
from .config import AsyncAgenticGRPOConfig
from .worker import AgenticAsyncRolloutLoop, TRLRolloutLoop

__all__ = ["AsyncAgenticGRPOTrainer"]

logger = logging.get_logger(__name__)

OBSERVED_ROWS_KEPT = 4096  # rows of `_observed_rows`

_ADVANTAGE_FIELDS = (
    "negative_sample_reward",
    "negative_reward_by_error",
    "max_negative_samples_per_group",
    "group_baseline",
    "snapshot_advantage",
    "snapshot_reward_func",
    "scale_rewards",
    "advantage_std_floor",
)

# Settings TRL's rollout worker carries out in trl-agentic's loop (`_use_agentic_loop`); another worker makes its own
# rollouts and rows, so they do nothing there (the trainer warns). An estimator needs the worker's groups: the stage
# refuses a worker's rows without them.
_WORKER_FIELDS = (*AGENTIC_LOOP_FIELDS, "mask_truncated_completions")


def check_before_model(args: AsyncAgenticGRPOConfig, advantage_estimator=None):
    """The checks that import user code: run by the trainer before TRL loads the model, and by `trl-agentic train`
    before its warm start and vLLM server. Returns the estimator the stage runs (a callable passed to the trainer
    takes precedence over the config's name), None for TRL's own advantages."""
    # Imported in the worker's child, where an error reaches only the child's stderr: checked here first.
    snapshot_reward(args.snapshot_reward_func)
    if args.advantage_estimator != "grpo" or advantage_estimator is not None:
        return resolve_estimator(advantage_estimator or args.advantage_estimator)
    return None


def _use_agentic_loop(worker, what: str) -> None:
    """Make TRL's rollout worker spawn `AgenticAsyncRolloutLoop` (its `start()` reads `_loop_cls`): only in place of
    TRL's own loop, not of a subclass with other arguments (the OpenEnv harness's)."""
    loop_cls = worker._loop_cls
    if loop_cls not in (AgenticAsyncRolloutLoop, TRLRolloutLoop, worker_module()._AsyncRolloutLoop):
        raise ValueError(
            f"{what} run in TRL's own asynchronous rollout loop, but this rollout worker runs "
            f"{loop_cls.__name__} ({type(worker).__name__}). Use TRL's AsyncRolloutWorker, or switch them off."
        )
    worker._loop_cls = AgenticAsyncRolloutLoop


def _environment_probes(environment_factory) -> list[tuple]:
    """`(factory, class)` per environment factory whose class is known without calling it, the class being what the
    environment's protocol (user turns, tool names) is read from: the factory itself, the class of a
    `functools.partial` (TRL's worker asks for picklable factories and names it), or a function's return annotation.
    Nothing is built here: the worker builds the rollouts' environments in its own process, and a factory may start a
    container or open a connection."""
    if environment_factory is None:
        return []
    factories = environment_factory.values() if isinstance(environment_factory, dict) else [environment_factory]
    probes = []
    for factory in factories:
        target = factory
        while isinstance(target, functools.partial):
            target = target.func
        if not isinstance(target, type) and callable(target):
            try:  # a string under `from __future__ import annotations`: resolved in the function's module
                target = inspect.signature(target, eval_str=True).return_annotation
            except Exception:  # noqa: BLE001 - an annotation that does not resolve: nothing to read
                continue
        if isinstance(target, type) and target is not inspect.Signature.empty:
            probes.append((factory, target))
    return probes


def _refuse_environment_rewards(reward_funcs) -> None:
    """Raise before any model loads when a reward function declares an `environments` argument.

    TRL's asynchronous worker calls reward functions with the completions and dataset columns only: it returns each
    rollout's environment to its pool (to be reset by the next rollout) before the group is scored, so it has no
    environments to pass. Such a function would fail in the worker process, after the model and the server started.
    """
    import inspect

    for func in reward_funcs if isinstance(reward_funcs, list) else [reward_funcs]:
        if func is None or isinstance(func, str) or not callable(func):
            continue
        try:
            parameters = inspect.signature(func).parameters
        except (TypeError, ValueError):
            continue
        if "environments" in parameters:
            name = getattr(func, "__name__", type(func).__name__)
            raise ValueError(
                f"Reward function `{name}` takes `environments`, which TRL's asynchronous trainer does not pass (it "
                "scores a group after its environments went back to the pool). Give the environment a `get_reward()` "
                "method instead: TRL scores it when the rollout ends and adds it as a reward column (for the "
                "calculator's tool bonus, `environment_factory=ToolBonusCalculatorEnv` in place of "
                "`tool_use_reward`)."
            )


class AsyncAgenticGRPOTrainer(ModelCardMixin, AsyncGRPOTrainer):
    """
    Asynchronous GRPO trainer for agentic tool use, built on TRL's `AsyncGRPOTrainer` (see the module docstring and
    `docs/async.md`).

    Args:
        model (`str`):
            As in `AsyncGRPOTrainer` (a model id or folder, served by the vLLM server too); a built-in short name such
            as `"smollm2-135m"` is resolved to its local folder.
        reward_funcs, train_dataset, processing_class, callbacks, optimizers, peft_config, tools,
        environment_factory, rollout_worker, weight_transfer:
            As in `AsyncGRPOTrainer`.
        args ([`AsyncAgenticGRPOConfig`], *optional*):
            The configuration.
        advantage_estimator (`Callable`, *optional*):
            An estimator callable, taking precedence over `args.advantage_estimator`.
        tracin_eval_dataset (`Dataset`, *optional*):
            Validation prompts of the TracIn filter (`args.tracin_enabled`).

    `create_model_card` is the synchronous trainer's (`model_card.ModelCardMixin`): TRL's card plus the features that
    ran, their settings and citations.
    """

    _tag_names = ["trl", "async-grpo", "trl-agentic"]
    _name = "AsyncAgenticGRPO"
    _card_trainers = ("AsyncAgenticGRPOTrainer", "AsyncGRPOTrainer")

    @property
    def _uses_agentic_loop(self) -> bool:
        """Whether the rollout worker runs trl-agentic's loop (any feature, or `mask_truncated_completions`), for the
        model card."""
        return getattr(getattr(self, "rollout_worker", None), "_loop_cls", None) is AgenticAsyncRolloutLoop

    def __init__(
        self,
        model: str,
        reward_funcs=None,
        args: AsyncAgenticGRPOConfig | None = None,
        train_dataset=None,
        processing_class=None,
        callbacks=None,
        optimizers=(None, None),
        peft_config=None,
        tools=None,
        environment_factory=None,
        rollout_worker=None,
        weight_transfer=None,
        *,
        advantage_estimator=None,
        tracin_eval_dataset=None,
    ):
        # TRL's parameters in TRL's order (positional use as with `AsyncGRPOTrainer`; tests/test_trl_signatures.py).
        kwargs = dict(
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
            rollout_worker=rollout_worker,
            weight_transfer=weight_transfer,
        )
        if args is None:
            args = AsyncAgenticGRPOConfig(f"{str(model).split('/')[-1]}-AsyncAgenticGRPO")
        elif not isinstance(args, AsyncAgenticGRPOConfig):
            raise TypeError(f"`args` must be an AsyncAgenticGRPOConfig, got {type(args).__name__}.")
        if not isinstance(model, str):
            raise TypeError("AsyncAgenticGRPOTrainer takes the model as a name or folder (the vLLM server serves it).")
        _refuse_environment_rewards(reward_funcs)
        estimator = check_before_model(args, advantage_estimator)
        if args.tracin_enabled and peft_config is None:
            raise ValueError("`tracin_enabled=True` needs a PEFT LoRA policy: pass `peft_config` (a `LoraConfig`).")
        from ..vllm_lora import refuse_activated_lora

        refuse_activated_lora(model, peft_config)  # vLLM always generates here
        if args.enable_context_snapshots:
            if environment_factory is None and not tools:
                raise ValueError(
                    "`enable_context_snapshots=True` needs a multi-turn tool setup: pass `tools` or "
                    "`environment_factory` (the `delete_context` tool is added to them)."
                )
        probes = _environment_probes(environment_factory)
        if args.enable_context_snapshots:
            _check_tool_names(tools, None, args)  # before ours is added
            for _, cls in probes:
                _check_tool_names([], cls, args)
            tools = [*(tools or []), delete_context]
        user_turns = any(has_user_turns(cls) for _, cls in probes)
        # An estimator passed here counts as one in the config does: it runs in the estimator stage (and in TRL's
        # plain worker setup it would be ignored).
        self._features_on = (
            args.agentic_features_enabled or args.uses_agentic_loop or user_turns or advantage_estimator is not None
        )
        if not self._features_on and args.scale_rewards != "group":
            # With every feature off TRL's worker scores the groups (population std plus 1e-8), whatever is set here.
            warnings.warn(
                f"`scale_rewards={args.scale_rewards!r}` has no effect with every trl-agentic feature off: TRL's "
                "AsyncGRPOTrainer computes the advantages and always divides by the group's std.",
                UserWarning,
                stacklevel=2,
            )
        from ..models import check_pushable, resolve_model_path

        check_pushable(model, args.push_to_hub)
        model = resolve_model_path(model)
        # Reward functions and tools reach the spawned worker pickled; kept here for TracIn's validation rollouts.
        self._reward_funcs_list = (
            reward_funcs if isinstance(reward_funcs, list) else [reward_funcs] * bool(reward_funcs)
        )
        self._tools_list, self._environment_factory = tools, environment_factory
        with cpu_peak_flops():
            super().__init__(
                model,
                reward_funcs=reward_funcs,
                args=args,
                train_dataset=train_dataset,
                tools=tools,
                environment_factory=environment_factory,
                peft_config=peft_config,
                **kwargs,
            )
        register_cpu_tree_attention()
        # The last rows the trainer consumed (kind, staleness, advantage, tokens): for inspection and tests, bounded so
        # that a long run does not keep every row's tokens.
        self._observed_rows: collections.deque[dict] = collections.deque(maxlen=OBSERVED_ROWS_KEPT)
        worker = self.rollout_worker
        is_trl_worker = isinstance(worker, trainer_module().AsyncRolloutWorker)
        if is_trl_worker:
            install_stop(worker)  # TRL's stop() hangs when the child has already died (compat docstring)
            if worker._loop_cls is worker_module()._AsyncRolloutLoop:
                worker._loop_cls = TRLRolloutLoop  # TRL's loop in a child that dies with the trainer
        if self._lora_sync and is_trl_worker:
            # TRL's fixed name would collide with a previous run's adapters on the same server (module docstring).
            self._lora_name = f"trl-policy-{uuid.uuid4().hex[:8]}"
            worker._loop_kwargs["lora_name"] = self._lora_name
        self.advantage_estimator = estimator
        if args.mask_truncated_completions and is_trl_worker:
            _use_agentic_loop(worker, "`mask_truncated_completions`")  # TRL's worker has no such option
            worker._loop_kwargs["mask_truncated_completions"] = True
        elif worker is not None and not is_trl_worker:
            ignored = [name for name in _WORKER_FIELDS if getattr(args, name)]
            if ignored:
                logger.warning(
                    f"{', '.join(f'`{name}`' for name in ignored)} ha{'s' if len(ignored) == 1 else 've'} no effect "
                    f"with a rollout worker other than TRL's: the rollouts and rows are the ones "
                    f"{type(worker).__name__} makes."
                )
        # The queue stage runs with a feature on, and with `mask_truncated_completions` alone: it counts the groups the
        # worker pushed no trained row of as consumed (`stage.AgenticRolloutQueue`).
        self._stage_on = self._features_on or (args.mask_truncated_completions and is_trl_worker)
        if not self._features_on:
            return
        for factory, cls in probes:
            if args.enable_tool_rollback or has_user_turns(cls):
                check_checkpointable(factory())
        if self.accelerator.is_main_process and is_trl_worker:
            self.vllm_client.wait_for_server_ready()
            _use_agentic_loop(worker, "trl-agentic's features")
            worker._loop_kwargs["agentic"] = {
                "loop": {name: getattr(args, name) for name in LoopConfig.__dataclass_fields__},
                "advantage": {name: getattr(args, name) for name in _ADVANTAGE_FIELDS},
                "max_model_len": self.vllm_client.get_max_model_len(),
                "seed": args.seed,
                "push_untrained": self.advantage_estimator is not None,
            }
        self._tracin = None
        if args.tracin_enabled:
            from .tracin import AsyncTracIn

            self._tracin = AsyncTracIn(self, tracin_eval_dataset)

    # ------------------------------------------------------------------------------------------------------------
    def _request_model_name(self) -> str:
        """The model name a generation request of the current policy uses (TRL's versioned adapter name)."""
        if self._lora_sync:
            return f"{self._lora_name}-v{self.model_version}"
        from trl.trainer.utils import get_config_model_id

        return get_config_model_id(self.accelerator.unwrap_model(self.model).config)

    def _server_unreachable(self, what: str, error: BaseException) -> RuntimeError:
        return RuntimeError(
            f"{what}: the vLLM server at {self.args.vllm_server_base_url} failed ({type(error).__name__}: {error}). "
            f"Training stopped at step {self.state.global_step} (policy version {self.model_version}); the "
            f"checkpoints saved so far in {self.args.output_dir} are intact: restart the server and call "
            "`train(resume_from_checkpoint=...)` (a resumed run publishes its adapters under a new name)."
        )

    def _sync_weight(self):
        """TRL's weight sync; a server that is gone or refuses the adapter stops training with a clear error."""
        import requests

        try:
            return super()._sync_weight()
        except requests.RequestException as error:
            raise self._server_unreachable("Weight sync failed", error) from error
        except Exception as error:
            if "Request failed" in str(error):  # TRL's client: the server answered with an error status
                raise self._server_unreachable(
                    f"The vLLM server refused the policy of version {self.model_version + 1}", error
                ) from error
            raise

    def _check_health(self, stale_after_s: float) -> None:
        """TRL's worker health check, plus the server's: the worker retries a dead server for minutes."""
        import requests

        self._worker_check_health(stale_after_s)
        try:
            requests.get(f"{self.args.vllm_server_base_url.rstrip('/')}/health", timeout=5).raise_for_status()
            self._server_failures = 0
        except requests.RequestException as error:
            self._server_failures = getattr(self, "_server_failures", 0) + 1
            if self._server_failures >= 2:
                raise self._server_unreachable("Waiting for rollouts", error) from error

    def get_train_dataloader(self):
        worker = self.rollout_worker
        if self.accelerator.is_main_process and worker is not None and not hasattr(self, "_worker_check_health"):
            # Read by TRL's queue dataset when it waits for rollouts (every `poll_interval_s`).
            self._worker_check_health = worker.check_health
            worker.check_health = self._check_health
        if self._stage_on and self.accelerator.is_main_process and self.rollout_queue is not None:
            from .stage import AgenticRolloutQueue

            if not hasattr(self.rollout_queue, "_observe"):
                self.rollout_queue = AgenticRolloutQueue(self, self.rollout_queue, self.advantage_estimator)
        dataloader = super().get_train_dataloader()
        if self._features_on and self.accelerator.is_main_process:
            from .stage import token_advantage_collate

            before = self._tracin.stash if getattr(self, "_tracin", None) is not None else None
            # accelerate's dispatcher iterates its `base_dataloader`, whose collate function is TRL's collator.
            target = getattr(dataloader, "base_dataloader", dataloader)
            target.collate_fn = token_advantage_collate(target.collate_fn, before=before)
        return dataloader

    def training_step(self, model, inputs, num_items_in_batch=None):
        """TRL's, after the TracIn filter (`tracin.AsyncTracIn.apply`): it runs here, at the weights the micro-batch
        trains with, not when it is collated (accelerate collates the next micro-batch before this one trains)."""
        if getattr(self, "_tracin", None) is not None and "tracin_batch" in inputs:
            inputs = self._tracin.apply(inputs, can_skip=not self.is_deepspeed_enabled)
            if inputs is None:  # no row selected: nothing trained, as TRL would count a micro-batch read
                self._step_microbatches += 1
                return torch.zeros((), device=self.args.device)
        return super().training_step(model, inputs, num_items_in_batch)

    def train(self, *args, **kwargs):
        try:
            return super().train(*args, **kwargs)
        finally:
            if getattr(self, "_tracin", None) is not None:
                self._tracin.close()  # the validation rollouts' event loop (a later `train()` starts another)

    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        tracin = getattr(self, "_tracin", None)
        if tracin is not None and self.args.should_save:
            folder = os.path.join(self._get_output_dir(trial=trial), f"checkpoint-{self.state.global_step}")
            tracin.save(folder)

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        tracin = getattr(self, "_tracin", None)
        if checkpoint is not None and tracin is not None:
            tracin.load(checkpoint)

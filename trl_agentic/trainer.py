"""`AgenticGRPOTrainer`: TRL's `GRPOTrainer` with rollback, negative samples, snapshots and pluggable advantages."""

from __future__ import annotations

import inspect
import json
import os
import random
import warnings
from collections.abc import Callable

import torch
from trl import GRPOTrainer

from .batch import BatchAugmenter, snapshot_reward
from .config import AgenticGRPOConfig
from .envs.protocol import check_checkpointable, has_user_turns
from .estimators import grpo_estimator, resolve_estimator
from .generation import GenerationMixin
from .gloo_exit import register_gloo_exit_pause
from .loss_weights import RowWeightedLossMixin
from .model_card import ModelCardMixin
from .rollout.context import delete_context
from .rollout.loop import AgenticRolloutLoop, LoopConfig
from .rollout.trl_backend import TrainerBackend
from .selection.trainer_mixin import RowSelectionMixin
from .tracin.trainer_mixin import TracInMixin, tracin_validation_set
from .vllm_lora import lora_sync_vllm

STATE_FILE = "trl_agentic_state.json"
TRACIN_STATE_FILE = "tracin_state.pt"


def _jsonable(value):
    return [_jsonable(v) for v in value] if isinstance(value, tuple | list) else value


def _tupled(value):
    return tuple(_tupled(v) for v in value) if isinstance(value, list) else value


def _check_user_turns_have_tools(tools, conversations: list) -> None:
    """TRL runs the tool loop (where user turns are asked) only when there are tools: refuse a conversation without."""
    if tools or not conversations or any(_public_methods(env) for env in conversations):
        return
    names = ", ".join(sorted({(env if isinstance(env, type) else type(env)).__qualname__ for env in conversations}))
    raise ValueError(
        f"Environment {names} defines `_next_user_turn` but exposes no tools: TRL's GRPOTrainer runs its multi-turn "
        "loop (where further user turns are asked) only when there are tools. Give the environment at least one public "
        "method (its tools) or pass `tools=`."
    )


def _public_methods(env) -> list[str]:
    """The names TRL exposes as an environment's tools: public functions of its class but `reset`/`get_reward`."""
    cls = env if isinstance(env, type) else type(env)
    return [
        name
        for name, _ in inspect.getmembers(cls, predicate=inspect.isfunction)
        if name not in ("reset", "get_reward") and not name.startswith("_")
    ]


def _check_tool_names(tools, environment_factory, args) -> None:
    """With snapshots on, `delete_context` is ours: a user tool of that name would be intercepted by the loop."""
    if not args.enable_context_snapshots:
        return
    names = [getattr(tool, "__name__", None) for tool in tools or []]
    if isinstance(environment_factory, type):
        names += _public_methods(environment_factory)
    if delete_context.__name__ in names:
        raise ValueError(
            f"A tool is named `{delete_context.__name__}`, the name of trl-agentic's context-deletion tool, which "
            "`enable_context_snapshots=True` adds: rename yours."
        )


def check_before_model(args: AgenticGRPOConfig, advantage_estimator=None):
    """The checks of `AgenticGRPOConfig` that import user code or depend on the estimator: run by the trainer before
    TRL loads the model, and by `trl-agentic train` before its warm start. Returns the estimator that runs (a
    callable passed to the trainer takes precedence over the config's name), what decides here, not the string."""
    snapshot_reward(args.snapshot_reward_func)  # a path that does not import fails here, naming the field
    estimator = resolve_estimator(advantage_estimator or args.advantage_estimator)
    if (
        args.agentic_features_enabled or estimator is not grpo_estimator
    ) and args.multi_objective_aggregation != "sum_then_normalize":
        raise ValueError(
            "`multi_objective_aggregation` must be 'sum_then_normalize' when rollback, snapshots, TracIn or an "
            "advantage estimator is on: negative and snapshot rows have a single reward, not one per reward "
            "function, and an estimator takes the summed rewards (GDPO would keep TRL's advantages, ignoring it)."
        )
    if estimator is not grpo_estimator and args.row_selection != "none":
        raise ValueError(
            f"`row_selection={args.row_selection!r}` selects among the regular rollouts and sets their advantages: "
            "it cannot be combined with an advantage estimator (passed as `advantage_estimator=`)."
        )
    return estimator


class AgenticGRPOTrainer(
    ModelCardMixin, RowSelectionMixin, GenerationMixin, TracInMixin, RowWeightedLossMixin, GRPOTrainer
):
    """
    GRPO trainer for agentic tool use, built on [`~trl.GRPOTrainer`].

    With every feature of [`AgenticGRPOConfig`] off it trains exactly like `GRPOTrainer` (tested). The features:

    - multi-turn tool rollouts with environment checkpoints, rollback-and-retry on tool errors and negative samples
      (`enable_tool_rollback`, `save_negative_samples`);
    - a `delete_context` tool that turns one rollout into several training rows (`enable_context_snapshots`);
    - GRPO advantages over variable-size groups across processes, with a pluggable estimator
      (`advantage_estimator`).

    Overridden `GRPOTrainer` methods (all private in TRL 1.16, guarded by `tests/test_trl_signatures.py`):

    - `_tool_call_loop`: TRL's own loop unless a feature needs ours (`AgenticGRPOConfig.uses_agentic_loop`:
      rollback, snapshots, `tool_timeout`, `max_tool_output_chars`, `malformed_tool_call_feedback`, or an
      environment with further user turns), then `trl_agentic.rollout.loop.AgenticRolloutLoop` (same inputs and
      7-tuple). Delegating, rather than reproducing TRL's loop, makes "features off = TRL" hold by construction for
      tool and environment runs too, and keeps it holding when TRL's loop changes; our loop renders tool messages
      and errors exactly as TRL does, so a run that turns a feature on keeps what the model reads;
    - `_generate_single_turn` (`trl_agentic.generation.GenerationMixin`): the per-turn cap (`max_turn_tokens`) on
      every engine, and on TRL's regular transformers path the prefix cache across turns
      (`transformers_prefix_caching`); otherwise TRL's;
    - `_calculate_rewards`: calls TRL's and keeps the gathered rewards for the batch augmentation;
    - `_generate_and_score_completions`: calls TRL's (within the prefix cache's lifetime), then `trl_agentic.batch.BatchAugmenter` appends the extra
      rows, recomputes the advantages over explicit group ids and the loss normaliser, and pads every process to the
      same divisible row count;
    - `_compute_loss` (`trl_agentic.loss_weights.RowWeightedLossMixin`): calls TRL's; for per-row loss types
      (`grpo`, `sapo`, `dr_grpo`, `luspo`) it rescales the policy term so that every trained row weighs
      `1 / num_rows_in_batch` whatever the padding rows and the micro-batch it falls in, and for `bnpo` (when a
      feature can reshape batches) so that every trained token weighs `1 / num_items_in_batch`;
    - `_save_checkpoint` / `_load_optimizer_and_scheduler`: call TRL's and save/restore trl-agentic's own state;
    - `create_model_card` (public): TRL's card plus the features used, their settings and citations.

    Args:
        model, reward_funcs, args, train_dataset, eval_dataset, processing_class, reward_processing_classes,
        callbacks, optimizers, peft_config, tools, environment_factory, rollout_func:
            As in [`~trl.GRPOTrainer`]. `model` may also be a built-in short name such as `"smollm2-135m"`.
        advantage_estimator (`Callable`, *optional*):
            An estimator callable, taking precedence over `args.advantage_estimator`.
        tracin_eval_dataset (`Dataset`, *optional*):
            Validation prompts of the TracIn filter (`args.tracin_enabled`); the eval dataset when unset.
    """

    _tag_names = ["trl", "grpo", "trl-agentic"]
    _name = "AgenticGRPO"

    def __init__(
        self,
        model,
        reward_funcs=None,
        args: AgenticGRPOConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        reward_processing_classes=None,
        callbacks=None,
        optimizers=(None, None),
        quantization_config=None,
        peft_config=None,
        tools=None,
        rollout_func=None,
        environment_factory=None,
        *,
        advantage_estimator: Callable | None = None,
        tracin_eval_dataset=None,
    ):
        # TRL's parameters in TRL's order (positional use as with `GRPOTrainer`; tests/test_trl_signatures.py).
        kwargs = dict(
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            reward_processing_classes=reward_processing_classes,
            callbacks=callbacks,
            optimizers=optimizers,
            quantization_config=quantization_config,
            peft_config=peft_config,
            rollout_func=rollout_func,
        )
        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path
            args = AgenticGRPOConfig(f"{str(name).split('/')[-1]}-AgenticGRPO")
        elif not isinstance(args, AgenticGRPOConfig):
            raise TypeError(f"`args` must be an AgenticGRPOConfig, got {type(args).__name__}.")
        if args.tracin_enabled and peft_config is None and not hasattr(model, "peft_config"):
            # Checked before TRL loads the model: the influence hooks need LoRA layers.
            raise ValueError(
                "`tracin_enabled=True` needs a PEFT LoRA policy: pass `peft_config` (a `peft.LoraConfig`) or a "
                "`peft.PeftModel` with LoRA adapters."
            )
        if args.tracin_enabled:
            tracin_validation_set(tracin_eval_dataset, eval_dataset, warn=True)  # before TRL loads the model
        if args.use_vllm:
            from .vllm_lora import refuse_activated_lora

            refuse_activated_lora(model, peft_config)
        _check_tool_names(tools, environment_factory, args)
        if args.enable_context_snapshots:
            if environment_factory is None and not tools:
                raise ValueError(
                    "`enable_context_snapshots=True` needs a multi-turn tool setup: pass `tools` or "
                    "`environment_factory` (the `delete_context` tool is added to them)."
                )
            tools = [*(tools or []), delete_context]
        if isinstance(environment_factory, type) and has_user_turns(environment_factory):
            # Before the model loads when it can; after `delete_context` joined the tools (TRL's loop runs with it).
            _check_user_turns_have_tools(tools, [environment_factory])
        estimator = check_before_model(args, advantage_estimator)
        if isinstance(model, str):
            from .models import check_pushable, resolve_model_path

            check_pushable(model, args.push_to_hub)
            model = resolve_model_path(model)
        # TRL builds its vLLM engine in here; LoRA support must be on from creation (docs/vllm.md).
        with lora_sync_vllm(args.use_vllm and args.vllm_lora_sync):
            super().__init__(
                model,
                reward_funcs if reward_funcs is not None else [],
                args=args,
                tools=tools,
                environment_factory=environment_factory,
                **kwargs,
            )
        probes = [pool[0] for pool in self._environment_pool.values()] if self.environment_factories else []
        conversations = [env for env in probes if has_user_turns(env)]
        if args.enable_context_snapshots and [t.__name__ for t in self.tools].count(delete_context.__name__) > 1:
            _check_tool_names([t for t in self.tools if t is not delete_context], None, args)  # a factory's method
        _check_user_turns_have_tools(self.tools, conversations)
        for env in probes:
            # Rollback restores a checkpoint; a timed-out call's environment is replaced by a restored copy; a user
            # turn that does not fit the budget is taken back (the hook may have advanced the environment).
            if args.enable_tool_rollback or args.tool_timeout or has_user_turns(env):
                check_checkpointable(env)
        self._uses_agentic_loop = args.uses_agentic_loop or bool(conversations)
        self.advantage_estimator = estimator
        self._loop_config = LoopConfig.from_args(args)
        self._rng = random.Random(args.seed)
        self._augmenter = BatchAugmenter(self)
        self._last_rewards_per_func = None
        self._last_loop_result = None
        self._init_tracin(tracin_eval_dataset)
        self._init_row_selection()
        self._init_generation()
        register_gloo_exit_pause()  # gloo worker threads must not outlive the interpreter (see gloo_exit.py)

    # ------------------------------------------------------------------------------------------------------------
    def _tool_call_loop(self, prompts, prompt_ids, completion_ids, completions, logprobs, images, multimodal_fields):
        if not self._uses_agentic_loop:
            # No feature needs our loop: TRL's own, so that tool messages, tokens and rewards are TRL's exactly.
            return super()._tool_call_loop(
                prompts, prompt_ids, completion_ids, completions, logprobs, images, multimodal_fields
            )
        if images is not None or multimodal_fields:
            raise NotImplementedError("trl-agentic's tool loop does not handle images; use text environments.")
        num_local = len(prompt_ids)
        base = self.accelerator.process_index * num_local
        group_size = self.num_generations if self.model.training else self.num_generations_eval
        loop = AgenticRolloutLoop(
            TrainerBackend(self), self._loop_config, async_loop=getattr(self, "async_loop", None), rng=self._rng
        )
        trl_tuple, result = loop.run(
            prompts,
            prompt_ids,
            completion_ids,
            completions,
            logprobs,
            self._sync_tool_dicts,
            self._async_tool_dicts,
            self.environments,
            group_ids=[(base + i) // group_size for i in range(num_local)],
        )
        self._last_loop_result = result
        return trl_tuple

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._last_rewards_per_func = rewards_per_func  # gathered over processes: (N_global, n_funcs)
        return rewards_per_func

    def _generate_and_score_completions(self, inputs):
        self._last_loop_result = None
        self._last_rewards_per_func = None
        with self._prefix_cache_scope():  # the kept caches live through the augmentation (RLVCR reuses them)
            output = super()._generate_and_score_completions(inputs)
            output = self._augmenter(output, inputs, self._last_rewards_per_func, self._last_loop_result)
        return self._select_rows(output)  # `row_selection` (trl_agentic.selection): last, on the finished batch

    # ------------------------------------------------------------------------------------------------------------
    def _state_file(self) -> str:
        """This process's file of trl-agentic's own RNG state (one per process, like transformers' `rng_state_{k}`)."""
        rank = self.accelerator.process_index
        return STATE_FILE if self.accelerator.num_processes == 1 else STATE_FILE.replace(".json", f"_{rank}.json")

    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        # Our own state beside TRL's: the snapshot-downsampling RNG (every process its own: each draws for its own
        # rollouts) and the TracIn state (V and its refresh schedule, identical on every process); everything else is
        # rebuilt deterministically.
        self._save_own_state(os.path.join(self._get_output_dir(trial=trial), f"checkpoint-{self.state.global_step}"))

    def _save_own_state(self, folder: str) -> None:
        tracin_state = self._tracin_state_dict()
        if tracin_state is not None and self.args.should_save:
            # Written before the state file, whose presence marks our part of the checkpoint as complete.
            torch.save(tracin_state, os.path.join(folder, TRACIN_STATE_FILE))
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, self._state_file()), "w") as f:
            json.dump({"rng": _jsonable(self._rng.getstate())}, f)

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None:
            self._load_own_state(checkpoint)

    def _load_own_state(self, checkpoint: str) -> None:
        path = os.path.join(checkpoint, self._state_file())
        if os.path.exists(path):
            with open(path) as f:
                state = json.load(f)
            self._rng.setstate(_tupled(state["rng"]))
        else:
            warnings.warn(
                f"{path} does not exist (a checkpoint saved with a different number of processes?): the "
                "snapshot-downsampling RNG of this process starts afresh.",
                UserWarning,
                stacklevel=2,
            )
        if self._tracin is not None:
            tracin_path = os.path.join(checkpoint, TRACIN_STATE_FILE)
            if os.path.exists(tracin_path):
                self._tracin_load_state_dict(torch.load(tracin_path, map_location="cpu", weights_only=True))
            else:
                # E.g. a checkpoint of a run without TracIn: V is computed afresh at the next step.
                warnings.warn(
                    f"TracIn is on but {tracin_path} does not exist; the validation gradient is recomputed at the "
                    "next step, so the run does not continue exactly as an uninterrupted one would.",
                    UserWarning,
                    stacklevel=2,
                )

    @torch.no_grad()
    def _logps_for_rows(self, model, prompt_ids, prompt_mask, completion_ids, completion_mask):
        """Per-token log-probs of extra rows, computed as TRL computes its old/ref log-probs (checkpointing paused by
        `checkpointing_paused`, which keeps `every_n_layers` / `offload`, where TRL re-enables without them)."""
        from .tracin.hooks import checkpointing_paused

        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        mode = "train" if self.model.training else "eval"
        batch_size = self.args.per_device_train_batch_size if mode == "train" else self.args.per_device_eval_batch_size
        with checkpointing_paused(self.model):
            logps, _, _ = self._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, completion_ids.size(1), batch_size=batch_size
            )
        return logps

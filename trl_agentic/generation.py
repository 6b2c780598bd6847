"""Turn generation of `AgenticGRPOTrainer`: prefix caching across turns and the per-turn token cap.

`GenerationMixin` overrides `GRPOTrainer._generate_single_turn`, which TRL calls for the first turn of every rollout
(`_generate`) and which both tool loops (TRL's and `trl_agentic.rollout.loop`) call for every later turn:

- `max_turn_tokens`: every engine generates at most that many tokens per call (transformers: a copy of the
  trainer's generation config with a smaller `max_new_tokens`; vLLM: its `max_completion_length` for the call);
- the call limit (`_generation_limit`): a later turn of trl-agentic's loop keeps at most what is left of the
  rollout's budget, so the engine is asked for no more than the largest such limit of the call, the same way;
- `transformers_prefix_caching`: when trl-agentic's own loop runs (a feature needs it; with every feature off TRL's
  generation runs untouched), on TRL's regular transformers path, `trl_agentic.rollout.prefix_cache` generates with
  each conversation's kept cache. Inputs, padding, the generation config (temperature, top-p/k, min-p,
  repetition penalty, `generation_kwargs`, eos and pad ids: all read from `self.generation_config`, the object TRL
  builds from `GRPOConfig`) and the context managers are TRL's, so a TRL change of those settings reaches both paths.

Every process makes the same calls as without caching (one `generate` per `_generate_single_turn`), so generation
stays a collective under DeepSpeed ZeRO-3 exactly as in TRL.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager

import torch

from .rollout.prefix_cache import (
    PrefixCache,
    dropout_reason,
    generate_with_prefix_cache,
    unsupported_reason,
    with_max_new_tokens,
)

logger = logging.getLogger(__name__)


class GenerationMixin:
    """Prefix caching and the per-turn cap for a `GRPOTrainer` subclass (see the module docstring)."""

    def _init_generation(self) -> None:
        """Decide once whether prefix caching applies; log why not when it was asked for and does not."""
        self._prefix_cache: PrefixCache | None = None
        self._call_limit: int | None = None  # `_generation_limit`
        self._dropout_in_training: str | None = None
        args = self.args
        if not args.transformers_prefix_caching or self.use_vllm or not self.tools:
            return  # vLLM has its own prefix caching; without tools every rollout is one turn
        if not self._uses_agentic_loop:
            # Every feature off: TRL's loop *and* TRL's generation, so that features off = GRPOTrainer bit for bit
            # (cached keys and values give the same tokens only up to float rounding, which sampling can amplify).
            return
        reason = None
        if self.use_transformers_continuous_batching:
            reason = "`use_transformers_continuous_batching` (its paged cache lives for one call)"
        elif self._is_vlm:
            reason = "vision-language model"
        else:
            reason = unsupported_reason(self.accelerator.unwrap_model(self.model), self.generation_config)
        if reason is not None:
            logger.warning(
                "transformers_prefix_caching is on but not used: %s. Every turn is generated from the whole "
                "conversation, as in TRL.",
                reason,
            )
            return
        self._prefix_cache = PrefixCache()
        # TRL samples under dropout in training mode, with fresh masks at every turn: no cache then (eval mode is fine).
        self._dropout_in_training = dropout_reason(self.accelerator.unwrap_model(self.model))
        if self._dropout_in_training is not None:
            logger.warning(
                "transformers_prefix_caching is not used in training mode: the model has dropout (%s), which TRL "
                "applies during generation with fresh masks at every turn. It is used in evaluation.",
                self._dropout_in_training,
            )
        # Sharing a prompt's prefix within a call costs one more forward per prompt; under ZeRO-3 without gathered
        # weights, and under FSDP (its units all-gather in every forward), every forward is a collective and processes
        # would make different numbers of them (transformers' `synced_gpus` rule: ZeRO-3 or FSDP, several processes).
        plugin = getattr(self.accelerator.state, "deepspeed_plugin", None)
        zero3_sharded = plugin is not None and plugin.zero_stage == 3 and not args.ds3_gather_for_generation
        fsdp = self._dist.is_fsdp and self.accelerator.num_processes > 1
        self._prefix_sharing_is_local = not (zero3_sharded or fsdp)

    @contextmanager
    def _generation_limit(self, limit: int | None):
        """Within the block, a generation call asks the engine for at most `limit` tokens per context (`_turn_cap`)."""
        old, self._call_limit = getattr(self, "_call_limit", None), limit
        try:
            yield
        finally:
            self._call_limit = old

    @contextmanager
    def _turn_cap(self):
        """Within the block, the trainer's engine generates at most `max_turn_tokens` per call, and at most the call
        limit (`_generation_limit`) when one is set."""
        caps = [c for c in (self.args.max_turn_tokens, getattr(self, "_call_limit", None)) if c is not None]
        cap = min(caps) if caps else None
        if cap is None:
            yield None
            return
        if self.use_vllm:
            vllm = self.vllm_generation
            old = vllm.max_completion_length
            vllm.max_completion_length = min(old, cap)
            try:
                yield None
            finally:
                vllm.max_completion_length = old
            return
        old = self.generation_config
        self.generation_config = with_max_new_tokens(old, cap)
        try:
            yield self.generation_config
        finally:
            self.generation_config = old

    def _active_prefix_cache(self) -> PrefixCache | None:
        """The prefix cache when it applies now (not in training mode with dropout: see `dropout_reason`)."""
        if self._prefix_cache is None or (self._dropout_in_training is not None and self.model.training):
            return None
        return self._prefix_cache

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        with self._turn_cap():
            cache = self._active_prefix_cache()
            if cache is None or images is not None or multimodal_fields or has_tool_images:
                return super()._generate_single_turn(
                    prompt_ids, images, multimodal_fields, num_generations, has_tool_images=has_tool_images
                )
            version = (self.state.global_step, self.model.training)
            if getattr(cache, "version", None) != version:
                cache.clear()  # computed with other weights (or another mode): never reused
                cache.version = version
            return self._generate_with_prefix_cache(prompt_ids), None

    def _generate_with_prefix_cache(self, prompt_ids: list[list[int]]) -> list[list[int]]:
        """TRL's regular transformers generation (`_generate_single_turn`'s last branch) with the kept prefixes."""
        from transformers import Trainer
        from trl.extras.profiling import profiling_context
        from trl.models.utils import unwrap_model_for_generation
        from trl.trainer.utils import pad

        tensors = [torch.tensor(ids) for ids in prompt_ids]
        inputs = {
            "input_ids": pad(
                tensors,
                padding_value=self._tokenizer.pad_token_id,
                padding_side="left",
                pad_to_multiple_of=self.pad_to_multiple_of,
            ),
            "attention_mask": pad(
                [torch.ones_like(t) for t in tensors],
                padding_value=0,
                padding_side="left",
                pad_to_multiple_of=self.pad_to_multiple_of,
            ),
        }
        inputs = Trainer._prepare_inputs(self, inputs)  # what TRL's `super()._prepare_inputs` is: device placement
        with (
            profiling_context(self, "transformers.generate"),
            unwrap_model_for_generation(
                self.model_wrapped,
                self.accelerator,
                gather_deepspeed3_params=self.args.ds3_gather_for_generation,
                generation_kwargs=self.generation_kwargs,
                gradient_checkpointing_kwargs=self.args.gradient_checkpointing_kwargs,
            ) as unwrapped_model,
            torch.no_grad(),
            self._dist.summon_full_params(self.model_wrapped, recurse=False),
        ):
            return generate_with_prefix_cache(
                unwrapped_model,
                self._prefix_cache,
                inputs["input_ids"],
                inputs["attention_mask"],
                prompt_ids,
                self.generation_config,
                self.eos_token_ids,
                share_within_call=self._prefix_sharing_is_local,
            )

    @contextmanager
    def _prefix_cache_scope(self):
        """The lifetime of the kept caches: one generation batch, its extra generations (RLVCR's alternative
        thinking reuses the rollouts' prefixes) included; the metrics are logged at its end."""
        cache = self._active_prefix_cache()
        if cache is None:
            yield
            return
        cache.clear()
        cache.reset_stats()
        try:
            yield
        finally:
            cache.clear()  # the next batch is generated with other weights
        self._log_prefix_cache(cache.stats)

    def _log_prefix_cache(self, stats) -> None:
        mode = "train" if self.model.training else "eval"
        local = torch.tensor(
            [stats.context_tokens, stats.prefilled_tokens],
            dtype=torch.float64,
            device=self.accelerator.device,
        )
        context, prefilled = self.accelerator.reduce(local, reduction="sum").tolist()
        # Net of the shared prefixes' own prefill: what TRL's path would have prefilled, minus what this one did.
        metrics = self._metrics[mode]
        metrics["prefix_cache/prefilled_tokens"].append(prefilled)
        metrics["prefix_cache/saved_tokens"].append(context - prefilled)
        metrics["prefix_cache/saved_ratio"].append((context - prefilled) / context if context else 0.0)

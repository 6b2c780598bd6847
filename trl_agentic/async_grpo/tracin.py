"""The TracIn-filtered step of the asynchronous trainer (`tracin_enabled`, LoRA, one training process).

Why not `tracin/trainer_mixin.py`: the mixin overrides `GRPOTrainer._prepare_inputs`, `_compute_loss` and
`_generate_and_score_completions`, which `AsyncGRPOTrainer` does not have, and it separates rows by the batch
dimension of the training forward, whereas TRL's asynchronous trainer packs all rows of a micro-batch into ONE
tree-packed sequence in which a shared prefix token belongs to several rows. What is reused: the ghost-gradient hooks
(`tracin.hooks.LoraGhostHooks`), the selection (`tracin.selection.select_rows`), the schedule (`tracin.schedule.due`)
and trl-agentic's rollout loop for the validation rollouts.

Per micro-batch (the planner's rows, before TRL's collator packs them):

1. V, the validation direction (refreshed every `tracin_val_refresh_steps` optimizer steps): `tracin_val_batch_size`
   validation prompts are rolled out `tracin_val_num_generations` times each with the current policy (the server's
   current adapter, through trl-agentic's rollout loop, tools and environments included), scored with the reward
   functions, given group advantages (`group_advantages`; exactly 0 in a group without reward spread,
   `without_reward_spread`, not float32 rounding noise), and V is the gradient w.r.t. the LoRA weights of TRL's
   asynchronous loss on them at ratio 1 (`-sum_b A_b sum_t exp(logp_t - sg(logp_t)) / N_tokens`).
2. Scores: `score_b = <grad ell_b, V>`, `ell_b` being row b's term of the loss TRL trains the micro-batch with
   (`-sum_t min(r_t A_t, clip(r_t) A_t) / N_tokens / gradient_accumulation_steps`, `r_t` against the row's sampling
   log-probs, `N_tokens` the micro-batch's trained tokens), from one forward of the rows unpacked (a padded batch) and
   one backward through the hooks (no parameter gradient is touched).
3. Selection: `select_rows` with the config's mode, at least one row (`max(tracin_min_selected, 1)`: a micro-batch
   without a trained token would have no loss term at all). When V is exactly zero (no validation group had a reward
   spread) every valid row is kept and none is scored, as in the synchronous trainer.
4. Training: the rejected rows' `completion_mask` is zeroed before packing, so TRL's collator counts, and its loss
   normalises by, the selected rows' tokens only: training on the masked micro-batch is training on the selected rows
   alone (the rejected rows' tokens stay in the forward as context of nothing but themselves).

Metrics: `tracin/selected_ratio`, `tracin/num_selected`, `tracin/score_mean`, `tracin/score_pos_frac`,
`tracin/val_reward`, `tracin/val_grad_norm`.
"""

from __future__ import annotations

import copy
import inspect
import math
import os
import random
import sys

import numpy as np
import torch

from ..advantages import group_advantages, without_reward_spread
from ..envs.protocol import tool_methods, with_observation
from ..rollout.loop import AgenticRolloutLoop, LoopConfig
from ..rollout.rendering import ChatRenderer
from ..tracin.hooks import LoraGhostHooks
from ..tracin.lora_gradient import is_zero
from ..tracin.schedule import due
from ..tracin.selection import select_rows

__all__ = ["AsyncTracIn", "async_row_losses"]

STATE_FILE = "tracin_async_state.pt"


def async_row_losses(model, samples: list[dict], *, temperature: float, epsilon_low: float, epsilon_high: float):
    """Per-row terms of TRL's asynchronous loss, from one padded forward of the rows (sum over the row's trained
    tokens of `-min(r A, clip(r) A)`, not yet normalised). Returns `(losses (B,), trained token count)`."""
    device = next(model.parameters()).device
    width = max(len(s["input_ids"]) for s in samples)
    ids = torch.zeros(len(samples), width, dtype=torch.long, device=device)
    attention = torch.zeros_like(ids)
    mask = torch.zeros(len(samples), width, dtype=torch.float32, device=device)
    old = torch.zeros(len(samples), width, dtype=torch.float32, device=device)
    adv = torch.zeros(len(samples), width, dtype=torch.float32, device=device)
    for b, s in enumerate(samples):
        n = len(s["input_ids"])
        ids[b, :n] = torch.as_tensor(np.asarray(s["input_ids"]), device=device)
        attention[b, :n] = 1
        mask[b, :n] = torch.as_tensor(np.asarray(s["completion_mask"]), dtype=torch.float32, device=device)
        old[b, :n] = torch.as_tensor(np.asarray(s["old_log_probs"]), dtype=torch.float32, device=device)
        a = s["advantage"]
        adv[b, :n] = (
            torch.as_tensor(np.asarray(a, dtype=np.float32), device=device) if isinstance(a, np.ndarray) else a
        )
    logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1].float() / temperature
    logps = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    target_mask, old, adv = mask[:, 1:], old[:, 1:], adv[:, 1:]
    ratio = torch.exp(logps - old)
    per_token = -torch.min(ratio * adv, torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high) * adv)
    return (per_token * target_mask).sum(dim=1), target_mask.sum()


class _HTTPBackend:
    """`RolloutBackend` generating through the vLLM server with the current policy's adapter (trainer process)."""

    multi_process = False

    def __init__(self, trainer, tools, max_model_len):
        from ..async_grpo.stage import EstimatorHost

        self._host = EstimatorHost(trainer)
        self.tools = tools
        self.tokenizer = trainer.processing_class
        self.renderer = ChatRenderer(self.tokenizer)
        args = trainer.args
        self.max_completion_length = args.max_completion_length
        self.max_model_len = max_model_len
        self.max_iterations = (
            sys.maxsize if args.max_tool_calling_iterations is None else args.max_tool_calling_iterations
        )
        self.stop_token_ids = {*trainer.eos_token_ids, self.tokenizer.pad_token_id} - {None}

    def generate(self, contexts):
        return self._host._generate_single_turn(contexts, max_tokens=self.max_completion_length)

    def parse(self, ids, prefix, row, tools=None):
        from trl.chat_template_utils import parse_response

        return parse_response(self.tokenizer, ids, prefix=prefix, tools=self.tools if tools is None else tools)

    def decode(self, ids):
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def tool_suffix_ids(self, tool_messages):
        return self.renderer.tool_suffix_ids(tool_messages)

    def hint_ids(self, hint):
        return self.renderer.hint_ids(hint)

    def user_turn_ids(self, content):
        return self.renderer.user_turn_ids(content)

    def render_prompt(self, messages, row, tools=None):
        return self.renderer.prompt_ids(messages, tools=self.tools if tools is None else tools)

    def new_environment(self, row, old):
        raise NotImplementedError("tool_timeout is not supported by the asynchronous trainer")

    def any_rank(self, flag, error=None):
        if error is not None:
            raise error
        return flag


class AsyncTracIn:
    """TracIn row filter of `AsyncAgenticGRPOTrainer` (module docstring).

    Args:
        trainer: The trainer.
        dataset: Validation prompts (map-style dataset with the training dataset's columns).
    """

    def __init__(self, trainer, dataset):
        if dataset is None or len(dataset) == 0:
            raise ValueError("TracIn needs validation prompts: pass `tracin_eval_dataset` to the trainer.")
        if trainer.accelerator.num_processes > 1:
            raise ValueError("The asynchronous TracIn filter runs with one training process.")
        self.trainer = trainer
        self.dataset = dataset
        self.direction = None
        self.refreshed_at: int | None = None
        self.refreshes = 0
        self.last: dict = {}
        from trl.chat_template_utils import add_response_schema

        tokenizer = trainer.processing_class
        if (
            getattr(tokenizer, "response_template", None) is None
            and getattr(tokenizer, "response_schema", None) is None
        ):
            add_response_schema(tokenizer)

    # ----------------------------------------------------------------------------------------------- checkpoints
    def save(self, folder: str) -> None:
        direction = None
        if self.direction is not None:
            direction = {name: {"A": g.A.cpu(), "B": g.B.cpu()} for name, g in self.direction.items()}
        state = {"direction": direction, "refreshed_at": self.refreshed_at, "refreshes": self.refreshes}
        os.makedirs(folder, exist_ok=True)
        torch.save(state, os.path.join(folder, STATE_FILE))

    def load(self, folder: str) -> None:
        from ..tracin.lora_gradient import LoraGradient

        path = os.path.join(folder, STATE_FILE)
        if not os.path.exists(path):
            return
        state = torch.load(path, map_location="cpu", weights_only=True)
        device = self.trainer.accelerator.device
        if state["direction"] is not None:
            self.direction = {
                name: LoraGradient(A=g["A"].to(device), B=g["B"].to(device)) for name, g in state["direction"].items()
            }
        self.refreshed_at, self.refreshes = state["refreshed_at"], state["refreshes"]

    # ----------------------------------------------------------------------------------------------- filter
    @property
    def direction_is_zero(self) -> bool:
        """V is exactly zero: no information, so every valid row is selected (and none is scored)."""
        return self.direction is not None and is_zero(self.direction)

    def _model(self):
        return self.trainer.accelerator.unwrap_model(self.trainer.model)

    def filter_rows(self, rows) -> None:
        """Score the micro-batch's rows (the planner's `TreeRow`s), select, and zero the rejected rows' masks."""
        t, args = self.trainer, self.trainer.args
        if due(t.state.global_step, self.refreshed_at, args.tracin_val_refresh_steps):
            self.refresh()
        samples = [s for row in rows for s in row.samples]
        valid = torch.tensor([bool(np.asarray(s["completion_mask"]).any()) for s in samples])
        if self.direction_is_zero:
            # V = 0 (no validation group had a reward spread): every score is 0 and says nothing about a row, so
            # every row is trained, as in the synchronous trainer; not the fallback's first row at full weight.
            scores, selected = torch.zeros(len(samples)), valid.clone()
        else:
            scores = self.scores(samples)
            selected = select_rows(
                scores.detach().cpu().double(),
                valid,
                mode=args.tracin_selection,
                fraction=args.tracin_top_fraction,
                threshold=args.tracin_threshold,
                min_selected=max(args.tracin_min_selected, 1),
            )
        for s, keep in zip(samples, selected.tolist()):
            if not keep:
                s["completion_mask"] = np.zeros_like(np.asarray(s["completion_mask"]))
        metrics = t._metrics["train"]
        n_valid = int(valid.sum())
        valid_scores = scores.detach().cpu().double()[valid]
        metrics["tracin/selected_ratio"].append(int(selected.sum()) / n_valid if n_valid else math.nan)
        metrics["tracin/num_selected"].append(float(selected.sum()))
        metrics["tracin/score_mean"].append(valid_scores.mean().item() if n_valid else math.nan)
        metrics["tracin/score_pos_frac"].append((valid_scores > 0).double().mean().item() if n_valid else math.nan)
        self.last = {"scores": scores.detach().cpu(), "selected": selected.clone(), "valid": valid}

    def scores(self, samples: list[dict]) -> torch.Tensor:
        """`<grad ell_b, V>` per row (module docstring, step 2)."""
        t = self.trainer
        model = self._model()
        with LoraGhostHooks(model) as hooks:
            with hooks.record(direction=self.direction):
                losses, tokens = async_row_losses(
                    model, samples, temperature=t.temperature, epsilon_low=t.epsilon_low, epsilon_high=t.epsilon_high
                )
                loss = losses.sum() / tokens.clamp(min=1.0) / t.args.gradient_accumulation_steps
            return hooks.score_rows(loss, self.direction)

    # ----------------------------------------------------------------------------------------------- validation
    def refresh(self) -> None:
        """Roll out validation prompts with the current policy and recompute V (module docstring, step 1)."""
        t = self.trainer
        samples, rewards = self._validation_rollouts()
        model = self._model()
        with LoraGhostHooks(model) as hooks, hooks.record():
            losses, tokens = async_row_losses(
                model, samples, temperature=t.temperature, epsilon_low=t.epsilon_low, epsilon_high=t.epsilon_high
            )
            self.direction = hooks.accumulate_gradient(losses.sum() / tokens.clamp(min=1.0))
        self.refreshed_at = t.state.global_step
        self.refreshes += 1
        norm = math.sqrt(
            sum(float(g.A.double().square().sum() + g.B.double().square().sum()) for g in self.direction.values())
        )
        t._metrics["train"]["tracin/val_grad_norm"].append(norm)
        t._metrics["train"]["tracin/val_reward"].append(float(np.nanmean(rewards)) if len(rewards) else math.nan)

    def _validation_rollouts(self):
        """Validation rows with their old log-probs set to the current ones (ratio 1) and group advantages."""
        t, args = self.trainer, self.trainer.args
        generator = torch.Generator().manual_seed(args.seed * 1_000_003 + self.refreshes)
        order = torch.randperm(len(self.dataset), generator=generator).tolist()
        prompts = [dict(self.dataset[order[i % len(order)]]) for i in range(args.tracin_val_batch_size)]
        max_model_len = t.vllm_client.get_max_model_len()
        rows, rewards, groups = [], [], []
        for g, row in enumerate(prompts):
            trajectories = [self._rollout(row, max_model_len) for _ in range(args.tracin_val_num_generations)]
            completions = [c for c, _ in trajectories]
            group_rewards = self._rewards(row, completions, [s.pop("env_reward") for _, s in trajectories])
            for (_, sample), reward in zip(trajectories, group_rewards):
                rows.append(sample)
                rewards.append(reward)
                groups.append(g)
        reward_t, group_t = torch.tensor(rewards, dtype=torch.float32), torch.tensor(groups)
        advantages = group_advantages(reward_t, group_t, scale=args.scale_rewards)
        # A group without reward spread says nothing about a row: its advantages are 0, not float32 rounding noise of
        # one sign (which would make V a "raise the validation completions' likelihood" direction of arbitrary sign).
        advantages = advantages.masked_fill(without_reward_spread(reward_t, group_t), 0.0)
        with torch.no_grad():
            for sample, advantage in zip(rows, advantages.tolist()):
                sample["advantage"] = advantage
            # Ratio 1 at the current weights: the rows' old log-probs are the current policy's.
            model = self._model()
            for sample in rows:
                sample["old_log_probs"] = self._current_logps(model, sample)
        return rows, rewards

    def _current_logps(self, model, sample) -> np.ndarray:
        ids = torch.as_tensor(np.asarray(sample["input_ids"]))[None].to(next(model.parameters()).device)
        logits = model(input_ids=ids).logits[0, :-1].float() / self.trainer.temperature
        logps = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]
        return np.concatenate([[0.0], logps.cpu().numpy()]).astype(np.float32)

    def _rollout(self, row: dict, max_model_len: int):
        """One validation trajectory through trl-agentic's rollout loop; returns (completion messages, row)."""
        t, args = self.trainer, self.trainer.args
        environment = t._environment_factory() if t._environment_factory is not None else None
        observation = environment.reset(**row) if environment is not None else None
        tool_dict = {f.__name__: f for f in (t._tools_list or [])}
        if environment is not None:
            tool_dict.update(tool_methods(environment))
        tools = list(tool_dict.values())
        backend = _HTTPBackend(t, tools, max_model_len)
        prompt = with_observation(copy.deepcopy(row["prompt"]), observation)
        prompt_ids = backend.render_prompt(prompt, 0)
        (ids,), (lps,) = backend.generate([prompt_ids])
        message = backend.parse(ids, prompt_ids, 0)
        loop = AgenticRolloutLoop(
            backend,
            LoopConfig(**{name: getattr(args, name) for name in LoopConfig.__dataclass_fields__}),
            rng=random.Random(args.seed),
        )
        prompts, prompt_lists = [prompt], [prompt_ids]
        sync = {n: f for n, f in tool_dict.items() if not inspect.iscoroutinefunction(f)}
        trl_tuple, _ = loop.run(
            prompts,
            prompt_lists,
            [list(ids)],
            [[message]],
            [list(lps)],
            [sync],
            [{}],
            [environment] if environment is not None else None,
        )
        tool_mask, completions, completion_ids, logprobs, *_ = trl_tuple
        input_ids = list(prompt_lists[0]) + list(completion_ids[0])
        mask = [0] * len(prompt_lists[0]) + list(tool_mask[0])
        reward = environment.get_reward() if hasattr(environment, "get_reward") else None
        sample = {"input_ids": np.asarray(input_ids), "completion_mask": np.asarray(mask), "env_reward": reward}
        return completions[0], sample

    def _rewards(self, row: dict, completions: list, env_rewards: list) -> list[float]:
        """The reward functions' sum (weight 1 each, as TRL's worker) plus an environment's `get_reward`."""
        t = self.trainer
        n = len(completions)
        kwargs = {key: [value] * n for key, value in row.items() if key not in ("prompt", "completion")}
        columns = []
        for func in t._reward_funcs_list:
            values = func(prompts=[row["prompt"]] * n, completions=completions, completion_ids=[[]] * n, **kwargs)
            columns.append([np.nan if v is None else float(v) for v in values])
        if any(r is not None for r in env_rewards):
            columns.append([np.nan if r is None else float(r) for r in env_rewards])
        values = np.array(columns, dtype=float).reshape(len(columns), n)
        total = np.nansum(values, axis=0)
        total[np.all(np.isnan(values), axis=0)] = np.nan
        return total.tolist()

"""Training-time callbacks: a compact per-step progress line and a recorder of training trajectories for the report."""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path

from transformers import TrainerCallback
from transformers.trainer_callback import ProgressCallback

from ..errors import tool_call_failed
from ..rollout.parsing import parse_tool_calls
from ..rollout.types import RowKind

_KIND_NAMES = {
    RowKind.REGULAR: "regular",
    RowKind.NEGATIVE: "negative",
    RowKind.SNAPSHOT: "snapshot",
    RowKind.EXPANSION: "expansion",
}
_USER_TURN = re.compile(r"<\|im_start\|>user\b")
_TOOL_RESPONSE = re.compile(r"<tool_response>\n?(.*?)\n?</tool_response>", re.DOTALL)
_LEVEL = re.compile(r"<level>\s*(\d+)\s*</level>")


def _fmt(value, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec)


def format_metric_table(log_history: list[dict], names) -> str:
    """A table of `reward` and the given metrics (rows) at every logged training step (columns); `n/a` when a step
    did not log a metric. Used by the examples to show their feature's metrics at the end of a run.

    Args:
        log_history (`list[dict]`):
            `trainer.state.log_history`.
        names (`Sequence[str]`):
            Metric names, e.g. `("rollback/attempts", "negatives/rows")`.
    """
    steps = [h for h in log_history if "reward" in h]
    width = max(len(n) for n in ("reward", *names)) + 2
    lines = [f"{'metric':<{width}}" + "".join(f"{'step ' + str(h['step']):>12}" for h in steps)]
    for name in ("reward", *names):
        cells = "".join(f"{h[name]:>12.4g}" if h.get(name) is not None else f"{'n/a':>12}" for h in steps)
        lines.append(f"{name:<{width}}{cells}")
    return "\n".join(lines)


def format_step_line(logs: dict, step: int, max_steps: int, seconds_per_step: float | None) -> str:
    """The compact per-step line: step, reward, tool failure rate, rollbacks, negatives, seconds per step.

    A log without a reward (e.g. an SFT step) gives step, loss, token accuracy and seconds per step.
    """
    parts = [f"step {step:>{len(str(max_steps))}}/{max_steps}"]
    if "reward" not in logs:
        parts.append(f"loss {_fmt(logs.get('loss'), '.4f')}")
        if "mean_token_accuracy" in logs:
            parts.append(f"token accuracy {_fmt(logs.get('mean_token_accuracy'), '.3f')}")
        parts.append(f"{_fmt(seconds_per_step, '.1f')} s/step")
        return " | ".join(parts)
    parts.append(f"reward {_fmt(logs.get('reward'), '.3f')}")
    if "tools/failure_frequency" in logs or "tools/call_frequency" in logs:
        parts.append(f"tool calls {_fmt(logs.get('tools/call_frequency'), '.2f')}")
        parts.append(f"tool fail {_fmt(logs.get('tools/failure_frequency'), '.2f')}")
    if "rollback/attempts" in logs:
        parts.append(f"rollbacks {_fmt(logs.get('rollback/attempts'), '.0f')}")
    if "negatives/rows" in logs:
        parts.append(f"negatives {_fmt(logs.get('negatives/rows'), '.0f')}")
    if "tracin/selected_ratio" in logs:
        parts.append(f"tracin kept {_fmt(logs.get('tracin/selected_ratio'), '.2f')}")
    levels = [logs.get(f"rlvcr/level_frac_{k}") for k in range(1, 5)]
    if any(v is not None for v in levels):
        parts.append("levels " + "/".join(_fmt(v, ".2f") for v in levels))
    if "loss" in logs:
        parts.append(f"loss {_fmt(logs.get('loss'), '.4f')}")
    parts.append(f"{_fmt(seconds_per_step, '.1f')} s/step")
    return " | ".join(parts)


class CompactProgressCallback(ProgressCallback):
    """
    transformers' progress bar, with one compact line per logged step instead of the full metrics dict.

    The line shows the step, the mean reward, the tool-call and tool-failure frequencies, rollbacks and negative rows
    of the step (and the TracIn selected ratio and RLVCR level mix when present), the loss and the wall time per step.
    Replace the default bar with `trainer.remove_callback(ProgressCallback)` then `trainer.add_callback(...)`, or use
    [`install_compact_progress`].
    """

    def __init__(self, max_str_len: int = 100):
        super().__init__(max_str_len)
        self._last_time: float | None = None
        self._last_step = 0
        self.seconds_per_step: list[float] = []

    def on_train_begin(self, args, state, control, **kwargs):
        super().on_train_begin(args, state, control, **kwargs)
        self._last_time, self._last_step = time.perf_counter(), state.global_step

    def on_step_end(self, args, state, control, **kwargs):
        super().on_step_end(args, state, control, **kwargs)
        now = time.perf_counter()
        if self._last_time is not None and state.global_step > self._last_step:
            self.seconds_per_step.append((now - self._last_time) / (state.global_step - self._last_step))
        self._last_time, self._last_step = now, state.global_step

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or self.training_bar is None or not logs:
            return
        if "reward" not in logs and "loss" not in logs:
            return  # e.g. the final train_runtime summary, printed by the caller
        recent = self.seconds_per_step[-1] if self.seconds_per_step else None
        self.training_bar.write(format_step_line(logs, state.global_step, state.max_steps, recent))


def install_compact_progress(trainer) -> CompactProgressCallback:
    """Swap a trainer's default progress bar (or printer) for a [`CompactProgressCallback`] and return it."""
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(ProgressCallback)
    trainer.remove_callback(PrinterCallback)
    callback = CompactProgressCallback()
    trainer.add_callback(callback)
    return callback


# ----------------------------------------------------------------------------------------------------------------------
# Trajectory recorder
# ----------------------------------------------------------------------------------------------------------------------


def split_segments(tokenizer, completion_ids: list[int], tool_mask: list[int], advantages: list[float]) -> list[dict]:
    """
    Cut a completion into alternating model and environment segments, with one decoded string per token.

    Args:
        tokenizer: Decodes the tokens (special tokens kept).
        completion_ids (`list[int]`): The completion's tokens (padding already removed).
        tool_mask (`list[int]`): 1 on model tokens, 0 on environment tokens (tool results, hints).
        advantages (`list[float]`): Per-token advantage of each completion token.

    Returns:
        `list[dict]`: Segments `{"role": "model" | "env", "tokens": [...], "advantages": [...], "text": ...}`. The
        token strings concatenate to the decoded completion: a token that ends inside a multi-byte character gets
        `""` and the token that completes the character gets all of it.
    """
    pieces = _token_pieces(tokenizer, completion_ids)
    segments: list[dict] = []
    start = 0
    for k in range(1, len(completion_ids) + 1):
        if k == len(completion_ids) or tool_mask[k] != tool_mask[start]:
            tokens = pieces[start:k]
            segments.append(
                {
                    "role": "model" if tool_mask[start] else "env",
                    "tokens": tokens,
                    "advantages": [round(float(a), 5) for a in advantages[start:k]],
                    "text": "".join(tokens),
                }
            )
            start = k
    return segments


def _token_pieces(tokenizer, ids: list[int]) -> list[str]:
    """Each token's share of `tokenizer.decode(ids)`, decoded incrementally as vLLM's detokenizer does: the text the
    tokens since `read` add to the window that starts at `prefix` (the token before, for context). A window ending in
    U+FFFD ends inside a multi-byte character: its tokens are held back until the character is complete. Each token is
    decoded a bounded number of times (decoding every prefix costs the square of the length)."""
    pieces, prefix, read = [], 0, 0
    for j in range(len(ids)):
        text = tokenizer.decode(ids[prefix : j + 1], skip_special_tokens=False)
        if text.endswith("\ufffd") and j + 1 < len(ids):
            pieces.append("")
            continue
        before = tokenizer.decode(ids[prefix:read], skip_special_tokens=False)
        new = (
            text[len(before) :]
            if text.startswith(before)
            else tokenizer.decode(ids[read : j + 1], skip_special_tokens=False)
        )
        pieces.append(new)
        prefix, read = read, j + 1
    return pieces


def describe_segments(segments: list[dict], failed: list[bool] | None = None) -> dict:
    """Tool calls, tool results (with error flags) and RLVCR levels found in a trajectory's segments.

    `failed[k]` says whether the k-th tool result's call failed, as the rollout loop recorded it (never read from the
    text); without it (TRL's own loop keeps no per-call record) the flags are None.
    """
    calls, results, levels = [], [], []
    flags = iter(failed or [])
    for segment in segments:
        text = segment["text"].replace("<|im_end|>", "")
        if segment["role"] == "model":
            parsed = parse_tool_calls(text)
            for call in parsed.calls:
                function = call.get("function", {})
                calls.append({"name": function.get("name"), "arguments": function.get("arguments")})
            for error in parsed.errors:
                calls.append({"name": None, "arguments": None, "malformed": error})
            levels += [int(level) for level in _LEVEL.findall(text)]
            segment["levels"] = [int(level) for level in _LEVEL.findall(text)]
        else:
            found = [
                {"content": content, "error": next(flags, None) if failed is not None else None}
                for content in _TOOL_RESPONSE.findall(segment["text"])
            ]
            results += found
            segment["error"] = any(r["error"] for r in found)
            # A further user message (an environment's `_next_user_turn`, or a rollback hint): ChatML user header.
            segment["user"] = not found and _USER_TURN.search(segment["text"]) is not None
    return {"tool_calls": calls, "tool_results": results, "levels": levels}


class _RecordingAugmenter:
    """Wraps the trainer's `BatchAugmenter`: calls it, then hands the finished batch to the recorder, which records it
    once `row_selection` has run (`TrajectoryRecorder.attach`)."""

    def __init__(self, inner, recorder: TrajectoryRecorder, trainer):
        self._inner = inner
        self._recorder = recorder
        self._trainer = trainer

    def __call__(self, output, inputs, rewards_per_func, loop_result):
        batch = self._inner(output, inputs, rewards_per_func, loop_result)
        tool_masks, self._recorder._tool_masks = self._recorder._tool_masks, None  # this batch's, if any
        self._recorder._pending = None
        # Training batches only: not evaluation, nor TracIn's validation rollouts (made during the training step).
        if self._trainer.model.training and not getattr(self._trainer, "_tracin_validating", False):
            self._recorder._pending = (batch, inputs, rewards_per_func, loop_result, tool_masks)
        return batch

    def __getattr__(self, name):
        return getattr(self._inner, name)


class TrajectoryRecorder(TrainerCallback):
    """
    Records the training trajectories of an `AgenticGRPOTrainer`, for `report.html` and `trajectories.jsonl`.

    [`attach`] wraps the trainer's batch augmenter (the last stage of `_generate_and_score_completions`, which sees the
    final training rows: regular rollouts, negative samples, snapshot segments, estimator expansion rows, with their
    token masks and advantages) and reads from it, per row: the prompt, the completion split into model and
    environment segments with per-token advantages, the tool calls and results, the reward, the rollbacks of the
    rollout and, for a negative sample, why it failed. No trainer change is needed.

    Only the main process records (its own rows). Training batches only; evaluation batches and TracIn's validation
    rollouts are skipped. When an optimizer step trains several generation batches (`steps_per_generation` smaller
    than `gradient_accumulation_steps`), a row's id and group key carry the batch's index within the step (`batch`,
    left out of the id of the first batch: `s{step}-r{row}`, then `s{step}-b{batch}-r{row}`).

    A rollout TRL masked (`mask_truncated_completions`: truncated, not trained) is recorded up to its padding, with
    `masked` set. Another row that is not trained (`counted_row` False: a rollout lost to infrastructure, or an earlier
    snapshot segment of an episode whose last segment is not trained; or a rollout `row_selection` left out, with
    `not_selected` naming the rule) has `not_trained` set, and its turns are shown from the loop's masks (the batch's
    tool mask is zeroed for it). Rows are recorded after `row_selection`, with the advantages it gave them. TracIn's
    selection is made later, inside the training step, and is not shown per row (its `tracin/*` metrics count it).

    Args:
        tokenizer: The policy's tokenizer.
        max_rows_per_step (`int`, *optional*, defaults to `64`):
            Rows kept per training step, over all its generation batches (whole groups first).
    """

    def __init__(self, tokenizer, max_rows_per_step: int = 64):
        self.tokenizer = tokenizer
        self.max_rows_per_step = max_rows_per_step
        self.trajectories: list[dict] = []
        self.errors: list[str] = []
        self._step = None  # the step of the last recorded batch, its batch index, rows kept in the step so far
        self._batch = 0
        self._kept = 0
        self._tool_masks = None  # the tool loop's masks of the batch being made (see `attach`)
        self._pending = None  # the augmented batch, recorded once row selection has run (see `attach`)

    def attach(self, trainer) -> TrajectoryRecorder:
        """Start recording the trainer's batches (wraps `trainer._augmenter`, adds this callback)."""
        if not hasattr(trainer, "_augmenter"):
            raise TypeError("TrajectoryRecorder needs an AgenticGRPOTrainer (no `_augmenter` found).")
        if not isinstance(trainer._augmenter, _RecordingAugmenter):
            trainer._augmenter = _RecordingAugmenter(trainer._augmenter, self, trainer)
            tool_call_loop = trainer._tool_call_loop

            def recording_tool_call_loop(*args, **kwargs):
                # The tool masks as the loop made them: TRL zeroes a truncated row's (`mask_truncated_completions`).
                out = tool_call_loop(*args, **kwargs)
                self._tool_masks = out[0]
                return out

            trainer._tool_call_loop = recording_tool_call_loop
            select_rows = trainer._select_rows

            def recording_select_rows(batch):
                # `row_selection` runs last, on the augmented batch: its rows are recorded as selected (trained, with
                # the advantages the selection gave them) or not.
                out = select_rows(batch)
                pending, self._pending = self._pending, None
                if pending is not None:
                    try:
                        self.record(trainer, *pending, selection=getattr(trainer, "_last_row_selection", None))
                    except Exception as e:  # noqa: BLE001 - the report must never break training
                        self.errors.append(f"{type(e).__name__}: {e}")
                return out

            trainer._select_rows = recording_select_rows
        trainer.add_callback(self)
        return self

    # ------------------------------------------------------------------------------------------------------------
    def record(
        self, trainer, batch: dict, inputs: list[dict], rewards_per_func, loop_result, tool_masks=None, selection=None
    ) -> None:
        """Record a finished training batch (`tool_masks`: the tool loop's per-rollout masks, unpadded, when known;
        `selection`: what `row_selection` decided for the batch's rows, `{"mode", "kept", "advantages"}` per local
        row, when it ran)."""
        if not trainer.accelerator.is_main_process:
            return
        step = trainer.state.global_step + 1  # the batch is generated for the step about to run
        if step == self._step:
            self._batch += 1
        else:
            self._step, self._batch, self._kept = step, 0, 0
        prefix = f"s{step}-" if self._batch == 0 else f"s{step}-b{self._batch}-"
        budget = self.max_rows_per_step - self._kept
        if budget <= 0:
            return
        kinds = batch["row_kind"].tolist() if "row_kind" in batch else [int(RowKind.REGULAR)] * len(inputs)
        groups = batch["group_id"].tolist() if "group_id" in batch else [None] * len(kinds)
        completion_ids = batch["completion_ids"].tolist()
        completion_mask = batch["completion_mask"].tolist()
        tool_mask = batch["tool_mask"].tolist() if "tool_mask" in batch else None
        counted = batch["counted_row"].tolist() if "counted_row" in batch else [True] * len(kinds)
        advantages = batch["advantages"] if selection is None else selection["advantages"]
        num_local = len(inputs)
        offset = trainer.accelerator.process_index * num_local
        weights = trainer.reward_weights.tolist() if hasattr(trainer, "reward_weights") else None
        names = list(getattr(trainer, "reward_func_names", []))
        extras = list(loop_result.extra_rows) if loop_result is not None else []
        rollback_log = loop_result.rollback_log if loop_result is not None else [[] for _ in range(num_local)]
        tool_failed = loop_result.tool_failed if loop_result is not None else []
        args = trainer.args
        pad = self.tokenizer.pad_token_id
        extra_cursor = 0
        rows = []
        for r, kind in enumerate(kinds):
            if kind == RowKind.PADDING:
                continue
            length = sum(completion_mask[r])
            masked = length == 0  # TRL's `mask_truncated_completions` zeroes a truncated row's masks: up to padding
            if masked:
                length = len(completion_ids[r])
                while length and completion_ids[r][length - 1] == pad:
                    length -= 1
            ids = completion_ids[r][:length]
            mask = tool_mask[r][:length] if tool_mask is not None else [1] * length
            # Not trained for another reason than TRL's mask: its tool mask is zeroed (`batch._untrained_rows`), or
            # `row_selection` left it out.
            dropped = selection is not None and r < num_local and not bool(selection["kept"][r])
            not_trained = not masked and ((r < len(counted) and not counted[r]) or dropped)
            # Zeroed: the loop's mask (below for an extra row), else model and environment cannot be told apart.
            zeroed = (masked or not_trained) and not any(mask)
            if zeroed and tool_masks is not None and r < min(num_local, len(tool_masks)):
                mask = list(tool_masks[r]) if len(tool_masks[r]) == length else [1] * length
            adv = advantages[r].tolist() if advantages.dim() == 2 else [advantages[r].item()] * len(completion_ids[r])
            row = {
                "id": f"{prefix}r{r}",
                "step": step,
                "batch": self._batch,
                "group": groups[r],
                "kind": _KIND_NAMES.get(RowKind(kind), str(kind)),
                "token_level": advantages.dim() == 2,
                "masked": masked,
                "not_trained": not_trained,
            }
            if dropped:
                row["not_selected"] = selection["mode"]
            if kind == RowKind.REGULAR and r < num_local:
                source = inputs[r]
                row["parent"] = None
                values = rewards_per_func[offset + r].tolist() if rewards_per_func is not None else []
                row["rewards"] = {n: (None if math.isnan(v) else v) for n, v in zip(names, values)}
                if weights and values and not all(math.isnan(v) for v in values):
                    row["reward"] = sum(w * v for w, v in zip(weights, values) if not math.isnan(v))
                else:
                    row["reward"] = None
                if not_trained and not dropped:  # lost to the infrastructure: out of its group's statistics too
                    row["reward"] = None
                row["rollbacks"] = rollback_log[r] if r < len(rollback_log) else []
                failed = tool_failed[r] if r < len(tool_failed) else None
            else:
                extra = None
                if kind in (RowKind.NEGATIVE, RowKind.SNAPSHOT):
                    while extra_cursor < len(extras):
                        candidate = extras[extra_cursor]
                        extra_cursor += 1
                        if int(candidate.kind) == kind and candidate.completion_ids[: len(ids)] == ids:
                            extra = candidate
                            break
                parent = extra.parent if extra is not None else None
                failed = (
                    None if extra is None else [tool_call_failed(m) for m in extra.messages if m.get("role") == "tool"]
                )
                source = inputs[parent] if parent is not None and parent < num_local else {}
                row["parent"] = f"{prefix}r{parent}" if parent is not None else None
                row["rollbacks"] = []
                if kind == RowKind.NEGATIVE:
                    from ..advantages import negative_sample_rewards

                    error_types = extra.error_types if extra is not None else []
                    row["reward"] = negative_sample_rewards(
                        [error_types], args.negative_sample_reward, args.negative_reward_by_error
                    )[0]
                    row["error_types"] = error_types
                    row["error_messages"] = extra.error_messages if extra is not None else []
                    row["tool_position"] = extra.tool_position if extra is not None else None
                else:
                    row["reward"] = None
                if kind == RowKind.SNAPSHOT and extra is not None:
                    row["segment_index"] = extra.segment_index
                    row["tokens_freed"] = extra.tokens_freed
                if zeroed and extra is not None and len(extra.tool_mask) >= length:
                    mask = list(extra.tool_mask[:length])
            if zeroed and not any(mask):
                mask = [1] * length
            model_adv = [a for a, m in zip(adv[:length], mask) if m]
            row["advantage"] = sum(model_adv) / len(model_adv) if model_adv else 0.0
            row["question"] = _question(source.get("prompt")) if source else ""
            row["answer"] = source.get("answer") if source else None
            row["segments"] = split_segments(self.tokenizer, ids, mask, adv[:length])
            row.update(describe_segments(row["segments"], failed))
            rows.append(row)
        kept = _keep_groups(rows, budget)
        self._kept += len(kept)
        self.trajectories.extend(kept)

    def save_jsonl(self, path: str | Path) -> Path:
        """Write every recorded trajectory as one JSON object per line."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w", encoding="utf-8") as f:
            for trajectory in self.trajectories:
                f.write(json.dumps(trajectory, ensure_ascii=False) + "\n")
        return path


def _question(prompt) -> str:
    if isinstance(prompt, str):
        return prompt
    if not prompt:
        return ""
    return next((m.get("content", "") for m in reversed(prompt) if m.get("role") == "user"), "")


def _keep_groups(rows: list[dict], limit: int) -> list[dict]:
    """Keep whole groups (a group's rollouts and its extra rows) until `limit` rows are reached; never more than
    `limit` rows (the first ones of a bigger first group, or of rows without group ids: TRL's own batch)."""
    if len(rows) <= limit:
        return rows
    kept, seen = [], []
    for row in rows:
        if row["group"] not in seen:
            seen.append(row["group"])
    for group in seen:
        members = [row for row in rows if row["group"] == group]
        if kept and len(kept) + len(members) > limit:
            break
        kept += members
    return kept[:limit]

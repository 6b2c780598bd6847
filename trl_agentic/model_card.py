"""The trl-agentic section of the model card: which features trained the model, their key settings, citations."""

from __future__ import annotations

import os

CITATIONS = {
    "grpo": (
        "GRPO (DeepSeekMath)",
        "@article{shao2024deepseekmath,\n  title={{DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open "
        "Language Models}},\n  author={Zhihong Shao and others},\n  journal={arXiv preprint arXiv:2402.03300},\n"
        "  year={2024}\n}",
    ),
    "rlvcr": (
        "CogRouter / CoPO (RLVCR thinking-level advantages)",
        "@article{yang2026thinkfastslow,\n  title={{Think Fast and Slow: Step-Level Cognitive Depth Adaptation for "
        "LLM Agents}},\n  author={Ruihan Yang and others},\n  journal={arXiv preprint arXiv:2602.12662},\n"
        "  year={2026}\n}",
    ),
    "snapshots": (
        "StateLM (context-deleting tool, trajectory snapshots)",
        "@article{statelm2026pensieve,\n  title={{The Pensieve Paradigm: Stateful Language Models Mastering Their Own "
        "Context}},\n  journal={arXiv preprint arXiv:2602.12108},\n  year={2026}\n}",
    ),
    "tracin": (
        "TracIn (influence-filtered training)",
        "@inproceedings{pruthi2020tracin,\n  title={{Estimating Training Data Influence by Tracing Gradient "
        "Descent}},\n  author={Garima Pruthi and Frederick Liu and Satyen Kale and Mukund Sundararajan},\n"
        "  booktitle={NeurIPS},\n  year={2020}\n}",
    ),
}

_KEY_SETTINGS = {
    "rollback": ["max_tool_retries", "rollback_feedback", "rollback_on_errors", "infra_error_types"],
    "negatives": ["max_negative_samples_per_group", "negative_sample_reward", "group_baseline"],
    "snapshots": ["max_snapshots_per_episode", "snapshot_downsample", "snapshot_advantage"],
    "rlvcr": ["rlvcr_mode", "rlvcr_k", "rlvcr_step_advantage_w", "rlvcr_expand", "rlvcr_expand_steps"],
    "tracin": ["tracin_selection", "tracin_val_num_generations", "tracin_val_refresh_steps", "tracin_min_selected"],
    "row-selection": ["row_selection", "row_selection_keep"],
    "rollout-loop": ["tool_timeout", "max_tool_output_chars", "malformed_tool_call_feedback", "max_turn_tokens"],
}


def estimator_name(args, estimator=None) -> str:
    """The name of the advantage estimator that runs: `"grpo"`, `"rlvcr"`, or a custom one's `module:function`.

    Args:
        args: The `AgenticGRPOConfig`.
        estimator (`Callable`, *optional*):
            The trainer's estimator (`trainer.advantage_estimator`: a callable passed to the trainer takes precedence
            over `args.advantage_estimator`). Without it, the one the config names.
    """
    from .estimators import grpo_estimator, resolve_estimator

    estimator = resolve_estimator(args.advantage_estimator) if estimator is None else estimator
    if estimator is grpo_estimator:
        return "grpo"
    if estimator is resolve_estimator("rlvcr"):
        return "rlvcr"
    name = getattr(estimator, "__qualname__", None) or type(estimator).__qualname__
    return f"{getattr(estimator, '__module__', None) or type(estimator).__module__}:{name}"


def features_used(args, estimator=None, agentic_loop: bool | None = None) -> list[str]:
    """Names of the trl-agentic features switched on in `args` (an `AgenticGRPOConfig`).

    Args:
        args: The `AgenticGRPOConfig`.
        estimator (`Callable`, *optional*):
            The trainer's advantage estimator (see [`estimator_name`]).
        agentic_loop (`bool`, *optional*):
            Whether trl-agentic's rollout loop runs (the trainer decides: an environment with further user turns needs
            it too); defaults to `args.uses_agentic_loop`.
    """
    used = []
    if args.enable_tool_rollback:
        used.append("rollback")
        if args.save_negative_samples:
            used.append("negatives")
    if args.enable_context_snapshots:
        used.append("snapshots")
    name = estimator_name(args, estimator)
    if name == "rlvcr":
        used.append("rlvcr")
    elif name != "grpo":
        used.append("estimator")
    if args.tracin_enabled:
        used.append("tracin")
    if args.row_selection != "none":
        used.append("row-selection")
    if args.uses_agentic_loop if agentic_loop is None else agentic_loop:
        used.append("rollout-loop")
    return used


def card_section(
    args,
    estimator=None,
    agentic_loop: bool | None = None,
    trainers: tuple[str, str] = ("AgenticGRPOTrainer", "GRPOTrainer"),
) -> str:
    """Markdown appended to TRL's model card (arguments as for [`features_used`]; `trainers`: ours and the TRL
    trainer it extends)."""
    used = features_used(args, estimator, agentic_loop)
    name = estimator_name(args, estimator)
    ours, trl = trainers
    lines = ["", "## Trained with trl-agentic", ""]
    lines.append(
        f"This model was trained with [trl-agentic](https://pypi.org/project/trl-agentic/)'s `{ours}`, "
        f"an extension of TRL's `{trl}` for multi-turn tool agents."
    )
    lines.append("")
    if not used:
        lines.append(f"Features: none beyond GRPO (the trainer then behaves exactly like `{trl}`).")
    else:
        lines.append("| feature | key settings |")
        lines.append("| --- | --- |")
        for feature in used:
            if feature == "estimator":
                settings = f"`{name}`"
            else:
                settings = ", ".join(f"`{k}={getattr(args, k)!r}`" for k in _KEY_SETTINGS[feature])
            lines.append(f"| {feature} | {settings} |")
    lines.append(f"\nAdvantage estimator: `{name}`.")
    lines += ["", "### Citations", ""]
    for key in ["grpo", *[u for u in used if u in CITATIONS]]:
        title, bibtex = CITATIONS[key]
        lines += [f"{title}:", "", "```bibtex", bibtex, "```", ""]
    return "\n".join(lines)


def feature_tags(args, estimator=None, agentic_loop: bool | None = None) -> list[str]:
    """The Hub tags: `trl-agentic` and one per feature (arguments as for [`features_used`])."""
    return ["trl-agentic", *[f"trl-agentic-{name}" for name in features_used(args, estimator, agentic_loop)]]


class ModelCardMixin:
    """`create_model_card` for both trainers: TRL's card plus a section naming the trl-agentic features that ran,
    their settings and citations, with a `trl-agentic-*` tag per feature. Reads `advantage_estimator` (None: the
    config's), `_uses_agentic_loop` (what ran, not the config's switches alone: user turns need the loop too) and
    `_card_trainers` (the trainer's name and the TRL trainer it extends)."""

    _card_trainers = ("AgenticGRPOTrainer", "GRPOTrainer")

    def create_model_card(self, model_name=None, dataset_name=None, tags=None):
        tags = [tags] if isinstance(tags, str) else list(tags or [])
        ran = {"estimator": self.advantage_estimator, "agentic_loop": self._uses_agentic_loop}
        super().create_model_card(
            model_name=model_name, dataset_name=dataset_name, tags=tags + feature_tags(self.args, **ran)
        )
        if self.is_world_process_zero():
            path = os.path.join(self.args.output_dir, "README.md")
            if os.path.exists(path):
                with open(path, "a") as f:
                    f.write(card_section(self.args, **ran, trainers=self._card_trainers))

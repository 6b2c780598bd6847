"""The trl-agentic section of the model card: which features trained the model, their key settings, citations."""

from __future__ import annotations

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
}


def features_used(args) -> list[str]:
    """Names of the trl-agentic features switched on in `args` (an `AgenticGRPOConfig`)."""
    used = []
    if args.enable_tool_rollback:
        used.append("rollback")
        if args.save_negative_samples:
            used.append("negatives")
    if args.enable_context_snapshots:
        used.append("snapshots")
    if args.advantage_estimator == "rlvcr":
        used.append("rlvcr")
    if args.tracin_enabled:
        used.append("tracin")
    return used


def card_section(args) -> str:
    """Markdown appended to TRL's model card."""
    used = features_used(args)
    lines = ["", "## Trained with trl-agentic", ""]
    lines.append(
        "This model was trained with [trl-agentic](https://pypi.org/project/trl-agentic/)'s `AgenticGRPOTrainer`, "
        "an extension of TRL's `GRPOTrainer` for multi-turn tool agents."
    )
    lines.append("")
    if not used:
        lines.append("Features: none beyond GRPO (the trainer then behaves exactly like `GRPOTrainer`).")
    else:
        lines.append("| feature | key settings |")
        lines.append("| --- | --- |")
        for name in used:
            settings = ", ".join(f"`{k}={getattr(args, k)!r}`" for k in _KEY_SETTINGS[name])
            lines.append(f"| {name} | {settings} |")
    lines.append(f"\nAdvantage estimator: `{args.advantage_estimator}`.")
    lines += ["", "### Citations", ""]
    for key in ["grpo", *[u for u in used if u in CITATIONS]]:
        title, bibtex = CITATIONS[key]
        lines += [f"{title}:", "", "```bibtex", bibtex, "```", ""]
    return "\n".join(lines)


def feature_tags(args) -> list[str]:
    return ["trl-agentic", *[f"trl-agentic-{name}" for name in features_used(args)]]

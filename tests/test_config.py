"""Config validation: every bad value fails when the config is built — before any model loads — naming the field."""

import dataclasses
import warnings

import pytest
import yaml

from trl_agentic import AgenticGRPOConfig
from trl_agentic.cli import main as cli_main
from trl_agentic.tasks import TaskArguments

BASE = dict(output_dir="/tmp/trl-agentic-config-test", use_cpu=True, report_to="none")

BAD_VALUES = [
    ("max_tool_retries", -1),
    ("max_tool_retries", 1.5),
    ("max_infra_retries", -2),
    ("max_negative_samples_per_group", -1),
    ("max_snapshots_per_episode", -1),
    ("max_tool_output_chars", 10),
    ("tool_timeout", -1.0),
    ("rollback_feedback", "loud"),
    ("group_baseline", "everything"),
    ("snapshot_downsample", "first"),
    ("snapshot_advantage", "token"),
    ("rollback_on_errors", ["NameError", ""]),
    ("infra_error_types", [3]),
    ("negative_reward_by_error", {"SyntaxError": "very bad"}),
    ("negative_reward_by_error", "{not json"),
    ("snapshot_reward_func", "no_colon_path"),
    ("advantage_estimator", "ppo"),
    ("rlvcr_mode", "multiplicative"),
    ("rlvcr_level_tag", ""),
    ("rlvcr_think_tag", "  "),
    ("rlvcr_action_tag", "<action>"),
    ("rlvcr_level_prompt_template", "Think at level {level}."),
    ("rlvcr_cost_max", 0.0),
    ("rlvcr_k", -1.0),
    ("advantage_std_floor", 0.0),
    ("rlvcr_max_thinking_tokens", 0),
    ("rlvcr_score_batch_size", 2.5),
    ("rlvcr_expand_steps", "some"),
    ("tracin_selection", "best"),
    ("tracin_val_num_generations", 1),
    ("tracin_val_batch_size", 0),
    ("tracin_val_refresh_steps", -1),
    ("tracin_top_fraction", 0.0),
    ("tracin_top_fraction", 1.5),
    ("tracin_min_selected", -1),
    ("max_turn_tokens", 0),
    ("max_turn_tokens", True),
    ("max_turn_tokens", 2.5),
    ("transformers_prefix_caching", "yes"),
    # Non-finite rewards, weights and thresholds: -inf with `group_baseline: all_rows` made a whole group's
    # advantages NaN; a NaN threshold compares false to every score.
    ("negative_sample_reward", float("-inf")),
    ("negative_sample_reward", float("nan")),
    ("negative_reward_by_error", {"NameError": float("nan")}),
    ("negative_reward_by_error", '{"NameError": -Infinity}'),
    ("rlvcr_step_advantage_w", float("inf")),
    ("row_selection_threshold", float("nan")),
    ("tracin_threshold", float("-inf")),
]


@pytest.mark.parametrize("field,value", BAD_VALUES, ids=[f"{f}={v!r}" for f, v in BAD_VALUES])
def test_bad_value_names_the_field(field, value):
    with pytest.raises(ValueError, match=f"`{field}`"):
        AgenticGRPOConfig(**BASE, **{field: value})


@pytest.mark.parametrize(
    "combo,field",
    [
        (dict(enable_tool_rollback=True, rollback_on_errors=[]), "rollback_on_errors"),
        (dict(rollback_feedback="hint", rollback_hint_template="no placeholder"), "rollback_hint_template"),
        (dict(advantage_estimator="rlvcr", rlvcr_mode="additive", rlvcr_expand=True), "rlvcr_expand"),
        (dict(rlvcr_think_tag="step", rlvcr_action_tag="step"), "rlvcr_level_tag"),
    ],
)
def test_bad_combinations(combo, field):
    with pytest.raises(ValueError, match=f"`{field}`"):
        AgenticGRPOConfig(**BASE, **combo)


def test_negatives_without_rollback_warns_seed_interaction_table():
    with pytest.warns(UserWarning, match="save_negative_samples"):
        AgenticGRPOConfig(**BASE, save_negative_samples=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        AgenticGRPOConfig(**BASE, save_negative_samples=True, enable_tool_rollback=True)


def test_the_baseline_choices_for_negatives_and_snapshots_are_independent():
    """`group_baseline` decides for the negative rows, `snapshot_advantage` for the snapshot segments, in the
    synchronous batch and the asynchronous rows alike; the default puts neither in the baseline."""
    from types import SimpleNamespace

    import torch

    from trl_agentic.async_grpo.rows import baseline_mask
    from trl_agentic.batch import BatchAugmenter
    from trl_agentic.rollout.types import RowKind

    default = AgenticGRPOConfig(**BASE, enable_context_snapshots=True)
    assert (default.group_baseline, default.snapshot_advantage) == ("episodes", "episode")
    kinds = torch.tensor([RowKind.REGULAR, RowKind.NEGATIVE, RowKind.SNAPSHOT, RowKind.REGULAR])
    for group_baseline in ("all_rows", "episodes"):
        for snapshot_advantage in ("episode", "row"):
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                args = AgenticGRPOConfig(
                    **BASE,
                    enable_context_snapshots=True,
                    save_negative_samples=True,
                    enable_tool_rollback=True,
                    group_baseline=group_baseline,
                    snapshot_advantage=snapshot_advantage,
                )
            expected = [True, group_baseline == "all_rows", snapshot_advantage == "row", True]
            augmenter = BatchAugmenter.__new__(BatchAugmenter)
            augmenter.trainer = SimpleNamespace(args=args)
            assert augmenter._baseline(kinds).tolist() == expected
            assert baseline_mask(kinds, args).tolist() == expected


def test_copo_expanding_every_step_warns():
    rlvcr = dict(**BASE, advantage_estimator="rlvcr", rlvcr_expand_steps="all")
    with pytest.warns(UserWarning, match="rlvcr_expand_steps='all'"):
        AgenticGRPOConfig(**rlvcr)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        AgenticGRPOConfig(**rlvcr, rlvcr_mode="additive")  # the thinking advantage is not scaled by A_episode
        AgenticGRPOConfig(**rlvcr, rlvcr_expand=True)  # expansion rows change the loss's normalisation
        AgenticGRPOConfig(**{**rlvcr, "rlvcr_expand_steps": "varied"})


def test_defaults_are_valid_and_features_off():
    config = AgenticGRPOConfig(**BASE)
    assert not config.agentic_features_enabled
    assert config.advantage_estimator == "grpo"


def test_every_field_has_help():
    for f in dataclasses.fields(AgenticGRPOConfig):
        assert f.metadata.get("help"), f"{f.name} has no help text"
    for f in dataclasses.fields(TaskArguments):
        assert f.metadata.get("help"), f"{f.name} has no help text"


@pytest.mark.parametrize(
    "override,field",
    [
        (["--max_tool_retries", "-3"], "max_tool_retries"),
        (["--task", "chess"], "task"),
        (["--num_train_tasks", "-5"], "num_train_tasks"),
        (["--tracin_enabled", "true"], "tracin_enabled"),  # TracIn without LoRA (`use_peft` is off)
        (["--rlvcr_action_tag", ""], "rlvcr_action_tag"),
    ],
)
def test_cli_fails_before_any_model_loads(tmp_path, monkeypatch, override, field):
    import transformers

    import trl_agentic.models

    def forbidden(*args, **kwargs):
        raise AssertionError("a model was loaded before the config was validated")

    monkeypatch.setattr(trl_agentic.models, "resolve_model_path", forbidden)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", forbidden)
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"output_dir": str(tmp_path / "out"), "use_cpu": True, "report_to": "none"}))
    with pytest.raises(ValueError, match=f"`{field}`"):
        cli_main(["train", "--config", str(config), *override])


def test_cli_choice_fields_fail_in_the_parser_naming_the_flag(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"output_dir": str(tmp_path / "out")}))
    with pytest.raises(SystemExit):
        cli_main(["train", "--config", str(config), "--group_baseline", "x"])
    assert "--group_baseline" in capsys.readouterr().err


@pytest.mark.parametrize("where", ["command line", "yaml"])
def test_negative_reward_by_error_parses_from_the_command_line_and_yaml(tmp_path, where):
    """The dict field reaches the config as a dict both as JSON on the command line (HfArgumentParser would call
    `dict()` on the string and exit) and as a YAML mapping; a bad JSON string still fails naming the field."""
    from trl import TrlParser

    config = tmp_path / "c.yaml"
    values = {"output_dir": str(tmp_path), "use_cpu": True}
    flags = []
    if where == "yaml":
        values["negative_reward_by_error"] = {"ZeroDivisionError": -0.75, "NameError": -1}
    else:
        flags = ["--negative_reward_by_error", '{"ZeroDivisionError": -0.75, "NameError": -1}']
    config.write_text(yaml.safe_dump(values))
    (args,) = TrlParser((AgenticGRPOConfig,)).parse_args_and_config(args=["--config", str(config), *flags])
    assert args.negative_reward_by_error == {"ZeroDivisionError": -0.75, "NameError": -1}
    with pytest.raises(ValueError, match="`negative_reward_by_error`"):
        TrlParser((AgenticGRPOConfig,)).parse_args_and_config(
            args=["--output_dir", str(tmp_path), "--use_cpu", "--negative_reward_by_error", "{-1}"]
        )


def test_cli_rejects_unknown_yaml_keys(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"output_dir": str(tmp_path), "max_tool_retriez": 2}))
    with pytest.raises((ValueError, SystemExit)):
        cli_main(["train", "--config", str(config)])


def _forbid_model_loading(monkeypatch):
    import transformers

    def forbidden(*args, **kwargs):
        raise AssertionError("a model was loaded before the set-up was validated")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", forbidden)


def test_trainer_rejects_tracin_without_lora_before_loading(monkeypatch, tmp_path):
    from datasets import Dataset

    from trl_agentic import AgenticGRPOTrainer

    _forbid_model_loading(monkeypatch)
    args = AgenticGRPOConfig(**{**BASE, "output_dir": str(tmp_path)}, tracin_enabled=True)
    with pytest.raises(ValueError, match="`tracin_enabled=True` needs a PEFT LoRA policy"):
        AgenticGRPOTrainer(
            "some/model", reward_funcs=[], args=args, train_dataset=Dataset.from_dict({"prompt": ["x"]})
        )


def test_trainer_rejects_snapshots_without_tools_before_loading(monkeypatch, tmp_path):
    from datasets import Dataset

    from trl_agentic import AgenticGRPOTrainer

    _forbid_model_loading(monkeypatch)
    args = AgenticGRPOConfig(**{**BASE, "output_dir": str(tmp_path)}, enable_context_snapshots=True)
    with pytest.raises(ValueError, match="`enable_context_snapshots=True` needs a multi-turn tool setup"):
        AgenticGRPOTrainer(
            "some/model", reward_funcs=[], args=args, train_dataset=Dataset.from_dict({"prompt": ["x"]})
        )


class _ChatOnly:
    """Several user turns, no tools."""

    def reset(self, **kwargs):
        return None

    def _next_user_turn(self, assistant_message):
        return "Tell me more."


def test_trainer_rejects_user_turns_without_tools_before_loading(monkeypatch, tmp_path):
    """TRL asks further user turns only inside its tool loop, which it runs only when there are tools."""
    from datasets import Dataset

    from trl_agentic import AgenticGRPOTrainer

    _forbid_model_loading(monkeypatch)
    args = AgenticGRPOConfig(**{**BASE, "output_dir": str(tmp_path)})
    with pytest.raises(ValueError, match="_ChatOnly defines `_next_user_turn` but exposes no tools"):
        AgenticGRPOTrainer(
            "some/model",
            reward_funcs=[],
            args=args,
            train_dataset=Dataset.from_dict({"prompt": ["x"]}),
            environment_factory=_ChatOnly,
        )


def test_user_turns_whose_only_tool_is_delete_context_are_accepted(monkeypatch, tmp_path, tiny_model_dir):
    """With snapshots on, TRL gets `tools=[delete_context]` and runs its tool loop: the set-up is valid."""
    from datasets import Dataset

    from trl_agentic import AgenticGRPOTrainer

    args = AgenticGRPOConfig(**{**BASE, "output_dir": str(tmp_path)}, enable_context_snapshots=True)
    trainer = AgenticGRPOTrainer(
        tiny_model_dir,
        reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
        args=args,
        train_dataset=Dataset.from_dict({"prompt": [[{"role": "user", "content": "x"}]]}),
        environment_factory=_ChatOnly,
    )
    assert [t.__name__ for t in trainer.tools] == ["delete_context"]


def test_trainer_rejects_a_user_tool_named_delete_context_before_loading(monkeypatch, tmp_path):
    from datasets import Dataset

    from trl_agentic import AgenticGRPOTrainer

    def delete_context(message_ids: list) -> str:
        """
        The user's own tool.

        Args:
            message_ids: Ids.
        """
        return "ok"

    _forbid_model_loading(monkeypatch)
    args = AgenticGRPOConfig(**{**BASE, "output_dir": str(tmp_path)}, enable_context_snapshots=True)
    with pytest.raises(ValueError, match="A tool is named `delete_context`"):
        AgenticGRPOTrainer(
            "some/model",
            reward_funcs=[],
            args=args,
            train_dataset=Dataset.from_dict({"prompt": ["x"]}),
            tools=[delete_context],
        )

"""The trl-agentic section of the Hub model card: it names what trained the model, beyond the config's switches."""

import pytest
from datasets import Dataset

from trl_agentic import AgenticGRPOConfig, AgenticGRPOTrainer
from trl_agentic.estimators import grpo_estimator
from trl_agentic.model_card import card_section, feature_tags

PLAIN = "exactly like `GRPOTrainer`"


def _args(tmp_path, **kwargs):
    return AgenticGRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, **kwargs)


def my_estimator(*args, **kwargs):
    """A user estimator (delegates to GRPO's)."""
    return grpo_estimator(*args, **kwargs)


def test_plain_config_says_grpo(tmp_path):
    card = card_section(_args(tmp_path))
    assert PLAIN in card and "Advantage estimator: `grpo`." in card


@pytest.mark.parametrize(
    "kwargs, row",
    [
        ({"row_selection": "successful"}, "| row-selection | `row_selection='successful'`"),
        ({"row_selection": "max_variance", "row_selection_keep": 2}, "`row_selection_keep=2`"),
        ({"tool_timeout": 5.0, "max_tool_output_chars": 200}, "`tool_timeout=5.0`, `max_tool_output_chars=200`"),
        ({"max_turn_tokens": 64}, "| rollout-loop |"),
    ],
)
def test_card_lists_row_selection_and_loop_settings(tmp_path, kwargs, row):
    args = _args(tmp_path, **kwargs)
    card = card_section(args)
    assert PLAIN not in card and row in card
    assert len(feature_tags(args)) == 2


def test_card_names_the_estimator_the_trainer_runs(tmp_path):
    args = _args(tmp_path)
    card = card_section(args, estimator=my_estimator)
    assert PLAIN not in card and "Advantage estimator: `test_model_card:my_estimator`." in card
    assert card_section(args, estimator=grpo_estimator) == card_section(args)


def test_trainer_card_with_a_callable_estimator(tiny_model_dir, tmp_path):
    args = AgenticGRPOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        report_to="none",
        max_steps=1,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        save_strategy="no",
    )
    trainer = AgenticGRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=lambda completions, **kwargs: [0.0] * len(completions),
        args=args,
        train_dataset=Dataset.from_dict({"prompt": [[{"role": "user", "content": "hi"}]] * 4}),
        advantage_estimator=my_estimator,
    )
    trainer.create_model_card(model_name="m")
    card = (tmp_path / "README.md").read_text()
    assert "Advantage estimator: `test_model_card:my_estimator`." in card and PLAIN not in card
    assert "trl-agentic-estimator" in card  # the Hub tag


def test_the_asynchronous_trainers_card_names_its_features(tiny_model_dir, tmp_path, monkeypatch):
    """AsyncAgenticGRPOTrainer wrote TRL's card alone: no trl-agentic section, no feature tags."""
    from test_async_equivalence import scripted_async_trainer

    trainer = scripted_async_trainer(
        tiny_model_dir, tmp_path, monkeypatch, config={"max_turn_tokens": 64}, advantage_estimator=my_estimator
    )
    trainer.create_model_card(model_name="m")
    card = (tmp_path / "README.md").read_text()
    assert "Advantage estimator: `test_model_card:my_estimator`." in card and PLAIN not in card
    assert "| rollout-loop |" in card and "`max_turn_tokens=64`" in card
    assert "trl-agentic-estimator" in card and "trl-agentic-rollout-loop" in card and "async-grpo" in card
    assert "`AsyncAgenticGRPOTrainer`, an extension of TRL's `AsyncGRPOTrainer`" in card

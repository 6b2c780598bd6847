"""Config errors fail before any model loads, naming the field (found by a review; each failed before its fix).

Checks of the trainer that import user code or read the estimator now run before the CLI's warm start and
base-model evaluation (`trainer.check_before_model`), the asynchronous trainer resolves its estimator before TRL loads
the model, TracIn's validation set is checked before it; error-type names must be class names; RLVCR's and the
advantage's numbers must be finite; import paths of the task arguments name their field; a feature switched on with a
zero budget warns.
"""

import pytest
import yaml

from trl_agentic import AgenticGRPOConfig
from trl_agentic.cli import main

BASE = dict(output_dir="unused", use_cpu=True, report_to="none")


def _forbid_model_loading(monkeypatch):
    import transformers
    import trl.trainer.grpo_trainer as grpo_trainer

    import trl_agentic.models

    def forbidden(*args, **kwargs):
        raise AssertionError("a model was loaded before the config was validated")

    monkeypatch.setattr(trl_agentic.models, "resolve_model_path", forbidden)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", forbidden)
    monkeypatch.setattr(grpo_trainer, "create_model_from_path", forbidden)


def _config(tmp_path, **values):
    path = tmp_path / "c.yaml"
    base = {"output_dir": str(tmp_path / "out"), "use_cpu": True, "report_to": "none", "max_steps": 1}
    path.write_text(yaml.safe_dump({**base, **values}))
    return str(path)


# 1. Config errors checked only in AgenticGRPOTrainer.__init__ come after the warm start (and the base-model eval).
@pytest.mark.parametrize(
    "values,field",
    [
        ({"advantage_estimator": "no_such_module:estimator"}, "advantage_estimator"),
        ({"enable_context_snapshots": True, "snapshot_reward_func": "no_such_module:f"}, "snapshot_reward_func"),
        (
            {"enable_tool_rollback": True, "multi_objective_aggregation": "normalize_then_sum"},
            "multi_objective_aggregation",
        ),
    ],
)
@pytest.mark.parametrize("stage", [{"warmstart_steps": 1}, {"heldout_eval": True, "heldout_eval_base_model": True}])
def test_trainer_config_checks_run_before_the_warm_start(tmp_path, monkeypatch, values, field, stage):
    _forbid_model_loading(monkeypatch)
    with pytest.raises(ValueError, match=f"`{field}"):
        main(["train", "--config", _config(tmp_path, use_peft=True, **stage, **values)])


# 2. The async trainer resolves `advantage_estimator` after TRL's __init__ loaded the model (CLI: after the server).
def test_async_estimator_import_fails_before_the_model(tmp_path, monkeypatch):
    _forbid_model_loading(monkeypatch)
    config = _config(tmp_path, trainer="async_grpo", use_peft=True, advantage_estimator="no_such_module:estimator")
    with pytest.raises(ValueError, match="`advantage_estimator"):
        main(["train", "--config", config])


# 3. Error-type names that cannot be a class name are accepted: the feature silently never fires.
@pytest.mark.parametrize("field", ["rollback_on_errors", "infra_error_types"])
@pytest.mark.parametrize("value", ["NameError, TypeError", "Name Error", None])
def test_error_type_names_are_identifiers(field, value):
    with pytest.raises(ValueError, match=f"`{field}`"):
        AgenticGRPOConfig(**BASE, enable_tool_rollback=True, **{field: value})


# 4. Non-finite RLVCR / advantage numbers are accepted (siblings such as rlvcr_step_advantage_w are refused).
@pytest.mark.parametrize(
    "field,value",
    [
        ("rlvcr_alpha", float("nan")),
        ("rlvcr_alpha", float("inf")),
        ("rlvcr_k", float("inf")),
        ("rlvcr_cost_max", float("inf")),
        ("advantage_std_floor", float("inf")),
    ],
)
def test_non_finite_numbers_are_refused(field, value):
    with pytest.raises(ValueError, match=f"`{field}`"):
        AgenticGRPOConfig(**BASE, advantage_estimator="rlvcr", rlvcr_mode="additive", **{field: value})


# 5. warmstart_error_fraction is read only by the arithmetic tasks' trace generator: a warning elsewhere (the
# ablation's shared settings set it for every task, so a refusal would break a registered design).
@pytest.mark.parametrize("task", ["textworld", "logsearch", "bfcl"])
def test_warmstart_error_fraction_warns_where_it_does_nothing(task):
    from trl_agentic.tasks import TaskArguments

    with pytest.warns(UserWarning, match="`warmstart_error_fraction` has no effect"):
        TaskArguments(task=task, warmstart_steps=4, warmstart_error_fraction=0.25)


# 6. Import paths of the task arguments name their field.
@pytest.mark.parametrize(
    "values,field",
    [
        ({"task": "no_such_module:build"}, "task"),
        ({"extra_reward_funcs": ["os:no_such_function"]}, "extra_reward_funcs"),
    ],
)
def test_import_paths_of_task_arguments_name_the_field(tmp_path, monkeypatch, values, field):
    _forbid_model_loading(monkeypatch)
    with pytest.raises(ValueError, match=f"`{field}`"):
        main(["train", "--config", _config(tmp_path, **values)])


# 6b. A calculator bonus on another task's environments names the field before any model loads (it used to fail at
# the first reward, `'PythonSandboxEnv' object has no attribute 'last_call_answered'`).
@pytest.mark.parametrize("task", ["python", "textworld", "logsearch"])
@pytest.mark.parametrize("reward", ["tool_use_reward", "tool_call_reward"])
def test_a_calculator_bonus_on_another_task_names_the_field(tmp_path, monkeypatch, task, reward):
    _forbid_model_loading(monkeypatch)
    values = {"task": task, "extra_reward_funcs": [f"trl_agentic.envs.calculator:{reward}"]}
    if task == "logsearch":
        values["logsearch_context_deletion"] = False  # else its own check comes first
    with pytest.raises(ValueError, match=f"`extra_reward_funcs`: `{reward}` reads the calls of a `CalculatorEnv`"):
        main(["train", "--config", _config(tmp_path, **values)])


def test_reward_environment_check_accepts_subclasses_and_reads_every_factory():
    from functools import partial

    from trl_agentic.envs.calculator import CalculatorEnv, ToolBonusCalculatorEnv, answer_reward, tool_use_reward
    from trl_agentic.envs.log_search import LogSearchEnv
    from trl_agentic.tasks import Task, _check_reward_environments

    def task(factory):
        return Task(None, None, factory, [answer_reward, tool_use_reward])

    for ok in (CalculatorEnv, ToolBonusCalculatorEnv, partial(CalculatorEnv), {"a": CalculatorEnv}):
        _check_reward_environments(task(ok), [answer_reward, tool_use_reward])
    # A reward without `environment_class` is never checked; a mapping is checked factory by factory.
    _check_reward_environments(task(LogSearchEnv), [answer_reward])
    with pytest.raises(ValueError, match="environments are LogSearchEnv:"):
        _check_reward_environments(task({"a": CalculatorEnv, "b": LogSearchEnv}), [tool_use_reward])


# 7. TracIn without validation prompts is refused only after the model loaded (Python API).
def test_tracin_without_validation_prompts_fails_before_the_model(tmp_path, monkeypatch):
    from datasets import Dataset
    from peft import LoraConfig

    from trl_agentic import AgenticGRPOTrainer
    from trl_agentic.models import build_tiny_model

    tiny = build_tiny_model(tmp_path / "tiny")
    _forbid_model_loading(monkeypatch)
    args = AgenticGRPOConfig(
        **{**BASE, "output_dir": str(tmp_path)}, tracin_enabled=True, num_generations=4, per_device_train_batch_size=4
    )
    with pytest.raises(ValueError, match="validation"):
        AgenticGRPOTrainer(
            model=tiny,
            reward_funcs=lambda completions, **k: [0.0] * len(completions),
            args=args,
            train_dataset=Dataset.from_list([{"prompt": [{"role": "user", "content": "q"}]}] * 4),
            peft_config=LoraConfig(r=4, target_modules=["q_proj"], task_type="CAUSAL_LM"),
        )


# 8. A feature switched on whose budget makes it a no-op: silent (save_negative_samples without rollback warns).
@pytest.mark.parametrize(
    "values,field",
    [
        ({"enable_tool_rollback": True, "max_tool_retries": 0}, "max_tool_retries"),
        (
            {"enable_tool_rollback": True, "save_negative_samples": True, "max_negative_samples_per_group": 0},
            "max_negative_samples_per_group",
        ),
    ],
)
def test_a_switched_on_feature_with_a_zero_budget_warns(values, field):
    with pytest.warns(UserWarning, match=field):
        AgenticGRPOConfig(**BASE, **values)


@pytest.mark.parametrize(
    "values, field",
    [
        ({"task": "bfcl", "bfcl_heldout_fraction": 1.0, "num_train_tasks": 4}, "bfcl_heldout_fraction"),
        ({"task": "textworld", "textworld_max_plan_steps": 1, "num_train_tasks": 4}, "textworld_max_plan_steps"),
    ],
)
def test_a_task_with_nothing_to_train_on_names_the_field(values, field):
    """It blamed `bfcl_categories` and `bfcl_classes`, or named no field."""
    from trl_agentic.tasks import TaskArguments, build_task

    with pytest.raises(ValueError, match=f"`{field}`"):
        build_task(TaskArguments(**values))


def test_rollback_names_may_be_an_environments_own_error_types_but_infrastructure_names_are_classes():
    """`rollback_on_errors` also matches a `ToolCallError`'s own `error_type` ("http-404"); infrastructure is read
    from class names alone. A catch-all base warns: it matches only itself."""
    config = AgenticGRPOConfig(**BASE, enable_tool_rollback=True, rollback_on_errors=["http-404", "api.error"])
    assert config.rollback_on_errors == ["http-404", "api.error"]
    with pytest.raises(ValueError, match="`infra_error_types` must be a list of exception class names"):
        AgenticGRPOConfig(**BASE, infra_error_types=["http-404"])
    with pytest.warns(UserWarning, match="lists `Exception`: it matches a bare `Exception` only"):
        AgenticGRPOConfig(**BASE, infra_error_types=["InfrastructureError", "Exception"])


# 6. TRL's AsyncGRPOTrainer takes no eval_dataset: transformers' Trainer refused an eval_strategy after the model
# (and, from the CLI, the vLLM server) had loaded.
@pytest.mark.parametrize("values", [{"eval_strategy": "steps", "eval_steps": 1}, {"eval_on_start": True}])
def test_async_evaluation_during_training_fails_before_the_model(tmp_path, monkeypatch, values):
    _forbid_model_loading(monkeypatch)
    field = next(iter(values))
    config = _config(tmp_path, trainer="async_grpo", use_peft=True, **values)
    with pytest.raises(ValueError, match=f"`{field}=.*not supported by AsyncAgenticGRPOTrainer"):
        main(["train", "--config", config])


# 7. Booleans and floats passed integer and fraction checks (`True` is 1, `0 < True <= 1`), a string raised a
# TypeError naming no field.
@pytest.mark.parametrize(
    "values,field",
    [
        ({"enable_context_snapshots": True, "max_snapshots_per_episode": True}, "max_snapshots_per_episode"),
        ({"max_snapshots_per_episode": 1.5}, "max_snapshots_per_episode"),
        ({"tracin_min_selected": True}, "tracin_min_selected"),
        ({"tracin_min_selected": 1.5}, "tracin_min_selected"),
        ({"tracin_val_num_generations": 2.0}, "tracin_val_num_generations"),
        ({"tracin_val_num_generations": True}, "tracin_val_num_generations"),
        ({"tracin_top_fraction": True}, "tracin_top_fraction"),
        ({"tracin_top_fraction": "0.5"}, "tracin_top_fraction"),
        ({"row_selection": "random", "row_selection_fraction": True}, "row_selection_fraction"),
        ({"enable_tool_rollback": True, "negative_reward_by_error": {"NameError": True}}, "negative_reward_by_error"),
    ],
)
def test_booleans_and_floats_in_integer_or_fraction_fields_are_refused(values, field):
    with pytest.raises(ValueError, match=f"`{field}`"):
        AgenticGRPOConfig(**BASE, **values)


@pytest.mark.parametrize(
    "field,value",
    [
        ("batch_size", 2.5),
        ("batch_size", True),
        ("limit", 1.5),
        ("seed", "0"),
        ("split_seed", 0.5),
        ("heldout_fraction", "0.25"),
        ("temperature", True),
    ],
)
def test_bfcl_eval_arguments_refuse_wrong_types_naming_the_field(field, value):
    from trl_agentic.envs.bfcl.evaluate import BFCLEvalArguments

    with pytest.raises(ValueError, match=f"`{field}`"):
        BFCLEvalArguments(**{field: value})


# 8. A builtin model is a local folder: a pushed adapter named it as its base (`adapter_config.json`), and the card
# named no base model. The async pipeline's warm start trains on a merged local folder too.
@pytest.mark.parametrize(
    "values",
    [
        {"push_to_hub": True},
        {"push_to_hub": True, "trainer": "async_grpo"},
        {
            "push_to_hub": True,
            "trainer": "async_grpo",
            "model_name_or_path": "org/m",
            "warmstart_steps": 1,
            "vllm_server_start": True,
        },
    ],
)
def test_pushing_a_model_nobody_else_can_load_fails_before_the_model(tmp_path, monkeypatch, values):
    _forbid_model_loading(monkeypatch)
    with pytest.raises(ValueError, match="`push_to_hub=True` with"):
        main(["train", "--config", _config(tmp_path, use_peft=True, **values)])


def test_the_trainer_refuses_to_push_a_builtin_model(tmp_path, monkeypatch):
    from trl_agentic import AgenticGRPOTrainer

    _forbid_model_loading(monkeypatch)
    args = AgenticGRPOConfig(**{**BASE, "output_dir": str(tmp_path)}, push_to_hub=True)
    with pytest.raises(ValueError, match="builtin model 'smollm2-135m'"):
        AgenticGRPOTrainer(model="smollm2-135m", reward_funcs=lambda completions, **kw: [0.0], args=args)


# 9. TRL applies `generation_kwargs` after its own length: a `max_tokens` there replaced the limit the rollout loop
# gives each turn, so a turn it cut read as complete.
@pytest.mark.parametrize("key", ["max_tokens", "max_new_tokens"])
def test_a_length_in_generation_kwargs_is_refused_when_our_loop_runs(key):
    with pytest.raises(ValueError, match=f"`generation_kwargs` sets `{key}`.*max_turn_tokens"):
        AgenticGRPOConfig(**BASE, enable_tool_rollback=True, generation_kwargs={key: 32})
    with pytest.raises(ValueError, match=f"`generation_kwargs` sets `{key}`"):
        AgenticGRPOConfig(**BASE, max_turn_tokens=64, generation_kwargs=f'{{"{key}": 32}}')  # JSON, from the CLI
    AgenticGRPOConfig(**BASE, generation_kwargs={key: 32})  # TRL's own loop: TRL's semantics

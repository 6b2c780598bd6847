"""`trl-agentic train`: its help, and the settings refused before any model loads (those the run could not honour)."""

import json
import types
from pathlib import Path

import pytest
import yaml

from trl_agentic.cli import main

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
BASE = {"use_cpu": True, "report_to": "none", "max_steps": 1, "save_strategy": "no"}


def _forbid_model_loading(monkeypatch):
    import transformers

    import trl_agentic.models

    def forbidden(*args, **kwargs):
        raise AssertionError("a model was loaded before the config was validated")

    monkeypatch.setattr(trl_agentic.models, "resolve_model_path", forbidden)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", forbidden)


def _config(tmp_path, **values) -> str:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"output_dir": str(tmp_path / "out"), **BASE, **values}))
    return str(path)


@pytest.mark.parametrize("trainer", [[], ["--trainer", "async_grpo"]])
def test_train_help_lists_every_field(capsys, trainer):
    """`trl-agentic train --help` listed only `--trainer`: the parser that reads the trainer's name answered it."""
    with pytest.raises(SystemExit) as exit_:
        main(["train", *trainer, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: trl-agentic train")
    for flag in ("--trainer", "--warmstart_steps", "--heldout_eval", "--enable_tool_rollback", "--lora_r"):
        assert flag in out, flag


@pytest.mark.parametrize(
    "values,field",
    [
        ({"heldout_eval": True, "num_eval_tasks": 0}, "num_eval_tasks"),
        ({"tracin_enabled": True, "use_peft": True, "num_eval_tasks": 0}, "num_eval_tasks"),
        ({"eval_strategy": "steps", "eval_steps": 1, "num_eval_tasks": 0}, "num_eval_tasks"),
        (
            {"heldout_eval": True, "task": "bfcl", "bfcl_heldout_fraction": 0.0, "num_train_tasks": 4},
            "bfcl_heldout_fraction",
        ),
    ],
    ids=["heldout_eval", "tracin", "eval_strategy", "bfcl"],
)
def test_a_run_that_needs_held_out_problems_and_has_none_fails_before_a_model_loads(
    tmp_path, monkeypatch, values, field
):
    """It crashed after the model had loaded (the held-out summary had no `success_rate`; TracIn refused an empty
    validation set in the trainer)."""
    _forbid_model_loading(monkeypatch)
    with pytest.raises(ValueError, match=f"`{field}`"):
        main(["train", "--config", _config(tmp_path, **values)])


def test_the_async_run_needs_held_out_problems_for_tracin(monkeypatch):
    _forbid_model_loading(monkeypatch)
    argv = ["train", "--config", str(CONFIGS / "async_calculator.yaml"), "--vllm_server_start", "false"]
    with pytest.raises(ValueError, match="`num_eval_tasks`"):
        main([*argv, "--tracin_enabled", "true", "--use_peft", "true", "--num_eval_tasks", "0"])


@pytest.mark.parametrize(
    "values,flags,field",
    [
        ({"warmstart_steps": 1.5}, [], "warmstart_steps"),
        ({"heldout_eval_batch_size": 2.5}, [], "heldout_eval_batch_size"),
        ({"num_train_tasks": 0}, [], "num_train_tasks"),
        ({"warmstart_steps": 1}, ["--warmstart_learning_rate", "nan"], "warmstart_learning_rate"),
        ({"heldout_eval": True}, ["--heldout_eval_temperature", "inf"], "heldout_eval_temperature"),
        ({"row_selection": "successful"}, ["--row_selection_threshold", "nan"], "row_selection_threshold"),
    ],
)
def test_bad_values_fail_before_a_model_loads(tmp_path, monkeypatch, values, flags, field):
    _forbid_model_loading(monkeypatch)
    with pytest.raises(ValueError, match=f"`{field}`"):
        main(["train", "--config", _config(tmp_path, **values), *flags])


@pytest.mark.parametrize("config", ["snapshots_logsearch.yaml", "async_snapshots_logsearch.yaml"])
def test_a_log_search_that_deletes_context_needs_the_delete_context_tool(monkeypatch, config):
    """Its prompts and warm-start traces call `delete_context`; without `enable_context_snapshots` the rollouts have
    no such tool, and the warm start taught calls to it."""
    _forbid_model_loading(monkeypatch)
    argv = ["train", "--config", str(CONFIGS / config), "--enable_context_snapshots", "false"]
    with pytest.raises(ValueError, match="`enable_context_snapshots: true`"):
        main(argv)


def test_the_warm_start_says_when_its_traces_exceed_the_budget():
    from types import SimpleNamespace

    from trl_agentic.cli import _warn_traces_over_budget

    with pytest.warns(UserWarning, match=r"2 of 3 warm-start traces .* \(96 tokens; the longest 142\)"):
        _warn_traces_over_budget(SimpleNamespace(completion_tokens=[(66, False), (140, True), (142, True)]), 96)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _warn_traces_over_budget(SimpleNamespace(completion_tokens=[(66, False), (96, True)]), 96)


@pytest.mark.parametrize("field", ["write_report", "heldout_eval_base_model"])
def test_the_async_trainer_refuses_what_it_does_not_write(monkeypatch, field):
    """`trainer: async_grpo` accepted these and wrote no report and evaluated no base model."""
    _forbid_model_loading(monkeypatch)
    with pytest.raises(ValueError, match=f"`{field}`"):
        main(["train", "--config", str(CONFIGS / "async_calculator.yaml"), f"--{field}", "true"])


def test_the_async_trainers_held_out_evaluation_is_written_to_eval_results(tmp_path, monkeypatch):
    """`heldout_eval` with `trainer: async_grpo` evaluates after training and writes `eval_results.json` (it only
    printed). Trainer and evaluation are recorders (the vLLM tier runs the trainer)."""
    import trl_agentic.async_grpo as async_grpo
    import trl_agentic.evaluation as evaluation
    import trl_agentic.models as models

    class Trainer:
        def __init__(self, model, args=None, **kwargs):
            self.model, self.processing_class = "policy", "tokenizer"
            self.accelerator = types.SimpleNamespace(unwrap_model=lambda m: m)
            self.state = types.SimpleNamespace(log_history=[{"loss": 0.5, "step": 1}], global_step=1)

        def train(self, resume_from_checkpoint=None):
            pass

        def save_model(self, output_dir):
            pass

    metrics = evaluation.summarize(
        [{"rewards": [1.0], "reward": 1.0, "tool_calls": 1, "tool_failures": 0, "completion_tokens": 4}]
    )
    stages = []

    def evaluate_policy(model, tokenizer, rows, **kwargs):
        stages.append((model, kwargs["desc"], len(rows)))
        return evaluation.EvalResult(metrics, [])

    monkeypatch.setattr(async_grpo, "AsyncAgenticGRPOTrainer", Trainer)
    monkeypatch.setattr(evaluation, "evaluate_policy", evaluate_policy)
    monkeypatch.setattr(models, "resolve_model_path", lambda name: name)
    out = tmp_path / "out"
    argv = ["train", "--config", str(CONFIGS / "async_calculator.yaml"), "--output_dir", str(out)]
    argv += ["--vllm_server_start", "false", "--heldout_eval", "true", "--num_eval_tasks", "3"]
    assert main(argv) == 0
    assert stages == [("policy", "eval after training", 3)]
    written = json.loads((out / "eval_results.json").read_text())
    assert written["eval"] == {"after training": metrics}
    assert written["grpo_steps"] == 1 and written["num_eval_problems"] == 3


@pytest.mark.parametrize("iterations", [None, 0, 5])
def test_the_held_out_evaluation_rolls_out_as_training_does(iterations, tmp_path, monkeypatch):
    """The evaluation got `max_tool_calling_iterations or 3` (None, TRL's no limit, and 0, no tool call, became 3)
    and neither `max_turn_tokens`, `top_p` nor `max_tool_output_chars`."""
    import trl_agentic.evaluation as evaluation
    from trl_agentic.cli import _evaluate_into
    from trl_agentic.config import AgenticGRPOConfig
    from trl_agentic.tasks import TaskArguments, build_task

    seen = {}

    def evaluate_policy(model, tokenizer, rows, **kwargs):
        seen.update(kwargs)
        return evaluation.EvalResult(evaluation.summarize([]), [])

    monkeypatch.setattr(evaluation, "evaluate_policy", evaluate_policy)
    args = AgenticGRPOConfig(
        output_dir=str(tmp_path),
        **BASE,
        max_tool_calling_iterations=iterations,
        max_turn_tokens=24,
        top_p=0.9,
        max_tool_output_chars=64,
    )
    task_args = TaskArguments(num_train_tasks=1, num_eval_tasks=2, heldout_eval_temperature=0.7)
    _evaluate_into("after training", None, None, build_task(task_args), task_args, args, {}, {})
    assert seen["max_tool_calling_iterations"] == iterations
    assert (seen["max_turn_tokens"], seen["top_p"], seen["temperature"]) == (24, 0.9, 0.7)
    assert seen["max_tool_output_chars"] == 64


def test_every_process_of_an_async_run_enters_the_held_out_evaluation(tmp_path, monkeypatch):
    """A process that is not the main one enters `_evaluate_into` too, where it waits for the main one's evaluation
    (`wait_for_everyone`); it skipped it, leaving the main process waiting there forever. It writes no file."""
    import trl_agentic.async_grpo as async_grpo
    import trl_agentic.cli as cli
    import trl_agentic.models as models

    class Trainer:
        def __init__(self, model, args=None, **kwargs):
            self.model, self.processing_class = "policy", "tokenizer"
            self.accelerator = types.SimpleNamespace(unwrap_model=lambda m: m)
            self.state = types.SimpleNamespace(log_history=[], global_step=1)

        def train(self, resume_from_checkpoint=None):
            pass

        def save_model(self, output_dir):
            pass

    entered = []
    monkeypatch.setattr(async_grpo, "AsyncAgenticGRPOTrainer", Trainer)
    monkeypatch.setattr(models, "resolve_model_path", lambda name: name)
    monkeypatch.setattr(cli, "_is_main_process", lambda: False)
    monkeypatch.setattr(cli, "_evaluate_into", lambda stage, *args: entered.append(stage))
    out = tmp_path / "out"
    argv = ["train", "--config", str(CONFIGS / "async_calculator.yaml"), "--output_dir", str(out)]
    argv += ["--vllm_server_start", "false", "--heldout_eval", "true", "--num_eval_tasks", "3"]
    assert main(argv) == 0
    assert entered == ["after training"]
    assert not (out / "eval_results.json").exists()


@pytest.mark.parametrize(
    "values,expected",
    [
        ({}, "4"),
        ({"steps_per_generation": 1, "gradient_accumulation_steps": 4}, "16"),  # read 4 (one micro-batch's)
        ({"steps_per_generation": 4, "gradient_accumulation_steps": 2}, "8"),  # read 16 (two steps' generation)
        ({"num_iterations": 2, "gradient_accumulation_steps": 2}, "4"),  # each rollout is trained on twice
    ],
)
def test_rollouts_per_step_are_a_steps_fresh_rollouts(values, expected):
    """A step trains `gradient_accumulation_steps` micro-batches; TRL generates `generation_batch_size` rollouts every
    `steps_per_generation` micro-batches, each trained on `num_iterations` times."""
    from trl_agentic import AgenticGRPOConfig
    from trl_agentic.cli import _rollouts_per_step

    args = AgenticGRPOConfig(
        output_dir="unused", use_cpu=True, per_device_train_batch_size=4, num_generations=4, **values
    )
    assert _rollouts_per_step(args) == expected
    # TRL's own numbers: a generation batch feeds steps_per_generation / GA steps, num_iterations times over.
    steps_per_batch = args.steps_per_generation * args.num_iterations / args.gradient_accumulation_steps
    assert float(expected) == args.generation_batch_size / steps_per_batch


@pytest.mark.parametrize(
    "values",
    [
        {"task": "calculator", "task_difficulty": "easy", "num_train_tasks": 64, "num_eval_tasks": 16},
        {"task": "textworld", "num_train_tasks": 64, "num_eval_tasks": 8, "textworld_max_plan_steps": 3},
        {"task": "logsearch", "num_train_tasks": 16, "num_eval_tasks": 8, "warmstart_steps": 2},
    ],
    ids=["calculator", "textworld", "logsearch"],
)
def test_tracin_validates_on_held_out_problems_the_run_neither_evaluates_nor_trains_on(values):
    """Regression: `trl-agentic train` passed the evaluated problems as TracIn's validation prompts, so their rewards
    chose the training rows and the held-out evaluation was no longer held out. Now the validation prompts are the
    held-out problems of the task built from `task_seed + 10`, minus every evaluated, training or warm-start problem
    (compared here by the column that names a problem in each task)."""
    from trl_agentic.cli import _tracin_validation
    from trl_agentic.tasks import TaskArguments, build_task

    args = TaskArguments(**values)
    task = build_task(args)

    def name(row):  # what a problem is, per task: its expression, its world, the seed of its log files
        return row.get("expression") or row.get("world") or row["task_seed"]

    used = {name(r) for d in (task.eval_dataset, task.train_dataset, task.warmstart_dataset) if d for r in d}
    other = build_task(TaskArguments(**{**values, "task_seed": args.task_seed + 10})).eval_dataset
    expected = [r for r in other if name(r) not in used]
    validation = list(_tracin_validation(task, args))
    assert validation == expected and len(validation) > 0
    assert not {name(r) for r in validation} & {name(r) for r in task.eval_dataset}


def test_bfcl_tracin_validates_on_held_out_scenarios_of_its_own_split_that_it_does_not_evaluate():
    """BFCL's scenario split is seeded by `task_seed`, so another seed's held-out tasks are mostly this run's training
    tasks (3 validation tasks were left at the defaults): its validation prompts are the held-out tasks of its own
    split that the run does not evaluate (50 held-out base scenarios - 32 evaluated = 18)."""
    from trl_agentic.cli import _tracin_validation
    from trl_agentic.envs.bfcl.dataset import split_scenarios
    from trl_agentic.tasks import TaskArguments, build_task

    args = TaskArguments(task="bfcl", num_train_tasks=0, num_eval_tasks=32)
    task = build_task(args)
    _, heldout = split_scenarios(args.bfcl_heldout_fraction, args.task_seed)
    evaluated = set(task.eval_dataset["bfcl_id"])
    validation = list(_tracin_validation(task, args)["bfcl_id"])
    assert sorted(validation) == sorted({f"multi_turn_base_{n}" for n in heldout} - evaluated)
    assert len(validation) == 18 and not set(validation) & set(task.train_dataset["bfcl_id"])


def test_a_bfcl_problem_is_its_scenario_in_every_category():
    """`multi_turn_<category>_<n>` is scenario n in every category, its first question worded a little differently
    (a trailing space, a dropped parameter): one problem. Keyed by the question, all four categories let 11 validation
    tasks of an evaluated scenario through."""
    from trl_agentic.cli import _tracin_validation
    from trl_agentic.tasks import TaskArguments, build_task, problem_key

    rows = {"base": {"bfcl_id": "multi_turn_base_9", "prompt": [{"content": "a"}]}}
    rows["miss_func"] = {"bfcl_id": "multi_turn_miss_func_9", "prompt": [{"content": "a "}]}
    rows["long"] = {"bfcl_id": "multi_turn_long_context_10", "prompt": [{"content": "a"}]}
    assert problem_key(rows["base"]) == problem_key(rows["miss_func"]) != problem_key(rows["long"])

    categories = ["base", "miss_func", "miss_param", "long_context"]
    args = TaskArguments(task="bfcl", bfcl_categories=categories, num_train_tasks=0, num_eval_tasks=32)
    task = build_task(args)

    def scenario(bfcl_id):
        return int(bfcl_id.rsplit("_", 1)[1])

    validation = {scenario(i) for i in _tracin_validation(task, args)["bfcl_id"]}
    assert validation and not validation & {scenario(i) for i in task.eval_dataset["bfcl_id"]}


@pytest.mark.parametrize(
    "values,remedy",
    [
        ({"task": "bfcl", "num_eval_tasks": 0}, r"0 evaluates them all\) or raise `bfcl_heldout_fraction`"),
        (
            {"task": "textworld", "textworld_max_plan_steps": 3, "num_eval_tasks": 20},
            "raise `textworld_heldout_fraction`",
        ),
        ({"task": "fixed_task:build", "num_eval_tasks": 4}, "make your builder draw other held-out problems"),
    ],
    ids=["bfcl", "textworld", "custom"],
)
def test_the_no_validation_prompts_error_says_what_to_change_for_the_task(tmp_path, monkeypatch, values, remedy):
    """BFCL's `num_eval_tasks: 0` takes every held-out task (lowering it is no remedy); a custom task whose builder
    ignores `task_seed` has the same held-out problems at `task_seed + 10`."""
    (tmp_path / "fixed_task.py").write_text(
        "from datasets import Dataset\n"
        "from trl_agentic.tasks import Task\n"
        "def build(args):\n"
        "    rows = [{'prompt': [{'role': 'user', 'content': f'q{i}'}], 'task_seed': i} for i in range(8)]\n"
        "    return Task(Dataset.from_list(rows[:4]), Dataset.from_list(rows[4:]), None, [])\n"
    )
    monkeypatch.chdir(tmp_path)
    _forbid_model_loading(monkeypatch)
    with pytest.raises(ValueError, match=rf"`tracin_enabled` needs validation prompts.*{remedy}"):
        main(["train", "--config", _config(tmp_path, tracin_enabled=True, use_peft=True, **values)])

"""The environments plug into TRL's own `GRPOTrainer` unchanged (tiny random model, CPU)."""

import pytest
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

from trl_agentic.envs.calculator import CalculatorEnv, answer_reward, make_arithmetic_tasks, tool_use_reward
from trl_agentic.envs.protocol import tool_methods
from trl_agentic.envs.python_sandbox import PythonSandboxEnv


def _trainer(model_dir, output_dir, factory) -> tuple[GRPOTrainer, list[dict]]:
    tasks = make_arithmetic_tasks(4, seed=0, difficulty="easy")
    trainer = GRPOTrainer(
        model=model_dir,
        reward_funcs=[answer_reward, tool_use_reward],
        args=GRPOConfig(
            output_dir=str(output_dir),
            use_cpu=True,
            bf16=False,
            max_steps=1,
            per_device_train_batch_size=2,
            num_generations=2,
            max_completion_length=8,
            report_to="none",
            save_strategy="no",
        ),
        train_dataset=Dataset.from_list(tasks),
        environment_factory=factory,
    )
    return trainer, tasks


@pytest.mark.parametrize(("factory", "tool"), [(CalculatorEnv, "calculate"), (PythonSandboxEnv, "python")])
def test_grpo_trainer_discovers_the_tools(tiny_model_dir, tmp_path, factory, tool):
    trainer, tasks = _trainer(tiny_model_dir, tmp_path, factory)
    assert [function.__name__ for function in trainer.tools] == list(tool_methods(factory())) == [tool]
    # The schema TRL renders into the prompt comes from our signature and docstring.
    prompt = trainer.processing_class.apply_chat_template(
        tasks[0]["prompt"], tools=trainer.tools, tokenize=False, add_generation_prompt=True
    )
    assert f'"name": "{tool}"' in prompt and "Args" not in prompt


def test_grpo_trainer_trains_a_step_with_the_calculator(tiny_model_dir, tmp_path):
    trainer, tasks = _trainer(tiny_model_dir, tmp_path, CalculatorEnv)
    assert trainer.train().global_step == 1
    environments = trainer._environment_pool[None]
    assert environments and all(isinstance(env, CalculatorEnv) for env in environments)
    # reset(**row) received the dataset columns.
    assert all(env.answer in {task["answer"] for task in tasks} for env in environments)

"""Warm-start traces of `task: textworld` (issue 18): every assistant turn is a well-formed RLVCR step for the parser
the trainer uses, its action is the `act` call of a shortest plan, and only the assistant tokens are trained."""

import json

import pytest

from trl_agentic.envs.textworld import TextWorldEnv, TextWorldToolEnv
from trl_agentic.envs.textworld_traces import FINAL_ANSWER, TOOL_STEP_TAGS, textworld_level_traces
from trl_agentic.rlvcr.estimator import find_steps, step_tags_from_args
from trl_agentic.rlvcr.parsing import LEVEL1_THINK
from trl_agentic.rollout.rendering import ChatRenderer
from trl_agentic.tasks import TaskArguments, build_task
from trl_agentic.warmstart import tokenize_trace


def _task(**kwargs):
    args = dict(task="textworld", num_train_tasks=3, num_eval_tasks=2, warmstart_steps=3, warmstart_batch_size=4)
    return build_task(TaskArguments(**{**args, **kwargs}))


def _runs(flags):
    """Maximal runs [start, end) of True."""
    out, start = [], None
    for i, flag in enumerate([*flags, False]):
        if flag and start is None:
            start = i
        elif not flag and start is not None:
            out.append((start, i))
            start = None
    return out


def test_textworld_accepts_a_warm_start_from_held_apart_problems():
    task = _task()
    assert len(task.warmstart_dataset) == 12
    datasets = {"train": task.train_dataset, "eval": task.eval_dataset, "warm": task.warmstart_dataset}
    seeds = {name: {r["task_seed"] for r in ds} for name, ds in datasets.items()}
    assert seeds["warm"].isdisjoint(seeds["train"]) and seeds["warm"].isdisjoint(seeds["eval"])
    # The prompts ask for level steps whose action is the `act` call (the tool the environment acts on).
    system = task.train_dataset[0]["prompt"][0]["content"]
    assert "<level>" in system and "`act` tool" in system and "<action>" not in system
    assert task.warmstart_dataset[0]["prompt"][0]["content"].split("Your task")[0] == system.split("Your task")[0]


def test_traces_are_solved_episodes_of_the_real_world():
    task = _task()
    rows = list(task.warmstart_dataset)
    traces = task.make_traces(rows)
    for row, trace in zip(rows, traces):
        world = TextWorldEnv()
        first = world.reset(**row)
        plan = world._oracle_actions()
        # TRL appends the observation returned by `reset` to the last prompt message.
        assert trace["prompt"][-1]["content"] == row["prompt"][-1]["content"] + first
        assert trace["prompt"][:-1] == row["prompt"][:-1]
        calls = [t for t in trace["turns"] if t["role"] == "assistant" and t.get("tool_calls")]
        assert [c["tool_calls"][0]["function"] for c in calls] == [
            {"name": "act", "arguments": {"action": a}} for a in plan
        ]
        tools = [t for t in trace["turns"] if t["role"] == "tool"]
        observations = [world.step(a) for a in plan]
        assert [t["content"] for t in tools] == observations
        assert world.success and trace["turns"][-1] == {"role": "assistant", "content": FINAL_ANSWER}
        assert [t.__name__ for t in trace["tools"]] == ["act"]
    assert {lv for t in traces for lv in t["levels"]} == {1, 2, 3, 4}
    again = textworld_level_traces(rows, seed=0)
    assert [t["turns"] for t in again] == [t["turns"] for t in traces]


def test_tokenized_traces_parse_as_well_formed_steps_and_train_only_assistant_tokens(tiny_tokenizer):
    from trl_agentic import AgenticGRPOConfig

    tok = tiny_tokenizer
    task = _task(warmstart_steps=2, warmstart_batch_size=3)
    rows = list(task.warmstart_dataset)
    traces = task.make_traces(rows)
    renderer = ChatRenderer(tok)
    # The tags the trainer parses with under the config's `rlvcr_action_tag: tool_call`.
    tags = step_tags_from_args(
        AgenticGRPOConfig(output_dir="unused", use_cpu=True, bf16=False, rlvcr_action_tag="tool_call")
    )
    assert tags == TOOL_STEP_TAGS
    for row, trace in zip(rows, traces):
        example = tokenize_trace(renderer, trace, trace["tools"])
        ids, labels = example["input_ids"], example["labels"]
        prompt = renderer.prompt_ids(trace["prompt"], tools=trace["tools"])
        assert ids[: len(prompt)] == prompt and set(labels[: len(prompt)]) == {-100}
        completion = ids[len(prompt) :]
        trained = [label != -100 for label in labels[len(prompt) :]]
        assert all(labels[len(prompt) + i] == completion[i] for i, t in enumerate(trained) if t)

        assistant = [t for t in trace["turns"] if t["role"] == "assistant"]
        runs = _runs(trained)
        assert len(runs) == len(assistant)
        # Each trained run is exactly one assistant turn and its end-of-turn token, written independently here.
        for (start, end), turn, level in zip(runs, assistant, [*trace["levels"], None]):
            text = tok.decode(completion[start:end])
            if level is None:
                assert text == FINAL_ANSWER + tok.eos_token
                continue
            action = turn["tool_calls"][0]["function"]["arguments"]["action"]
            call = json.dumps({"name": "act", "arguments": {"action": action}})
            assert text.startswith(f"<level>{level}</level>\n<think>")
            assert text.endswith(f"</think>\n<tool_call>\n{call}\n</tool_call>{tok.eos_token}")
            if level == 1:
                assert f"<think>{LEVEL1_THINK}</think>" in text
        # Everything untrained after the prompt is the environment's: tool responses and assistant headers.
        for start, end in _runs([not t for t in trained]):
            text = tok.decode(completion[start:end])
            assert "<tool_response>" in text and text.endswith("<|im_start|>assistant\n"), text

        # The trainer's step parser: every tool turn is a well-formed step of its level whose action tokens are the
        # `act` call; the closing answer (no tool call, so the rollout ends) is the one malformed turn.
        steps = find_steps(
            completion,
            [1] * len(completion),
            [int(t) for t in trained],
            lambda x: tok.decode(x, skip_special_tokens=True),
            tags,
        )
        assert len(steps) == len(assistant)
        for step, turn, level in zip(steps[:-1], assistant, trace["levels"]):
            assert step.error is None and step.parsed.level == level
            call = json.loads(tok.decode(completion[step.action_start : step.action_end]))
            assert call == {"name": "act", "arguments": turn["tool_calls"][0]["function"]["arguments"]}
        assert steps[-1].error == "no_level"

        # Replaying the parsed actions through a fresh environment solves the task.
        env = TextWorldToolEnv()
        env.reset(**row)
        for step in steps[:-1]:
            env.act(json.loads(step.parsed.action)["arguments"]["action"])
        assert env.get_reward() == 1.0


def test_rlvcr_config_parses_with_the_cli():
    from pathlib import Path

    from trl_agentic.cli import make_parser

    config = Path(__file__).resolve().parents[1] / "configs" / "rlvcr_textworld.yaml"
    task_args, training_args, model_args = make_parser().parse_args_and_config(args=["--config", str(config)])
    assert task_args.task == "textworld" and task_args.warmstart_steps > 0
    assert training_args.advantage_estimator == "rlvcr" and training_args.rlvcr_action_tag == "tool_call"
    assert model_args.model_name_or_path == "smollm2-135m" and model_args.use_peft


def test_warm_start_still_refused_for_tasks_without_traces():
    with pytest.raises(ValueError, match="`warmstart_steps`"):
        TaskArguments(task="my_pkg.tasks:build", warmstart_steps=1)

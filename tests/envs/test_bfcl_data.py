"""BFCL suite data: the installed package's files, splits, dataset rows, reward functions and partial credit."""

import copy
import json
from pathlib import Path

import pytest

from trl_agentic.envs.bfcl import (
    CATEGORIES,
    bfcl_reward,
    bfcl_turn_credit,
    environment_factories,
    get_task,
    load_tasks,
    make_rows,
    select_tasks,
    split_scenarios,
    turn_credit,
)
from trl_agentic.envs.bfcl.checker import official_verdict
from trl_agentic.envs.bfcl.traces import play_ground_truth


def test_the_package_data_is_loaded_whole():
    import bfcl_eval

    data = Path(bfcl_eval.__file__).parent / "data"
    for category in CATEGORIES:
        tasks = load_tasks(category)
        with open(data / f"BFCL_v4_multi_turn_{category}.json") as f:
            ids = [json.loads(line)["id"] for line in f]
        assert [t.id for t in tasks] == ids and len(ids) == 200
        assert all(len(t.turns) == len(t.ground_truth) for t in tasks)
    assert get_task("multi_turn_miss_param_3").category == "miss_param"


def test_importing_the_suite_creates_no_folders_next_to_the_package():
    """bfcl_eval.constants.eval_config creates result/, score/ and .file_locks/ when imported: we never import it."""
    import subprocess
    import sys

    import bfcl_eval

    root = Path(bfcl_eval.__file__).resolve().parents[1]
    code = (
        "from trl_agentic.envs.bfcl.traces import play_ground_truth; from trl_agentic.envs.bfcl import get_task;"
        "assert play_ground_truth(get_task('multi_turn_base_1')).env._official_verdict()['valid'];"
        "import sys; assert 'bfcl_eval.constants.eval_config' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    assert not any((root / name).exists() for name in ("result", "score", ".file_locks"))


def test_splits_are_disjoint_and_cover_every_scenario():
    train, heldout = split_scenarios(0.25, seed=3)
    assert len(heldout) == 50 and len(train) == 150
    assert set(train) | set(heldout) == set(range(200)) and not set(train) & set(heldout)
    assert split_scenarios(0.25, seed=3) == (train, heldout) and split_scenarios(0.25, seed=4) != (train, heldout)
    tasks = select_tasks(["base", "miss_param"], scenarios=heldout)
    assert {t.index for t in tasks} == set(heldout) and len(tasks) == 100


def test_select_by_api_classes():
    tasks = select_tasks(["base"], classes=["TradingBot", "MessageAPI"])
    assert tasks and all(set(t.involved_classes) <= {"TradingBot", "MessageAPI"} for t in tasks)
    every = [t for t in load_tasks("base") if set(t.involved_classes) <= {"TradingBot", "MessageAPI"}]
    assert [t.id for t in tasks] == [t.id for t in every]
    with pytest.raises(ValueError, match="Unknown API classes"):
        select_tasks(["base"], classes=["Bank"])


def test_rows_and_factories_for_trl_multi_environment_mode():
    tasks = select_tasks(["base", "miss_func"], scenarios=[0, 66])
    rows = make_rows(tasks, system_prompt="Be brief.")
    assert [r["bfcl_id"] for r in rows] == [t.id for t in tasks]
    assert rows[0]["prompt"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": tasks[0].turns[0][0]["content"]},
    ]
    factories = environment_factories(rows)
    assert set(factories) == {r["environment"] for r in rows}
    for row in rows:  # what TRL does with a row: the factory of its environment, reset with the other columns
        env = factories[row["environment"]]()
        env.reset(**{k: v for k, v in row.items() if k != "environment"})
    bad = dict(rows[0], environment=rows[-1]["environment"])
    if bad["environment"] != rows[0]["environment"]:
        with pytest.raises(ValueError, match="expected"):
            environment_factories([bad])


def test_turn_credit_counts_leading_turns_that_pass():
    task = get_task("multi_turn_base_0")  # 4 turns
    calls = play_ground_truth(task).env._turn_calls
    assert turn_credit(task, calls) == 1.0
    assert turn_credit(task, calls[:2]) == 0.5  # cut after two turns (force-terminated for the verdict)
    assert official_verdict(task, calls[:2])["valid"] is False
    wrong = copy.deepcopy(calls)
    wrong[2] = ["sort(file_name='nothing.pdf')"]  # turn 2 fails
    assert turn_credit(task, wrong) == 0.5
    wrong[0] = []  # turn 0 fails: nothing counts
    assert turn_credit(task, wrong) == 0.0


def test_reward_functions_read_the_environments():
    episode = play_ground_truth(get_task("multi_turn_miss_param_0"))
    unfinished_task = get_task("multi_turn_base_1")
    unfinished = play_ground_truth(unfinished_task).env
    unfinished._calls = unfinished._calls[:1]  # as if the rollout ended after the first turn
    other = object()
    assert bfcl_reward(environments=[episode.env, unfinished, other]) == [1.0, 0.0, None]
    credit = bfcl_turn_credit(environments=[episode.env, unfinished, other])
    assert credit == [1.0, 1 / len(unfinished_task.turns), None]


def test_ground_truth_traces_tokenize_with_masked_user_and_tool_turns(tiny_tokenizer):
    """Warm-start traces: only the assistant's tokens are trained; tool results and later user turns are masked."""
    from trl_agentic.envs.bfcl.traces import ground_truth_traces
    from trl_agentic.evaluation import ChatRenderer
    from trl_agentic.warmstart import tokenize_trace, tool_call_text

    task = get_task("multi_turn_miss_func_0")
    [trace] = ground_truth_traces(make_rows([task]))
    renderer = ChatRenderer(tiny_tokenizer)
    example = tokenize_trace(renderer, trace, trace["tools"])
    ids, labels = example["input_ids"], example["labels"]
    prompt = renderer.prompt_ids(trace["prompt"], tools=trace["tools"])
    assert ids[: len(prompt)] == prompt and set(labels[: len(prompt)]) == {-100}
    eos = tiny_tokenizer.eos_token_id
    # The trained spans, in order, are exactly the assistant messages (each closed by the end-of-turn token).
    spans, current = [], []
    for token, label in zip(ids, labels):
        if label != -100:
            current.append(token)
        elif current:
            spans.append(current)
            current = []
    if current:
        spans.append(current)
    expected = []
    for message in trace["turns"]:
        if message["role"] == "assistant":
            text = message["content"] or ""
            for call in message.get("tool_calls") or []:
                text += tool_call_text(call["function"]["name"], call["function"]["arguments"])
            expected.append(tiny_tokenizer.encode(text, add_special_tokens=False) + [eos])
    assert spans == expected
    ground_truth_calls = sum(len(turn) for turn in task.ground_truth)
    assert sum("<tool_call>" in tiny_tokenizer.decode(s) for s in spans) == ground_truth_calls
    # Each later user message sits in the masked tokens, after an assistant turn.
    masked = tiny_tokenizer.decode([t for t, label in zip(ids[len(prompt) :], labels[len(prompt) :]) if label == -100])
    for turn in task.turns[1:]:
        for message in turn:
            assert f"<|im_start|>user\n{message['content']}<|im_end|>" in masked
    assert masked.count("What about now?") == 1

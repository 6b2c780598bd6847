"""The `logsearch` task (issue 18, snapshots live): rows, environment, and warm-start traces laid out as the rollout.

The replay test runs the real rollout loop with snapshots on, scripted to emit a trace's assistant turns, and checks
that the loop's snapshot rows carry exactly the traces' segment prompts and turns (message level: the scripted
backend's renderer is not the chat template). The budget test checks, with SmolLM2's real tokenizer and chat
template, that one file fits the config's per-segment completion budget and two do not.
"""

import json
import re
from pathlib import Path

import pytest
import yaml
from rollout_helpers import ScriptBackend, run_tools_loop

from trl_agentic.config import DEFAULT_INFRA_ERROR_TYPES, DEFAULT_ROLLBACK_ON_ERRORS
from trl_agentic.envs.calculator import answer_reward
from trl_agentic.envs.log_search import LogSearchEnv, log_search_traces, make_log_rows
from trl_agentic.rollout.loop import LoopConfig
from trl_agentic.rollout.types import RowKind
from trl_agentic.tasks import TaskArguments, build_task

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "snapshots_logsearch.yaml"


def test_rows_are_deterministic_and_answers_are_the_sums_of_the_files():
    rows = make_log_rows(6, 0)
    assert rows == make_log_rows(6, 0) and rows != make_log_rows(6, 1)
    for row in rows:
        env = LogSearchEnv()
        env.reset(**row)
        counts = []
        for name in row["files"]:
            found = re.findall(r"count=(\d+)", env.read_file(name))
            assert len(found) == 1  # exactly one line reports the count
            counts.append(int(found[0]))
        assert row["answer"] == str(sum(counts))
        with pytest.raises(FileNotFoundError, match="the files are"):
            env.read_file("missing.log")


def test_task_splits_do_not_share_episodes():
    task = build_task(
        TaskArguments(
            task="logsearch", num_train_tasks=32, num_eval_tasks=16, warmstart_steps=2, warmstart_batch_size=4
        )
    )
    seeds = [{r["task_seed"] for r in d} for d in (task.train_dataset, task.eval_dataset, task.warmstart_dataset)]
    assert [len(s) for s in seeds] == [32, 16, 8]
    assert not (seeds[0] & seeds[1]) and not (seeds[0] & seeds[2]) and not (seeds[1] & seeds[2])


def _turn_text(message: dict) -> str:
    blocks = "".join(
        f"<tool_call>{json.dumps({'name': c['function']['name'], 'arguments': c['function']['arguments']})}</tool_call>"
        for c in message.get("tool_calls") or []
    )
    return f"{message['content']}{blocks}<|im_end|>"


def _strip(messages: list[dict]) -> list[dict]:
    # The loop's assistant messages carry parsed calls and stripped content; compare what the template renders.
    out = []
    for m in messages:
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in m.get("tool_calls") or []]
        out.append((m["role"], (m.get("content") or "").strip(), calls))
    return out


@pytest.mark.parametrize("num_files", [1, 2, 3])
def test_the_rollout_loop_replaying_a_trace_closes_the_same_segments(tiny_tokenizer, num_files):
    [row] = make_log_rows(1, 5, num_files=num_files)
    traces = log_search_traces([row])
    assert [t["segment"] for t in traces] == list(range(num_files + 1))
    assistant_turns = [m for t in traces for m in t["turns"] if m["role"] == "assistant"]
    script = [_turn_text(m) for m in assistant_turns]

    backend = ScriptBackend(tiny_tokenizer, [[s] for s in script[1:]])
    env = LogSearchEnv()
    env.reset(**row)
    config = LoopConfig(
        enable_context_snapshots=True,
        max_snapshots_per_episode=10,
        rollback_on_errors=list(DEFAULT_ROLLBACK_ON_ERRORS),
        infra_error_types=list(DEFAULT_INFRA_ERROR_TYPES),
    )
    prompts, _, trl_tuple, result = run_tools_loop(
        backend, script[:1], [{"read_file": env.read_file}], config, envs=[env], prompts=[row["prompt"]]
    )
    _, completions, *_ = trl_tuple
    snapshots = [x for x in result.extra_rows if x.kind == RowKind.SNAPSHOT]
    assert result.stats.snapshots == num_files and len(snapshots) == num_files
    for snapshot, trace in zip(snapshots, traces[:-1], strict=True):
        assert _strip(snapshot.prompt_messages) == _strip(trace["prompt"])
        assert _strip(snapshot.messages) == _strip(trace["turns"])
    # The final segment: the loop's prompt is the stubbed conversation, the episode's messages end with the answer.
    assert _strip(prompts[0]) == _strip(traces[-1]["prompt"])
    assert _strip(completions[0][-1:]) == _strip(traces[-1]["turns"])
    assert answer_reward([completions[0]], [row["answer"]]) == [1.0]
    # Every deleted message is a file's content, replaced by the stub.
    stubbed = [m for m in traces[-1]["prompt"] if m["content"] == "[deleted]"]
    assert len(stubbed) == num_files and all(m["role"] == "tool" and m["name"] == "read_file" for m in stubbed)


def test_one_file_fits_the_segment_budget_and_two_do_not():
    """With SmolLM2's tokenizer and TRL's chat template: deleting is needed to finish under the live config."""
    from transformers import AutoTokenizer

    from trl_agentic.models import resolve_model_path
    from trl_agentic.rollout.rendering import ChatRenderer
    from trl_agentic.warmstart import tokenize_trace

    budget = yaml.safe_load(CONFIG.read_text())["max_completion_length"]
    renderer = ChatRenderer(AutoTokenizer.from_pretrained(resolve_model_path("smollm2-135m")))
    rows = make_log_rows(8, 3)
    for row in rows:
        traces = log_search_traces([row])
        for trace in traces:
            example = tokenize_trace(renderer, trace, trace["tools"])
            completion = len(example["input_ids"]) - len(renderer.prompt_ids(trace["prompt"], tools=trace["tools"]))
            assert completion <= budget, (trace["segment"], completion)
        # Without the deletion: the first segment's turns, minus its delete call, then the second file read.
        first, second = traces[0], traces[1]
        no_delete = {
            "prompt": first["prompt"],
            "turns": [*first["turns"][:2], *second["turns"][:2]],
            "tools": first["tools"],
        }
        example = tokenize_trace(renderer, no_delete, no_delete["tools"])
        completion = len(example["input_ids"]) - len(renderer.prompt_ids(first["prompt"], tools=first["tools"]))
        assert completion > budget


# ------------------------------------------------------------------------------------------------ without deletion


def test_without_deletion_the_problems_are_the_same_and_the_prompt_does_not_ask_to_delete():
    """`context_deletion=False` (the ablation's control, amendment 4) changes only the system prompt."""
    deleting, keeping = make_log_rows(8, 3), make_log_rows(8, 3, context_deletion=False)
    strip = [{k: v for k, v in r.items() if k != "prompt"} for r in deleting]
    assert strip == [{k: v for k, v in r.items() if k != "prompt"} for r in keeping]
    assert [r["prompt"][1] for r in deleting] == [r["prompt"][1] for r in keeping]  # the same question
    assert all("delete_context" in r["prompt"][0]["content"] for r in deleting)
    assert not any("delete" in r["prompt"][0]["content"] for r in keeping)
    task = build_task(
        TaskArguments(
            task="logsearch",
            num_train_tasks=4,
            num_eval_tasks=4,
            warmstart_steps=1,
            warmstart_batch_size=2,
            logsearch_context_deletion=False,
        )
    )
    for dataset in (task.train_dataset, task.eval_dataset, task.warmstart_dataset):
        assert len(dataset) and not any("delete" in r["prompt"][0]["content"] for r in dataset)
    traces = task.make_traces(list(task.warmstart_dataset))
    assert len(traces) == len(task.warmstart_dataset)  # one an episode
    assert not any("delete" in t["prompt"][0]["content"] for t in traces)
    assert not any(
        c["function"]["name"] == "delete_context"
        for t in traces
        for m in t["turns"]
        for c in m.get("tool_calls") or []
    )
    assert list(task.eval_dataset["task_seed"]) == [r["task_seed"] for r in make_log_rows(4, 1)]


@pytest.mark.parametrize("num_files", [1, 2, 3])
def test_a_trace_that_keeps_every_file_replays_through_the_loop_without_snapshots(tiny_tokenizer, num_files):
    """One trace an episode, the environment's tools only; our loop without snapshots (TRL's loop, token for token)
    replaying its assistant turns gives back its turns and a correct answer."""
    [row] = make_log_rows(1, 5, num_files=num_files, context_deletion=False)
    [trace] = log_search_traces([row], context_deletion=False)
    assert [t.__name__ for t in trace["tools"]] == ["read_file"] and trace["prompt"] == row["prompt"]
    calls = [c["function"]["name"] for m in trace["turns"] for c in m.get("tool_calls") or []]
    assert calls == ["read_file"] * num_files
    script = [_turn_text(m) for m in trace["turns"] if m["role"] == "assistant"]
    env = LogSearchEnv()
    env.reset(**row)
    config = LoopConfig(
        rollback_on_errors=list(DEFAULT_ROLLBACK_ON_ERRORS), infra_error_types=list(DEFAULT_INFRA_ERROR_TYPES)
    )
    backend = ScriptBackend(tiny_tokenizer, [[s] for s in script[1:]])
    _, _, trl_tuple, result = run_tools_loop(
        backend, script[:1], [{"read_file": env.read_file}], config, envs=[env], prompts=[row["prompt"]]
    )
    _, completions, *_ = trl_tuple
    assert not result.extra_rows and result.stats.snapshots == 0
    assert _strip(completions[0]) == _strip(trace["turns"])
    assert answer_reward([completions[0]], [row["answer"]]) == [1.0]


def test_a_trace_that_keeps_both_files_fits_the_controls_budget():
    """With SmolLM2's tokenizer and chat template: the control's budget (`trl_fit`, 640) holds a whole episode."""
    from transformers import AutoTokenizer

    from trl_agentic.ablation import design
    from trl_agentic.models import resolve_model_path
    from trl_agentic.rollout.rendering import ChatRenderer
    from trl_agentic.warmstart import tokenize_trace

    budget = design.arm("logsearch", "trl_fit").overrides["max_completion_length"]
    assert design.arm("logsearch", "warmstart_fit").overrides["max_completion_length"] == budget
    renderer = ChatRenderer(AutoTokenizer.from_pretrained(resolve_model_path("smollm2-135m")))
    lengths = []
    for trace in log_search_traces(make_log_rows(8, 3, context_deletion=False), context_deletion=False):
        example = tokenize_trace(renderer, trace, trace["tools"])
        lengths.append(len(example["input_ids"]) - len(renderer.prompt_ids(trace["prompt"], tools=trace["tools"])))
    assert 320 < max(lengths) <= budget, lengths  # more than one segment's budget, within the control's


@pytest.mark.parametrize(
    ("num_files", "deleting", "keeping"), [(2, 892, 759), (3, 1048, 996), (4, 1205, 1232), (5, 1362, 1468)]
)
def test_peak_context_of_the_oracle_traces_is_what_the_docs_say(num_files, deleting, keeping):
    """docs/snapshots.md and the ablation findings: with SmolLM2's tokenizer, the longest context of an episode
    (segment prompt and turns) is larger with deletion at two files and smaller from four files on. Recomputed here
    from the traces, the mean over the problems of `make_log_rows(n, 5)` (64 at two files, 32 with more)."""
    from transformers import AutoTokenizer

    from trl_agentic.models import resolve_model_path
    from trl_agentic.rollout.rendering import ChatRenderer
    from trl_agentic.warmstart import tokenize_trace

    renderer = ChatRenderer(AutoTokenizer.from_pretrained(resolve_model_path("smollm2-135m")))
    n = 64 if num_files == 2 else 32
    means = {}
    for deletion in (True, False):
        rows = make_log_rows(n, 5, num_files=num_files, context_deletion=deletion)
        peaks = []
        for row in rows:
            traces = log_search_traces([row], context_deletion=deletion)
            peaks.append(max(len(tokenize_trace(renderer, t, t["tools"])["input_ids"]) for t in traces))
        means[deletion] = sum(peaks) / len(peaks)
    assert round(means[True]) == deleting and round(means[False]) == keeping, means

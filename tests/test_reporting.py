"""Run outputs: the compact step line, the trajectory recorder, curves.png and report.html (synthetic data, fast)."""

import json
import re
from html.parser import HTMLParser
from types import SimpleNamespace

import matplotlib.image
import pytest
import torch
from datasets import Dataset
from report_helpers import completion, synthetic_trajectories, tool_call

from trl_agentic import AgenticGRPOConfig, AgenticGRPOTrainer
from trl_agentic.envs.calculator import CalculatorEnv, answer_reward
from trl_agentic.errors import FailedToolMessage
from trl_agentic.reporting import (
    CompactProgressCallback,
    TrajectoryRecorder,
    format_step_line,
    plot_curves,
    select_trajectories,
    write_report,
)
from trl_agentic.reporting.callbacks import describe_segments, split_segments
from trl_agentic.rollout.types import ExtraRow, LoopResult, LoopStats, RowKind


def _history(steps=6, tracin=False, rlvcr=False):
    history = []
    for s in range(1, steps + 1):
        entry = {
            "step": s,
            "reward": 0.1 * s,
            "reward_std": 0.2,
            "rewards/answer_reward/mean": 0.1 * s,
            "tools/call_frequency": 1.2,
            "tools/failure_frequency": 0.5 / s,
            "rollback/attempts": float(6 - s),
            "rollback/recovered_ratio": 0.5,
            "negatives/rows": float(min(2, 6 - s)),
            "negatives/saved": float(6 - s),
            "loss": 0.01,
        }
        if tracin:
            entry["tracin/selected_ratio"] = 0.5
        if rlvcr:
            entry.update({f"rlvcr/level_frac_{k}": 0.25 for k in range(1, 5)})
        history.append(entry)
    history.append({"step": steps, "train_runtime": 12.0, "train_loss": 0.01})
    return history


# ---------------------------------------------------------------------------------------------------- step line


def test_step_line_is_compact_and_complete():
    logs = _history()[0]
    line = format_step_line(logs, 1, 20, 12.34)
    assert line == (
        "step  1/20 | reward 0.100 | tool calls 1.20 | tool fail 0.50 | rollbacks 5 | negatives 2 | loss 0.0100 "
        "| 12.3 s/step"
    )
    rich = format_step_line({**logs, "tracin/selected_ratio": 0.5, "rlvcr/level_frac_1": 1.0}, 1, 20, None)
    assert "tracin kept 0.50" in rich and "levels 1.00/-/-/-" in rich and rich.endswith("- s/step")


def test_step_line_for_sft_logs():
    line = format_step_line({"loss": 1.5, "mean_token_accuracy": 0.75}, 3, 10, 2.0)
    assert line == "step  3/10 | loss 1.5000 | token accuracy 0.750 | 2.0 s/step"


def test_compact_progress_writes_one_line_per_logged_step():
    callback = CompactProgressCallback()
    written = []
    callback.training_bar = SimpleNamespace(write=written.append)
    state = SimpleNamespace(is_world_process_zero=True, global_step=2, max_steps=5)
    callback.on_log(None, state, None, logs=_history()[1])
    callback.on_log(None, state, None, logs={"train_runtime": 1.0})  # end-of-training summary: not a step line
    assert len(written) == 1 and written[0].startswith("step 2/5 | reward 0.200")


# ---------------------------------------------------------------------------------------------------- curves


@pytest.mark.parametrize("tracin,rlvcr,rows", [(False, False, 2), (True, True, 3)])
def test_curves_png_has_a_panel_per_metric_group(tmp_path, tracin, rlvcr, rows):
    path = plot_curves(
        _history(tracin=tracin, rlvcr=rlvcr),
        tmp_path / "curves.png",
        eval_results={"before GRPO": {"success_rate": 0.3}, "after GRPO": {"success_rate": 0.6}},
    )
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width = matplotlib.image.imread(path).shape[:2]
    assert width == 11 * 110 and height == round(3.2 * rows * 110)


def test_curves_tolerate_an_empty_history(tmp_path):
    assert plot_curves([], tmp_path / "c.png").stat().st_size > 1000


# ---------------------------------------------------------------------------------------------------- segments


def test_split_segments_round_trips_text_and_marks_errors(tiny_tokenizer):
    ids, mask = completion(
        tiny_tokenizer,
        [
            (tool_call("12 x 3"), True),
            (
                "\n<|im_start|>user\n<tool_response>\n{'error': 'Invalid expression'}\n</tool_response><|im_end|>",
                False,
            ),
            ("<level>2</level>" + tool_call("12 * 3"), True),
        ],
    )
    advantages = [0.5 if m else 0.0 for m in mask]
    segments = split_segments(tiny_tokenizer, ids, mask, advantages)
    assert [s["role"] for s in segments] == ["model", "env", "model"]
    assert "".join(s["text"] for s in segments) == tiny_tokenizer.decode(ids, skip_special_tokens=False)
    assert all(len(s["tokens"]) == len(s["advantages"]) for s in segments)
    info = describe_segments(segments, [True])  # the loop recorded that the call failed
    assert [c["arguments"] for c in info["tool_calls"]] == [{"expression": "12 x 3"}, {"expression": "12 * 3"}]
    assert info["tool_results"] == [{"content": "{'error': 'Invalid expression'}", "error": True}]
    assert info["levels"] == [2] and segments[1]["error"]
    # The flags come from the loop, never from the text: a call that returned the same text did not fail.
    returned = describe_segments(split_segments(tiny_tokenizer, ids, mask, advantages), [False])
    assert returned["tool_results"] == [{"content": "{'error': 'Invalid expression'}", "error": False}]
    printed = describe_segments(
        [{"role": "env", "text": "<tool_response>\nValueError: caught\n</tool_response>"}], [False]
    )
    assert printed["tool_results"] == [{"content": "ValueError: caught", "error": False}]
    # Without a record (TRL's own loop keeps only the failure count) the flag is unknown.
    assert describe_segments(segments)["tool_results"][0]["error"] is None


# ---------------------------------------------------------------------------------------------------- recorder


def _fake_trainer(step=3):
    return SimpleNamespace(
        accelerator=SimpleNamespace(is_main_process=True, process_index=0),
        state=SimpleNamespace(global_step=step),
        reward_weights=torch.tensor([1.0]),
        reward_func_names=["answer_reward"],
        args=SimpleNamespace(negative_sample_reward=-0.5, negative_reward_by_error={"ValueError": -1.0}),
        model=SimpleNamespace(training=True),
    )


def test_recorder_maps_rows_rewards_negatives_and_token_advantages(tiny_tokenizer):
    tok = tiny_tokenizer
    good, good_mask = completion(
        tok,
        [
            (tool_call("12 * 3"), True),
            (
                "\n<|im_start|>user\n<tool_response>\n{'error': 'just a dict'}\n</tool_response><|im_end|>\n"
                "<|im_start|>assistant\n",
                False,
            ),
            ("Answer: 36<|im_end|>", True),
        ],
    )
    bad, bad_mask = completion(
        tok,
        [
            (tool_call("12 x 3"), True),
            ("\n<|im_start|>user\n<tool_response>\n{'error': 'bad'}\n</tool_response><|im_end|>\n", False),
        ],
    )
    wrong, wrong_mask = completion(tok, [("Answer: 35<|im_end|>", True)])
    rows = [good, wrong, bad]
    masks = [good_mask, wrong_mask, bad_mask]
    width = max(len(r) for r in rows)
    pad = tok.pad_token_id

    def padded(values, fill):
        return torch.tensor([v + [fill] * (width - len(v)) for v in values])

    batch = {
        "completion_ids": torch.cat([padded(rows, pad), torch.full((1, width), pad)]),
        "completion_mask": torch.cat(
            [padded([[1] * len(r) for r in rows], 0), torch.zeros(1, width, dtype=torch.long)]
        ),
        "tool_mask": torch.cat([padded(masks, 1), torch.ones(1, width, dtype=torch.long)]),
        "advantages": torch.tensor([0.7, -0.7, -1.2, 0.0]),
        "row_kind": torch.tensor([RowKind.REGULAR, RowKind.REGULAR, RowKind.NEGATIVE, RowKind.PADDING]),
        "group_id": torch.tensor([0, 0, 0, -1]),
    }
    inputs = [{"prompt": [{"role": "user", "content": "What is 12 * 3?"}], "answer": "36"}] * 2
    negative = ExtraRow(
        kind=RowKind.NEGATIVE,
        parent=0,
        prompt_ids=[1],
        completion_ids=bad,
        tool_mask=bad_mask,
        logprobs=None,
        error_types=["ValueError"],
        error_messages=["bad"],
        messages=[
            {"role": "assistant", "content": tool_call("12 x 3")},
            FailedToolMessage(role="tool", name="calculate", content="{'error': 'bad'}"),
        ],
    )
    loop_result = LoopResult(
        [negative],
        [False, False],
        [1, 1],
        LoopStats(),
        [[{"turn": 1, "error_types": ["ValueError"], "errors": ["bad"]}], []],
        tool_failed=[[False], []],  # the first rollout's call returned (printing an error-looking dict)
    )
    recorder = TrajectoryRecorder(tok)
    recorder.record(_fake_trainer(), batch, inputs, torch.tensor([[1.0], [0.0]]), loop_result)
    recorded = recorder.trajectories
    assert [t["kind"] for t in recorded] == ["regular", "regular", "negative"]  # padding row skipped
    first, second, neg = recorded
    assert first["id"] == "s4-r0" and first["step"] == 4 and first["reward"] == 1.0 and first["rollbacks"]
    assert second["reward"] == 0.0 and second["rollbacks"] == []
    assert neg["parent"] == "s4-r0" and neg["error_types"] == ["ValueError"] and neg["reward"] == -1.0
    assert neg["question"] == "What is 12 * 3?"
    # Scalar advantages are spread over every token; environment tokens are their own segments.
    assert first["advantage"] == pytest.approx(0.7)
    assert [s["role"] for s in first["segments"]] == ["model", "env", "model"]
    assert all(a == pytest.approx(0.7) for s in first["segments"] for a in s["advantages"])
    assert first["tool_calls"] == [{"name": "calculate", "arguments": {"expression": "12 * 3"}}]
    assert neg["tool_results"] == [{"content": "{'error': 'bad'}", "error": True}]
    assert first["tool_results"] == [{"content": "{'error': 'just a dict'}", "error": False}]
    assert not any(s.get("error") for s in first["segments"])


def test_recorder_skips_evaluation_batches_and_other_processes(tiny_tokenizer):
    recorder = TrajectoryRecorder(tiny_tokenizer)
    trainer = _fake_trainer()
    trainer.accelerator.is_main_process = False
    recorder.record(trainer, {}, [], None, None)  # returns before reading the batch
    assert recorder.trajectories == []


# ---------------------------------------------------------------------------------------------------- recorder + trainer


class _Script:
    """Scripted generation: in the first call of each step, every other rollout makes a malformed call; every later
    turn (the regenerated ones included) makes the right call, then answers."""

    def __init__(self, tok, trainer):
        self.tok, self.trainer, self.first_call_done = tok, trainer, set()

    def __call__(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        step = self.trainer.state.global_step
        first = step not in self.first_call_done
        self.first_call_done.add(step)
        out = []
        for k, ids in enumerate(prompt_ids):
            if "<tool_response>" in self.tok.decode(ids):
                out.append("Answer: 36<|im_end|>")
            else:
                out.append(tool_call("12 x 3") if first and k % 2 == 0 else tool_call("12 * 3"))
        return [self.tok.encode(s, add_special_tokens=False) for s in out], None


def test_recorder_on_a_real_trainer_with_rollbacks(tiny_model_dir, tiny_tokenizer, tmp_path):
    dataset = Dataset.from_dict(
        {"prompt": [[{"role": "user", "content": "What is 12 * 3? a"}]] * 4, "answer": ["36"] * 4}
    )
    args = AgenticGRPOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        report_to="none",
        seed=0,
        max_steps=2,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=512,
        logging_steps=1,
        save_strategy="no",
        enable_tool_rollback=True,
        save_negative_samples=True,
        max_negative_samples_per_group=2,
        rollback_on_errors=["ValueError"],
    )
    trainer = AgenticGRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=answer_reward,
        args=args,
        train_dataset=dataset,
        environment_factory=CalculatorEnv,
    )
    trainer._generate_single_turn = _Script(tiny_tokenizer, trainer)
    recorder = TrajectoryRecorder(trainer.processing_class).attach(trainer)
    trainer.train()
    assert recorder.errors == []
    kinds = [t["kind"] for t in recorder.trajectories]
    assert kinds.count("regular") == 8 and kinds.count("negative") == 4  # 2 rolled-back rollouts per step
    assert {t["step"] for t in recorder.trajectories} == {1, 2}
    ids = {t["id"] for t in recorder.trajectories}
    negatives = [t for t in recorder.trajectories if t["kind"] == "negative"]
    assert all(n["parent"] in ids and n["error_types"] == ["ValueError"] for n in negatives)
    parents = {n["parent"] for n in negatives}
    assert all(t["rollbacks"] for t in recorder.trajectories if t["id"] in parents)
    regular = [t for t in recorder.trajectories if t["kind"] == "regular"]
    assert all(t["reward"] == 1.0 for t in regular)  # every rollout recovers and answers 36
    log = [e for e in trainer.state.log_history if "rollback/attempts" in e]
    assert sum(e["rollback/attempts"] for e in log) == sum(len(t["rollbacks"]) for t in regular)
    path = recorder.save_jsonl(tmp_path / "trajectories.jsonl")
    assert len(path.read_text().splitlines()) == len(recorder.trajectories)
    json.loads(path.read_text().splitlines()[0])


# ---------------------------------------------------------------------------------------------------- report


class _Collector(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags: list[tuple[str, dict]] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))


def test_report_is_self_contained_and_renders_every_trajectory(tiny_tokenizer, tmp_path):
    trajectories = synthetic_trajectories(tiny_tokenizer)
    eval_results = {
        "before GRPO": {"success_rate": 0.25, "num_problems": 4},
        "after GRPO": {"success_rate": 0.5, "num_problems": 4},
    }
    records = [
        {"question": "q", "answer": "1", "correct": True, "messages": [{"role": "assistant", "content": "Answer: 1"}]}
    ]
    path = write_report(
        tmp_path / "report.html",
        trajectories,
        summary={"stage times": "warmstart 10"},
        eval_results=eval_results,
        eval_records={"before GRPO": records, "after GRPO": records},
        system_prompt="Solve the math problem.",
    )
    text = path.read_text()
    parser = _Collector()
    parser.feed(text)
    articles = [a for tag, a in parser.tags if tag == "article"]
    assert len(articles) == len(trajectories)
    assert {a["data-kind"] for a in articles} == {"regular", "negative", "snapshot"}
    assert sum(a["data-rollbacks"] != "0" for a in articles) == 3  # one rolled-back rollout per step
    # Nothing is loaded from elsewhere: no external script, stylesheet, image or font.
    assert not any(tag in ("link", "img", "iframe") for tag, _ in parser.tags)
    assert not any(tag == "script" and "src" in a for tag, a in parser.tags)
    assert not re.search(r"(src|href)=[\"']?(https?:)?//", text)
    assert "tool call → calculate(expression=&quot;12 * 3&quot;)" in text
    assert "rollback ×1" in text and "negative sample: ValueError" in text and "snapshot segment 1" in text
    assert "level 3" in text
    assert 'href="#s1-r0"' in text  # negative sample links to its rollout
    assert "25.0%" in text and "50.0%" in text  # held-out metrics table
    assert "rgba(46,160,67" in text and "rgba(214,40,40" in text  # positive and negative advantage colours


def test_report_without_trajectories(tmp_path):
    text = write_report(tmp_path / "r.html", []).read_text()
    assert "No training trajectories were recorded." in text


def test_selection_keeps_whole_groups_and_the_interesting_ones():
    trajectories = []
    for step in range(1, 41):
        for r in range(8):
            trajectories.append(
                {
                    "id": f"s{step}-r{r}",
                    "step": step,
                    "group": step,
                    "kind": "regular",
                    "rollbacks": [1] if step == 20 and r == 0 else [],
                }
            )
    chosen = select_trajectories(trajectories, 48)
    assert 40 <= len(chosen) <= 48
    steps = [t["step"] for t in chosen]
    assert all(steps.count(s) == 8 for s in set(steps))  # whole groups
    assert {1, 20, 40} <= set(steps)
    assert steps == sorted(steps)


def test_metric_table_has_one_column_per_logged_step():
    from trl_agentic.reporting import format_metric_table

    history = [
        {"step": 1, "reward": 0.25, "rollback/attempts": 3.0},
        {"step": 1, "train_runtime": 9.0},  # the end-of-training record has no reward: not a column
        {"step": 2, "reward": 0.5},
    ]
    lines = format_metric_table(history, ["rollback/attempts"]).splitlines()
    assert lines[0].split() == ["metric", "step", "1", "step", "2"]
    assert lines[1].split() == ["reward", "0.25", "0.5"]
    assert lines[2].split() == ["rollback/attempts", "3", "n/a"]

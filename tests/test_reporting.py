"""Run outputs: the compact step line, the trajectory recorder, curves.png and report.html (synthetic data, fast)."""

import json
import re
from html.parser import HTMLParser
from types import SimpleNamespace

import matplotlib.image
import pytest
import torch
from datasets import Dataset
from hypothesis import assume, given, settings
from hypothesis import strategies as st
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


# ---------------------------------------------------------------------------------------------------- review fixes


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from transformers import AutoTokenizer

    from trl_agentic.models import resolve_model_path

    return AutoTokenizer.from_pretrained(resolve_model_path("smollm2-135m"))


# Characters of one to four UTF-8 bytes: the tiny tokenizer has one token per byte, so every non-ASCII character is cut
# over several tokens; SmolLM2's byte-level BPE cuts the rarer ones.
_TEXT = st.lists(
    st.sampled_from(list('ab Z1*=.\n{}":<>/_数学é🙂ïç—€𝕏ß日本語') + ["<|im_end|>", " the", "ing"]), max_size=40
).map("".join)


@pytest.mark.parametrize("tokenizer_name", ["tiny_tokenizer", "smollm2_tokenizer"])
@settings(max_examples=60)
@given(text=_TEXT, cuts=st.lists(st.integers(min_value=1, max_value=200), max_size=5))
def test_split_segments_texts_concatenate_to_the_decoded_completion(request, tokenizer_name, text, cuts):
    tokenizer = request.getfixturevalue(tokenizer_name)
    ids = tokenizer.encode(text, add_special_tokens=False)
    assume(ids)
    # The role changes at the cuts, which may fall inside a character.
    mask, role = [], 1
    for k in range(len(ids)):
        role = 1 - role if k in cuts else role
        mask.append(role)
    segments = split_segments(tokenizer, ids, mask, [0.5] * len(ids))
    decoded = tokenizer.decode(ids, skip_special_tokens=False)
    assert "".join(s["text"] for s in segments) == decoded
    assert all(s["text"] == "".join(s["tokens"]) for s in segments)
    assert [len(s["tokens"]) for s in segments] == [len(s["advantages"]) for s in segments]
    assert sum(len(s["tokens"]) for s in segments) == len(ids)
    runs = [m for k, m in enumerate(mask) if k == 0 or mask[k - 1] != m]
    assert [s["role"] for s in segments] == ["model" if m else "env" for m in runs]
    if "\ufffd" not in decoded:
        assert not any("\ufffd" in token for s in segments for token in s["tokens"])


def test_split_segments_keeps_multibyte_tool_arguments(tiny_tokenizer):
    payload = json.dumps({"name": "calculate", "arguments": {"expression": "数学 🙂"}}, ensure_ascii=False)
    ids, mask = completion(tiny_tokenizer, [(f"<tool_call>\n{payload}\n</tool_call><|im_end|>", True)])
    segments = split_segments(tiny_tokenizer, ids, mask, [0.1] * len(ids))
    assert describe_segments(segments)["tool_calls"] == [{"name": "calculate", "arguments": {"expression": "数学 🙂"}}]


class _CountingTokenizer:
    """Counts the tokens handed to `decode`."""

    def __init__(self, tokenizer):
        self.tokenizer, self.decoded = tokenizer, 0

    def decode(self, ids, **kwargs):
        self.decoded += len(ids)
        return self.tokenizer.decode(ids, **kwargs)


def test_split_segments_decodes_each_token_a_bounded_number_of_times(tiny_tokenizer):
    """Linear, not quadratic, in the completion's length: every token is decoded a bounded number of times (here
    a 4-byte character holds back at most 3 pieces; decoding every prefix would pass n * (n + 1) / 2 tokens)."""
    ids = tiny_tokenizer.encode("The answer is 12 * 3 = 36, 数学 🙂. " * 40, add_special_tokens=False)
    counting = _CountingTokenizer(tiny_tokenizer)
    split_segments(counting, ids, [1] * len(ids), [0.0] * len(ids))
    assert counting.decoded <= 12 * len(ids)


def test_recorder_skips_tracin_validation_rollouts(tiny_model_dir, tmp_path):
    from peft import LoraConfig

    args = AgenticGRPOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        report_to="none",
        seed=3,
        max_steps=1,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=10,
        logging_steps=1,
        save_strategy="no",
        tracin_enabled=True,
        tracin_val_num_generations=2,
        tracin_val_batch_size=2,
    )
    trainer = AgenticGRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=lambda completions, **kwargs: [float(len(c)) for c in completions],
        args=args,
        train_dataset=Dataset.from_dict({"prompt": [f"Say something about {i}:" for i in range(8)]}),
        tracin_eval_dataset=Dataset.from_dict({"prompt": [f"HELD-OUT VALIDATION {i}:" for i in range(4)]}),
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"),
    )
    recorder = TrajectoryRecorder(trainer.processing_class).attach(trainer)
    trainer.train()
    assert recorder.errors == []
    assert trainer._tracin.refreshes >= 1  # the validation rollouts did run
    questions = [t["question"] for t in recorder.trajectories]
    assert len(questions) == 4 and all(q.startswith("Say something about") for q in questions)


class _OneCallScript:
    """Scripted generation: a correct call, then the answer (the same for every generation batch)."""

    def __init__(self, tok):
        self.tok = tok

    def __call__(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        out = [
            "Answer: 36<|im_end|>" if "<tool_response>" in self.tok.decode(i) else tool_call("12 * 3")
            for i in prompt_ids
        ]
        return [self.tok.encode(s, add_special_tokens=False) for s in out], None


def test_recorder_ids_are_unique_with_several_generation_batches_per_step(tiny_model_dir, tiny_tokenizer, tmp_path):
    """`steps_per_generation` < `gradient_accumulation_steps`: two generation batches in one optimizer step."""
    prompts = [[{"role": "user", "content": f"What is 12 * 3? ({k})"}] for k in range(8)]
    args = AgenticGRPOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        report_to="none",
        seed=0,
        max_steps=1,
        per_device_train_batch_size=4,
        num_generations=4,
        gradient_accumulation_steps=2,
        steps_per_generation=1,
        max_completion_length=256,
        logging_steps=1,
        save_strategy="no",
        enable_tool_rollback=True,
    )
    trainer = AgenticGRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=answer_reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": prompts, "answer": ["36"] * 8}),
        environment_factory=CalculatorEnv,
    )
    trainer._generate_single_turn = _OneCallScript(tiny_tokenizer)
    recorder = TrajectoryRecorder(trainer.processing_class).attach(trainer)
    trainer.train()
    rows = recorder.trajectories
    assert len(rows) == 8 and len({t["id"] for t in rows}) == 8
    assert [t["id"] for t in rows[:4]] == ["s1-r0", "s1-r1", "s1-r2", "s1-r3"]  # the first batch's ids as before
    questions = {}
    for t in rows:
        questions.setdefault((t["step"], t.get("batch", 0), t["group"]), set()).add(t["question"])
    assert len(questions) == 2 and all(len(q) == 1 for q in questions.values())  # one prompt per group
    text = write_report(tmp_path / "report.html", rows).read_text()
    parser = _Collector()
    parser.feed(text)
    element_ids = [a["id"] for tag, a in parser.tags if tag == "article"]
    assert sorted(element_ids) == sorted(t["id"] for t in rows)


def test_recorder_numbers_the_generation_batches_of_a_step(tiny_tokenizer):
    """Ids, parents and the per-step row budget over two generation batches of the same optimizer step."""
    tok = tiny_tokenizer
    good, good_mask = completion(tok, [("Answer: 36<|im_end|>", True)])
    bad, bad_mask = completion(tok, [(tool_call("12 x 3"), True)])
    width = max(len(good), len(bad))

    def batch():
        ids = [good + [tok.pad_token_id] * (width - len(good)), bad + [tok.pad_token_id] * (width - len(bad))]
        return {
            "completion_ids": torch.tensor(ids),
            "completion_mask": torch.tensor([[1] * len(good) + [0] * (width - len(good)), [1] * len(bad)]),
            "tool_mask": torch.ones(2, width, dtype=torch.long),
            "advantages": torch.tensor([0.5, -1.0]),
            "row_kind": torch.tensor([RowKind.REGULAR, RowKind.NEGATIVE]),
            "group_id": torch.tensor([0, 0]),
        }

    negative = ExtraRow(
        kind=RowKind.NEGATIVE, parent=0, prompt_ids=[1], completion_ids=bad, tool_mask=bad_mask, logprobs=None
    )
    loop_result = LoopResult([negative], [False], [1], LoopStats(), [[]], tool_failed=[[]])
    inputs = [{"prompt": "What is 12 * 3?", "answer": "36"}]
    recorder = TrajectoryRecorder(tok, max_rows_per_step=3)
    trainer = _fake_trainer(step=0)
    for _ in range(3):  # three generation batches for step 1; the third is over the budget of 3 rows
        recorder.record(trainer, batch(), inputs, torch.tensor([[1.0]]), loop_result)
    trainer.state.global_step = 1
    recorder.record(trainer, batch(), inputs, torch.tensor([[1.0]]), loop_result)
    ids = [(t["id"], t["parent"]) for t in recorder.trajectories]
    assert ids == [("s1-r0", None), ("s1-r1", "s1-r0"), ("s1-b1-r0", None), ("s2-r0", None), ("s2-r1", "s2-r0")]
    assert [t["batch"] for t in recorder.trajectories] == [0, 0, 1, 0, 0]


def test_recorder_shows_a_truncated_rollout_masked_by_trl(tiny_tokenizer, tmp_path):
    """`mask_truncated_completions`: TRL zeroes the completion mask (and the tool mask) of a truncated rollout."""
    tok = tiny_tokenizer
    ids = tok.encode("Let me think about 12 * 3 step by step, first 12 * 3 is", add_special_tokens=False)
    width = len(ids) + 3
    answered = ids[:5] + [tok.convert_tokens_to_ids("<|im_end|>")]
    batch = {
        "completion_ids": torch.tensor([ids + [tok.pad_token_id] * 3, answered + [tok.pad_token_id] * (width - 6)]),
        "completion_mask": torch.tensor([[0] * width, [1] * 6 + [0] * (width - 6)]),
        "tool_mask": torch.tensor([[0] * width, [1] * width]),
        "advantages": torch.tensor([-0.5, 0.5]),
        "row_kind": torch.tensor([RowKind.REGULAR, RowKind.REGULAR]),
        "group_id": torch.tensor([0, 0]),
    }
    inputs = [{"prompt": "What is 12 * 3?", "answer": "36"}] * 2
    recorder = TrajectoryRecorder(tok)
    recorder.record(_fake_trainer(), batch, inputs, torch.tensor([[0.0], [1.0]]), None)
    truncated, answered = recorder.trajectories
    assert "".join(s["text"] for s in truncated["segments"]) == tok.decode(ids)
    assert truncated["masked"] and not answered["masked"]
    assert truncated["advantage"] == pytest.approx(-0.5)
    assert "".join(s["text"] for s in answered["segments"]) == tok.decode(ids[:5]) + "<|im_end|>"
    text = write_report(tmp_path / "report.html", [truncated, answered]).read_text()
    assert text.count("truncated, masked (not trained)") == 1


def test_keep_groups_without_group_ids_keeps_the_limit():
    """TRL's own batch (`multi_objective_aggregation='normalize_then_sum'`) has no `group_id`: every row's group is
    None."""
    from trl_agentic.reporting.callbacks import _keep_groups

    rows = [{"group": None, "id": k} for k in range(256)]
    assert [r["id"] for r in _keep_groups(rows, 64)] == list(range(64))


def test_selection_with_groups_bigger_than_the_budget(tmp_path):
    rows = [
        {"id": f"s{s}-r{r}", "step": s, "group": s, "kind": "regular", "rollbacks": [], "segments": []}
        for s in range(1, 4)
        for r in range(16)
    ]
    assert select_trajectories(rows, 10) == rows[:10]  # the first rows of the first group
    text = write_report(tmp_path / "r.html", rows, max_trajectories=10).read_text()
    assert "48 training rows recorded" in text and "10 shown" in text
    assert "No training trajectories were recorded." not in text
    assert text.count("<article") == 10


def test_curves_title_with_dollar_signs(tmp_path):
    path = plot_curves(_history(2), tmp_path / "curves.png", title="outputs/run_$5_^$")
    assert matplotlib.image.imread(path).shape[0] > 0


class _TruncatingScript:
    """Scripted generation: a correct call, then an answer that runs past the length budget (no end of turn)."""

    def __init__(self, tok):
        self.tok = tok

    def __call__(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        out = [
            "The answer is 36 " * 20 if "<tool_response>" in self.tok.decode(i) else tool_call("12 * 3")
            for i in prompt_ids
        ]
        return [self.tok.encode(s, add_special_tokens=False) for s in out], None


@pytest.mark.parametrize("rollback", [True, False])  # trl-agentic's rollout loop, TRL's own
def test_recorder_keeps_the_turns_of_a_truncated_rollout_on_a_real_trainer(
    tiny_model_dir, tiny_tokenizer, tmp_path, rollback
):
    """TRL zeroes the tool mask too: the recorder takes the turns from the tool loop."""
    args = AgenticGRPOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        report_to="none",
        max_steps=1,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=200,
        mask_truncated_completions=True,
        logging_steps=1,
        save_strategy="no",
        enable_tool_rollback=rollback,
    )
    trainer = AgenticGRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=answer_reward,
        args=args,
        train_dataset=Dataset.from_dict(
            {"prompt": [[{"role": "user", "content": "What is 12 * 3?"}]] * 4, "answer": ["36"] * 4}
        ),
        environment_factory=CalculatorEnv,
    )
    trainer._generate_single_turn = _TruncatingScript(tiny_tokenizer)
    recorder = TrajectoryRecorder(trainer.processing_class).attach(trainer)
    trainer.train()
    assert recorder.errors == [] and len(recorder.trajectories) == 4
    for t in recorder.trajectories:
        assert t["masked"]
        assert [s["role"] for s in t["segments"]] == ["model", "env", "model"]
        assert t["tool_results"][0]["content"] == "36"
        assert t["segments"][2]["text"].startswith("The answer is 36")


def test_recorder_flags_a_rollout_lost_to_infrastructure(tiny_model_dir, tiny_tokenizer, tmp_path):
    """A lost rollout is not trained (`counted_row` False, its tool mask zeroed by the batch): it is flagged, its
    turns come from the loop's masks (not all environment text) and it is not coloured."""
    from test_row_count import DownOnceEnv, Script, reward

    DownOnceEnv.remaining = 1
    args = AgenticGRPOConfig(
        output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", seed=0, per_device_train_batch_size=4,
        num_generations=4, max_completion_length=256, save_strategy="no", max_tool_output_chars=1000,
        max_infra_retries=0,
    )  # fmt: skip
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": "task 0"}]] * 4})
    trainer = AgenticGRPOTrainer(
        model=tiny_model_dir, reward_funcs=reward, args=args, train_dataset=dataset, environment_factory=DownOnceEnv
    )
    trainer._generate_single_turn = Script(tiny_tokenizer)
    recorder = TrajectoryRecorder(trainer.processing_class).attach(trainer)
    trainer.model.train()
    trainer._generate_and_score_completions([dict(dataset[i]) for i in range(4)])
    lost = trainer._last_loop_result.infra_failed.index(True)
    assert recorder.errors == [] and len(recorder.trajectories) == 4
    assert [t["not_trained"] for t in recorder.trajectories] == [r == lost for r in range(4)]
    row = recorder.trajectories[lost]
    assert not row["masked"] and row["kind"] == "regular"
    # Its badge says "no reward", and no reward is shown beside it (the reward function scored it all the same).
    assert row["reward"] is None and any(v is not None for v in row["rewards"].values())
    assert all(t["reward"] is not None for t in recorder.trajectories if t is not row)
    # The rollout ends at the lost call: one model turn (with the zeroed tool mask it read as environment text).
    assert [s["role"] for s in row["segments"]] == ["model"] and '"work"' in row["segments"][0]["text"]
    text = write_report(tmp_path / "report.html", recorder.trajectories).read_text()
    assert text.count(">not trained</span>") == 1
    # Its tokens get no gradient: not coloured, whatever advantage the row holds (a lost row's is 0 here).
    segment = {**row["segments"][0], "advantages": [1.0] * len(row["segments"][0]["tokens"])}
    for flag, coloured in ((True, False), (False, True)):
        shown = {**row, "not_trained": flag, "segments": [segment]}
        text = write_report(tmp_path / "one.html", [shown, {**shown, "id": "other", "not_trained": True}]).read_text()
        article = text[text.index(f'id="{row["id"]}"') :]
        assert ("rgba(" in article[: article.index("</article>")]) == coloured


def test_recorder_shows_the_turns_of_an_untrained_snapshot_segment(tiny_tokenizer):
    """An earlier segment of an episode whose last segment is not trained: its tool mask is zeroed in the batch; the
    recorder flags it and shows its turns from the loop's segment (`ExtraRow.tool_mask`)."""
    tok = tiny_tokenizer
    last, last_mask = completion(tok, [(tool_call("2 + 2"), True)])
    first, first_mask = completion(tok, [(tool_call("1 + 1"), True), ("<tool_response>\n2\n</tool_response>", False)])
    width = max(len(last), len(first))
    pad = tok.pad_token_id
    batch = {
        "completion_ids": torch.tensor([last + [pad] * (width - len(last)), first + [pad] * (width - len(first))]),
        "completion_mask": torch.tensor([[1] * len(last) + [0] * (width - len(last)), [1] * len(first) + [0] * (width - len(first))]),
        "tool_mask": torch.zeros(2, width, dtype=torch.long),
        "advantages": torch.tensor([0.0, 0.0]),
        "row_kind": torch.tensor([RowKind.REGULAR, RowKind.SNAPSHOT]),
        "group_id": torch.tensor([0, 0]),
        "counted_row": torch.tensor([False, False]),
    }  # fmt: skip
    segment = ExtraRow(
        kind=RowKind.SNAPSHOT, parent=0, prompt_ids=[1], completion_ids=first, tool_mask=first_mask, logprobs=None,
        segment_index=0,
    )  # fmt: skip
    loop_result = LoopResult([segment], [True], [2], LoopStats(), [[]], tool_failed=[[]])
    recorder = TrajectoryRecorder(tok)
    recorder.record(_fake_trainer(), batch, [{"prompt": "task", "answer": None}], torch.tensor([[float("nan")]]),
                    loop_result, tool_masks=[last_mask])  # fmt: skip
    lost, snapshot = recorder.trajectories
    assert lost["not_trained"] and snapshot["not_trained"] and snapshot["kind"] == "snapshot"
    assert [s["role"] for s in lost["segments"]] == ["model"]
    assert [s["role"] for s in snapshot["segments"]] == ["model", "env"]
    assert snapshot["tool_results"][0]["content"] == "2"


def test_evaluation_samples_with_content_blocks_render(tmp_path):
    """A tool may return content blocks (TRL passes a list on as the message's content): the report crashed on them
    (`str + list`)."""
    records = [
        {
            "question": "q",
            "answer": "1",
            "correct": False,
            "messages": [
                {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": {}}}]},
                {"role": "tool", "content": [{"type": "text", "text": "block <one>"}, {"type": "image"}]},
            ],
        }
    ]
    text = write_report(tmp_path / "report.html", [], eval_records={"before": records}).read_text()
    assert "[tool] block &lt;one&gt;[image]" in text and "tool call → f({})" in text

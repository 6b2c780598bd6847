"""`trl-agentic train` chooses the asynchronous trainer from the YAML config; bad values fail before a model loads."""

from pathlib import Path

import pytest

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "async_calculator.yaml"


def _forbid_model_loading(monkeypatch):
    import transformers

    import trl_agentic.models

    def forbidden(*args, **kwargs):
        raise AssertionError("a model was loaded while parsing the config")

    monkeypatch.setattr(trl_agentic.models, "resolve_model_path", forbidden)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", forbidden)


def test_yaml_selects_the_async_trainer_and_its_config(monkeypatch):
    from trl_agentic.async_grpo import AsyncAgenticGRPOConfig
    from trl_agentic.cli import make_parser, trainer_kind

    _forbid_model_loading(monkeypatch)
    argv = ["--config", str(CONFIG)]
    assert trainer_kind(argv) == "async_grpo"
    task_args, training_args, model_args, choice = make_parser("async_grpo").parse_args_and_config(args=argv)
    assert isinstance(training_args, AsyncAgenticGRPOConfig) and choice.trainer == "async_grpo"
    assert training_args.enable_tool_rollback and training_args.vllm_server_start
    assert trainer_kind([*argv, "--trainer", "grpo"]) == "grpo"  # the command line overrides the YAML
    assert trainer_kind(["--output_dir", "x"]) == "grpo"  # the default


def test_unknown_trainer_fails_naming_the_field(monkeypatch):
    from trl_agentic.cli import main

    _forbid_model_loading(monkeypatch)
    with pytest.raises((ValueError, SystemExit)) as error:
        main(["train", "--config", str(CONFIG), "--trainer", "sync_grpo"])
    assert "trainer" in str(error.value) or error.value.code == 2


def test_bad_feature_field_fails_in_the_async_parser(monkeypatch):
    from trl_agentic.cli import main

    _forbid_model_loading(monkeypatch)
    with pytest.raises(ValueError, match="`max_negative_samples_per_group`"):
        main(["train", "--config", str(CONFIG), "--max_negative_samples_per_group", "-1"])
    with pytest.raises(ValueError, match="`tool_timeout`"):
        main(["train", "--config", str(CONFIG), "--tool_timeout", "5"])
    # Fields of the synchronous config the asynchronous trainer cannot honour are refused, not silently ignored.
    with pytest.raises(ValueError, match="`max_turn_tokens`"):  # supported, and validated as in the synchronous one
        main(["train", "--config", str(CONFIG), "--max_turn_tokens", "0"])
    with pytest.raises(ValueError, match="`row_selection` is not supported"):
        main(["train", "--config", str(CONFIG), "--row_selection", "random"])


def test_a_warm_start_needs_the_server_this_run_starts(monkeypatch):
    from trl_agentic.cli import main

    _forbid_model_loading(monkeypatch)
    with pytest.raises(
        ValueError, match="`warmstart_steps` with `trainer: async_grpo` needs `vllm_server_start: true`"
    ):
        main(["train", "--config", str(CONFIG), "--warmstart_steps", "4", "--vllm_server_start", "false"])


def test_a_warm_start_is_merged_into_the_folder_the_server_serves_and_the_trainer_loads(
    tiny_model_dir, tmp_path, monkeypatch
):
    """`trainer: async_grpo` with `warmstart_steps`: the SFT warm start runs, its adapter is merged into
    `output_dir/warmstart-merged`, and both the vLLM server and the asynchronous trainer get that folder, whose
    model computes the warm-started policy's logits (not the base model's). Server and trainer are recorders here;
    the vLLM tier runs them for real."""
    import torch
    from transformers import AutoModelForCausalLM

    import trl_agentic.async_grpo as async_grpo
    import trl_agentic.async_grpo.server as server_module
    import trl_agentic.warmstart as warmstart
    from trl_agentic.cli import main

    seen = {}
    ids = torch.tensor([[5, 17, 42, 9, 100, 3]])

    class Server:
        def __init__(self, model, **kwargs):
            seen["served"], seen["dtype"], self.log_path = model, kwargs.get("dtype"), kwargs.get("log_path")

        def start(self):
            self.url = "http://127.0.0.1:1"
            return self

        def stop(self):
            seen["stopped"] = True

    class Trainer:
        def __init__(self, model, **kwargs):
            seen["trained"] = model

        def train(self, resume_from_checkpoint=None):
            pass

        def save_model(self, output_dir):
            pass

    def recording_warm_start(*args, **kwargs):
        result = run(*args, **kwargs)
        with torch.no_grad():
            seen["warm_logits"] = result.model(ids).logits
        return result

    run = warmstart.run_task_warmstart
    monkeypatch.setattr(warmstart, "run_task_warmstart", recording_warm_start)
    monkeypatch.setattr(server_module, "VLLMServer", Server)
    monkeypatch.setattr(async_grpo, "AsyncAgenticGRPOTrainer", Trainer)
    out = tmp_path / "out"
    argv = ["train", "--config", str(CONFIG), "--model_name_or_path", str(tiny_model_dir), "--output_dir", str(out)]
    argv += ["--warmstart_steps", "2", "--warmstart_batch_size", "2", "--warmstart_learning_rate", "0.01"]
    argv += ["--disable_tqdm", "true"]
    assert main(argv) == 0
    folder = str(out / "warmstart-merged")
    assert seen["served"] == seen["trained"] == folder and seen["stopped"]
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)(ids).logits
        base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)(ids).logits
    torch.testing.assert_close(merged, seen["warm_logits"], atol=1e-5, rtol=1e-5)
    assert (merged - base).abs().max() > 1e-3  # the adapter is in the merged weights
    # A plain model folder, what vLLM serves: merged weights, no adapter (transformers would load one too), the chat
    # template kept, and served at the trainer's dtype.
    saved = {p.name for p in (out / "warmstart-merged").iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer_config.json",
    } <= saved and "adapter_config.json" not in saved
    from transformers import AutoTokenizer

    template = AutoTokenizer.from_pretrained(folder).chat_template
    assert template and template == AutoTokenizer.from_pretrained(str(tiny_model_dir)).chat_template
    assert seen["dtype"] == "float32"
    # A resumed run reuses the folder (its checkpoint's adapter was trained on those weights), no warm start again.
    seen.clear()
    monkeypatch.setattr(warmstart, "run_task_warmstart", lambda *a, **k: pytest.fail("warm-started again"))
    assert main([*argv, "--resume_from_checkpoint", str(out / "checkpoint-1")]) == 0
    assert seen["served"] == seen["trained"] == folder
    # Without it, a resumed run is refused before a model loads.
    _forbid_model_loading(monkeypatch)
    with pytest.raises(ValueError, match="warmstart-merged is missing"):
        main([*argv, "--output_dir", str(tmp_path / "other"), "--resume_from_checkpoint", "x"])


def test_tracin_takes_trls_default_gradient_checkpointing():
    """TracIn with `AsyncGRPOConfig`'s default `gradient_checkpointing=True` (it was refused; the filter's passes now
    run checkpointed, `tests/test_async_tracin.py::test_scores_and_v_under_gradient_checkpointing`)."""
    from trl_agentic.async_grpo import AsyncAgenticGRPOConfig

    config = AsyncAgenticGRPOConfig(output_dir="x", tracin_enabled=True, use_cpu=True, bf16=False)
    assert config.tracin_enabled and config.gradient_checkpointing


def test_a_reward_function_taking_environments_is_refused_before_a_model_loads(monkeypatch, tmp_path):
    """TRL's asynchronous worker never passes `environments` to reward functions: such a function would only fail in
    the worker process, after the model and the server started. The trainer refuses it first, naming it."""
    from trl_agentic.async_grpo import AsyncAgenticGRPOConfig, AsyncAgenticGRPOTrainer
    from trl_agentic.envs.calculator import ToolBonusCalculatorEnv, answer_reward, tool_use_reward

    _forbid_model_loading(monkeypatch)
    args = AsyncAgenticGRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, enable_tool_rollback=True)
    with pytest.raises(ValueError, match="`tool_use_reward` takes `environments`"):
        AsyncAgenticGRPOTrainer(
            "some/model",
            reward_funcs=[answer_reward, tool_use_reward],
            args=args,
            environment_factory=ToolBonusCalculatorEnv,
        )


def test_tool_bonus_environment_rewards_what_tool_use_reward_does():
    """`ToolBonusCalculatorEnv.get_reward` (the asynchronous trainer's way) gives `tool_use_reward`'s bonus: 0.1 when
    the last successful call returned the row's answer (5 here, compared as `answer_reward` compares; failed calls
    change nothing), 0 with no call, only failed calls, or a last successful call that returned something else (a
    useless `0` or `1+1`, a wrong guess after a right one)."""
    from trl_agentic.envs.calculator import ToolBonusCalculatorEnv, tool_use_reward

    cases = {
        (): 0.0,
        ("1/0",): 0.0,
        ("1/0", "2+3"): 0.1,
        ("2+3", "1/0"): 0.1,
        ("10/2",): 0.1,
        ("7*6",): 0.0,
        ("0",): 0.0,
        ("1+1", "0"): 0.0,
        ("2+3", "1+1"): 0.0,
        ("4", "5", "6"): 0.0,
        ("4", "6", "5", "1/0"): 0.1,
    }
    envs = []
    for calls in cases:
        env = ToolBonusCalculatorEnv()
        env.reset(question="q", answer="5")
        for expression in calls:
            try:
                env.calculate(expression)
            except Exception:
                pass
        envs.append(env)
    assert [env.get_reward() for env in envs] == list(cases.values())
    assert tool_use_reward([[]] * len(envs), environments=envs) == list(cases.values())


def test_loop_fields_the_asynchronous_trainer_supports_are_accepted(tmp_path):
    """`max_turn_tokens`, `malformed_tool_call_feedback`, `max_tool_output_chars` (the shared rollout loop's) and
    `mask_truncated_completions` (ours: TRL's asynchronous config has none) make a valid config, which routes the
    rollouts through trl-agentic's loop."""
    from trl_agentic.async_grpo import AsyncAgenticGRPOConfig

    args = AsyncAgenticGRPOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        max_turn_tokens=32,
        malformed_tool_call_feedback=True,
        max_tool_output_chars=64,
        mask_truncated_completions=True,
    )
    assert args.uses_agentic_loop and args.mask_truncated_completions
    assert not AsyncAgenticGRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False).mask_truncated_completions


def test_the_warm_start_config_parses_as_an_async_run_with_its_server(monkeypatch):
    """configs/async_calculator_warmstart.yaml (the run in docs/async.md where rollback fires on the embedded model):
    the asynchronous trainer, a warm start, the server started by the run, rollback and negatives on."""
    from trl_agentic.cli import make_parser, trainer_kind

    _forbid_model_loading(monkeypatch)
    argv = ["--config", str(CONFIG.with_name("async_calculator_warmstart.yaml"))]
    assert trainer_kind(argv) == "async_grpo"
    task_args, training_args, model_args, _ = make_parser("async_grpo").parse_args_and_config(args=argv)
    assert task_args.warmstart_steps > 0 and training_args.vllm_server_start
    assert training_args.enable_tool_rollback and training_args.save_negative_samples
    assert training_args.use_cpu and not training_args.bf16 and model_args.model_name_or_path == "smollm2-135m"


@pytest.mark.parametrize(
    "async_name, sync_name, feature",
    [
        ("async_snapshots_logsearch.yaml", "snapshots_logsearch.yaml", "enable_context_snapshots"),
        ("async_rlvcr_textworld.yaml", "rlvcr_textworld.yaml", "advantage_estimator"),
    ],
)
def test_async_feature_configs_warm_start_as_their_synchronous_twins(monkeypatch, async_name, sync_name, feature):
    """configs/async_snapshots_logsearch.yaml and configs/async_rlvcr_textworld.yaml (the runs in docs/async.md where
    snapshots, TracIn and RLVCR fire on a warm-started model): the same task, warm start and feature settings as the
    synchronous configs whose live runs docs/snapshots.md and docs/rlvcr.md record, so stage 1 teaches the same format;
    the asynchronous trainer, its server started by the run, and TracIn with gradient checkpointing off (as the
    recorded run was)."""
    import dataclasses

    from trl_agentic.cli import make_parser, trainer_kind

    _forbid_model_loading(monkeypatch)
    argv = ["--config", str(CONFIG.with_name(async_name))]
    assert trainer_kind(argv) == "async_grpo"
    task_a, train_a, model_a, _ = make_parser("async_grpo").parse_args_and_config(args=argv)
    sync_argv = ["--config", str(CONFIG.with_name(sync_name))]
    task_s, train_s, model_s, _ = make_parser("grpo").parse_args_and_config(args=sync_argv)
    assert task_a.warmstart_steps > 0 and train_a.vllm_server_start
    assert train_a.use_cpu and not train_a.bf16 and train_a.report_to == [] and train_a.save_strategy == "no"
    assert train_a.output_dir.startswith("outputs/")
    assert dataclasses.asdict(task_a) == dataclasses.asdict(task_s)
    assert model_a.model_name_or_path == model_s.model_name_or_path and model_a.lora_r == model_s.lora_r
    assert model_a.lora_target_modules == model_s.lora_target_modules
    prefixes = ("snapshot", "max_snapshots", "context_stub", "enable_context", "rlvcr_", "advantage_estimator")
    shared = [f.name for f in dataclasses.fields(train_s) if f.name.startswith(prefixes)]
    assert {n: getattr(train_a, n) for n in shared} == {n: getattr(train_s, n) for n in shared}
    assert getattr(train_a, feature) not in (False, "grpo")
    for name in ("max_completion_length", "max_tool_calling_iterations", "num_generations", "temperature"):
        assert getattr(train_a, name) == getattr(train_s, name), name
    assert str(train_a.dtype).removeprefix("torch.") == model_s.dtype == "float32"  # the server's dtype too
    if train_a.enable_context_snapshots:
        assert train_a.tracin_enabled and not train_a.gradient_checkpointing


def test_the_recorded_live_steps_are_what_docs_async_says():
    """docs/async.md quotes the first step of the two live runs ("Snapshots, TracIn and RLVCR after a warm start"); the
    numbers must be the logged metrics kept in docs/bench-data/async-live-2026-11-29.json."""
    import json

    repo = CONFIG.parents[1]
    runs = json.loads((repo / "docs" / "bench-data" / "async-live-2026-11-29.json").read_text())["runs"]
    doc = " ".join((repo / "docs" / "async.md").read_text().split())
    snap = runs["async_snapshots_logsearch"]["steps"][0]
    rlvcr = runs["async_rlvcr_textworld"]["steps"][0]
    assert "loss 1.369 -> 0.076" in runs["async_snapshots_logsearch"]["warm_start"]
    assert "loss 0.801 -> 0.105" in runs["async_rlvcr_textworld"]["warm_start"]
    assert (float(snap["snapshots/closed_total"]), float(snap["snapshots/rows_total"])) == (32, 31)
    assert (float(snap["groups/rows_total"]), float(snap["context/tokens_freed_total"])) == (87, 2135)
    assert float(snap["tracin/val_grad_norm"]) == 0 and float(snap["tracin/selected_ratio"]) == 0.25
    assert float(snap["reward"]) == 0 and float(snap["rows/snapshot_frac"]) == 0
    assert float(snap["tools/call_frequency"]) == 1.5 and float(snap["completions/clipped_ratio"]) == 0.35
    assert float(rlvcr["rlvcr/expanded_steps"]) == 7 and float(rlvcr["rlvcr/confidence_mean"]) == 0.4981
    assert float(rlvcr["rlvcr/invalid_format"]) == 2.5 and float(rlvcr["rlvcr/failed_alternatives"]) == 0
    assert [round(float(rlvcr[f"rlvcr/level_frac_{k}"]), 3) for k in (1, 2, 3, 4)] == [0.375, 0.417, 0.0, 0.208]
    assert float(rlvcr["reward"]) == 0 and float(rlvcr["perf/rollout_wait_s"]) == 1309
    for quoted in (
        "32 segments closed by `delete_context` (2135 context tokens freed), 31 snapshot rows pushed into the queue of 87",
        "`tracin/selected_ratio` 0.25",
        "`rlvcr/expanded_steps` 7",
        "`rlvcr/confidence_mean` 0.498",
        "1: 0.375, 2: 0.417, 3: 0, 4: 0.208",
        "`perf/rollout_wait_s`, 1309 s",
    ):
        assert quoted in doc, quoted


def test_the_recorded_tracin_step_is_what_docs_async_says():
    """docs/async.md quotes step 1 of the asynchronous TracIn run with a non-zero V ("TracIn with a validation direction
    that is not zero"); the numbers must be the logged metrics kept in docs/bench-data."""
    import json

    repo = CONFIG.parents[1]
    data = json.loads((repo / "docs" / "bench-data" / "async-live-tracin-2026-11-29.json").read_text())
    (step,) = data["runs"]["async_tracin_calculator"]["steps"]
    doc = " ".join((repo / "docs" / "async.md").read_text().split())
    assert float(step["tracin/val_grad_norm"]) == 0.1394 and float(step["tracin/val_reward"]) == 0.875
    assert float(step["tracin/score_pos_frac"]) == 1 and float(step["tracin/selected_ratio"]) == 1
    assert float(step["tracin/score_mean"]) == 0.003589 and float(step["tracin/num_selected"]) == 8
    assert float(step["reward"]) == 0.75 and float(step["loss"]) == -0.1802
    assert (float(step["perf/fwd_bwd_s"]), float(step["perf/fwd_s"]), float(step["perf/rollout_wait_s"])) == (
        60.26,
        21.37,
        101.2,
    )
    for quoted in (
        "`tracin/val_grad_norm` 0.1394",
        "`tracin/score_pos_frac` 1, `tracin/score_mean` 0.003589",
        "`tracin/selected_ratio` 1",
        "training reward 0.75, loss −0.1802",
        "`perf/fwd_bwd_s` 60, `perf/fwd_s` 21, `perf/rollout_wait_s` 101",
    ):
        assert quoted in doc, quoted

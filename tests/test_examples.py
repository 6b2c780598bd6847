"""The examples in examples/ and their configs in configs/.

Fast: every script's YAML goes through the script's *own* argument parsing (the script runs as `__main__` until its
`TrlParser` has parsed, then stops) into valid configs, without loading a model; the DeepSpeed launch script makes the
CPU copy of the ZeRO-2 config that docs/distributed.md describes. Slow: each example added for issue 10 trains one
step end to end on the tiny test model and logs its feature's metrics.
"""

import importlib.util
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import trl
import yaml

from trl_agentic.cli import make_parser as cli_parser

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
CONFIGS = REPO / "configs"

# Every Python example, its config, and what the config must switch on (checked on the parsed configs).
PYTHON_EXAMPLES = {
    "quickstart.py": ("quickstart.yaml", {"enable_tool_rollback": True, "save_negative_samples": True}),
    "rlvcr_textworld.py": ("rlvcr_textworld_step.yaml", {"advantage_estimator": "rlvcr"}),
    "tracin_filtered.py": ("tracin.yaml", {"tracin_enabled": True, "use_peft": True}),
    "tool_rollback.py": (
        "tool_rollback.yaml",
        {"task": "python", "enable_tool_rollback": True, "save_negative_samples": True, "rollback_feedback": "hint"},
    ),
    "context_snapshots.py": ("context_snapshots.yaml", {"enable_context_snapshots": True, "task": "calculator"}),
    "bfcl.py": ("bfcl.yaml", {"task": "bfcl", "enable_tool_rollback": True, "save_negative_samples": True}),
    "async_agentic.py": (
        "async_calculator.yaml",
        {
            "trainer": "async_grpo",
            "enable_tool_rollback": True,
            "save_negative_samples": True,
            "vllm_server_start": True,
        },
    ),
}
# Examples whose argument classes are the CLI's: `trl-agentic train --config <their config>` must parse as well.
CLI_COMPATIBLE = ("quickstart.py", "tracin_filtered.py", "tool_rollback.py", "context_snapshots.py", "bfcl.py")


class _Parsed(Exception):
    def __init__(self, configs):
        super().__init__("parsed")
        self.configs = configs


def _forbid_model_loading(monkeypatch):
    import transformers

    import trl_agentic.models

    def forbidden(*args, **kwargs):
        raise AssertionError("a model was loaded while parsing the config")

    monkeypatch.setattr(trl_agentic.models, "resolve_model_path", forbidden)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", forbidden)


def parse_with_script(monkeypatch, script: str, *args: str) -> tuple:
    """Run `examples/<script>` as `__main__` until its `TrlParser` has parsed `--config ...`; return the configs."""

    class StopAfterParsing(trl.TrlParser):
        def parse_args_and_config(self, *a, **kw):
            raise _Parsed(super().parse_args_and_config(*a, **kw))

    monkeypatch.setattr(trl, "TrlParser", StopAfterParsing)
    _forbid_model_loading(monkeypatch)
    path = EXAMPLES / script
    monkeypatch.setattr(sys, "argv", [str(path), *args])
    with pytest.raises(_Parsed) as parsed:
        runpy.run_path(str(path), run_name="__main__")
    return parsed.value.configs


def test_every_example_is_covered():
    scripts = {p.name for p in EXAMPLES.iterdir() if p.suffix in (".py", ".sh")}
    assert scripts == {*PYTHON_EXAMPLES, "deepspeed_launch.sh"}
    for config, _ in PYTHON_EXAMPLES.values():
        assert (CONFIGS / config).is_file(), config


@pytest.mark.parametrize("script", sorted(PYTHON_EXAMPLES))
def test_config_parses_with_the_scripts_parser(monkeypatch, script):
    config, expected = PYTHON_EXAMPLES[script]
    configs = parse_with_script(monkeypatch, script, "--config", str(CONFIGS / config))
    values = {name: getattr(c, name) for c in configs for name in expected if hasattr(c, name)}
    assert values == expected
    # Runnable on CPU with the embedded model, offline, and no checkpoints: the configs are demos.
    training_args, model_args = configs[1], configs[2]
    assert training_args.use_cpu and not training_args.bf16
    assert training_args.report_to == [] and training_args.save_strategy == "no"
    assert model_args.model_name_or_path == "smollm2-135m"
    assert training_args.output_dir.startswith("outputs/")


@pytest.mark.parametrize("script", CLI_COMPATIBLE)
def test_config_also_parses_with_the_cli(monkeypatch, script):
    _forbid_model_loading(monkeypatch)
    config, expected = PYTHON_EXAMPLES[script]
    configs = cli_parser().parse_args_and_config(args=["--config", str(CONFIGS / config)])
    assert {name: getattr(c, name) for c in configs for name in expected if hasattr(c, name)} == expected


def test_command_line_overrides_the_config(monkeypatch):
    task_args, training_args, model_args = parse_with_script(
        monkeypatch,
        "tool_rollback.py",
        "--config",
        str(CONFIGS / "tool_rollback.yaml"),
        "--max_steps",
        "1",
        "--model_name_or_path",
        "/some/model",
        "--warmstart_steps",
        "0",
    )
    assert training_args.max_steps == 1 and model_args.model_name_or_path == "/some/model"
    assert task_args.warmstart_steps == 0 and training_args.enable_tool_rollback


def test_bad_override_fails_in_the_parser(monkeypatch):
    with pytest.raises(ValueError, match="`max_negative_samples_per_group`"):
        parse_with_script(
            monkeypatch,
            "tool_rollback.py",
            "--config",
            str(CONFIGS / "tool_rollback.yaml"),
            "--max_negative_samples_per_group",
            "-1",
        )


def _launch_script(tmp_path, *args, **env):
    return subprocess.run(
        ["bash", str(EXAMPLES / "deepspeed_launch.sh"), *args],
        cwd=REPO,
        env={**os.environ, "DRY_RUN": "1", "CPU_CONFIG": str(tmp_path / "zero2_cpu.yaml"), **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_deepspeed_launch_script_cpu(tmp_path):
    result = _launch_script(tmp_path, "cpu", "--max_steps", "1")
    assert result.returncode == 0, result.stderr
    command = result.stdout.strip().splitlines()[-1]
    assert command == (
        f"+ accelerate launch --config_file {tmp_path / 'zero2_cpu.yaml'} -m trl_agentic train "
        "--config configs/tool_rollback.yaml --max_steps 1"
    )
    # docs/distributed.md: a copy of the shipped config with three values changed, and no `--cpu` flag.
    shipped = yaml.safe_load((CONFIGS / "accelerate" / "zero2.yaml").read_text())
    copy = yaml.safe_load((tmp_path / "zero2_cpu.yaml").read_text())
    assert copy == {**shipped, "use_cpu": True, "num_processes": 2, "mixed_precision": "no"}
    assert copy["distributed_type"] == "DEEPSPEED" and copy["deepspeed_config"]["zero_stage"] == 2
    # The training config it launches parses with the CLI (the one `-m trl_agentic train` uses) and runs on CPU.
    _, training_args, _ = cli_parser().parse_args_and_config(args=["--config", str(CONFIGS / "tool_rollback.yaml")])
    assert training_args.use_cpu


def test_deepspeed_launch_script_gpu(tmp_path):
    result = _launch_script(tmp_path, "gpu", "--max_steps", "2", NUM_GPUS="4")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == (
        "+ accelerate launch --config_file configs/accelerate/zero2.yaml --num_processes 4 -m trl_agentic train "
        "--config configs/tool_rollback.yaml --use_cpu false --bf16 true --max_steps 2"
    )
    assert _launch_script(tmp_path, "tpu").returncode == 2


class _Reached(Exception):
    def __init__(self, kwargs):
        super().__init__("reached")
        self.kwargs = kwargs


@pytest.mark.parametrize("bf16", ["true", "false"])
def test_quickstart_warm_starts_with_the_configs_precision(tiny_model_dir, monkeypatch, bf16):
    """The quickstart's warm start ran with `run_task_warmstart`'s defaults (`use_cpu=True`, `bf16=False`) whatever
    the config said; the CLI passes both."""
    import trl_agentic.models
    import trl_agentic.warmstart

    def warm_start(*args, **kwargs):
        raise _Reached(kwargs)

    monkeypatch.setattr(trl_agentic.models, "resolve_model_path", lambda name: tiny_model_dir)
    monkeypatch.setattr(trl_agentic.warmstart, "run_task_warmstart", warm_start)
    monkeypatch.setattr(sys, "argv", ["quickstart.py", "--config", str(CONFIGS / "quickstart.yaml"), "--bf16", bf16])
    with pytest.raises(_Reached) as reached:
        runpy.run_path(str(EXAMPLES / "quickstart.py"), run_name="__main__")
    assert (reached.value.kwargs["use_cpu"], reached.value.kwargs["bf16"]) == (True, bf16 == "true")


def test_quickstart_without_a_warm_start_trains_a_new_adapter(tiny_model_dir, tmp_path, monkeypatch):
    """`--warmstart_steps 0` (TaskArguments: "0 skips it") warm-started anyway and failed with a bare StopIteration.
    Now GRPO gets the base model and the config's LoRA, as `trl-agentic train` does."""
    import trl_agentic
    import trl_agentic.evaluation
    import trl_agentic.models
    import trl_agentic.warmstart

    def trainer(*args, **kwargs):
        raise _Reached(kwargs)

    def evaluate_policy(model, tokenizer, rows, **kwargs):
        return trl_agentic.evaluation.EvalResult(trl_agentic.evaluation.summarize([]), [])

    monkeypatch.setattr(trl_agentic.models, "resolve_model_path", lambda name: tiny_model_dir)
    monkeypatch.setattr(trl_agentic.warmstart, "run_task_warmstart", lambda *a, **k: pytest.fail("warm-started"))
    monkeypatch.setattr(trl_agentic.evaluation, "evaluate_policy", evaluate_policy)
    monkeypatch.setattr(trl_agentic, "AgenticGRPOTrainer", trainer)
    argv = ["--config", str(CONFIGS / "quickstart.yaml"), "--warmstart_steps", "0", "--output_dir", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", ["quickstart.py", *argv])
    with pytest.raises(_Reached) as reached:
        runpy.run_path(str(EXAMPLES / "quickstart.py"), run_name="__main__")
    from peft import LoraConfig, PeftModel

    kwargs = reached.value.kwargs
    assert not isinstance(kwargs["model"], PeftModel)
    assert isinstance(kwargs["peft_config"], LoraConfig) and kwargs["peft_config"].r == 16  # the config's lora_r


# ----------------------------------------------------------------------------------------------------------------------
# One real step of each new example on the tiny model
# ----------------------------------------------------------------------------------------------------------------------

TINY_RUN = [
    "--max_steps=1",
    "--num_train_tasks=4",
    "--num_eval_tasks=2",
    "--per_device_train_batch_size=2",
    "--gradient_accumulation_steps=1",
    "--num_generations=2",
    "--max_completion_length=32",
    "--lora_r=4",
    "--lora_alpha=8",
    "--warmstart_steps=1",  # the warm start runs too (SFT on 2 traces), then GRPO continues its adapter
    "--warmstart_batch_size=2",
    "--disable_tqdm=true",
]


def _load_example(script: str):
    spec = importlib.util.spec_from_file_location(f"example_{Path(script).stem}", EXAMPLES / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.parametrize(
    "script,metrics",
    [
        ("tool_rollback.py", "ROLLBACK_METRICS"),
        ("context_snapshots.py", "SNAPSHOT_METRICS"),
    ],
)
def test_example_trains_one_step(tiny_model_dir, tmp_path, capsys, script, metrics):
    module = _load_example(script)
    config, _ = PYTHON_EXAMPLES[script]
    out = tmp_path / "out"
    argv = ["--config", str(CONFIGS / config), f"--model_name_or_path={tiny_model_dir}", f"--output_dir={out}"]
    trainer = module.main(argv + TINY_RUN)

    assert trainer.state.global_step == 1
    [step] = [h for h in trainer.state.log_history if "reward" in h]
    names = getattr(module, metrics)
    assert all(name in step for name in names), sorted(set(names) - set(step))
    assert (out / "adapter_model.safetensors").is_file()
    printed = capsys.readouterr().out
    assert "Warm start: 2 traces" in printed
    for name in names:  # the final table has a row per metric
        assert any(line.startswith(name + " ") for line in printed.splitlines()), name

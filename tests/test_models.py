"""Tests for `trl_agentic.models`: the tiny test model, builtin-name resolution and the embedded SmolLM2 model."""

import json
import threading
import time
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig, GRPOTrainer
from trl.chat_template_utils import (
    add_response_schema,
    get_training_chat_template,
    parse_response,
    qwen3_chat_template,
    qwen3_training_chat_template,
    supports_tool_calling,
)

from trl_agentic import models
from trl_agentic.models import (
    build_tiny_model,
    builtin_model_dir,
    builtin_model_names,
    is_builtin_model,
    load_model_and_tokenizer,
    resolve_model_path,
)

TOOL_CALL_TURN = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "17*23"}}\n</tool_call><|im_end|>'


def calculate(expression: str) -> str:
    """
    Evaluate an arithmetic expression.

    Args:
        expression: The expression to evaluate, e.g. "2*3".
    """
    return str(eval(expression, {"__builtins__": {}}, {}))


def multiply(a: int, b: int) -> int:
    """
    Multiply two integers.

    Args:
        a: First factor.
        b: Second factor.
    """
    return a * b


class CalculatorEnv:
    """Minimal `environment_factory` environment: one tool, no state worth mentioning."""

    def reset(self, **kwargs):
        return None

    def calculate(self, expression: str) -> str:
        """
        Evaluate an arithmetic expression.

        Args:
            expression: The expression to evaluate, e.g. "2*3".
        """
        return calculate(expression)


def length_reward(completions, **kwargs):
    return [float(len(str(completion))) for completion in completions]


def assert_tool_capable(tokenizer):
    """The checks TRL's GRPOTrainer relies on when it is given tools, plus a parsed tool call from a scripted turn."""
    assert tokenizer.chat_template == qwen3_chat_template
    assert supports_tool_calling(tokenizer)
    # Qwen3's inference template drops past reasoning, so TRL swaps in its training variant for multi-turn rollouts.
    assert get_training_chat_template(tokenizer) == qwen3_training_chat_template
    add_response_schema(tokenizer)
    assert tokenizer.response_template is not None

    prompt = [{"role": "user", "content": "What is 17*23?"}]
    prefix = tokenizer.apply_chat_template(
        prompt, tools=[calculate], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert tokenizer.decode(prefix).endswith("<|im_start|>assistant\n")

    ids = tokenizer(TOOL_CALL_TURN, add_special_tokens=False)["input_ids"]
    parsed = parse_response(tokenizer, ids, prefix=prefix, tools=[calculate])
    assert parsed["content"] == ""
    assert parsed["tool_calls"] == [
        {"type": "function", "function": {"name": "calculate", "arguments": {"expression": "17*23"}}}
    ]

    # Arguments are typed with the tool's schema: "4" becomes 4 for an integer parameter.
    turn = '<tool_call>\n{"name": "multiply", "arguments": {"a": 3, "b": "4"}}\n</tool_call><|im_end|>'
    ids = tokenizer(turn, add_special_tokens=False)["input_ids"]
    parsed = parse_response(tokenizer, ids, prefix=prefix, tools=[multiply])
    assert parsed["tool_calls"][0]["function"]["arguments"] == {"a": 3, "b": 4}

    ids = tokenizer("The answer is 391.<|im_end|>", add_special_tokens=False)["input_ids"]
    assert parse_response(tokenizer, ids, prefix=prefix, tools=[calculate]) == {
        "role": "assistant",
        "content": "The answer is 391.",
    }


def grpo_args(output_dir, **kwargs):
    return GRPOConfig(
        output_dir=str(output_dir),
        use_cpu=True,
        bf16=False,
        max_steps=1,
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=8,
        report_to="none",
        save_strategy="no",
        **kwargs,
    )


PROMPTS = Dataset.from_dict({"prompt": [[{"role": "user", "content": "What is 17*23?"}]] * 4})


# ----------------------------------------------------------------------------------------------------------------------
# Tiny test model
# ----------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def test_tiny_model_is_deterministic(tmp_path):
    first = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "a", seed=3)).state_dict()
    second = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "b", seed=3)).state_dict()
    other_seed = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "c", seed=4)).state_dict()

    assert first.keys() == second.keys()
    assert all(torch.equal(first[name], second[name]) for name in first)
    # Guards against a trivially "deterministic" init (e.g. all zeros): the seed must actually matter.
    assert not torch.equal(first["model.embed_tokens.weight"], other_seed["model.embed_tokens.weight"])
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (tmp_path / "b" / "tokenizer.json").read_bytes()


def test_tiny_model_does_not_disturb_global_rng(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_model(tmp_path / "model")
    assert torch.equal(torch.rand(3), expected)


def test_tiny_model_is_reused_and_seed_checked(tmp_path):
    path = build_tiny_model(tmp_path / "model")
    weights = Path(path) / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    assert build_tiny_model(tmp_path / "model") == path
    assert weights.stat().st_mtime_ns == mtime
    with pytest.raises(ValueError, match="different model"):
        build_tiny_model(tmp_path / "model", seed=1)


def test_tiny_model_fills_existing_empty_dir(tmp_path):
    # pytest's `tmp_path` itself is an existing empty folder: a common way to call the builder.
    assert build_tiny_model(tmp_path) == str(tmp_path)
    assert (tmp_path / "config.json").is_file()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp dir left behind


def test_tiny_model_config(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert model.config.vocab_size == len(tokenizer) == 265
    assert sum(p.numel() for p in model.parameters()) < 100_000
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|endoftext|>"
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id == model.config.eos_token_id
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id == model.config.pad_token_id
    assert tokenizer.pad_token_id != tokenizer.eos_token_id


def test_tiny_tokenizer_round_trip(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    for text in [
        "hello world",
        "  leading spaces , odd punctuation !",
        "Héllo wörld 🤗 ünïcode\n\ttab",
        TOOL_CALL_TURN,
    ]:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(ids) == text
    # Byte-level: one token per byte for plain text; the markers are single tokens.
    assert len(tokenizer("abc", add_special_tokens=False)["input_ids"]) == 3
    for marker in ["<tool_call>", "</tool_call>", "<think>", "</think>", "<tool_response>", "</tool_response>"]:
        assert len(tokenizer(marker, add_special_tokens=False)["input_ids"]) == 1
    # The tool-call markers are not special, so they survive `skip_special_tokens=True`; <|im_end|> does not.
    ids = tokenizer(TOOL_CALL_TURN, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == TOOL_CALL_TURN.removesuffix("<|im_end|>")


def test_tiny_tokenizer_is_tool_capable(tiny_model_dir):
    assert_tool_capable(AutoTokenizer.from_pretrained(tiny_model_dir))


def test_tiny_model_trains_one_grpo_step_with_environment(tiny_model_dir, tmp_path):
    trainer = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=length_reward,
        args=grpo_args(tmp_path),
        train_dataset=PROMPTS,
        environment_factory=CalculatorEnv,
    )
    assert trainer.chat_template == qwen3_training_chat_template
    assert trainer.processing_class.response_template is not None
    result = trainer.train()
    assert result.global_step == 1
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


# ----------------------------------------------------------------------------------------------------------------------
# Atomic writes and builtin-name resolution (no conversion)
# ----------------------------------------------------------------------------------------------------------------------


def test_write_atomically_with_racing_writers(tmp_path):
    target = tmp_path / "model"
    barrier = threading.Barrier(3)
    errors = []

    def writer(tag):
        def write(out_dir):
            (out_dir / "weights.txt").write_text(tag)
            barrier.wait(timeout=10)  # both temp dirs are fully written before either rename

        try:
            models._write_atomically(target, write, {"writer": tag})
        except Exception as error:  # collected: an exception in a thread would otherwise be lost
            errors.append(error)

    threads = [threading.Thread(target=writer, args=(tag,)) for tag in ("a", "b", "c")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)

    assert errors == []
    marker = json.loads((target / models._MARKER_FILE).read_text())
    # The folder is one writer's complete output, never a mix.
    assert (target / "weights.txt").read_text() == marker["writer"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # losers cleaned up their temp dirs


def test_write_atomically_merges_into_nonempty_dir(tmp_path):
    (tmp_path / "notes.txt").write_text("keep me")
    models._write_atomically(tmp_path, lambda out: (out / "weights.txt").write_text("w"), {"name": "x"})
    assert (tmp_path / "notes.txt").read_text() == "keep me"
    assert (tmp_path / "weights.txt").read_text() == "w"
    assert models._is_complete(tmp_path)


def test_is_builtin_model():
    assert builtin_model_names() == ["smollm2-135m"]
    assert is_builtin_model("smollm2-135m")
    assert is_builtin_model("builtin:smollm2-135m")
    assert not is_builtin_model("builtin:nope")
    assert not is_builtin_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert not is_builtin_model("./smollm2-135m")
    assert not is_builtin_model(Path("smollm2-135m"))


def test_resolve_model_path_passes_other_names_through(tmp_path):
    for name in ["HuggingFaceTB/SmolLM2-135M-Instruct", "Qwen/Qwen3-0.6B", str(tmp_path), "./smollm2-135m", "gpt2"]:
        assert resolve_model_path(name, cache_dir=tmp_path) == name
    assert list(tmp_path.iterdir()) == []  # nothing converted or created
    with pytest.raises(ValueError, match="Unknown builtin model"):
        resolve_model_path("builtin:nope")


def test_builtin_model_dir_honours_cache_env(monkeypatch, tmp_path):
    monkeypatch.setenv("TRL_AGENTIC_CACHE", str(tmp_path / "env-cache"))
    path = builtin_model_dir("builtin:smollm2-135m")
    assert path.parent == tmp_path / "env-cache" / "models"
    assert path.name.startswith("smollm2-135m-0.1.2-r")
    assert builtin_model_dir("smollm2-135m") == path
    assert builtin_model_dir("smollm2-135m", cache_dir=tmp_path / "arg") == tmp_path / "arg" / "models" / path.name

    monkeypatch.delenv("TRL_AGENTIC_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert builtin_model_dir("smollm2-135m") == tmp_path / "xdg" / "trl_agentic" / "models" / path.name


def test_resolve_converts_builtin_once_under_concurrency(monkeypatch, tmp_path):
    calls = []

    def fake_convert(gguf_path, out_dir):
        calls.append(gguf_path)
        time.sleep(0.3)  # long enough for the other threads to reach the lock
        (out_dir / "config.json").write_text("{}")

    monkeypatch.setattr(models, "_convert_gguf", fake_convert)
    results, errors = [], []

    def resolve():
        try:
            results.append(resolve_model_path("smollm2-135m", cache_dir=tmp_path))
        except Exception as error:
            errors.append(error)

    threads = [threading.Thread(target=resolve) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)

    assert errors == []
    assert len(calls) == 1
    assert calls[0].name == "SmolLM2-135M-Instruct.Q4_1.gguf" and calls[0].is_file()
    assert len(set(results)) == 1 and len(results) == 3
    path = Path(results[0])
    assert path == builtin_model_dir("smollm2-135m", cache_dir=tmp_path)
    assert (path / "config.json").is_file()
    assert json.loads((path / models._MARKER_FILE).read_text())["name"] == "smollm2-135m"
    assert resolve_model_path("builtin:smollm2-135m", cache_dir=tmp_path) == str(path)
    assert len(calls) == 1


# ----------------------------------------------------------------------------------------------------------------------
# Embedded SmolLM2 (slow: the first conversion takes ~30 s)
# ----------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """Convert SmolLM2 once into a fresh cache; return the cache root and the folder."""
    cache_root = tmp_path_factory.mktemp("trl_agentic_cache")
    return {"cache_root": cache_root, "path": resolve_model_path("smollm2-135m", cache_dir=cache_root)}


def _forbid_conversion(monkeypatch):
    """A converted model must be reused as it is: converting again fails the test (no wall-clock bound)."""

    def convert(*args, **kwargs):
        raise AssertionError("the converted model was not reused")

    monkeypatch.setattr(models, "_convert_gguf", convert)


@pytest.mark.slow
def test_smollm2_conversion_produces_plain_model_dir(smollm2):
    path = Path(smollm2["path"])
    assert path.parent == smollm2["cache_root"] / "models"
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in path.iterdir()
    }
    config = json.loads((path / "config.json").read_text())
    assert "quantization_config" not in config  # a plain float32 checkpoint, not a GGUF-backed one
    assert config["architectures"] == ["LlamaForCausalLM"]
    generation_config = json.loads((path / "generation_config.json").read_text())
    assert generation_config["eos_token_id"] == 2  # <|im_end|>: generation stops at the end of an assistant turn
    assert generation_config["pad_token_id"] == 0  # <|endoftext|>


@pytest.mark.slow
def test_smollm2_reloads_without_converting(smollm2, monkeypatch):
    _forbid_conversion(monkeypatch)
    model, tokenizer = load_model_and_tokenizer("builtin:smollm2-135m", cache_dir=smollm2["cache_root"])
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.dtype == torch.float32
    assert 134_000_000 < sum(p.numel() for p in model.parameters()) < 135_000_000
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied, as in SmolLM2
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", 2)
    assert (tokenizer.pad_token, tokenizer.pad_token_id) == ("<|endoftext|>", 0)
    assert model.generation_config.eos_token_id == 2


@pytest.mark.slow
def test_smollm2_tokenizer_is_tool_capable(smollm2):
    tokenizer = AutoTokenizer.from_pretrained(smollm2["path"])
    # SmolLM2's vocabulary has no <tool_call> token: the markup is spelled with several tokens, which is fine
    # because the response parser works on decoded text, as long as decoding round-trips exactly.
    assert len(tokenizer("<tool_call>", add_special_tokens=False)["input_ids"]) > 1
    for text in ["Hello , world !  x", 'def f(x):\n    return {"a": [1, 2]}\n', "Héllo 🤗", TOOL_CALL_TURN]:
        assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text
    assert_tool_capable(tokenizer)


@pytest.mark.slow
def test_smollm2_greedy_generation(smollm2):
    model, tokenizer = load_model_and_tokenizer(smollm2["path"])
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=24, do_sample=False)
    new_tokens = output[0, inputs["input_ids"].shape[1] :].tolist()
    text = tokenizer.decode(new_tokens, skip_special_tokens=True)
    # Random or mangled weights would not name the city; greedy float32 decoding on CPU is deterministic.
    assert "Paris" in text
    assert new_tokens[-1] == tokenizer.eos_token_id  # stops at <|im_end|> well before the token budget


@pytest.mark.slow
def test_smollm2_conversion_is_idempotent(smollm2, monkeypatch):
    weights = Path(smollm2["path"]) / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    # Resolved through the environment variable this time, to the same folder.
    monkeypatch.setenv("TRL_AGENTIC_CACHE", str(smollm2["cache_root"]))
    _forbid_conversion(monkeypatch)
    assert resolve_model_path("smollm2-135m") == smollm2["path"]
    assert weights.stat().st_mtime_ns == mtime
    assert [p.name for p in (smollm2["cache_root"] / "models").iterdir() if p.is_dir()] == [weights.parent.name]


@pytest.mark.slow
def test_smollm2_grpo_trainer_accepts_environment_factory(smollm2, tmp_path):
    trainer = GRPOTrainer(
        model=smollm2["path"],
        reward_funcs=length_reward,
        args=grpo_args(tmp_path),
        train_dataset=PROMPTS,
        environment_factory=CalculatorEnv,
    )
    assert [tool.__name__ for tool in trainer.tools] == ["calculate"]
    assert trainer.chat_template == qwen3_training_chat_template
    assert trainer.processing_class.response_template is not None
    # The token-level splice TRL uses after a tool call: it must line up with the assistant turn's <|im_end|>.
    suffix = trainer._get_tool_suffix_ids([{"role": "tool", "name": "calculate", "content": "391"}])
    assert trainer.processing_class.decode(suffix) == (
        "\n<|im_start|>user\n<tool_response>\n391\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )

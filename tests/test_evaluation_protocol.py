"""Held-out evaluation follows the training run where it must (found by a review; each failed before its fix):
prompts rendered with the run's `chat_template_kwargs`, a turn ending at every end-of-turn id TRL stops at, a
generation config of its own (not the checkpoint's repetition penalty), BFCL's verdict on untyped arguments from
`trl-agentic train` too, and CUDA's random state restored like the CPU's."""

import inspect
from types import SimpleNamespace

import pytest
import torch


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    from trl_agentic.evaluation import with_response_schema

    return with_response_schema(AutoTokenizer.from_pretrained(tiny_model_dir, padding_side="left"))


@pytest.fixture
def model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


def _row_and_tools():
    from trl_agentic.envs.calculator import CalculatorEnv, make_arithmetic_tasks
    from trl_agentic.envs.protocol import tool_methods

    row = make_arithmetic_tasks(1, 1, "easy")[0]
    env = CalculatorEnv()
    env.reset(**row)
    return row, list(tool_methods(env).values())


def test_eval_renders_prompts_with_the_runs_chat_template_kwargs(tok, model):
    """Training (trl_backend.renderer) and the warm start render with `chat_template_kwargs`; evaluation must too."""
    from trl_agentic.evaluation import evaluate_policy
    from trl_agentic.rollout.rendering import ChatRenderer, grpo_chat_template

    assert "chat_template_kwargs" in inspect.signature(evaluate_policy).parameters
    row, tools = _row_and_tools()
    kwargs = {"enable_thinking": False}
    train_ids = ChatRenderer(tok, grpo_chat_template(tok), kwargs).prompt_ids(row["prompt"], tools=tools)
    seen = []
    orig = model.generate
    model.generate = lambda **k: (seen.append(k["input_ids"][0].tolist()), orig(**k))[1]
    from trl_agentic.envs.calculator import CalculatorEnv, answer_reward

    evaluate_policy(
        model,
        tok,
        [row],
        environment_factory=CalculatorEnv,
        reward_funcs=[answer_reward],
        max_completion_length=4,
        progress=False,
        chat_template_kwargs=kwargs,
        prefix_caching=False,
    )
    assert seen[0] == train_ids


def _cli_evaluation_kwargs(monkeypatch, task_args, **training) -> dict:
    """The keyword arguments `trl-agentic train`'s held-out evaluation passes to `evaluate_policy` (stopped there)."""
    import trl_agentic.evaluation as evaluation
    from trl_agentic import cli
    from trl_agentic.tasks import build_task

    seen = {}
    monkeypatch.setattr(
        evaluation, "evaluate_policy", lambda *a, **k: (_ for _ in ()).throw(RuntimeError(seen.update(k)))
    )
    defaults = dict(
        max_completion_length=96,
        max_tool_calling_iterations=3,
        max_turn_tokens=None,
        max_tool_output_chars=None,
        top_p=1.0,
        seed=0,
        disable_tqdm=True,
        enable_context_snapshots=False,
        context_stub_text="[deleted]",
        chat_template_kwargs=None,
    )
    args = SimpleNamespace(**{**defaults, **training})
    with pytest.raises(RuntimeError):
        cli._evaluate_into("before", None, None, build_task(task_args), task_args, args, {}, {})
    return seen


def test_cli_heldout_eval_passes_chat_template_kwargs(monkeypatch):
    from trl_agentic.tasks import TaskArguments

    task_args = TaskArguments(num_train_tasks=2, num_eval_tasks=2, heldout_eval=True)
    seen = _cli_evaluation_kwargs(monkeypatch, task_args, chat_template_kwargs={"enable_thinking": False})
    assert seen.get("chat_template_kwargs") == {"enable_thinking": False}


def test_eval_stops_a_turn_at_every_eos_id_of_the_generation_config(tok, model):
    """TRL's GRPOTrainer stops at tokenizer eos + model.generation_config.eos_token_id (its `eos_token_ids`)."""
    from trl_agentic.evaluation import HFGenerationBackend

    eot = tok.convert_tokens_to_ids("<|endoftext|>")
    model.generation_config.eos_token_id = [tok.eos_token_id, eot]
    _, tools = _row_and_tools()
    script = (
        tok.encode("12", add_special_tokens=False)
        + [eot]
        + tok.encode("34", add_special_tokens=False)
        + [tok.eos_token_id]
    )
    step = {"n": 0}

    def hook(module, inputs, out):
        out = out.clone()
        out[:, -1, :] = -1e9
        out[:, -1, script[min(step["n"], len(script) - 1)]] = 1e9
        step["n"] += 1
        return out

    model.lm_head.register_forward_hook(hook)
    row, _ = _row_and_tools()
    backend = HFGenerationBackend(
        model, tok, [tools], max_completion_length=16, max_iterations=1, prefix_caching=False
    )
    [ids], _ = backend.generate([backend.render_prompt(row["prompt"], 0)])
    assert ids == script[:3]  # the turn ends at <|endoftext|>, as in training


def test_eval_generation_ignores_the_checkpoints_repetition_penalty(tok, model):
    """GRPO generates with TRL's explicit GenerationConfig (repetition_penalty=args.repetition_penalty, 1.0)."""
    from trl_agentic.evaluation import HFGenerationBackend

    model.generation_config.repetition_penalty = 1.3
    row, tools = _row_and_tools()
    backend = HFGenerationBackend(
        model, tok, [tools], max_completion_length=24, max_iterations=1, prefix_caching=False
    )
    ids = backend.render_prompt(row["prompt"], 0)
    [got], _ = backend.generate([ids])
    model.generation_config.repetition_penalty = 1.0
    [want], _ = backend.generate([ids])
    assert got == want


def test_cli_bfcl_heldout_eval_parses_arguments_as_bfcl(monkeypatch):
    from trl_agentic.tasks import TaskArguments

    task_args = TaskArguments(task="bfcl", bfcl_classes=["GorillaFileSystem"], heldout_eval=True, num_eval_tasks=2)
    seen = _cli_evaluation_kwargs(monkeypatch, task_args, max_completion_length=1536, max_tool_calling_iterations=24)
    assert seen.get("typed_arguments") is False


def test_eval_forks_the_random_state_of_every_visible_cuda_device(tok, model, monkeypatch):
    """`torch.manual_seed` seeds every CUDA device: the fork saved only the CPU's, so a before-GRPO evaluation reset
    GRPO's CUDA sampling stream. Here the fork must cover each visible device (simulated: this machine has none)."""
    import contextlib

    from trl_agentic.envs.calculator import CalculatorEnv, answer_reward, make_arithmetic_tasks
    from trl_agentic.evaluation import evaluate_policy

    forked = []

    @contextlib.contextmanager
    def fork_rng(devices=None, **kwargs):
        forked.append(list(devices))
        state = torch.get_rng_state()
        yield
        torch.set_rng_state(state)

    monkeypatch.setattr(torch.random, "fork_rng", fork_rng)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "manual_seed_all", lambda seed: None)  # no device to seed here
    evaluate_policy(
        model, tok, make_arithmetic_tasks(1, 1, "easy"), environment_factory=CalculatorEnv,
        reward_funcs=[answer_reward], max_completion_length=4, temperature=0.8, progress=False,
    )  # fmt: skip
    assert forked == [[0, 1]]


def lookup(key: str) -> str:
    """
    Looks a key up.

    Args:
        key: The key.
    """
    return f"value of {key}"


def test_standalone_tools_of_a_task_are_evaluated_with_them(tiny_tokenizer):
    """A custom task's `tools` were never given to evaluation: with no environment it crashed ('NoneType' object is
    not callable), with one it was evaluated without them. Listed first, as TRL lists them; a scripted turn calls one."""
    from test_evaluation import ScriptedModel

    from trl_agentic.envs.calculator import CalculatorEnv, answer_reward, make_arithmetic_tasks
    from trl_agentic.evaluation import evaluate_policy

    class LookupThenAnswer(ScriptedModel):
        def _turn(self, text):
            if "<tool_response>" not in text:
                return '<tool_call>\n{"name": "lookup", "arguments": {"key": "k"}}\n</tool_call>'
            return "Answer: 0"

    rows = make_arithmetic_tasks(2, 3, "easy")
    for factory in (None, CalculatorEnv):
        model = LookupThenAnswer(tiny_tokenizer, rows, ["right"])
        result = evaluate_policy(
            model, tiny_tokenizer, rows, environment_factory=factory, tools=[lookup], reward_funcs=[answer_reward],
            max_completion_length=4096, prefix_caching=False, progress=False,
        )  # fmt: skip
        for record in result.records:
            [tool] = [m for m in record["messages"] if m["role"] == "tool"]
            assert tool["content"] == "value of k"
        assert result.metrics["tool_call_success_rate"] == 1.0
    with pytest.raises(ValueError, match="`environment_factory` or `tools`"):
        evaluate_policy(model, tiny_tokenizer, rows, environment_factory=None, reward_funcs=[answer_reward])


def test_a_turn_the_per_turn_cap_cut_ends_the_evaluation_rollout(tok, model):
    """The engine caps each turn at `max_turn_tokens`, the loop did not know it: a capped turn (shorter than the
    conversation's budget) was taken for a complete one, checked for malformed calls and answered with an
    'unclosed <tool_call> tag' error, and the conversation went on from it."""
    from trl_agentic.envs.calculator import CalculatorEnv, answer_reward
    from trl_agentic.evaluation import evaluate_policy

    text = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    script = tok.encode(text, add_special_tokens=False)
    step = {"n": 0}

    def write_the_call_forever(module, inputs, out):
        out = out.clone()
        out[:, -1, :] = -1e9
        out[:, -1, script[step["n"] % len(script)]] = 1e9
        step["n"] += 1
        return out

    model.lm_head.register_forward_hook(write_the_call_forever)
    row, _ = _row_and_tools()
    result = evaluate_policy(
        model, tok, [row], environment_factory=CalculatorEnv, reward_funcs=[answer_reward],
        max_completion_length=200, max_turn_tokens=20, max_tool_calling_iterations=3, progress=False,
        prefix_caching=False,
    )  # fmt: skip
    (record,) = result.records
    assert [m["role"] for m in record["messages"] if m["role"] != "user"] == ["assistant"]
    assert not any("unclosed" in str(m.get("content")) for m in record["messages"])

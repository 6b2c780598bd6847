"""A tiny tool-calling policy that vLLM's CPU backend serves, built in a second (the vLLM tier's tests, the async
benchmark's multi-turn runs).

`build_tool_policy` writes a tiny random Qwen3 whose tokenizer has extra tokens, each a whole assistant turn (e.g. a
failing calculator call, a good call, an answer), and whose output layer favours those tokens and the end of turn: sampled
at temperature 1, a turn is mostly one or two of them. Conversations are therefore multi-turn tool conversations in
which rollbacks, negatives and snapshots happen, at negligible model cost.
"""

from __future__ import annotations

import json
import os

__all__ = ["CALCULATOR_TURNS", "build_tool_policy", "tool_call_text"]


def tool_call_text(expression: str, name: str = "calculate", arguments: dict | None = None) -> str:
    call = {"name": name, "arguments": arguments if arguments is not None else {"expression": expression}}
    return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"


# Whole turns as single tokens: a call that fails (ZeroDivisionError, rolled back), a call that succeeds, an answer.
CALCULATOR_TURNS = (tool_call_text("1/0"), tool_call_text("6*7"), "Answer: 42")


# The tiny policy's reward spread. Its one good call computes 6*7, which is rarely a problem's answer, so the
# calculator's own tool bonus (`tool_use_reward`: the last successful call returned the answer) would leave almost every
# group of the benchmarks and the vLLM tests without spread, and their steps without gradient. They use the shaping
# bonus `trl_agentic.envs.calculator.tool_call_reward` / `ToolCallBonusCalculatorEnv` instead: it pays any call that
# returned, which a policy can farm with `calculate("0")`.


def build_tool_policy(path, *, seed: int = 0, turn_tokens=CALCULATOR_TURNS, biases=(0.9, 0.9, 0.75)) -> str:
    """A tiny random Qwen3 that vLLM's CPU backend serves and that uses the calculator, built in a second.

    The tokenizer is `trl_agentic.models.build_tiny_model`'s (byte-level, TRL's Qwen3 chat template) plus three
    tokens, each a whole turn: `FAILING_CALL` (`calculate("1/0")`), `GOOD_CALL` (`calculate("6*7")`) and `ANSWER`.
    The weights are random except for a constant channel: hidden dimension 0 of the residual stream holds the same
    value at every position (its embedding column is constant, nothing writes to it), so the matching `lm_head`
    column acts as an output bias favouring the three turn tokens and `<|im_end|>`. Sampled at temperature 1, a turn
    is then mostly one or two of these tokens and an end of turn: tool calls that fail or succeed, answers. The rest
    of the network is random and context-dependent, so a LoRA adapter on it changes the distribution. Head size is
    32, the smallest vLLM's CPU attention supports. `turn_tokens` / `biases` replace the three turns and their output
    biases (the asynchronous trainer's snapshot test adds a `delete_context` call).
    """
    import torch
    from tokenizers import AddedToken
    from transformers import AutoTokenizer, GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    from trl_agentic.models import build_tiny_model

    path = str(path)
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model(f"{path}-base"))
    tokenizer.add_tokens([AddedToken(text, normalized=False, special=False) for text in turn_tokens])
    hidden = 64
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        intermediate_size=128,
        tie_word_embeddings=False,
        max_position_embeddings=4096,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    turn_ids = [tokenizer.convert_tokens_to_ids(t) for t in turn_tokens]
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
        embed = model.model.embed_tokens.weight
        embed.normal_(0.0, 1.0)
        embed[:, 0] = 8.0  # the constant channel
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[0].zero_()
            layer.mlp.down_proj.weight[0].zero_()
        head = model.lm_head.weight
        head.normal_(0.0, 0.05)
        head[:, 0] = 0.0
        head[turn_ids, 0] = torch.tensor(list(biases))
        head[tokenizer.eos_token_id, 0] = 0.95
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path

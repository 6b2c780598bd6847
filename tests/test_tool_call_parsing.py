"""The Hermes tool-call parser: exact results on known inputs, and hypothesis fuzzing (never raises, bounded time)."""

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trl_agentic.rollout.parsing import MAX_CALLS, ToolCallParse, parse_tool_calls


def block(obj) -> str:
    return f"<tool_call>\n{json.dumps(obj)}\n</tool_call>"


def test_parses_one_and_several_calls():
    text = "Let me compute. " + block({"name": "calculate", "arguments": {"expression": "17*23"}}) + "<|im_end|>"
    parsed = parse_tool_calls(text)
    assert parsed.errors == []
    assert parsed.calls == [
        {"type": "function", "function": {"name": "calculate", "arguments": {"expression": "17*23"}}}
    ]
    assert parsed.content == "Let me compute. <|im_end|>"
    two = parse_tool_calls(block({"name": "a", "arguments": {}}) + block({"name": "b", "arguments": '{"x": 1}'}))
    assert [c["function"]["name"] for c in two.calls] == ["a", "b"]
    assert two.calls[1]["function"]["arguments"] == {"x": 1}  # JSON-string arguments are decoded


def test_plain_text_has_no_markup():
    parsed = parse_tool_calls("The answer is 42.")
    assert not parsed.has_markup and parsed.content == "The answer is 42."


def test_each_malformation_is_reported():
    cases = {
        "<tool_call>{nope</tool_call>": "invalid JSON",
        "<tool_call>  </tool_call>": "empty <tool_call> block",
        "<tool_call>[1, 2]</tool_call>": "must be a JSON object",
        '<tool_call>{"arguments": {}}</tool_call>': 'non-empty string "name"',
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>': "must be a JSON object, got list",
        '<tool_call>{"name": "f", "arguments": "{bad"}</tool_call>': "is a string that is not valid JSON",
        '<tool_call>{"name": "f"}': "unclosed <tool_call> tag",
        "done </tool_call>": "without a matching <tool_call>",
        "<tool_call><tool_call>{}</tool_call>": "nested <tool_call> tag",
    }
    for text, expected in cases.items():
        parsed = parse_tool_calls(text)
        assert parsed.calls == [] and len(parsed.errors) == 1 and expected in parsed.errors[0], (text, parsed)


def test_too_many_calls_is_an_error_not_a_parse():
    text = block({"name": "f", "arguments": {}}) * (MAX_CALLS + 5)
    parsed = parse_tool_calls(text)
    assert len(parsed.calls) == MAX_CALLS and any("more than" in e for e in parsed.errors)


def test_non_text_input():
    assert parse_tool_calls(None).errors  # type: ignore[arg-type]


FRAGMENTS = st.sampled_from(
    [
        "<tool_call>",
        "</tool_call>",
        "{",
        "}",
        '"name"',
        ":",
        '"arguments"',
        "[",
        "]",
        ",",
        '"f"',
        "null",
        "1e999",
        "\\u0000",
        "é",
        "😀",
        "\n",
        " ",
        '"',
        "<|im_end|>",
        "<tool_call",
        "tool_call>",
    ]
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(st.text(max_size=300), st.lists(FRAGMENTS, max_size=60).map("".join)))
def test_fuzz_never_raises_and_is_consistent(text):
    parsed = parse_tool_calls(text)
    assert isinstance(parsed, ToolCallParse)
    assert len(parsed.calls) <= MAX_CALLS
    for c in parsed.calls:
        assert isinstance(c["function"]["name"], str) and c["function"]["name"]
        assert isinstance(c["function"]["arguments"], dict)
    if "<tool_call>" not in text and "</tool_call>" not in text:
        assert not parsed.has_markup


@settings(max_examples=50, deadline=None)
@given(
    st.dictionaries(st.text(min_size=1, max_size=8), st.one_of(st.integers(), st.text(max_size=20)), max_size=4),
    st.text(min_size=1, max_size=12),
)
def test_fuzz_valid_calls_round_trip(arguments, name):
    parsed = parse_tool_calls(block({"name": name, "arguments": arguments}))
    assert parsed.errors == []
    assert parsed.calls == [{"type": "function", "function": {"name": name, "arguments": arguments}}]


def test_adversarial_huge_inputs_are_parsed():
    # Correctness only: a pathological slowdown shows up as the suite's per-test timeout, not as a wall-clock bound.
    inputs = [
        "<tool_call>" * 200_000,
        "</tool_call>" * 200_000,
        "<tool_call>" + "[" * 100_000 + "</tool_call>",  # deep JSON nesting
        "x" * 5_000_000,
        ("<tool_call>{}</tool_call>" * 50_000),
    ]
    for text in inputs:
        parsed = parse_tool_calls(text)
        assert isinstance(parsed, ToolCallParse)

"""The RLVCR step parser, renderer and prompts: exact cases, every error reason, and fuzzing."""

import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trl_agentic.rlvcr.parsing import (
    DEFAULT_TAGS,
    LEVEL1_THINK,
    LEVEL_FORCING_TEMPLATES,
    LEVEL_NAMES,
    LEVEL_SYSTEM_PROMPT,
    PARSE_ERROR_REASONS,
    ParsedStep,
    StepParseError,
    StepTags,
    cut_before_action,
    level_forcing_prompt,
    parse_step,
    render_prefix,
    render_step,
)

TAGS = DEFAULT_TAGS.all()


def span(text: str, s: tuple[int, int]) -> str:
    return text[s[0] : s[1]]


def reason(text, **kwargs) -> str:
    out = parse_step(text, **kwargs)
    assert isinstance(out, StepParseError), out
    assert out.reason in PARSE_ERROR_REASONS
    return out.reason


# ---- valid steps ----


def test_parse_compact_step_with_spans():
    text = "<level>3</level><think>check the fridge</think><action>open fridge</action>"
    out = parse_step(text)
    assert isinstance(out, ParsedStep)
    assert (out.level, out.think, out.action) == (3, "check the fridge", "open fridge")
    # "<level>3</level>" is 16 characters; "<think>" ends at 23; the think content has 16 characters.
    assert out.level_span == (0, 16)
    assert out.think_span == (23, 39)
    assert out.action_span == (55, 66)
    assert out.step_span == (0, len(text))
    assert span(text, out.level_span) == "<level>3</level>"
    assert span(text, out.think_span) == out.think
    assert span(text, out.action_span) == out.action


def test_parse_whitespace_newlines_and_unicode():
    text = (
        "\n  <level> 2 </level>\n\n<think>\n  Der Kühlschrank ist zu — 冷蔵庫.\n\n</think>"
        "\t<action>  öffne Kühlschrank 🧊 </action>\n"
    )
    out = parse_step(text)
    assert isinstance(out, ParsedStep)
    assert out.level == 2
    assert out.think == "Der Kühlschrank ist zu — 冷蔵庫."
    assert out.action == "öffne Kühlschrank 🧊"
    assert span(text, out.think_span) == out.think
    assert span(text, out.action_span) == out.action
    assert span(text, out.level_span) == "<level> 2 </level>"
    assert span(text, out.step_span).startswith("<level>") and span(text, out.step_span).endswith("</action>")


def test_parse_empty_think_and_level1():
    out = parse_step("<level>4</level><think></think><action>look</action>")
    assert isinstance(out, ParsedStep)
    assert out.think == "" and out.think_span == (23, 23)
    text = render_step(1, None, "look")
    out = parse_step(text)
    assert isinstance(out, ParsedStep) and (out.level, out.think, out.action) == (1, LEVEL1_THINK, "look")


def test_non_strict_ignores_surrounding_text():
    text = "Sure! <level>2</level><think>t</think><action>go hallway</action> Done."
    assert reason(text) == "leading_text"
    assert reason("<level>2</level><think>t</think><action>go hallway</action> Done.") == "trailing_text"
    out = parse_step(text, strict=False)
    assert isinstance(out, ParsedStep) and out.action == "go hallway"
    assert span(text, out.step_span) == "<level>2</level><think>t</think><action>go hallway</action>"


def test_custom_tags():
    tags = StepTags("[L]", "[/L]", "[T]", "[/T]", "[A]", "[/A]")
    text = "[L]4[/L] [T]plan[/T] [A]take apple[/A]"
    out = parse_step(text, tags)
    assert isinstance(out, ParsedStep) and (out.level, out.think, out.action) == (4, "plan", "take apple")
    assert reason(text) == "no_level"  # default tags do not match
    assert parse_step(render_step(2, "x", "y", tags), tags).action == "y"
    with pytest.raises(ValueError):
        StepTags(level_open="")
    with pytest.raises(ValueError):
        StepTags(think_open="<a>", think_close="</a>", action_open="<a>", action_close="</b>")  # duplicate tag
    with pytest.raises(ValueError):
        StepTags(action_open="<act", action_close="<action>")  # "<act" occurs inside "<action>"


# ---- every error reason ----


@pytest.mark.parametrize(
    "text, expected",
    [
        (None, "not_text"),
        (b"<level>1</level>", "not_text"),
        ("", "no_level"),
        ("   \n", "no_level"),
        ("<think>x</think><action>look</action>", "no_level"),
        ("hi <level>1</level><think>x</think><action>look</action>", "leading_text"),
        ("<level>1<think>x</think><action>look</action>", "unclosed_tag"),  # no </level> anywhere
        ("<level>1<think>x</level><action>look</action>", "nested_tag"),  # the level content holds <think>
        ("<level>1", "unclosed_tag"),
        ("<level>2</level><think>never closed", "unclosed_tag"),
        ("<level>2</level><think>x</think><action>look", "unclosed_tag"),
        ("<level>2</level><think>a <think> b</think><action>look</action>", "nested_tag"),
        ("<level>2</level><think>I will write <action>go</action></think><action>look</action>", "nested_tag"),
        ("<level>2</level><think>x</think><action><action>look</action>", "nested_tag"),
        ("<level>7</level><think>x</think><action>look</action>", "bad_level"),
        ("<level>x</level><think>x</think><action>look</action>", "bad_level"),
        ("<level></level><think>x</think><action>look</action>", "bad_level"),
        ("<level>0</level><think>x</think><action>look</action>", "bad_level"),
        ("<level>12</level><think>x</think><action>look</action>", "bad_level"),
        ("<level>+3</level><think>x</think><action>look</action>", "bad_level"),
        ("<level>３</level><think>x</think><action>look</action>", "bad_level"),  # full-width digit
        ("<level>٣</level><think>x</think><action>look</action>", "bad_level"),  # Arabic-Indic digit
        ("<level>2</level><action>look</action>", "no_think"),
        ("<level>2</level><think>x</think>", "no_action"),
        ("<level>2</level><think>x</think> look", "no_action"),
        ("<level>2</level> so <think>x</think><action>look</action>", "unexpected_text"),
        ("<level>2</level><think>x</think>then<action>look</action>", "unexpected_text"),
        ("<level>2</level><action>a</action><think>x</think><action>b</action>", "unexpected_text"),
        ("<level>2</level><think>x</think><action> \n </action>", "empty_action"),
        ("<level>2</level><think>x</think><action>look</action>extra", "trailing_text"),
        ("<level>2</level><think>x</think><action>a</action><level>1</level>", "trailing_text"),
    ],
)
def test_error_reasons(text, expected):
    assert reason(text) == expected


def test_internal_error_is_reported_not_raised():
    # A wrong `tags` argument is a caller bug, yet the parser still returns instead of raising.
    assert reason("<level>1</level>", tags=None) == "internal_error"


def test_huge_level_digit_string_is_rejected_fast():
    # int() on a 10**6-digit string raises ValueError in Python >= 3.11; the parser never calls int() on raw text.
    assert reason("<level>" + "3" * 1_000_000 + "</level><think></think><action>a</action>") == "bad_level"


# ---- fuzzing ----

FRAGMENTS = list(TAGS) + [
    "<level>1</level>",
    "<level>4</level>",
    "<level>7</level>",
    "<level>x</level>",
    "<think>",
    "<lev",
    "el>",
    "</",
    "<",
    ">",
    "/",
    "<think",
    "action>",
    "1",
    "2",
    "3",
    "4",
    " ",
    "\n",
    "\t",
    "\u00a0",
    "go kitchen",
    "ß",
    "🧊",
    "\u202e",
    "\x00",
    "冷",
]
fragment_text = st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=6)), max_size=30).map("".join)
step_like = st.builds(
    lambda lead, level, think, mid, action, tail: (
        f"{lead}<level>{level}</level>{mid}<think>{think}</think>{mid}<action>{action}</action>{tail}"
    ),
    st.sampled_from(["", " ", "\n", "\n\u00a0", "x"]),
    st.sampled_from(["1", "2", "3", "4", " 3 ", "\n4\n", "5", "x", "", "<think>"]),
    st.one_of(st.text(max_size=20), fragment_text),
    st.sampled_from(["", "\n", " \t ", "junk"]),
    st.one_of(st.text(min_size=1, max_size=20), fragment_text),
    st.sampled_from(["", "\n", " ", "tail", "</action>"]),
)
any_text = st.one_of(st.text(max_size=200), fragment_text, step_like)
whitespace = st.text(alphabet=" \t\n\r\u00a0\u3000", max_size=3)
# Mostly well-formed steps, so the oracle comparison also sees many valid parses.
valid_like = st.builds(
    lambda lead, level, think, mid, action, tail: (
        f"{lead}<level>{level}</level>{mid}<think>{think}</think>{mid}<action>{action}</action>{tail}"
    ),
    whitespace,
    st.sampled_from(["1", "2", "3", "4", " 2\n"]),
    st.text(max_size=30),
    whitespace,
    st.text(min_size=1, max_size=30),
    whitespace,
)

_SPACE = r"\s*"
_ORACLE = re.compile(
    _SPACE + r"<level>\s*([1-4])\s*</level>\s*<think>(.*?)</think>\s*<action>(.*?)</action>" + _SPACE,
    re.DOTALL,
)


def oracle(text: str):
    """An independent regex definition of a well-formed strict step (only for short inputs: it may backtrack)."""
    match = _ORACLE.fullmatch(text)
    if match is None:
        return None
    level, think, action = match.groups()
    if any(tag in think or tag in action for tag in TAGS) or not action.strip():
        return None
    return int(level), think.strip(), action.strip()


def check_consistent(text: str, out) -> None:
    assert isinstance(out, (ParsedStep, StepParseError))
    if isinstance(out, StepParseError):
        assert out.reason in PARSE_ERROR_REASONS
        return
    assert out.level in (1, 2, 3, 4)
    assert span(text, out.think_span) == out.think and out.think == out.think.strip()
    assert span(text, out.action_span) == out.action and out.action == out.action.strip() and out.action
    level_block = span(text, out.level_span)
    assert level_block.startswith("<level>") and level_block.endswith("</level>")
    assert level_block[len("<level>") : -len("</level>")].strip() == str(out.level)
    assert out.step_span[0] == out.level_span[0] <= out.level_span[1] <= out.think_span[0] <= out.think_span[1]
    assert out.think_span[1] <= out.action_span[0] <= out.action_span[1] <= out.step_span[1] <= len(text)
    assert not any(tag in out.think or tag in out.action for tag in TAGS)
    # The step alone parses to the same step, with spans shifted by its start.
    alone = parse_step(span(text, out.step_span))
    shift = out.step_span[0]
    assert (alone.level, alone.think, alone.action) == (out.level, out.think, out.action)
    assert alone.action_span == (out.action_span[0] - shift, out.action_span[1] - shift)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(any_text)
def test_fuzz_never_raises_and_matches_oracle(text):
    out = parse_step(text)
    check_consistent(text, out)
    expected = oracle(text)
    if expected is None:
        assert isinstance(out, StepParseError), (text, out)
    else:
        assert isinstance(out, ParsedStep), (text, out)
        assert (out.level, out.think, out.action) == expected
    check_consistent(text, parse_step(text, strict=False))
    think = cut_before_action(text)
    assert think is None or (think == think.strip() and think and not any(tag in think for tag in TAGS))


@settings(max_examples=300, deadline=None)
@given(valid_like)
def test_fuzz_step_shaped_inputs_match_oracle(text):
    out = parse_step(text)
    check_consistent(text, out)
    expected = oracle(text)
    assert (None if isinstance(out, StepParseError) else (out.level, out.think, out.action)) == expected, (text, out)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.lists(st.sampled_from(FRAGMENTS), min_size=1, max_size=12).map("".join), st.booleans())
def test_fuzz_megabyte_inputs(unit, wrap):
    """Correct on megabyte inputs; a super-linear parser would not finish within the suite's per-test timeout."""
    body = unit * (1_000_000 // len(unit) + 1)
    text = f"<level>2</level><think>{body}</think><action>{body}</action>" if wrap else body
    for strict in (True, False):
        check_consistent(text, parse_step(text, strict=strict))
    cut_before_action(text)


@pytest.mark.parametrize(
    "text",
    [
        "<level>" * 150_000,
        "<level>2</level><think>" + "<" * 1_000_000,
        "<level>2</level><think>" + "</thin" * 200_000 + "</think><action>" + "a" * 1_000_000 + "</action>",
        "<level>2</level><think>" + "é" * 1_000_000 + "</think><action>go</action>" + " " * 1_000_000,
        "\n" * 1_000_000 + "<level>1</level>",
        "<level>4</level><think>" + "x</action>" * 100_000,
        ("<level>2</level><think>t</think><action>a</action>" * 20_000),
    ],
)
def test_adversarial_megabyte_inputs(text):
    check_consistent(text, parse_step(text))


# ---- rendering ----


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from([1, 2, 3, 4]),
    st.text(max_size=50).filter(lambda s: not any(tag in s for tag in TAGS)),
    st.text(min_size=1, max_size=30).filter(lambda s: s.strip() and not any(tag in s for tag in TAGS)),
)
def test_render_parse_round_trip(level, think, action):
    text = render_step(level, think, action)
    assert text == render_prefix(level, think) + action + "</action>"
    out = parse_step(text)
    assert isinstance(out, ParsedStep)
    assert (out.level, out.think, out.action) == (level, think.strip(), action.strip())


def test_render_exact_text_and_errors():
    assert render_step(2, "t", "go hallway") == "<level>2</level>\n<think>t</think>\n<action>go hallway</action>"
    assert render_prefix(1) == f"<level>1</level>\n<think>{LEVEL1_THINK}</think>\n<action>"
    for bad_level in (0, 5, True, 2.0, "2"):
        with pytest.raises(ValueError):
            render_step(bad_level, "t", "a")
    with pytest.raises(ValueError):
        render_step(2, None, "a")  # None think is level 1 only
    with pytest.raises(ValueError):
        render_step(2, "see </think>", "a")
    with pytest.raises(ValueError):
        render_step(2, "t", "<action>a")


# ---- cut_before_action ----


@pytest.mark.parametrize(
    "generated, expected",
    [
        (
            "<level>3</level>\n<think>\nGoal: x\nReasoning: y\n</think>\n<action>open fridge</action>",
            "Goal: x\nReasoning: y",
        ),
        ("<think>no level block</think>", "no level block"),
        ("<level>2</level><think>forgot to close\n<action>open fridge</action>", "forgot to close"),
        ("<think>before<action>a</action> after</think>", "before"),
        ("<level>2</level><action>open fridge</action>", None),  # no think block
        ("<level>2</level><think>truncated by max_tokens", None),
        ("<level>2</level><think>   </think><action>a</action>", None),  # blank
        ("<level>2</level><think>a <level>3</level> b</think>", None),  # nested tag
        ("", None),
        (None, None),
    ],
)
def test_cut_before_action(generated, expected):
    assert cut_before_action(generated) == expected


# ---- prompts ----


def test_level_forcing_prompt_default_templates():
    history = "Your task is to: put the apple in the fridge.\nObservation: You are in the kitchen."
    for level in (2, 3, 4):
        prompt = level_forcing_prompt(history, level, "open fridge")
        assert history in prompt
        assert '"open fridge"' in prompt
        assert f"Level {level} ({LEVEL_NAMES[level]})" in prompt
        assert f"<level>{level}</level>" in prompt and "<action>open fridge</action>" in prompt
        assert "{" not in prompt  # every placeholder filled
    assert "Evaluation:" in level_forcing_prompt(history, 4, "a") and "Evaluation:" not in level_forcing_prompt(
        history, 3, "a"
    )
    assert "Reflection:" in level_forcing_prompt(history, 3, "a") and "Reflection:" not in level_forcing_prompt(
        history, 2, "a"
    )
    assert set(LEVEL_FORCING_TEMPLATES) == {2, 3, 4}
    for level in (1, 5, 0):
        with pytest.raises(ValueError, match="level"):
            level_forcing_prompt(history, level, "a")


def test_level_forcing_prompt_placeholders_are_literal():
    # Braces in the history, the action or the template are never interpreted (no str.format).
    template = 'H={history} A={action} L={level} json={"k": 1} {think_open}...{think_close}'
    out = level_forcing_prompt("h {action} {level}", 1, "a {history}", template=template)
    assert out == 'H=h {action} {level} A=a {history} L=1 json={"k": 1} <think>...</think>'
    tags = StepTags("[L]", "[/L]", "[T]", "[/T]", "[A]", "[/A]")
    assert "[L]2[/L]" in level_forcing_prompt("h", 2, "a", tags=tags)
    with pytest.raises(ValueError):
        level_forcing_prompt("h", 9, "a", template=template)


def test_system_prompt_examples_parse():
    examples = re.split(r"EXAMPLE \d:\n", LEVEL_SYSTEM_PROMPT)[1:]
    assert len(examples) == 4
    for level, example in enumerate(examples, start=1):
        out = parse_step(example)
        assert isinstance(out, ParsedStep), (level, out)
        assert out.level == level
    assert parse_step(examples[0]).think == LEVEL1_THINK
    for name in LEVEL_NAMES.values():
        assert name in LEVEL_SYSTEM_PROMPT

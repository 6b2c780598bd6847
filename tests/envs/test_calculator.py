"""`CalculatorEnv`, the arithmetic task generator and the reward functions (`trl_agentic.envs.calculator`)."""

import ast
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trl_agentic.envs.calculator import (
    SYSTEM_PROMPT,
    TOOL_USE_BONUS,
    CalculatorEnv,
    answer_reward,
    evaluate_expression,
    extract_answer,
    make_arithmetic_tasks,
    tool_use_reward,
)


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("2 + 3", "5"),
        ("(12 + 7) * 3", "57"),
        (" 100 - 2 * 3 ", "94"),
        ("7 / 2", "3.5"),
        ("6 / 3", "2"),  # true division, shown without ".0"
        ("7 // 2", "3"),
        ("-7 % 3", "2"),
        ("2 ** 10", "1024"),
        ("2 ** -1", "0.5"),
        ("2 ** -100000", "0"),  # a negative exponent gives a float, which underflows: not "too large"
        ("(-3) ** -3", "-0.037037037037"),
        ("-(3 - 5)", "2"),
        ("+4", "4"),
        ("1.5 * 4", "6"),
        ("1 / 3", "0.333333333333"),
        ("12 × 3 − 6 ÷ 4", "34.5"),
        ("1_000 + 1", "1001"),
    ],
)
def test_calculate_evaluates_arithmetic(expression, expected):
    env = CalculatorEnv()
    assert env.calculate(expression) == expected
    assert (env.calls, env.failures) == (1, 0)


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("2 ** 10 ** 10", "too large"),
        ("9 ** 9 ** 9", "too large"),
        ("10 ** 10 ** 10 ** 10", "too large"),
        ("(10 ** 1000) * (10 ** 1000)", "too large"),
        ("2.0 ** 10000", "too large"),
        ("1e308 * 10", "too large"),
        ("(-8) ** 0.5", "not a real number"),
        ("__import__('os')", "Function calls are not supported"),
        ("__import__('os').system('echo hacked')", "Function calls are not supported"),
        ("(1).__class__", "Attribute"),
        ("x + 1", "Unknown name 'x'"),
        ("'a' * 3", "Unsupported constant 'a'"),
        ("True + 1", "Unsupported constant True"),
        ("[1, 2]", "List"),
        ("1, 000", "Tuple"),
        ("2 ^ 3", "use ** for powers"),
        ("1 if 2 else 3", "IfExp"),
        ("lambda: 1", "Lambda"),
        ("1 +", "Invalid expression '1 +'"),
        ("", "Empty expression"),
        ("1" + " + 1" * 200, "Expression too long"),
        ("(" * 210 + "1" + ")" * 210, "Invalid expression"),  # nesting beyond the parser's limit
        ("-" * 250 + "1", "too complex"),
    ],
)
def test_calculate_rejects_unsafe_or_invalid_input(expression, message):
    env = CalculatorEnv()
    with pytest.raises(ValueError, match=re.escape(message)):
        env.calculate(expression)
    assert (env.calls, env.failures) == (1, 1)


def test_calculate_rejects_non_strings():
    with pytest.raises(ValueError, match="must be a string"):
        CalculatorEnv().calculate(12)


@pytest.mark.parametrize("expression", ["1 / 0", "5 // 0", "5 % 0", "1 / (2 - 2)", "0 ** -1", "3.5 / 0.0"])
def test_division_by_zero_raises_zero_division_error(expression):
    env = CalculatorEnv()
    with pytest.raises(ZeroDivisionError, match="division by zero"):
        env.calculate(expression)
    assert env.failures == 1


def test_big_but_bounded_results_are_allowed():
    assert CalculatorEnv().calculate("2 ** 4095") == str(2**4095)
    with pytest.raises(ValueError, match="too large"):
        CalculatorEnv().calculate("2 ** 4096")


_integers = st.integers(min_value=-1000, max_value=1000).map(str)
_expressions = st.recursive(
    _integers,
    lambda children: st.tuples(children, st.sampled_from(["+", "-", "*"]), children).map(
        lambda parts: f"({parts[0]} {parts[1]} {parts[2]})"
    ),
    max_leaves=12,
)


@settings(max_examples=150, deadline=None)
@given(_expressions)
def test_calculate_agrees_with_python_on_integer_arithmetic(expression):
    assert CalculatorEnv().calculate(expression) == str(eval(expression))


def test_reset_stores_answer_and_zeroes_counters():
    env = CalculatorEnv()
    env.calculate("1 + 1")
    with pytest.raises(ValueError):
        env.calculate("oops")
    assert (env.calls, env.failures) == (2, 1)
    assert env.reset(prompt=[], answer="42", expression="40 + 2") is None
    assert (env.answer, env.calls, env.failures) == ("42", 0, 0)
    env.reset(prompt=[])
    assert env.answer is None


# ----------------------------------------------------------------------------------------------------------- tasks


def _operators(expression: str) -> list[str]:
    return [
        type(node.op).__name__ for node in ast.walk(ast.parse(expression, mode="eval")) if isinstance(node, ast.BinOp)
    ]


def _operands(expression: str) -> list[int]:
    return [node.value for node in ast.walk(ast.parse(expression, mode="eval")) if isinstance(node, ast.Constant)]


def test_tasks_are_deterministic_from_the_seed():
    first = make_arithmetic_tasks(50, seed=7, difficulty="hard")
    assert first == make_arithmetic_tasks(50, seed=7, difficulty="hard")
    assert first != make_arithmetic_tasks(50, seed=8, difficulty="hard")
    assert make_arithmetic_tasks(10, seed=7, difficulty="hard") == first[:10]
    assert make_arithmetic_tasks(0, seed=7) == []


@pytest.mark.parametrize("difficulty", ["easy", "medium", "hard"])
def test_tasks_are_well_formed(difficulty):
    tasks = make_arithmetic_tasks(200, seed=0, difficulty=difficulty)
    assert len(tasks) == 200
    for task in tasks:
        assert set(task) == {"prompt", "answer", "expression"}
        system, user = task["prompt"]
        assert system == {"role": "system", "content": SYSTEM_PROMPT}
        assert user["role"] == "user" and user["content"].endswith("?")
        assert isinstance(task["answer"], str) and task["answer"].isdigit()  # non-negative integer, as a string
        assert float(task["answer"]) == evaluate_expression(task["expression"])
        assert CalculatorEnv().calculate(task["expression"]) == task["answer"]  # the tool can solve it
        for operand in _operands(task["expression"]):  # every number the model needs is in the question
            assert re.search(rf"(?<!\d){operand}(?!\d)", user["content"]), (operand, user["content"])
    # Several templates are used (shopping and savings in dollars, travel, areas, sharing).
    questions = [task["prompt"][1]["content"] for task in tasks]
    for marker in ("$", " km", "square meters", "How many cookies" if difficulty == "hard" else "gives away"):
        assert any(marker in question for question in questions), marker
    assert len({re.sub(r"\d+", "N", question) for question in questions}) > 20
    assert len({task["answer"] for task in tasks}) > 100


def test_difficulty_controls_operations_and_operand_sizes():
    for task in make_arithmetic_tasks(100, seed=1, difficulty="easy"):
        assert len(_operators(task["expression"])) == 1 and _operators(task["expression"])[0] in ("Add", "Sub")
        assert all(10 <= operand <= 109 for operand in _operands(task["expression"]))
    for task in make_arithmetic_tasks(100, seed=1, difficulty="medium"):
        operators = _operators(task["expression"])
        assert len(operators) == 2 and "Mult" in operators
    for task in make_arithmetic_tasks(100, seed=1, difficulty="hard"):
        assert len(_operators(task["expression"])) == 3
    sizes = {
        difficulty: sum(int(t["answer"]) for t in make_arithmetic_tasks(100, seed=1, difficulty=difficulty)) / 100
        for difficulty in ("easy", "medium", "hard")
    }
    assert sizes["easy"] < 200 < sizes["medium"]


def test_invalid_task_arguments_are_rejected():
    with pytest.raises(ValueError, match="difficulty"):
        make_arithmetic_tasks(3, seed=0, difficulty="extreme")
    with pytest.raises(ValueError, match="non-negative"):
        make_arithmetic_tasks(-1, seed=0)


def test_system_prompt_asks_for_the_tool_and_the_answer_format():
    assert "`calculate`" in SYSTEM_PROMPT and "Answer: <number>" in SYSTEM_PROMPT
    assert len(SYSTEM_PROMPT) < 200


# --------------------------------------------------------------------------------------------------------- rewards


def _conversation(*contents: str | None, tool_results: tuple = ()) -> list[dict]:
    messages = [{"role": "tool", "name": "calculate", "content": result} for result in tool_results]
    return messages + [{"role": "assistant", "content": content} for content in contents]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The total is 57.\nAnswer: 57", 57.0),
        ("Answer: 1,234", 1234.0),
        ("**Answer:** $57", 57.0),
        ("answer = -3", -3.0),
        ("Answer: 2.5 dollars", 2.5),
        ("Answer: 12\nWait, no. Answer: 13", 13.0),  # the last one counts
        ("First 3 apples, then 5, so 8 in all.", 8.0),  # fallback: the last number
        ("I don't know.", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_answer_reward_reads_the_last_assistant_message():
    completions = [
        _conversation("Answer: 57"),
        _conversation("Answer: 56"),
        _conversation("It is 57"),
        _conversation("Answer: 1,234"),
        _conversation("Answer: 57", ""),  # the completion ended on an empty turn (e.g. a cut tool call)
        _conversation("Let me compute.", tool_results=("57",)) + [{"role": "assistant", "content": None}],
        [{"role": "assistant", "content": [{"type": "text", "text": "Answer: "}, {"type": "text", "text": "57"}]}],
        "Answer: 57",  # non-conversational completions work too
        [],
    ]
    answers = ["57", "57", "57", "1234", "57", "57", "57", 57, "57"]
    assert answer_reward(completions, answers) == [1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0]


def test_answer_reward_end_to_end_with_generated_tasks():
    tasks = make_arithmetic_tasks(5, seed=3)
    env = CalculatorEnv()
    completions = []
    for task in tasks:
        env.reset(**task)
        result = env.calculate(task["expression"])
        completions.append(_conversation(f"The result is {result}.\nAnswer: {result}", tool_results=(result,)))
    assert answer_reward(completions, [task["answer"] for task in tasks], prompts=None) == [1.0] * 5
    wrong = [_conversation(f"Answer: {int(task['answer']) + 1}") for task in tasks]
    assert answer_reward(wrong, [task["answer"] for task in tasks]) == [0.0] * 5


def test_tool_use_reward_counts_only_successful_tool_calls():
    """The bonus reads what the environment recorded (the tool returned or raised), never the text the model saw: a
    result that looks like TRL's error rendering is a success, a raised error is not (009b255 read the text)."""
    succeeded, failed, mixed, unused = CalculatorEnv(), CalculatorEnv(), CalculatorEnv(), CalculatorEnv()
    result = succeeded.calculate("2 + 3")
    with pytest.raises(ZeroDivisionError):
        failed.calculate("1 / 0")
    with pytest.raises(ValueError):
        mixed.calculate("2 ^ 3")
    mixed.calculate("2 ** 3")
    looks_like_an_error = str({"error": "division by zero"})
    completions = [
        _conversation("Answer: 5", tool_results=(looks_like_an_error,)),  # text is not read
        _conversation("Answer: 5", tool_results=(result,)),
        _conversation("Answer: 5", tool_results=(looks_like_an_error, "8")),
        _conversation("Answer: 5"),
    ]
    environments = [succeeded, failed, mixed, unused]
    assert tool_use_reward(completions, environments=environments) == [TOOL_USE_BONUS, 0.0, TOOL_USE_BONUS, 0.0]
    assert TOOL_USE_BONUS == 0.1
    with pytest.raises(ValueError, match="environment_factory=CalculatorEnv"):
        tool_use_reward(completions)


_OLD_ANSWER_PATTERN = re.compile(r"answer\s*[:=]\s*[*$\s]*(-?\d[\d,]*(?:\.\d+)?)", re.IGNORECASE)


@settings(max_examples=400, deadline=None)
@given(st.text(alphabet="Answer:= *$\t\n-0123456789,.x", max_size=60))
def test_the_answer_pattern_matches_what_it_matched_before(text):
    """The pattern without its redundant `\\s*` (a second quantifier over the same whitespace) finds the same answers
    in ASCII text."""
    from trl_agentic.envs.calculator import _ANSWER_PATTERN

    assert _ANSWER_PATTERN.findall(text) == _OLD_ANSWER_PATTERN.findall(text)


@pytest.mark.timeout(120)  # a guard against the hang, not a speed threshold: the old pattern needs tens of minutes
def test_a_long_run_of_spaces_after_answer_is_scored():
    """`"Answer:"` followed by 200,000 spaces and no number (a small model stuck on whitespace; SmolLM2 writes up to 81
    spaces a token): the old pattern backtracked in time quadratic in the run (8.8 s at 16,000 spaces)."""
    completion = [{"role": "assistant", "content": "Answer:" + " " * 200_000 + "none"}]
    assert answer_reward([completion], ["57"]) == [0.0]
    assert extract_answer("Answer:" + " " * 200_000 + "57") == 57.0


def test_a_unicode_minus_is_a_minus():
    """`−57` (U+2212, which `calculate` reads as a minus) is −57: it scored 1.0 against 57."""
    assert extract_answer("Answer: −57") == -57.0 and extract_answer("so −3") == -3.0
    assert answer_reward([[{"role": "assistant", "content": "Answer: −57"}]], ["57"]) == [0.0]
    assert answer_reward([[{"role": "assistant", "content": "Answer: −57"}]], ["-57"]) == [1.0]

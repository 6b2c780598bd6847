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
    ToolBonusCalculatorEnv,
    ToolCallBonusCalculatorEnv,
    answer_reward,
    evaluate_expression,
    extract_answer,
    make_arithmetic_tasks,
    tool_call_reward,
    tool_use_reward,
)
from trl_agentic.envs.protocol import check_checkpointable, checkpoint_env, restore_env, tool_methods


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
    for env, answer in zip((succeeded, failed, mixed, unused), ("5", "5", "8", "5"), strict=True):
        env.reset(answer=answer)
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


def _bonus(answer, *expressions: str, **row) -> float:
    """`tool_use_reward` of one episode with this answer and these calls (failed calls included), checked against
    `ToolBonusCalculatorEnv.get_reward`, which must agree."""
    rewards = []
    for factory in (CalculatorEnv, ToolBonusCalculatorEnv):
        env = factory()
        env.reset(question="q", **({} if answer is None else {"answer": answer}), **row)
        for expression in expressions:
            try:
                env.calculate(expression)
            except (ValueError, ZeroDivisionError):
                pass
        assert env.calls == len(expressions)
        rewards.append(tool_use_reward([[]], environments=[env])[0])
        if isinstance(env, ToolBonusCalculatorEnv):
            assert env.get_reward() == rewards[-1]
    assert rewards[0] == rewards[1]
    return rewards[0]


@pytest.mark.parametrize("useless", [("0",), ("1+1",), ("0", "1+1", "2 * 2"), ("1/0", "0")])
def test_a_useless_successful_call_earns_no_tool_bonus(useless):
    """A call that always succeeds but does none of the problem's work (`calculate("0")`, `calculate("1+1")`) earned
    the bonus on every problem whatever the answer (the rule was `calls > failures`): it earns nothing now."""
    assert _bonus("57", *useless) == 0.0


@pytest.mark.parametrize(
    "expressions",
    [
        ("55", "56", "57", "58", "59"),  # guess spam: an earlier guess was right, the last one is not
        ("55", "57", "58", "1 / 0"),  # a failed call after the last wrong guess changes nothing
        ("(12 + 7) * 3", "0"),  # the answer, then a useless call that succeeds
        ("(12 + 7) * 3", "1 / 0", "1 + 1", "x"),
    ],
)
def test_the_tool_bonus_reads_only_the_last_successful_call(expressions):
    """Up to 32 calls fit in a turn, so "any call returned the answer" paid bare-number guessing (`calculate("55")`,
    `calculate("56")`, ...) whenever one guess was right: only the last successful call counts now."""
    assert _bonus("57", *expressions) == 0.0


@pytest.mark.parametrize(
    "expressions",
    [
        ("55", "56", "57"),  # guess spam still wins when the last guess is right (documented)
        ("0", "(12 + 7) * 3", "1 / 0", "2 ^ 3"),  # failed calls after the answer do not cancel it
    ],
)
def test_the_tool_bonus_is_paid_when_the_last_successful_call_returned_the_answer(expressions):
    assert _bonus("57", *expressions) == TOOL_USE_BONUS


def test_the_answer_comparison_has_an_absolute_tolerance_only():
    """`math.isclose`'s default relative tolerance (1e-9) made 2000000001 equal 2000000000, for the final answer and
    for the tool bonus: only the documented absolute tolerance of 1e-6 applies now."""
    final = [[{"role": "assistant", "content": "Answer: 2000000001"}]]
    assert answer_reward(final, ["2000000000"]) == [0.0]
    assert answer_reward(final, ["2,000,000,001"]) == [1.0]
    assert _bonus("2000000000", "2000000001") == 0.0
    assert _bonus("2000000000", "1999999999 + 1") == TOOL_USE_BONUS
    assert _bonus("2000000000", "2000000000 + 0.0000005") == TOOL_USE_BONUS  # within 1e-6


@pytest.mark.parametrize(
    ("answer", "expressions"),
    [
        ("57", ("(12 + 7) * 3",)),
        ("57", ("(12 + 7) * 3", "1 / 0")),  # a failed call after the answering one does not take the bonus away
        ("57", ("2 ^ 3", "0", "(12 + 7) * 3", "x")),  # nor do failed or useless calls around it
        ("42", ("84 / 2",)),  # the value is 42.0
        ("42.0", ("6 * 7",)),
        (42, ("6 * 7",)),  # an answer column of numbers
        (42.0, ("6 * 7",)),
        ("1,234", ("1000 + 234",)),  # thousands separators, as `answer_reward` reads them
        ("3.5", ("7 / 2",)),
        ("0.333333", ("1 / 3",)),  # equal within 1e-6, as `answer_reward` compares
        ("-3", ("2 - 5",)),
    ],
)
def test_a_call_that_returned_the_answer_earns_the_tool_bonus(answer, expressions):
    assert _bonus(answer, *expressions) == TOOL_USE_BONUS


@pytest.mark.parametrize(
    ("answer", "expressions"),
    [
        ("57", ()),
        ("57", ("1 / 0",)),  # a failed call only
        ("57", ("2 ^ 3", "57 +", "x")),
        ("57", ("57.01",)),  # close is not equal
        ("57", ("2 ** 4000",)),  # an integer too large for a float is no match, and no error
        (None, ("6 * 7",)),  # a row without an answer: no bonus
        ("forty-two", ("6 * 7",)),  # an answer that is not a number: no bonus
    ],
)
def test_no_tool_bonus_without_a_call_that_returned_the_answer(answer, expressions):
    assert _bonus(answer, *expressions) == 0.0


def test_the_tool_bonus_agrees_with_answer_reward_on_what_equals_the_answer():
    """A call's value earns the bonus exactly when the same number, given as the final answer, earns `answer_reward`."""
    answers = ["57", "1,234", "42", "3.5", "0.333333", "-3", "forty-two", None]
    for expression in ("57", "1000 + 234", "84 / 2", "7 / 2", "1 / 3", "2 - 5", "57.01", "0"):
        value = evaluate_expression(expression)
        for answer in answers:
            final = [{"role": "assistant", "content": f"Answer: {value!r}"}]
            assert (_bonus(answer, expression) == TOOL_USE_BONUS) == (answer_reward([final], [answer]) == [1.0]), (
                expression,
                answer,
            )


def test_reset_clears_the_last_call_flag():
    env = ToolBonusCalculatorEnv()
    assert env.last_call_answered is False
    env.reset(answer="57")
    env.calculate("19 * 3")
    assert env.last_call_answered is True and env.get_reward() == TOOL_USE_BONUS
    env.reset(answer="58")
    assert (env.calls, env.failures, env.last_call_answered) == (0, 0, False) and env.get_reward() == 0.0


@pytest.mark.parametrize("factory", [CalculatorEnv, ToolBonusCalculatorEnv])
def test_a_rollback_before_the_answering_call_removes_the_tool_bonus(factory):
    """The last call's flag is environment state: restoring a checkpoint taken before the answering call (the
    rollout loop's rollback, and a timed-out call's restore onto a fresh instance: `checkpoint_env`/`restore_env`)
    takes the bonus back; restoring one taken after it keeps it."""
    env = factory()
    check_checkpointable(env)
    env.reset(answer="57")
    env.calculate("1 + 1")
    before = checkpoint_env(env)
    env.calculate("19 * 3")
    after = checkpoint_env(env)
    assert tool_use_reward([[]], environments=[env]) == [TOOL_USE_BONUS]

    restore_env(env, before)  # a rollback to the turn before the answering call
    assert (env.calls, env.failures, env.last_call_answered) == (1, 0, False)
    assert tool_use_reward([[]], environments=[env]) == [0.0]
    fresh = factory()  # a timed-out call: the rollout continues on a fresh instance holding the state before it
    restore_env(fresh, before)
    assert fresh.last_call_answered is False and tool_use_reward([[]], environments=[fresh]) == [0.0]

    restore_env(env, after)
    assert env.last_call_answered is True and tool_use_reward([[]], environments=[env]) == [TOOL_USE_BONUS]
    if isinstance(env, ToolBonusCalculatorEnv):
        assert env.get_reward() == TOOL_USE_BONUS
        restore_env(env, before)
        assert env.get_reward() == 0.0


@pytest.mark.parametrize("factory", [CalculatorEnv, ToolBonusCalculatorEnv])
def test_a_rollback_before_a_useless_last_call_restores_the_tool_bonus(factory):
    """A useless call after the answering one takes the bonus away; rolling it back (a restore of the state before
    it) gives the bonus back, as the flag is restored with the rest of the state."""
    env = factory()
    env.reset(answer="57")
    env.calculate("19 * 3")
    answered = checkpoint_env(env)
    env.calculate("0")
    assert env.last_call_answered is False and tool_use_reward([[]], environments=[env]) == [0.0]
    restore_env(env, answered)
    assert env.last_call_answered is True and tool_use_reward([[]], environments=[env]) == [TOOL_USE_BONUS]
    fresh = factory()  # a timed-out useless call: the rollout continues on a fresh instance
    restore_env(fresh, answered)
    assert tool_use_reward([[]], environments=[fresh]) == [TOOL_USE_BONUS]


def test_the_bonus_environments_expose_only_calculate_as_a_tool():
    """The rewards' helpers are private (TRL makes every public method of an environment a tool)."""
    for factory in (CalculatorEnv, ToolBonusCalculatorEnv, ToolCallBonusCalculatorEnv):
        assert list(tool_methods(factory())) == ["calculate"], factory


_OPERATORS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b, "//": lambda a, b: a // b}
_call = st.one_of(
    st.tuples(st.integers(-30, 30), st.sampled_from(sorted(_OPERATORS)), st.integers(-30, 30)),
    st.sampled_from(["1 / 0", "2 ^ 3", "x", "", "0", "(1 +"]),
)


@settings(max_examples=300, deadline=None)
@given(
    answer=st.integers(-100, 100),
    spelling=st.sampled_from([str, float, int, lambda n: f"{n:,}", lambda n: f"{n}.0"]),
    calls=st.lists(_call, max_size=6),
)
def test_the_tool_bonus_is_paid_exactly_when_the_last_returned_value_equals_the_answer(answer, spelling, calls):
    """Both rewards against a plain loop over the calls (integer arithmetic in Python, no tolerance needed):
    `tool_use_reward` pays when the last successful call's value equals the answer, `tool_call_reward` when any call
    succeeded."""
    env = ToolBonusCalculatorEnv()
    env.reset(answer=spelling(answer))
    last_value, failures = None, 0
    for call in calls:
        if isinstance(call, str):  # the fixed expressions: only "0" succeeds
            expression, value = call, (0 if call == "0" else None)
        else:
            left, symbol, right = call
            expression = f"{left} {symbol} ({right})"
            value = None if symbol == "//" and right == 0 else _OPERATORS[symbol](left, right)
        try:
            env.calculate(expression)
        except (ValueError, ZeroDivisionError):
            assert value is None, expression
            failures += 1
            continue
        assert value is not None, expression
        last_value = value
    assert (env.calls, env.failures) == (len(calls), failures)
    expected = TOOL_USE_BONUS if last_value is not None and last_value == answer else 0.0
    assert tool_use_reward([[]], environments=[env]) == [expected]
    assert env.get_reward() == expected
    any_success = TOOL_USE_BONUS if failures < len(calls) else 0.0
    assert tool_call_reward([[]], environments=[env]) == [any_success]


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


def test_the_tiny_policy_bonus_pays_any_successful_call_and_rolls_back():
    """The shaping bonus of the benchmarks, the vLLM tests and `configs/tracin.yaml` (`tool_call_reward`,
    `ToolCallBonusCalculatorEnv.get_reward`) pays a call that returned, the answer or not (the tiny policy's one good
    call computes 6*7), unlike `tool_use_reward`."""
    env = ToolCallBonusCalculatorEnv()
    env.reset(answer="5")
    state = checkpoint_env(env)
    with pytest.raises(ZeroDivisionError):
        env.calculate("1/0")
    assert env.get_reward() == 0.0 and tool_call_reward([[]], environments=[env]) == [0.0]
    env.calculate("6*7")
    assert env.get_reward() == TOOL_USE_BONUS and tool_call_reward([[]], environments=[env]) == [TOOL_USE_BONUS]
    assert tool_use_reward([[]], environments=[env]) == [0.0]  # 42 is not the answer
    restore_env(env, state)
    assert env.get_reward() == 0.0
    env.calculate("0")  # farmable
    assert env.get_reward() == TOOL_USE_BONUS
    with pytest.raises(ValueError, match="`tool_call_reward` reads the calls"):
        tool_call_reward([[]])

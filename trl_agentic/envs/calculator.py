"""Arithmetic word problems solved with a calculator tool: the environment, a task generator and reward functions."""

import ast
import math
import operator
import random
import re
from collections.abc import Callable
from typing import Any

SYSTEM_PROMPT = (
    "Solve the math problem. Use the `calculate` tool for the arithmetic, then give the final answer on its own "
    'line as "Answer: <number>".'
)
TOOL_USE_BONUS = 0.1

# Bounds that keep every evaluation fast, whatever the model sends.
_MAX_EXPRESSION_CHARS = 500
_MAX_NODES = 200
_MAX_BITS = 4096  # about 1233 decimal digits
_BINARY_OPERATORS: dict[type, Callable] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY_OPERATORS: dict[type, Callable] = {ast.USub: operator.neg, ast.UAdd: operator.pos}
_SYMBOLS = {ast.BitXor: "^", ast.BitAnd: "&", ast.BitOr: "|", ast.LShift: "<<", ast.RShift: ">>", ast.MatMult: "@"}
_ALLOWED = "only numbers, parentheses and the operators + - * / // % ** are allowed"


def _check_size(value: int | float) -> int | float:
    if isinstance(value, int) and value.bit_length() > _MAX_BITS:
        raise ValueError(f"Result too large (more than {_MAX_BITS} bits).")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("Result too large (not a finite number).")
    if isinstance(value, complex):
        raise ValueError("The result is not a real number.")
    return value


def _evaluate_node(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant):
        if type(node.value) in (int, float):  # not bool, complex or str
            return _check_size(node.value)
        raise ValueError(f"Unsupported constant {node.value!r}: {_ALLOWED}.")
    if isinstance(node, ast.BinOp):
        operator_type = type(node.op)
        if operator_type not in _BINARY_OPERATORS:
            symbol = _SYMBOLS.get(operator_type, operator_type.__name__)
            hint = " (use ** for powers)" if symbol == "^" else ""
            raise ValueError(f"Unsupported operator {symbol!r}{hint}: {_ALLOWED}.")
        left, right = _evaluate_node(node.left), _evaluate_node(node.right)
        if operator_type is ast.Pow:
            # Check before computing: 2 ** 10 ** 10 must fail instantly, not after minutes of work. The result has
            # at least (bits(left) - 1) * right bits; a negative exponent gives a float, and float powers are O(1) and
            # overflow (or underflow to 0.0) on their own.
            if isinstance(left, int) and isinstance(right, int) and abs(left) > 1:
                if right > 0 and (abs(left).bit_length() - 1) * right > _MAX_BITS:
                    raise ValueError(f"Result too large (more than {_MAX_BITS} bits).")
        if operator_type in (ast.Div, ast.FloorDiv, ast.Mod) and right == 0:
            raise ZeroDivisionError("division by zero")
        try:
            return _check_size(_BINARY_OPERATORS[operator_type](left, right))
        except OverflowError:
            raise ValueError("Result too large.") from None
        except ZeroDivisionError:  # e.g. 0 ** -1
            raise ZeroDivisionError("division by zero") from None
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY_OPERATORS:
        return _UNARY_OPERATORS[type(node.op)](_evaluate_node(node.operand))
    if isinstance(node, ast.Name):
        raise ValueError(f"Unknown name {node.id!r}: {_ALLOWED}.")
    if isinstance(node, ast.Call):
        raise ValueError(f"Function calls are not supported: {_ALLOWED}.")
    raise ValueError(f"Unsupported syntax {type(node).__name__}: {_ALLOWED}.")


def evaluate_expression(expression: str) -> int | float:
    """
    Safely evaluates an arithmetic expression (no names, calls or attribute access; bounded size and exponents).

    Args:
        expression (`str`):
            For example `"(12 + 7) * 3"`. `×`, `÷` and `−` are accepted for `*`, `/` and `-`.

    Returns:
        `int` or `float`: The value (`/` always gives a `float`).

    Raises:
        `ValueError`: If the expression is malformed, uses anything but arithmetic, or its result is too large.
        `ZeroDivisionError`: On division or modulo by zero.
    """
    if not isinstance(expression, str):
        raise ValueError(f"The expression must be a string, got {type(expression).__name__}.")
    text = expression.strip().replace("×", "*").replace("÷", "/").replace("−", "-")
    if not text:
        raise ValueError("Empty expression.")
    if len(text) > _MAX_EXPRESSION_CHARS:
        raise ValueError(f"Expression too long ({len(text)} characters, at most {_MAX_EXPRESSION_CHARS}).")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"Invalid expression {expression!r}: {exc.msg}.") from None
    except ValueError as exc:  # e.g. an integer literal with too many digits
        raise ValueError(f"Invalid expression {expression!r}: {exc}.") from None
    if sum(1 for _ in ast.walk(tree)) > _MAX_NODES:
        raise ValueError(f"Expression too complex (more than {_MAX_NODES} syntax nodes).")
    return _evaluate_node(tree.body)


def format_number(value: int | float) -> str:
    """
    Formats a calculator result: integers (and integral floats) without `.0`, other floats with 12 significant digits.

    Args:
        value (`int` or `float`):
            The number to format.

    Returns:
        `str`: E.g. `"42"` for `42.0`, `"0.333333333333"` for `1 / 3`.
    """
    if isinstance(value, float):
        if value.is_integer() and abs(value) < 2**53:
            return str(int(value))
        return f"{value:.12g}"
    return str(value)


class CalculatorEnv:
    """
    TRL environment with one tool, `calculate`, for arithmetic word problems (see `make_arithmetic_tasks`).

    Invalid expressions raise `ValueError` and division by zero raises `ZeroDivisionError`: these are the model's
    errors, which the trainer shows to the model as tool errors. The episode's bookkeeping (reset with the episode) is
    plain instance attributes, so a rollback or a timed-out call's restore (the default deep copy of the instance
    attributes, `trl_agentic.envs.protocol.checkpoint_env`) rolls it back with the rest of the state:

    - `calls` and `failures` count the `calculate` calls and the failed ones (metrics, and `tool_call_reward`).
    - `last_call_answered` is whether the episode's last *successful* `calculate` call returned the row's `answer`
      (compared as `answer_reward` compares numbers); `False` before any successful call, unchanged by a failed one.
      `tool_use_reward` pays for it.
    """

    def __init__(self):
        self.answer: str | None = None
        self.calls = 0
        self.failures = 0
        self.last_call_answered = False

    def reset(self, **row) -> None:
        """
        Starts an episode: stores the row's `answer` (if any) and zeroes the counters and `last_call_answered`.

        Args:
            **row: The dataset row.
        """
        self.answer = row.get("answer")
        self.calls = 0
        self.failures = 0
        self.last_call_answered = False

    def calculate(self, expression: str) -> str:
        """
        Evaluate an arithmetic expression and return its value.

        Supports numbers, parentheses and the operators + - * / // % ** (for example "(12 + 7) * 3").

        Args:
            expression: The arithmetic expression to evaluate, for example "(12 + 7) * 3".

        Returns:
            The value of the expression.
        """
        self.calls += 1
        try:
            value = evaluate_expression(expression)
            result = format_number(value)
        except Exception:
            self.failures += 1
            raise
        self.last_call_answered = _matches_answer(value, self.answer)
        return result


# ------------------------------------------------------------------------------------------------------- task generator

_NAMES = ["Ava", "Ben", "Chloe", "Diego", "Emma", "Farid", "Grace", "Hiro", "Isla", "Jonas", "Kira", "Liam", "Maya"]
_ITEMS = ["notebooks", "pens", "mugs", "plants", "books", "lamps", "scarves", "puzzles", "candles", "backpacks"]
_THINGS = ["marbles", "stickers", "stamps", "cards", "shells", "coins", "beads", "pencils"]
_DIFFICULTIES = ("easy", "medium", "hard")


def _shopping(rng: random.Random, difficulty: str) -> tuple[str, str]:
    name, (item1, item2) = rng.choice(_NAMES), rng.sample(_ITEMS, 2)
    if difficulty == "easy":
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        if rng.random() < 0.5:
            return (
                f"{name} spends ${a} on {item1} and ${b} on {item2}. How many dollars does {name} spend?",
                f"{a} + {b}",
            )
        a, b = max(a, b) + 10, min(a, b)
        return f"{name} has ${a} and spends ${b} on {item1}. How many dollars does {name} have left?", f"{a} - {b}"
    if difficulty == "medium":
        q, p, fee = rng.randint(11, 99), rng.randint(12, 999), rng.randint(100, 999)
        question = f"{name} buys {q} {item1} at ${p} each and pays a ${fee} delivery fee. How many dollars is that?"
        return question, f"{q} * {p} + {fee}"
    q1, p1, q2, p2 = rng.randint(11, 99), rng.randint(12, 999), rng.randint(11, 99), rng.randint(12, 999)
    question = f"{name} buys {q1} {item1} at ${p1} each and {q2} {item2} at ${p2} each. How many dollars is that?"
    return question, f"{q1} * {p1} + {q2} * {p2}"


def _travel(rng: random.Random, difficulty: str) -> tuple[str, str]:
    if difficulty == "easy":
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        if rng.random() < 0.5:
            return (
                f"A train travels {a} km before noon and {b} km after noon. How many km does it travel?",
                f"{a} + {b}",
            )
        a, b = max(a, b) + 10, min(a, b)
        return f"A trail is {a} km long. After hiking {b} km, how many km are left?", f"{a} - {b}"
    if difficulty == "medium":
        v, t, d = rng.randint(40, 130), rng.randint(11, 30), rng.randint(100, 999)
        question = f"A bus drives {t} hours at {v} km per hour, then {d} km more. How many km does it drive in total?"
        return question, f"{v} * {t} + {d}"
    t, v, back, stops = rng.randint(11, 30), rng.randint(40, 130), rng.randint(100, 999), rng.randint(2, 9)
    question = (
        f"A truck makes {stops} trips. On each trip it drives {t} hours at {v} km per hour, then {back} km back. "
        "How many km does it drive in total?"
    )
    return question, f"{stops} * ({t} * {v} + {back})"


def _sharing(rng: random.Random, difficulty: str) -> tuple[str, str]:
    name, thing = rng.choice(_NAMES), rng.choice(_THINGS)
    if difficulty == "easy":
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        if rng.random() < 0.5:
            return f"{name} has {a} {thing} and gets {b} more. How many {thing} does {name} have now?", f"{a} + {b}"
        a, b = max(a, b) + 10, min(a, b)
        return f"{name} has {a} {thing} and gives away {b}. How many {thing} does {name} have now?", f"{a} - {b}"
    if difficulty == "medium":
        bags, per = rng.randint(11, 99), rng.randint(12, 250)
        given = rng.randint(10, min(999, bags * per - 1))
        question = f"{name} has {bags} bags of {per} {thing} and gives away {given} {thing}. How many are left?"
        return question, f"{bags} * {per} - {given}"
    while True:  # rejection sampling keeps the answer an integer
        trays, per, classes, kept = rng.randint(11, 60), rng.randint(12, 99), rng.randint(3, 12), rng.randint(10, 999)
        if trays * per > kept and (trays * per - kept) % classes == 0:
            break
    question = (
        f"A baker makes {trays} trays of {per} cookies, keeps {kept} cookies, and shares the rest equally among "
        f"{classes} classes. How many cookies does each class get?"
    )
    return question, f"({trays} * {per} - {kept}) / {classes}"


def _area(rng: random.Random, difficulty: str) -> tuple[str, str]:
    if difficulty == "easy":
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        if rng.random() < 0.5:
            return f"Two gardens measure {a} and {b} square meters. What is their total area?", f"{a} + {b}"
        a, b = max(a, b) + 10, min(a, b)
        return f"A park covers {a} square meters and a pond {b} of them. How many are land?", f"{a} - {b}"
    if difficulty == "medium":
        length, width = rng.randint(11, 99), rng.randint(11, 99)
        rug = rng.randint(10, min(999, length * width - 1))
        question = (
            f"A hall is {length} m long and {width} m wide, and a rug covers {rug} square meters. "
            "How many square meters of floor are not covered?"
        )
        return question, f"{length} * {width} - {rug}"
    l1, w1, l2, w2 = rng.randint(11, 99), rng.randint(11, 99), rng.randint(11, 99), rng.randint(11, 99)
    question = (
        f"A house has a {l1} m by {w1} m hall and a {l2} m by {w2} m garage. "
        "What is their combined area in square meters?"
    )
    return question, f"{l1} * {w1} + {l2} * {w2}"


def _savings(rng: random.Random, difficulty: str) -> tuple[str, str]:
    name = rng.choice(_NAMES)
    if difficulty == "easy":
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        if rng.random() < 0.5:
            return f"{name} saves ${a} in May and ${b} in June. How many dollars does {name} save?", f"{a} + {b}"
        a, b = max(a, b) + 10, min(a, b)
        return f"{name} has ${a} saved and spends ${b}. How many dollars are left?", f"{a} - {b}"
    if difficulty == "medium":
        wage, hours, rent = rng.randint(12, 99), rng.randint(11, 99), rng.randint(100, 999)
        rent = min(rent, wage * hours - 1)
        question = f"{name} earns ${wage} an hour for {hours} hours and pays ${rent} rent. How many dollars are left?"
        return question, f"{wage} * {hours} - {rent}"
    weeks, pay, spent, bonus = rng.randint(11, 52), rng.randint(200, 999), rng.randint(100, 199), rng.randint(100, 999)
    question = (
        f"{name} earns ${pay} a week and spends ${spent} a week. After {weeks} weeks {name} also gets a ${bonus} "
        f"bonus. How many dollars has {name} saved?"
    )
    return question, f"{weeks} * ({pay} - {spent}) + {bonus}"


_TEMPLATES = (_shopping, _travel, _sharing, _area, _savings)


def make_arithmetic_tasks(n: int, seed: int, difficulty: str = "medium") -> list[dict]:
    """
    Generates arithmetic word problems (shopping, travel, sharing, areas, savings), deterministically from `seed`.

    Difficulty sets the operand sizes and the number of operations: `"easy"` is one `+`/`-` on two 2-digit numbers,
    `"medium"` two operations including a `*` on 2-3 digit numbers, `"hard"` three operations (products, sums and an
    exact division). Every answer is a non-negative integer.

    Args:
        n (`int`):
            Number of tasks.
        seed (`int`):
            Random seed: the same `(n, seed, difficulty)` always gives the same tasks.
        difficulty (`str`, *optional*, defaults to `"medium"`):
            `"easy"`, `"medium"` or `"hard"`.

    Returns:
        `list[dict]`: Tasks with a conversational `prompt` (system prompt + question), the `answer` as a decimal
        string (e.g. `"1234"`, a string so the dataset column has one type) and the ground-truth `expression`.
    """
    if difficulty not in _DIFFICULTIES:
        raise ValueError(f"`difficulty` must be one of {_DIFFICULTIES}, got {difficulty!r}.")
    if n < 0:
        raise ValueError(f"`n` must be non-negative, got {n}.")
    rng = random.Random(seed)
    tasks = []
    for _ in range(n):
        question, expression = rng.choice(_TEMPLATES)(rng, difficulty)
        value = evaluate_expression(expression)
        assert value == int(value) and value >= 0, (expression, value)  # the templates guarantee this
        tasks.append(
            {
                "prompt": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}],
                "answer": str(int(value)),
                "expression": expression,
            }
        )
    return tasks


# ------------------------------------------------------------------------------------------------------ reward functions

# One quantifier over the whitespace after the colon: `\s*[*$\s]*` matched the same language, but backtracked in time
# quadratic in a run of spaces with no digit after it (16 s to score a 509-token completion of spaces).
_ANSWER_PATTERN = re.compile(r"answer\s*[:=][*$\s]*([-\u2212]?\d[\d,]*(?:\.\d+)?)", re.IGNORECASE)
_NUMBER_PATTERN = re.compile(r"[-\u2212]?\d[\d,]*(?:\.\d+)?")


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content blocks: [{"type": "text", "text": ...}, ...]
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return ""


def _final_assistant_text(completion: Any) -> str:
    if isinstance(completion, str):
        return completion
    for message in reversed(completion):
        if message.get("role") == "assistant":
            return _text(message.get("content"))
    return ""


def extract_answer(text: str) -> float | None:
    """
    Parses the final answer of a completion: the last `"Answer: <number>"`, else the last number in the text.

    Args:
        text (`str`):
            The final assistant message.

    Returns:
        `float` or `None`: The number (thousands separators allowed), or `None` if there is none.
    """
    matches = _ANSWER_PATTERN.findall(text) or _NUMBER_PATTERN.findall(text)
    if not matches:
        return None
    try:
        return float(matches[-1].replace(",", "").replace("\u2212", "-"))  # U+2212 is a minus (`calculate` reads it)
    except ValueError:
        return None


def _matches_answer(value: int | float | None, truth: Any) -> bool:
    """
    Whether a number equals a ground-truth answer: the comparison of `answer_reward` (and of the tool-use bonus).

    Args:
        value (`int`, `float` or `None`):
            The number to check (a parsed final answer, a `calculate` result).
        truth (`Any`):
            The ground truth, a string or a number; thousands separators are allowed (`"1,234"`).

    Returns:
        `bool`: `True` if both are numbers and differ by at most 1e-6 (an absolute tolerance only: 2000000001 does not
        match 2000000000). `False` for no value, a ground truth that is not a number (`None` included: a row without
        an `answer`) or an integer too large for a float.
    """
    if value is None:
        return False
    try:
        return math.isclose(value, float(str(truth).replace(",", "")), rel_tol=0.0, abs_tol=1e-6)
    except (ValueError, OverflowError):
        return False


def answer_reward(completions: list, answer: list, **kwargs) -> list[float]:
    """
    TRL reward function: 1.0 if the final answer equals the ground truth, else 0.0.

    The final answer is read from the *last* assistant message only, as `"Answer: <number>"`, falling back to the last
    number in that message. A completion cut after a tool call (the tool-round limit, the token budget) is read from
    that call's turn: its text outside the call (`"Answer: 57 <tool_call>..."` scores 1.0 when 57 is right), not from
    an earlier turn.

    Args:
        completions (`list`):
            One message list per completion (plain strings are accepted too).
        answer (`list`):
            The ground-truth answers (the dataset's `answer` column), as strings or numbers.
        **kwargs: Other dataset columns and trainer arguments (ignored).

    Returns:
        `list[float]`: One reward per completion.
    """
    return [
        1.0 if _matches_answer(extract_answer(_final_assistant_text(completion)), truth) else 0.0
        for completion, truth in zip(completions, answer, strict=True)
    ]


def _tool_use_bonus(env: CalculatorEnv) -> float:
    """The bonus of `tool_use_reward` and `ToolBonusCalculatorEnv.get_reward` for one rollout."""
    return TOOL_USE_BONUS if env.last_call_answered else 0.0


def _tool_call_bonus(env: CalculatorEnv) -> float:
    """The bonus of `tool_call_reward` and `ToolCallBonusCalculatorEnv.get_reward` for one rollout."""
    return TOOL_USE_BONUS if env.calls > env.failures else 0.0


def _environment_rewards(
    name: str, bonus: Callable[[CalculatorEnv], float], completions: list, environments: list | None
) -> list[float]:
    if environments is None:
        raise ValueError(
            f"`{name}` reads the calls from the environments: train with `environment_factory=CalculatorEnv`."
        )
    return [bonus(env) for env in environments[: len(completions)]]


class ToolBonusCalculatorEnv(CalculatorEnv):
    """`CalculatorEnv` that owns `tool_use_reward`'s bonus through TRL's `get_reward` protocol.

    TRL calls `get_reward()` when a rollout ends, while the environment still holds that rollout's state, and adds the
    result as a reward column (named after this class, weight 1). Use it where reward functions get no
    `environments` argument: TRL's asynchronous trainer (`AsyncAgenticGRPOTrainer`) does not pass one.
    """

    def get_reward(self) -> float:
        """`TOOL_USE_BONUS` if the rollout's last successful `calculate` call returned the row's answer, else 0.0 (the
        rule of `tool_use_reward`, by the same code)."""
        return _tool_use_bonus(self)


def tool_use_reward(completions: list, environments: list | None = None, **kwargs) -> list[float]:
    """
    TRL reward function: a small bonus (`TOOL_USE_BONUS`, 0.1) for completions whose last successful `calculate` call
    returned the answer.

    The bonus is paid when the rollout's *last* successful `calculate` call returned the row's `answer`, compared as
    `answer_reward` compares a final answer (thousands separators allowed, an absolute tolerance of 1e-6: `"42"`
    matches `42.0`). Failed calls neither earn nor cancel it; a later successful call that returns anything else
    cancels it. What this rules out: farming it with calls that do none of the problem's work (`calculate("0")`,
    `calculate("1+1")`, on their own or after the answering call). What it does not: a rollout can still guess,
    e.g. a turn of bare-number calls `calculate("40")`, `calculate("41")`, ... (up to 32 calls a turn), and earns the
    bonus when its last guess is the answer, with no arithmetic; and a call of the answer itself (`calculate("57")`,
    once the model knows 57) earns it. A row without an `answer` (or with one that is not a number) never earns it.
    The environment records the flag (`CalculatorEnv.last_call_answered`, set from the value `calculate` computed, not
    from its text), so nothing is read from the text the model saw, and a rollback or a timed-out call's restore
    restores it with the rest of the state. Meant to be combined with `answer_reward` early in training, with
    `environment_factory=CalculatorEnv` (TRL passes `environments`). For a policy whose rollouts never reach the
    answer (a short demo, a tiny model), this bonus gives no reward spread: see `tool_call_reward`.

    Args:
        completions (`list`):
            One message list per completion.
        environments (`list[CalculatorEnv]`):
            The completions' environments, as TRL passes them to reward functions.
        **kwargs: Dataset columns and trainer arguments (ignored).

    Returns:
        `list[float]`: `TOOL_USE_BONUS` or 0.0 per completion.

    Raises:
        ValueError: Without `environments` (the calculator is not the trainer's environment).
    """
    return _environment_rewards("tool_use_reward", _tool_use_bonus, completions, environments)


class ToolCallBonusCalculatorEnv(CalculatorEnv):
    """`CalculatorEnv` that owns `tool_call_reward`'s shaping bonus through TRL's `get_reward` protocol (for TRL's
    asynchronous trainer, which passes no `environments` to reward functions; see `ToolBonusCalculatorEnv`)."""

    def get_reward(self) -> float:
        """`TOOL_USE_BONUS` once a `calculate` call returned (whatever its value), else 0.0 (the rule of
        `tool_call_reward`, by the same code)."""
        return _tool_call_bonus(self)


def tool_call_reward(completions: list, environments: list | None = None, **kwargs) -> list[float]:
    """
    TRL reward function, a shaping reward: `TOOL_USE_BONUS` (0.1) for completions with any `calculate` call that
    returned, whatever its value.

    A policy can farm it with `calculate("0")`: it rewards calling the tool, not using it well. It is meant for short
    demos and tiny policies whose rollouts never reach the answer, where `tool_use_reward` would be 0 for every
    rollout and leave the groups without a reward spread. Failed calls neither earn nor cancel it. It reads the
    environment's counters (`CalculatorEnv.calls` and `failures`), which a rollback or a timed-out call's restore
    restores with the rest of the state.

    Args:
        completions (`list`):
            One message list per completion.
        environments (`list[CalculatorEnv]`):
            The completions' environments, as TRL passes them to reward functions.
        **kwargs: Dataset columns and trainer arguments (ignored).

    Returns:
        `list[float]`: `TOOL_USE_BONUS` or 0.0 per completion.

    Raises:
        ValueError: Without `environments` (the calculator is not the trainer's environment).
    """
    return _environment_rewards("tool_call_reward", _tool_call_bonus, completions, environments)


# The environment class each bonus reads: `tasks.build_task` refuses it for another task before any model loads.
tool_use_reward.environment_class = CalculatorEnv
tool_call_reward.environment_class = CalculatorEnv

"""Function calls as the official checker reads them, and ground-truth calls as tool calls.

The checker takes a model's calls as Python call strings (`"mv(source='a.txt',destination='b')"`): BFCL's decoders
turn a structured call `{name: arguments}` into `name(k1=repr(v1),k2=repr(v2))` (`convert_to_function_call` in
`bfcl_eval.model_handler.utils`, not importable without the package's heavy dependencies), which [`format_call`]
reproduces. Ground-truth calls sometimes pass arguments by position (`"sort('final_report.pdf')"`); tool calls are
keyword-only, so [`ground_truth_call`] binds them to the API method's parameter names.
"""

from __future__ import annotations

import ast
import inspect
import keyword
from collections.abc import Callable
from typing import Any


def format_call(name: str, arguments: dict) -> str:
    """A structured call as the call string BFCL's decoders produce (and the checker evaluates).

    Raises:
        `TypeError`: For an argument name that is not a Python identifier, as Python's own call raises for a name the
            method does not take. BFCL's decoder pastes names into the string as they are, and the checker `eval`s
            it: a name such as `x=__import__('os').system(...),y` would run the model's code in the trainer.
    """
    for key in arguments:
        if not (isinstance(key, str) and key.isidentifier() and not keyword.iskeyword(key)):
            raise TypeError(f"{name}() got an unexpected keyword argument {key!r}")
    return f"{name}({','.join(f'{key}={value!r}' for key, value in arguments.items())})"


def run_call(call: str, method: Callable) -> Any:
    """Run a `format_call` string on the API method with the argument values the checker's `eval` of it gets: fresh
    objects (the APIs keep argument objects in their state, e.g. a tweet's `mentions` list, which must not alias the
    conversation's messages), and a `NameError` for a value Python's literal syntax cannot write (JSON's `NaN` is
    `nan`: the checker, and BFCL's inference, fail the call; natively it set a fuel level to nan and succeeded).
    Unlike the checker, a method name followed by `(` inside a string argument is not rewritten (BFCL's
    `_process_method_calls` inserts its instance's name there, which differs between the model's and the ground
    truth's runs).

    Args:
        call (`str`): A call string of `format_call` (keyword arguments only).
        method (`Callable`): The API instance's bound method.
    """
    node = ast.parse(call, mode="eval").body
    values = {
        keyword_.arg: eval(compile(ast.Expression(keyword_.value), "<call>", "eval"), {"__builtins__": {}})  # noqa: S307
        for keyword_ in node.keywords
    }
    return method(**values)


def parse_call(call: str) -> tuple[str, list, dict]:
    """
    Split a ground-truth call string into its name, positional and keyword arguments (literal values only).

    Args:
        call (`str`): e.g. `"mv(source='a', destination='b')"`.

    Returns:
        `tuple[str, list, dict]`: Name, positional arguments, keyword arguments.
    """
    node = ast.parse(call.strip(), mode="eval").body
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        raise ValueError(f"Not a plain function call: {call!r}")
    args = [ast.literal_eval(a) for a in node.args]
    kwargs = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
    return node.func.id, args, kwargs


def ground_truth_call(call: str, methods: dict) -> tuple[str, dict]:
    """
    A ground-truth call string as a tool call: its name and keyword arguments (positional ones bound to the API
    method's parameter names).

    Args:
        call (`str`): A ground-truth call string.
        methods (`dict`): Method name -> the API instance's bound method (to bind positional arguments).

    Returns:
        `tuple[str, dict]`: The function name and its arguments by name.
    """
    name, args, kwargs = parse_call(call)
    if args:
        bound = inspect.signature(methods[name]).bind_partial(*args, **kwargs)
        kwargs = dict(bound.arguments)
    return name, kwargs

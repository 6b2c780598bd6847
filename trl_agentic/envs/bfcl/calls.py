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


def format_call(name: str, arguments: dict) -> str:
    """A structured call as the call string BFCL's decoders produce (and the checker evaluates)."""
    return f"{name}({','.join(f'{key}={value!r}' for key, value in arguments.items())})"


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

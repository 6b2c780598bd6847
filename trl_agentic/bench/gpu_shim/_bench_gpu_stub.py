"""Shared pieces of the import stand-ins (see README.md in this folder)."""


class Unavailable:
    """A class that can be named (isinstance checks, annotations) but not used."""

    def __init__(self, *args, **kwargs):
        raise RuntimeError(
            f"{type(self).__name__} is an import stand-in of `make bench-gpu`: the real package is not installed."
        )


def unavailable(name: str):
    def function(*args, **kwargs):
        raise RuntimeError(f"{name} is an import stand-in of `make bench-gpu`: the real package is not installed.")

    function.__name__ = name
    return function


def module_getattr(module: str):
    def __getattr__(name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return unavailable(f"{module}.{name}")

    return __getattr__

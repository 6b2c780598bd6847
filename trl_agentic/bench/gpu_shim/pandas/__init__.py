"""Import stand-in for `pandas` (bench-gpu only; see ../README.md)."""

from _bench_gpu_stub import Unavailable, module_getattr


class DataFrame(Unavailable):
    pass


__getattr__ = module_getattr("pandas")

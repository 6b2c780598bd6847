"""Import stand-in for `pyarrow` (bench-gpu only; see ../README.md)."""

from _bench_gpu_stub import module_getattr

__getattr__ = module_getattr("pyarrow")

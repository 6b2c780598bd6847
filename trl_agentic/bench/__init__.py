"""Benchmarks (`make bench` = `python -m trl_agentic.bench --out docs/benchmarks.md`); see `tracin.py`."""

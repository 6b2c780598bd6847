"""The README's `make demo` table, written from a recorded run's `eval_results.json` (numbers come from the code the
README ships, never by hand).

`make demo-record` (after `time make demo` on a fresh clone) copies `outputs/quickstart/eval_results.json` to
`docs/demo/eval_results.json` with where it came from (commit, date, machine, the wall time of `make demo`) and
rewrites the README's block between its markers; `tests/test_readme_demo.py` checks that the README's block is
[`demo_block`] of the committed file.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time
from pathlib import Path

START = "<!-- demo-table:start -->"
END = "<!-- demo-table:end -->"
ROWS = (
    ("success_rate", "success rate"),
    ("tool_call_success_rate", "successful tool calls"),
    ("tool_success_rate", "problems with a successful tool call"),
)


def demo_block(recorded: dict | None) -> str:
    """The README block: the recorded run's provenance and its before/after table (`recorded`: the committed
    `docs/demo/eval_results.json`, or `None` when no run of this code has been recorded)."""
    lines = [START]
    if recorded is None:
        lines += [
            "`make demo` runs a short SFT warm start on synthetic tool-use traces, then GRPO with rollback and negative",
            "samples, evaluated on held-out problems before and after GRPO. No run of this code has been recorded yet:",
            '`time make demo` on a fresh clone, then `make demo-record WALL="<its wall time>"` writes this table from',
            "the run's `eval_results.json`.",
            "",
            "| held-out metric | before GRPO | after GRPO |",
            "| --- | --- | --- |",
            *(f"| {label} | pending | pending |" for _, label in ROWS),
        ]
        return "\n".join([*lines, END]) + "\n"
    source, run = recorded["source"], recorded["run"]
    stages = run["eval"]
    before, after = stages["before GRPO"], stages["after GRPO"]
    lines += [
        f"What `make demo` shows (recorded {source['date']} at commit `{source['commit']}`, {source['machine']}, "
        f"`make demo` {source['wall']}; details in [docs/quickstart.md](docs/quickstart.md)): a short SFT warm start on "
        f"synthetic tool-use traces, then {run['grpo_steps']} GRPO steps with rollback and negative samples, "
        f"evaluated on {run['num_eval_problems']} held-out problems before and after GRPO "
        f"({'greedy' if run['eval_decoding'] == 'greedy' else 'sampled at ' + run['eval_decoding']}; "
        "[docs/demo/eval_results.json](docs/demo/eval_results.json)):",
        "",
        "| held-out metric | before GRPO | after GRPO |",
        "| --- | --- | --- |",
        *(f"| {label} | {_percent(before[key])} | **{_percent(after[key])}** |" for key, label in ROWS),
    ]
    return "\n".join([*lines, END]) + "\n"


def _percent(value: float) -> str:
    return f"{100 * value:.1f} %"


def replace_block(readme: str, block: str) -> str:
    start, end = readme.find(START), readme.find(END)
    if start < 0 or end < start:
        raise RuntimeError(f"README.md has no {START} ... {END} block.")
    return readme[:start] + block.rstrip("\n") + readme[end + len(END) :]


def record(results: Path, wall: str, out: Path, readme: Path) -> dict:
    """Copy a run's `eval_results.json` to `out` with its provenance, and rewrite the README's block from it."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    try:
        cpu = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    except (OSError, StopIteration):
        cpu = platform.processor()
    recorded = {
        "source": {
            "commit": commit or "unknown",
            "date": time.strftime("%Y-%m-%d"),
            "machine": f"{os.cpu_count()} CPU cores ({cpu})",
            "wall": wall,
        },
        "run": json.loads(results.read_text()),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(recorded, indent=2) + "\n")
    readme.write_text(replace_block(readme.read_text(), demo_block(recorded)))
    return recorded


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m trl_agentic.reporting.demo_record", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--results", default="outputs/quickstart/eval_results.json")
    parser.add_argument("--wall", required=True, help="Wall time of `make demo`, e.g. '10 min 59 s'.")
    parser.add_argument("--out", default="docs/demo/eval_results.json")
    parser.add_argument("--readme", default="README.md")
    a = parser.parse_args(argv)
    record(Path(a.results), a.wall, Path(a.out), Path(a.readme))
    print(Path(a.readme).read_text().split(START)[1].split(END)[0])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

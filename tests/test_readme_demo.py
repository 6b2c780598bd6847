"""The README's `make demo` table is written from a recorded run's `eval_results.json` (issue 37)."""

import json
from pathlib import Path

from trl_agentic.reporting import demo_record

ROOT = Path(__file__).resolve().parents[1]
RECORDED = ROOT / "docs" / "demo" / "eval_results.json"


def _readme_block(text: str) -> str:
    start, end = text.index(demo_record.START), text.index(demo_record.END) + len(demo_record.END)
    return text[start:end] + "\n"


def test_the_readme_table_is_the_recorded_run():
    """The README shows the committed run's numbers (or says none is recorded), never numbers typed by hand."""
    recorded = json.loads(RECORDED.read_text()) if RECORDED.exists() else None
    assert _readme_block((ROOT / "README.md").read_text()) == demo_record.demo_block(recorded)


def _payload():
    # The shape `trl-agentic train` writes (trl_agentic/cli.py `_finish`; tests/test_demo.py checks it on a real run).
    def metrics(success, calls, problems):
        return {"success_rate": success, "tool_call_success_rate": calls, "tool_success_rate": problems}

    return {
        "eval": {"before GRPO": metrics(23 / 64, 0.883, 0.75), "after GRPO": metrics(36 / 64, 0.966, 0.90625)},
        "grpo_steps": 10,
        "num_eval_problems": 64,
        "eval_decoding": "T=0.8",
    }


def test_record_copies_the_run_and_writes_the_readme(tmp_path):
    results = tmp_path / "eval_results.json"
    results.write_text(json.dumps(_payload()))
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n{demo_record.START}\nold numbers\n{demo_record.END}\n\nrest\n")
    out = tmp_path / "docs" / "demo" / "eval_results.json"
    demo_record.record(results, "10 min 59 s", out, readme)
    recorded = json.loads(out.read_text())
    assert recorded["run"] == _payload() and recorded["source"]["wall"] == "10 min 59 s"
    text = readme.read_text()
    assert text.startswith("# x\n\n") and text.endswith("\n\nrest\n") and "old numbers" not in text
    block = _readme_block(text)
    assert block == demo_record.demo_block(recorded)
    # 23/64 = 35.9 %, 36/64 = 56.2 %; 88.3 % and 96.6 % of the calls; 75.0 % and 90.6 % of the problems.
    assert "| success rate | 35.9 % | **56.2 %** |" in block
    assert "| successful tool calls | 88.3 % | **96.6 %** |" in block
    assert "| problems with a successful tool call | 75.0 % | **90.6 %** |" in block
    assert "10 GRPO steps" in block and "64 held-out problems" in block and "sampled at T=0.8" in block
    assert "`make demo` 10 min 59 s" in block


def test_without_a_recorded_run_the_table_says_so():
    block = demo_record.demo_block(None)
    assert block.count("| pending | pending |") == 3 and "No run of this code has been recorded yet" in block

"""The configuration reference in docs/ is generated from the help texts and must be up to date."""

from pathlib import Path

from trl_agentic.docgen import render

DOC = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def test_configuration_reference_is_current():
    assert DOC.read_text() == render(), "docs/configuration.md is stale: run `python -m trl_agentic.docgen`"


def test_reference_lists_every_agentic_field():
    text = DOC.read_text()
    for name in (
        "enable_tool_rollback",
        "save_negative_samples",
        "group_baseline",
        "enable_context_snapshots",
        "snapshot_advantage",
        "advantage_estimator",
        "task",
    ):
        assert f"| `{name}` |" in text

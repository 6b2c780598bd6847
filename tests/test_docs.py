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


def test_relative_links_in_readme_and_docs_resolve():
    """Every relative markdown link of README.md and docs/*.md points at a file of the repository."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    broken = []
    for page in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(root)} -> {target}")
    assert not broken, broken

"""The configuration reference in docs/ is generated from the help texts and must be up to date."""

from pathlib import Path

import pytest

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


def _github_anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation (but `-` and `_`) dropped, spaces to `-`."""
    import re

    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_github_anchor_is_githubs():
    assert _github_anchor("Amendment 5 (2026-12-04): the log search's RL learning rate") == (
        "amendment-5-2026-12-04-the-log-searchs-rl-learning-rate"
    )
    assert _github_anchor("The verdicts over seeds 0–4, from `cells`") == "the-verdicts-over-seeds-04-from-cells"


def test_anchors_of_links_between_readme_and_docs_exist():
    """Every `page.md#anchor` link of README.md and docs/**/*.md (and `#anchor` within a page) names a heading of that
    page: a renamed heading breaks no link silently."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    pages = [root / "README.md", *sorted((root / "docs").rglob("*.md"))]
    broken = []
    for page in pages:
        for target, anchor in re.findall(r"\]\(([^)#\s]*)#([^)\s]+)\)", page.read_text()):
            linked = (page.parent / target) if target else page
            if "://" in target or linked.suffix != ".md" or not linked.exists():
                continue
            text = re.sub(r"```.*?```", "", linked.read_text(), flags=re.S)
            anchors = {_github_anchor(h) for h in re.findall(r"^#{1,6} (.+)$", text, flags=re.M)}
            if anchor not in anchors:
                broken.append(f"{page.relative_to(root)} -> {target}#{anchor}")
    assert not broken, broken


def test_reference_tables_keep_one_cell_per_column():
    """A `|` in a type or default (`int | None`) is escaped: GFM splits a table row on an unescaped pipe, even inside
    a code span."""
    import dataclasses

    from markdown_it import MarkdownIt

    from trl_agentic.config import AgenticGRPOConfig
    from trl_agentic.docgen import _default

    fields = {f.name: f for f in dataclasses.fields(AgenticGRPOConfig)}
    rows, row = [], None
    for token in MarkdownIt("commonmark").enable("table").parse(render()):
        if token.type == "tr_open":
            row = []
        elif token.type == "inline" and row is not None:
            row.append(token.content)
        elif token.type == "tr_close":
            rows.append(row)
            row = None
    assert len(rows) > 40 and all(len(r) == 4 for r in rows)
    optional = [r for r in rows if r[0] == "`max_tool_output_chars`"]
    assert optional == [[optional[0][0], "`int | None`", "`None`", optional[0][3]]]
    for name, _kind, default, _ in rows[1:]:
        if name.strip("`") in fields:
            assert default == f"`{_default(fields[name.strip('`')])}`"


@pytest.mark.parametrize("argv, code", [(["--help"], 0), (["-h"], 0), (["--out", "x.md"], 2), (["a.md", "b.md"], 2)])
def test_docgen_writes_no_file_named_like_an_option(argv, code, tmp_path, monkeypatch, capsys):
    """`python -m trl_agentic.docgen --help` wrote the reference into a file named `--help`."""
    from trl_agentic.docgen import main

    monkeypatch.chdir(tmp_path)
    assert main(argv) == code
    assert "usage:" in capsys.readouterr().out and list(tmp_path.iterdir()) == []

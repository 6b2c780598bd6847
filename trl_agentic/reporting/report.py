"""`report.html`: a self-contained, browsable sample of training trajectories (no external assets, works offline).

Per trajectory: the step, group and row kind (regular rollout, negative sample, snapshot segment, estimator
expansion), the reward and mean advantage, the question and expected answer, then the completion turn by turn: the
model's tokens coloured by their advantage (green positive, red negative, hover for the value), the tool calls it
made, the tool results (failed calls in red, as the rollout loop recorded them, never read from the text), the
rollbacks of the rollout with their errors (linked to the negative samples they produced), snapshot segment indices and
RLVCR thinking levels when present. A few filters (row kind, step, rollbacks only, text search) run in a small inline
script.
"""

from __future__ import annotations

import html
import json
import math
from collections import OrderedDict
from pathlib import Path

_CSS = """
:root { --fg:#1d232a; --muted:#667; --line:#d8dde3; --env:#eef1f4; --bad:#c62828; --good:#2e7d32; }
* { box-sizing: border-box; }
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; color: var(--fg); margin: 0 auto;
       max-width: 1100px; padding: 16px 20px 60px; }
h1 { font-size: 22px; margin: 8px 0 4px; } h2 { font-size: 17px; margin: 26px 0 8px; }
.muted { color: var(--muted); }
table.metrics { border-collapse: collapse; margin: 6px 0; }
table.metrics td, table.metrics th { border: 1px solid var(--line); padding: 3px 10px; text-align: right; }
table.metrics th:first-child, table.metrics td:first-child { text-align: left; }
.controls { position: sticky; top: 0; background: #fff; padding: 8px 0; border-bottom: 1px solid var(--line);
            display: flex; gap: 14px; flex-wrap: wrap; align-items: center; z-index: 2; }
.legend span { padding: 1px 6px; border-radius: 3px; margin-right: 4px; }
.trajectory { border: 1px solid var(--line); border-radius: 6px; margin: 12px 0; padding: 10px 12px; }
.trajectory.kind-negative { border-left: 5px solid var(--bad); }
.trajectory.kind-snapshot { border-left: 5px solid #6a1b9a; }
.trajectory.kind-expansion { border-left: 5px solid #00838f; }
.traj-head { display: flex; gap: 8px; flex-wrap: wrap; align-items: center; font-size: 13px; }
.traj-id { font-family: ui-monospace, monospace; color: var(--muted); }
.badge { display: inline-block; padding: 0 7px; border-radius: 10px; font-size: 12px; border: 1px solid transparent; }
.badge-kind { background: #e3e8ee; }
.badge-rollback { background: #fff3e0; border-color: #ef6c00; color: #b34700; }
.badge-negative { background: #ffebee; border-color: var(--bad); color: var(--bad); }
.badge-snapshot { background: #f3e5f5; border-color: #6a1b9a; color: #6a1b9a; }
.badge-masked { background: #eceff1; border-color: #546e7a; color: #37474f; }
.badge-level { background: #e0f7fa; border-color: #00838f; color: #00606b; }
.badge-correct { background: #e8f5e9; border-color: var(--good); color: var(--good); }
.badge-wrong { background: #fafafa; border-color: #999; color: #555; }
.question { margin: 6px 0; } .question b { font-weight: 600; }
.turn { margin: 6px 0; padding: 6px 8px; border-radius: 4px; }
.turn-model { background: #fff; border: 1px dashed var(--line); }
.turn-env { background: var(--env); font-family: ui-monospace, monospace; font-size: 12.5px; white-space: pre-wrap; }
.turn-env.tool-error { background: #fdecea; color: #8e1b1b; }
.turn-env.turn-user { background: #e8f0fe; }
.turn-label { font-size: 11px; text-transform: uppercase; letter-spacing: .04em; color: var(--muted); margin-bottom: 2px; }
.tokens { font-family: ui-monospace, monospace; font-size: 12.5px; white-space: pre-wrap; word-break: break-word; }
.tok { border-radius: 2px; }
.tool-call { font-family: ui-monospace, monospace; font-size: 12.5px; margin-top: 4px; color: #0d47a1; }
.tool-call.malformed { color: var(--bad); }
.rollbacks, .failure { margin-top: 6px; font-size: 13px; background: #fff8e1; padding: 4px 8px; border-radius: 4px; }
.failure { background: #ffebee; }
details { margin: 6px 0; } summary { cursor: pointer; }
.hidden { display: none; }
pre.system { white-space: pre-wrap; font-size: 12px; background: var(--env); padding: 6px; }
"""

_JS = """
(function () {
  const items = Array.from(document.querySelectorAll('.trajectory'));
  const kind = document.getElementById('filter-kind');
  const step = document.getElementById('filter-step');
  const rb = document.getElementById('filter-rollback');
  const search = document.getElementById('filter-text');
  const count = document.getElementById('shown-count');
  function apply() {
    const q = search.value.trim().toLowerCase();
    let shown = 0;
    for (const el of items) {
      const ok = (kind.value === 'all' || el.dataset.kind === kind.value)
        && (step.value === 'all' || el.dataset.step === step.value)
        && (!rb.checked || el.dataset.rollbacks !== '0' || el.dataset.kind === 'negative')
        && (!q || el.textContent.toLowerCase().includes(q));
      el.classList.toggle('hidden', !ok);
      if (ok) shown += 1;
    }
    count.textContent = shown + ' of ' + items.length + ' trajectories shown';
  }
  [kind, step, rb].forEach(e => e.addEventListener('change', apply));
  search.addEventListener('input', apply);
  apply();
})();
"""


def _e(value) -> str:
    return html.escape("" if value is None else str(value))


def _num(value, spec: str = ".2f") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return format(value, spec)


def _color(advantage: float, scale: float) -> str:
    if scale <= 0 or advantage == 0:
        return ""
    strength = min(1.0, abs(advantage) / scale)
    alpha = 0.12 + 0.55 * strength
    rgb = "46,160,67" if advantage > 0 else "214,40,40"
    return f"background:rgba({rgb},{alpha:.2f})"


def select_trajectories(trajectories: list[dict], max_trajectories: int = 150) -> list[dict]:
    """
    Pick a browsable sample of whole groups: the first and last steps, every group with rollbacks, negatives or
    snapshots (up to half the budget), then groups evenly spread over the run.

    Args:
        trajectories (`list[dict]`): Recorded trajectories (see `TrajectoryRecorder`).
        max_trajectories (`int`, *optional*, defaults to `150`): Budget of rows.

    Returns:
        `list[dict]`: The kept trajectories, in (step, group) order. When no whole group fits, the first
        `max_trajectories` rows of the first group.
    """
    groups: OrderedDict[tuple, list[dict]] = OrderedDict()
    for t in trajectories:  # a step's generation batches (`batch`) have group ids of their own
        groups.setdefault((t.get("step", 0), t.get("batch", 0), t.get("group")), []).append(t)
    if len(trajectories) <= max_trajectories:
        return list(trajectories)
    keys = list(groups)
    chosen: list[tuple] = []
    used = 0

    def take(key, budget) -> None:
        nonlocal used
        if key in chosen or used + len(groups[key]) > budget:
            return
        chosen.append(key)
        used += len(groups[key])

    take(keys[0], max_trajectories)
    take(keys[-1], max_trajectories)
    for key in keys:
        rows = groups[key]
        if any(r.get("rollbacks") or r.get("kind") != "regular" for r in rows):
            take(key, max(max_trajectories // 2, used))
    remaining = [k for k in keys if k not in chosen]
    if remaining:
        stride = max(1, len(remaining) // max(1, (max_trajectories - used) // max(1, len(groups[remaining[0]]))))
        for key in remaining[::stride]:
            take(key, max_trajectories)
    if not chosen:
        return groups[keys[0]][: max(0, max_trajectories)]
    chosen.sort(key=lambda k: (k[0], k[1], -1 if k[2] is None else k[2]))
    return [t for key in chosen for t in groups[key]]


def _badges(t: dict, children: dict[str, list[str]]) -> str:
    out = [f'<span class="badge badge-kind">{_e(t.get("kind", "regular"))}</span>']
    rollbacks = t.get("rollbacks") or []
    if rollbacks:
        out.append(
            f'<span class="badge badge-rollback" title="rollbacks of this rollout">rollback ×{len(rollbacks)}</span>'
        )
    if t.get("kind") == "negative":
        types = ", ".join(t.get("error_types") or []) or "tool error"
        out.append(f'<span class="badge badge-negative">negative sample: {_e(types)}</span>')
    if t.get("masked"):
        out.append(
            '<span class="badge badge-masked" title="mask_truncated_completions: cut by the length budget, its loss '
            'mask zeroed">truncated, masked (not trained)</span>'
        )
    if t.get("not_trained"):
        if t.get("not_selected"):
            why = f"left out by row_selection={t['not_selected']}"
        elif t.get("kind") == "regular":
            why = "a rollout lost to infrastructure (no reward)"
        else:
            why = "a segment of an episode whose last segment is not trained"
        out.append(f'<span class="badge badge-masked" title="{_e(why)}: no loss">not trained</span>')
    if t.get("kind") == "snapshot" or t.get("segment_index"):
        out.append(f'<span class="badge badge-snapshot">snapshot segment {_e(t.get("segment_index", 0))}</span>')
    for level in t.get("levels") or []:
        out.append(f'<span class="badge badge-level">level {_e(level)}</span>')
    # Correct / wrong for answer-checking rewards (the first reward function, e.g. `answer_reward`).
    name, correct = next(iter((t.get("rewards") or {}).items()), (None, None))
    if t.get("kind") == "regular" and correct is not None and name and ("answer" in name or "correct" in name):
        label = "correct" if correct >= 0.5 else "wrong answer"
        out.append(f'<span class="badge badge-{"correct" if correct >= 0.5 else "wrong"}">{label}</span>')
    if children.get(t.get("id")):
        links = " ".join(f'<a href="#{_e(c)}">{_e(c)}</a>' for c in children[t["id"]])
        out.append(f'<span class="muted">negatives: {links}</span>')
    return " ".join(out)


def _tool_call_line(call: dict) -> str:
    if call.get("malformed"):
        return f'<div class="tool-call malformed">malformed tool call: {_e(call["malformed"])}</div>'
    arguments = call.get("arguments") or {}
    if isinstance(arguments, dict):
        args = ", ".join(f"{k}={json.dumps(v, ensure_ascii=False)}" for k, v in arguments.items())
    else:
        args = _e(arguments)
    return f'<div class="tool-call">tool call → {_e(call.get("name"))}({_e(args)})</div>'


def _render_segments(t: dict, scale: float) -> str:
    from ..rollout.parsing import parse_tool_calls

    parts = []
    for segment in t.get("segments") or []:
        if segment["role"] == "model":
            advantages = segment.get("advantages") or [0.0] * len(segment["tokens"])
            # A row that is not trained is not coloured: its tokens get no gradient.
            plain = t.get("masked") or t.get("not_trained")
            spans = "".join(
                f'<span class="tok" style="{"" if plain else _color(a, scale)}" title="advantage {a:+.3f}">'
                f"{_e(tok)}</span>"
                for tok, a in zip(segment["tokens"], advantages)
            )
            calls = parse_tool_calls(segment["text"].replace("<|im_end|>", ""))
            lines = "".join(
                _tool_call_line({"name": c["function"].get("name"), "arguments": c["function"].get("arguments")})
                for c in calls.calls
            )
            lines += "".join(_tool_call_line({"malformed": err}) for err in calls.errors)
            levels = "".join(
                f' <span class="badge badge-level">level {_e(k)}</span>' for k in segment.get("levels") or []
            )
            parts.append(
                f'<div class="turn turn-model"><div class="turn-label">model{levels}</div>'
                f'<div class="tokens">{spans}</div>{lines}</div>'
            )
        else:
            error = " tool-error" if segment.get("error") else ""
            if segment.get("user"):
                error, label = " turn-user", "user message (environment, not trained)"
            else:
                label = "tool result (error)" if error else "environment (tool result, not trained)"
            parts.append(
                f'<div class="turn turn-env{error}"><div class="turn-label">{label}</div>{_e(segment["text"])}</div>'
            )
    return "".join(parts)


def _render_trajectory(t: dict, scale: float, children: dict[str, list[str]]) -> str:
    rollbacks = t.get("rollbacks") or []
    head = (
        f'<span class="traj-id">{_e(t.get("id"))}</span> step {_e(t.get("step"))} · group {_e(t.get("group"))} · '
        f"reward <b>{_num(t.get('reward'))}</b> · advantage <b>{_num(t.get('advantage'), '+.3f')}</b> "
        f"{_badges(t, children)}"
    )
    parent = ""
    if t.get("parent"):
        parent = f' <span class="muted">(from rollout <a href="#{_e(t["parent"])}">{_e(t["parent"])}</a>)</span>'
    expected = ""
    if t.get("answer") is not None:
        expected = f' <span class="muted">expected: {_e(t.get("answer"))}</span>'
    question = f'<div class="question"><b>Question:</b> {_e(t.get("question"))}{expected}{parent}</div>'
    extra = ""
    if rollbacks:
        items = "".join(
            f"<li>turn {_e(r.get('turn'))}: {_e(', '.join(r.get('error_types') or []))} — "
            f"{_e('; '.join(r.get('errors') or []))}</li>"
            for r in rollbacks
        )
        extra += (
            f'<div class="rollbacks"><b>Rolled back</b> (environment restored, the turn regenerated; the '
            f"completion below is the final one):<ul>{items}</ul></div>"
        )
    if t.get("kind") == "negative":
        messages = "; ".join(t.get("error_messages") or [])
        extra += (
            f'<div class="failure"><b>Failed attempt</b> saved before a rollback, trained with reward '
            f"{_num(t.get('reward'))}: {_e(messages)}</div>"
        )
    return (
        f'<article class="trajectory kind-{_e(t.get("kind", "regular"))}" id="{_e(t.get("id"))}" '
        f'data-kind="{_e(t.get("kind", "regular"))}" data-step="{_e(t.get("step"))}" '
        f'data-rollbacks="{len(rollbacks)}">'
        f'<div class="traj-head">{head}</div>{question}{extra}'
        f'<div class="turns">{_render_segments(t, scale)}</div></article>'
    )


def _metrics_table(results: dict[str, dict]) -> str:
    rows = [
        ("success_rate", "success rate (correct final answer)", ".1%"),
        ("tool_call_success_rate", "successful tool calls (of all calls)", ".1%"),
        ("tool_success_rate", "problems with a successful tool call", ".1%"),
        ("tool_calls_per_problem", "tool calls per problem", ".2f"),
        ("no_tool_call_rate", "problems without a tool call", ".1%"),
        ("mean_completion_tokens", "completion tokens per problem", ".1f"),
        ("num_problems", "problems", "d"),
    ]
    head = "".join(f"<th>{_e(stage)}</th>" for stage in results)
    body = "".join(
        f"<tr><td>{_e(label)}</td>" + "".join(f"<td>{_num(m.get(key), spec)}</td>" for m in results.values()) + "</tr>"
        for key, label, spec in rows
        if any(key in m for m in results.values())
    )
    return f'<table class="metrics"><tr><th>held-out evaluation</th>{head}</tr>{body}</table>'


def _content_text(content) -> str:
    """A message's content as text: a tool may return content blocks (TRL passes a list on), shown by their text."""
    if content is None:
        return ""
    if isinstance(content, list):
        return "".join(b.get("text", f"[{b.get('type')}]") if isinstance(b, dict) else str(b) for b in content)
    return str(content)


def _eval_samples(eval_records: dict[str, list[dict]], limit: int = 12) -> str:
    stages = list(eval_records)
    if not stages:
        return ""
    n = min(limit, *(len(v) for v in eval_records.values()))
    blocks = []
    for k in range(n):
        first = eval_records[stages[0]][k]
        cells = []
        for stage in stages:
            record = eval_records[stage][k]
            text = "\n".join(
                (f"[{m.get('role')}] " + _content_text(m.get("content")))
                + "".join(
                    f"\n  tool call → {c.get('function', {}).get('name')}({json.dumps(c.get('function', {}).get('arguments'))})"
                    for c in m.get("tool_calls") or []
                )
                for m in record.get("messages") or []
            )
            mark = "correct" if record.get("correct") else "wrong"
            cells.append(
                f'<div class="turn turn-env"><div class="turn-label">{_e(stage)} · '
                f'<span class="badge badge-{"correct" if record.get("correct") else "wrong"}">{mark}</span></div>'
                f"{_e(text)}</div>"
            )
        blocks.append(
            f'<details class="eval-sample"><summary>{_e(first.get("question"))} '
            f'<span class="muted">(expected {_e(first.get("answer"))})</span></summary>{"".join(cells)}</details>'
        )
    return "".join(blocks)


def write_report(
    path: str | Path,
    trajectories: list[dict],
    *,
    title: str = "trl-agentic run report",
    summary: dict | None = None,
    eval_results: dict[str, dict] | None = None,
    eval_records: dict[str, list[dict]] | None = None,
    max_trajectories: int = 150,
    system_prompt: str | None = None,
) -> Path:
    """
    Write a self-contained HTML report of a run.

    Args:
        path (`str` or `Path`):
            Output file.
        trajectories (`list[dict]`):
            Recorded training trajectories (`TrajectoryRecorder.trajectories`, or the same dicts from
            `trajectories.jsonl`); a sample of at most `max_trajectories` is shown (see [`select_trajectories`]).
        title (`str`, *optional*):
            Page title.
        summary (`dict`, *optional*):
            Key facts shown at the top (stage times, config values), rendered as a two-column table.
        eval_results (`dict[str, dict]`, *optional*):
            Held-out evaluation metrics by stage (e.g. before / after GRPO).
        eval_records (`dict[str, list[dict]]`, *optional*):
            Held-out evaluation records by stage (same problems in the same order), shown side by side.
        max_trajectories (`int`, *optional*, defaults to `150`):
            Number of training rows shown.
        system_prompt (`str`, *optional*):
            The task's system prompt, shown once at the top.

    Returns:
        `Path`: The written file.
    """
    shown = select_trajectories(trajectories, max_trajectories)
    scale = max(
        (abs(a) for t in shown for s in t.get("segments") or [] for a in s.get("advantages") or []), default=0.0
    )
    children: dict[str, list[str]] = {}
    for t in shown:
        if t.get("parent") and t.get("kind") == "negative":
            children.setdefault(t["parent"], []).append(t["id"])
    steps = sorted({t.get("step") for t in shown if t.get("step") is not None})
    kinds = sorted({t.get("kind", "regular") for t in shown})
    num_rollbacks = sum(len(t.get("rollbacks") or []) for t in trajectories)
    num_negatives = sum(t.get("kind") == "negative" for t in trajectories)

    out = [
        "<!doctype html><html lang='en'><head><meta charset='utf-8'>",
        "<meta name='viewport' content='width=device-width, initial-scale=1'>",
        f"<title>{_e(title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{_e(title)}</h1>",
        f'<p class="muted">{len(trajectories)} training rows recorded ({num_rollbacks} rollbacks, {num_negatives} '
        f"negative samples); {len(shown)} shown.</p>",
    ]
    if summary:
        rows = "".join(f"<tr><td>{_e(k)}</td><td>{_e(v)}</td></tr>" for k, v in summary.items())
        out.append(f'<h2>Run</h2><table class="metrics">{rows}</table>')
    if eval_results:
        out.append("<h2>Held-out evaluation</h2>" + _metrics_table(eval_results))
    if eval_records:
        out.append("<details><summary>Evaluation samples, stage by stage</summary>")
        out.append(_eval_samples(eval_records) + "</details>")
    if system_prompt:
        out.append(f'<details><summary>System prompt</summary><pre class="system">{_e(system_prompt)}</pre></details>')
    out.append("<h2>Training trajectories</h2>")
    out.append(
        '<p class="legend">Model tokens are coloured by their advantage: '
        f'<span style="{_color(1, 1)}">positive</span><span style="{_color(-1, 1)}">negative</span>'
        f"(scale ±{scale:.3f}; hover a token for its value). Grey blocks are environment tokens (tool results), "
        "masked from the loss.</p>"
    )
    step_options = "".join(f'<option value="{_e(s)}">step {_e(s)}</option>' for s in steps)
    kind_options = "".join(f'<option value="{_e(k)}">{_e(k)}</option>' for k in kinds)
    out.append(
        '<div class="controls">'
        f'<label>kind <select id="filter-kind"><option value="all">all</option>{kind_options}</select></label>'
        f'<label>step <select id="filter-step"><option value="all">all</option>{step_options}</select></label>'
        '<label><input type="checkbox" id="filter-rollback"> with rollbacks / negatives</label>'
        '<label>search <input type="search" id="filter-text" placeholder="text in trajectory"></label>'
        '<span id="shown-count" class="muted"></span></div>'
    )
    out.append('<section id="trajectories">')
    out += [_render_trajectory(t, scale, children) for t in shown]
    if not trajectories:
        out.append('<p class="muted">No training trajectories were recorded.</p>')
    elif not shown:
        out.append(f'<p class="muted">None shown (<code>max_trajectories={_e(max_trajectories)}</code>).</p>')
    out.append(f"</section><script>{_JS}</script></body></html>")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(out), encoding="utf-8")
    return path

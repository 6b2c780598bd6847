"""`make ablation`: a verdict per feature (issue 37), pre-registered in docs/ablation.md.

- `design`: the tasks, arms, comparisons, seeds, the decision rule and the budget (pure data);
- `cells`: runs one (task, seed, arm) and writes its JSON cell (resumable, with its commit and settings);
- `report`: renders docs/ablation.md (the pre-registration kept, then verdicts, checks and arms) and the README's
  table of verdicts;
- `first`: the first ablation (issue 18), superseded, kept to re-render docs/ablation-superseded/first/.

`python -m trl_agentic.ablation run` computes the missing cells (the calibration ladder first, then the learning-rate
ladder, then every arm of every seed in order) and renders; `render` only renders.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from . import design


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trl_agentic.ablation", description=__doc__.split("\n")[0])
    parser.add_argument("action", choices=("run", "render"), nargs="?", default="run")
    parser.add_argument("--tasks", nargs="+", default=list(design.TASKS), choices=list(design.TASKS))
    parser.add_argument(
        "--seeds", nargs="+", type=int, default=None, help="Seeds to run (default: each task's pre-registered ones)."
    )
    parser.add_argument("--arms", nargs="+", default=None, help="Only these arms (and what they depend on).")
    parser.add_argument("--out", default="outputs/ablation", help="Adapters and trainer output go here.")
    parser.add_argument("--cells", default="docs/ablation-cells", help="Cells (JSON): existing ones are reused.")
    parser.add_argument("--doc", default="docs/ablation.md")
    parser.add_argument("--readme", default="README.md", help="Its verdict block is rewritten ('' to skip).")
    parser.add_argument(
        "--set", nargs="*", default=[], metavar="KEY=VALUE", help="Overrides for every arm (YAML values; tests only)."
    )
    parser.add_argument(
        "--allow-other-cpu",
        action="store_true",
        help="Train a warm start recorded on another CPU kind again anyway (the loss check still guards the pairing: "
        "if it fails, that seed's missing arms are skipped and named); without it, they are skipped before training.",
    )
    a = parser.parse_args(argv)
    import yaml

    from . import cells as cells_mod
    from . import report

    overrides = {k: yaml.safe_load(v) for k, v in (item.split("=", 1) for item in a.set)}
    ctx = cells_mod.Context(
        out=Path(a.out), cells=Path(a.cells), doc=Path(a.doc), overrides=overrides, allow_other_cpu=a.allow_other_cpu
    )
    skipped = []
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if a.action == "run":
        cells_mod.registered_block(ctx.doc)  # nothing runs before the pre-registration ...
        report.check_registration(ctx.doc.read_text())  # ... nor under a design other than the registered one
        for name in a.tasks:
            task = design.TASKS[name]
            for seed in a.seeds if a.seeds is not None else task.seeds:
                for arm in design.ARMS[name]:
                    if a.arms and arm.name not in a.arms:
                        continue
                    try:
                        cell = cells_mod.run_cell(task, seed, arm, ctx)
                    # Refused before any training, or its warm start's loss check failed (and will not be trained
                    # again for the seed's other arms): go on with the next arm, render what exists, exit 1.
                    except (cells_mod.WarmStartHostError, cells_mod.WarmStartMismatchError) as error:
                        print(f"{name} seed {seed} {arm.name}: skipped: {error}", file=sys.stderr, flush=True)
                        skipped.append(f"{name} seed {seed} `{arm.name}`")
                        continue
                    sampled = sum(cell["sampled"]) / len(cell["sampled"])
                    print(f"{name} seed {seed} {arm.name}: sampled success {sampled:.3f}", flush=True)
    found, calibration = report.load(ctx.cells)
    lr_rungs = report.load_lr_ladder(ctx.cells)
    doc = Path(a.doc)
    findings = doc.with_name(doc.stem + "-findings.md")
    forms = cells_mod.forms_by_seed(found)
    text = report.render_doc(
        doc.read_text(), found, calibration, findings.read_text() if findings.exists() else None, lr_rungs, forms
    )
    doc.write_text(text)
    report.plot(found, doc.with_suffix(".png"))
    if a.readme:
        readme = Path(a.readme)
        readme.write_text(report.replace_readme_block(readme.read_text(), report.readme_block(found, calibration)))
    print(text)
    if skipped:  # rendered with what exists, but the run did not compute every cell it was asked for
        print(
            f"Not computed (their seed's warm start cannot be reproduced here): {'; '.join(skipped)}.", file=sys.stderr
        )
        return 1
    return 0

"""The README's Python example runs (on the tiny model, one step), so it cannot silently rot."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_example_trains(tiny_model_dir, tmp_path):
    code = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)
    assert 'model="smollm2-135m"' in code and 'output_dir="calc-agent",' in code
    code = code.replace('model="smollm2-135m"', f"model={tiny_model_dir!r}")
    code = code.replace(
        'output_dir="calc-agent",',
        f'output_dir={str(tmp_path)!r}, max_steps=1, use_cpu=True, report_to="none", save_strategy="no",',
    )
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    trainer = scope["trainer"]
    assert trainer.state.global_step == 1
    assert trainer.args.enable_tool_rollback and trainer.args.save_negative_samples

"""The README's Python example runs as written."""

import re
from pathlib import Path


def test_readme_python_example_runs():
    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    example = re.findall(r"```python\n(.*?)```", text, re.S)[0]
    namespace: dict = {}
    exec(compile(example, "README.md", "exec"), namespace)
    assert namespace["diff_src"].shape == (8, 56, 56, 32)
    assert namespace["diff_weights"].shape == (3, 3, 32, 64)

"""The documentation's runnable examples run."""

from __future__ import annotations

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs"


def _python_blocks(page: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (DOCS / page).read_text(), flags=re.S)


def test_api_page_example_runs(device, capsys):
    (block,) = _python_blocks("api.md")
    exec(compile(block, "docs/api.md", "exec"), {})  # noqa: S102 - our own documentation
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == "['QMoE']" and printed[1] == "8" and printed[-1] == "1"

"""The README's examples run as written; the CLI demo runs end to end."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import hiermem as hm
from hiermem.cli import main

ROOT = Path(__file__).resolve().parent.parent


def test_readme_python_examples_run():
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert blocks
    for code in blocks:
        exec(compile(code, "README.md", "exec"), {})


def test_readme_starts_with_the_two_commands():
    text = (ROOT / "README.md").read_text()
    first = re.search(r"```bash\n(.*?)```", text, re.S).group(1).splitlines()
    assert "hiermem demo" in first[0] and "pytest" in first[1]
    assert "pytest" in (ROOT / ".ci" / "run").read_text()


def test_demo_small(capsys, tmp_path):
    assert main(["demo", "--steps", "4", "--batch", "256", "--num-rows", "20000", "--device-rows", "300",
                 "--host-rows", "2000", "--path", str(tmp_path / "d")]) == 0
    out = capsys.readouterr().out
    summary = json.loads(out.strip().splitlines()[-1])
    for tier in ("device", "host", "disk"):
        assert 0 <= summary[f"user_{tier}_hit_rate"] <= 1
    assert summary["ids"] == 4 * 256 * 20
    # the demo left a store that the stats command reads back
    assert main(["stats", str(tmp_path / "d")]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["stats"]["user"]["device"]["lookups"] == 0  # counters are per session
    assert stats["stats"]["_store"]["disk_rows"] > 0


def test_cli_errors_are_clean(tmp_path):
    (tmp_path / "f").write_text("not a store")
    r = subprocess.run([sys.executable, "-m", "hiermem.cli", "stats", str(tmp_path / "f")],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "not a hiermem store" in r.stderr and "Traceback" not in r.stderr
    assert hm.__version__

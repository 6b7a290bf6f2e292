"""The README's examples run as written; the CLI demo runs end to end."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import hiermem as hm
from hiermem.cli.main import main

ROOT = Path(__file__).resolve().parent.parent


#: Documents whose ```python blocks are executed (the README's and the guides it links).
EXECUTED_DOCS = ("README.md", "docs/guide.md", "docs/operations.md")


def test_readme_python_examples_run():
    for doc in EXECUTED_DOCS:
        blocks = re.findall(r"```python\n(.*?)```", (ROOT / doc).read_text(), re.S)
        assert blocks, doc
        for code in blocks:
            exec(compile(code, doc, "exec"), {})


def test_readme_is_a_short_guide_whose_links_resolve():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    for head in ("## What it is, and for whom", "## Quickstart", "## Migrating an existing model",
                 "## The CLI at a glance", "## Documentation"):
        assert head in text
    links = re.findall(r"\]\(([\w./-]+\.md)(?:#[\w-]*)?\)", text)
    assert {"docs/guide.md", "docs/design.md", "docs/performance.md", "docs/reliability.md",
            "docs/operations.md"} <= set(links)
    for link in links:
        assert (ROOT / link).is_file(), link
    for doc in (ROOT / "docs").glob("*.md"):  # docs link back, and their relative links resolve
        for link in re.findall(r"\]\(([\w./-]+\.md)(?:#[\w-]*)?\)", doc.read_text()):
            assert (doc.parent / link).resolve().exists(), (doc.name, link)


def test_documented_commands_write_under_runs():
    """Shell examples that write files (trace import, tune) write under runs/ (git-ignored)."""
    assert "runs/" in (ROOT / ".gitignore").read_text().split()
    for doc in ("README.md", *(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))):
        for block in re.findall(r"```bash\n(.*?)```", (ROOT / doc).read_text(), re.S):
            for line in block.splitlines():
                argv = line.split("#")[0].split()
                if argv[:3] == ["hiermem", "trace", "import"]:
                    out = argv[5] if argv[3] == "npy" else argv[4]
                    assert out.startswith("runs/"), (doc, line)
                if argv[:2] == ["hiermem", "tune"]:
                    assert "--out-dir" not in argv or argv[argv.index("--out-dir") + 1].startswith("runs/")


def test_readme_starts_with_the_two_commands():
    text = (ROOT / "README.md").read_text()
    first = re.search(r"```bash\n(.*?)```", text, re.S).group(1).splitlines()
    assert "hiermem demo" in first[0] and "pytest" in first[1]
    assert "pytest" in (ROOT / ".ci" / "run").read_text()


@pytest.mark.slow
def test_demo_small(capsys, tmp_path):
    run = tmp_path / "d"
    args = ["demo", "--steps", "12", "--batch", "64", "--device-rows", "2048", "--host-rows", "8192",
            "--checkpoint-every", "5", "--path", str(run), "--no-progress"]
    assert main(args) == 0
    out = capsys.readouterr().out
    summary = json.loads(out.strip().splitlines()[-1])
    for tier in ("device", "host", "disk"):
        assert 0 <= summary[f"{tier}_hit_rate"] <= 1
    pf = summary["prefetch"]  # the batches that fit on the device beside the pinned ones are pinned
    assert summary["steps"] == 12 and pf["prefetched_batches"] >= 1
    assert pf["prefetched_batches"] + pf["prefetch_degraded"] == 12
    assert "loss:" in out and "hit rates:" in out and "prefetch:" in out
    # the demo left a store that the stats command reads back, and a checkpoint to resume from
    assert main(["stats", str(run / "store"), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["stats"]["C1"]["device"]["lookups"] > 0  # counters are saved with the store
    assert stats["stats"]["_store"]["disk_rows"] > 0
    assert main([*args[:2], "16", *args[3:], "--resume"]) == 0
    resumed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert resumed["start_step"] == 12 and resumed["steps"] == 4
    # a run directory that is not the demo's is never deleted
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "keep").write_text("x")
    assert main(["demo", "--steps", "1", "--path", str(tmp_path / "other"), "--no-progress"]) == 2
    assert (tmp_path / "other" / "keep").exists()


@pytest.mark.slow
def test_demo_reads_criteo_tsv_and_synthetic(capsys, tmp_path):
    lines = []
    rng = np.random.default_rng(0)
    for i in range(100):
        ints = [str(int(x)) if x >= 0 else "" for x in rng.integers(-1, 50, 13)]
        cats = [f"{int(x):08x}" if x >= 0 else "" for x in rng.integers(-5, 2**32, 26)]
        lines.append("\t".join([str(i % 2), *ints, *cats]))
    tsv = tmp_path / "day_0.tsv"
    tsv.write_text("\n".join(lines) + "\n")
    for src in (["--criteo", str(tsv)], ["--synthetic"]):
        assert main(["demo", "--steps", "6", "--batch", "32", "--device-rows", "1024", "--host-rows", "4096",
                     "--path", str(tmp_path / src[0]), "--no-progress", *src]) == 0
        s = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert s["data"] == (f"criteo:{tsv}" if src[0] == "--criteo" else "synthetic") and s["steps"] == 6
    bad = tmp_path / "bad.tsv"
    bad.write_text("1\t2\t3\n")
    assert main(["demo", "--steps", "2", "--criteo", str(bad), "--path", str(tmp_path / "b"), "--no-progress"]) == 2


def test_cli_errors_are_clean(tmp_path):
    (tmp_path / "f").write_text("not a store")
    r = subprocess.run([sys.executable, "-m", "hiermem", "stats", str(tmp_path / "f")],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "not a hiermem store" in r.stderr and "Traceback" not in r.stderr
    assert hm.__version__

"""A benchmark result's commit is ``+dirty`` for a code change, not for results files rewritten by
an earlier section of the same run (bench/provenance.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))

from provenance import changed_paths  # noqa: E402


def git(root: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=root, check=True,
                   capture_output=True)


def test_results_files_do_not_make_a_checkout_dirty_and_code_does(tmp_path: Path) -> None:
    (tmp_path / "bench" / "results").mkdir(parents=True)
    (tmp_path / "src").mkdir()
    (tmp_path / "bench" / "results" / "a.json").write_text("{}")
    (tmp_path / "src" / "m.py").write_text("x = 1\n")
    git(tmp_path, "init", "-q")
    git(tmp_path, "add", "-A")
    git(tmp_path, "commit", "-qm", "start")
    assert changed_paths(tmp_path) == []
    (tmp_path / "bench" / "results" / "a.json").write_text('{"b": 1}')
    (tmp_path / "bench" / "results" / "new.md").write_text("new")
    assert changed_paths(tmp_path) == []
    (tmp_path / "src" / "m.py").write_text("x = 2\n")
    (tmp_path / "src" / "new file.py").write_text("")
    git(tmp_path, "mv", "bench/results/a.json", "src/moved.json")
    assert sorted(changed_paths(tmp_path)) == ["src/m.py", "src/moved.json", "src/new file.py"]

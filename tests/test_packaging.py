"""`requires-python` is what the code needs: vermin finds the oldest Python each construct runs on."""

import shutil
import subprocess
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]


def test_the_code_needs_nothing_newer_than_requires_python():
    required = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    oldest = required.removeprefix(">=")
    vermin = shutil.which("vermin", path=str(Path(sys.executable).parent))
    assert vermin, "vermin comes with the test extra"
    found = subprocess.run([vermin, "--no-tips", "--violations", f"-t={oldest}-", "--eval-annotations",
                            str(ROOT / "pytest_freezecompat")], capture_output=True, text=True, check=False)
    assert found.returncode == 0, found.stdout + found.stderr

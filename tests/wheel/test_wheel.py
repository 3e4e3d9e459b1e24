"""The built wheel and sdist as a user gets them: `nox -s wheel` builds them, installs the wheel in a fresh venv
with torch (this interpreter) and in one without (`FREEZECOMPAT_BARE_PYTHON`), then runs this module.
Everything runs from an empty folder, so nothing of the checkout is on the path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

DIST = os.environ.get("FREEZECOMPAT_WHEEL_DIST")
BARE_PYTHON = os.environ.get("FREEZECOMPAT_BARE_PYTHON")
pytestmark = pytest.mark.skipif(not (DIST and BARE_PYTHON), reason="run by `nox -s wheel` (a built wheel, fresh venvs)")
TWO_CELLS = "--freeze-matrix-select=model=tiny-gpt,framework=torch,plugin=ddp,init=eager,checkpoint=none,freeze=none,"\
            "freeze=embedding,clip=clip"


def run(python: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FREEZECOMPAT_", "PYTHONPATH"))}
    return subprocess.run([python, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600, check=False)


def small_report(path: Path) -> Path:
    cell = {"id": "m/torch/ddp/eager/none/none", "model": "m", "framework": "torch", "plugin": "ddp", "init": "eager",
            "checkpoint": "none", "freeze": "none", "environment": "torch", "status": "pass", "message": ""}
    path.write_text(json.dumps({"schema": 1, "environments": {"torch": {"python": "3.11.7"}}, "cells": [cell]}))
    return path


def test_a_few_cells_run_from_an_empty_folder(tmp_path: Path) -> None:
    result = run(sys.executable, "-m", "pytest", "--freeze-matrix", TWO_CELLS, "-p", "no:cacheprovider", cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "2 passed" in result.stdout and "freeze-matrix cells: 2 of the built-in matrix" in result.stdout
    report = json.loads((tmp_path / ".freeze-matrix" / "matrix.json").read_text())
    assert [c["status"] for c in report["cells"]] == ["pass", "pass"]
    assert (tmp_path / ".freeze-matrix" / "matrix.html").stat().st_size > 0
    where = run(sys.executable, "-c", "import pytest_freezecompat; print(pytest_freezecompat.__file__)", cwd=tmp_path)
    assert "site-packages" in where.stdout  # the installed wheel ran, not a checkout
    assert report["environments"]["torch"]["run"]["plugin"] == run(
        sys.executable, "-m", "pytest_freezecompat.cli", "--version", cwd=tmp_path).stdout.split()[-1]


def test_without_torch_the_report_tools_work_and_the_matrix_refuses_in_one_line(tmp_path: Path) -> None:
    assert run(BARE_PYTHON, "-c", "import torch", cwd=tmp_path).returncode != 0
    shard = small_report(tmp_path / "shard.json")
    merged = run(BARE_PYTHON, "-m", "pytest_freezecompat.cli", "merge", str(shard), "-o", "out", cwd=tmp_path)
    assert merged.returncode == 0, merged.stderr
    assert {p.name for p in (tmp_path / "out").iterdir()} >= {"matrix.json", "matrix.md", "matrix.html"}
    same = run(BARE_PYTHON, "-m", "pytest_freezecompat.cli", "diff", str(shard), "out/matrix.json", cwd=tmp_path)
    assert same.returncode == 0, same.stderr
    refused = run(BARE_PYTHON, "-m", "pytest", "--freeze-matrix", "-p", "no:cacheprovider", cwd=tmp_path)
    assert refused.returncode == 4
    assert refused.stderr.strip().splitlines() == [
        "ERROR: the freeze matrix runs its cells on torch and numpy; torch and numpy not installed here: "
        "pip install torch numpy (or 'pytest-freezecompat[torch]')"]
    plain = run(BARE_PYTHON, "-m", "pytest", "-p", "no:cacheprovider", cwd=tmp_path)  # the plugin loads, idle
    assert plain.returncode == 5 and "freezecompat" in plain.stdout, plain.stdout + plain.stderr


def test_the_metadata_says_what_is_true() -> None:
    wheel = next(Path(DIST).glob("*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        meta = Parser().parsestr(archive.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode())
    assert meta["License-Expression"] == "Apache-2.0" and meta["License-File"] == "LICENSE"
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert meta["Requires-Python"] == ">=3.10"
    assert "Topic :: Software Development :: Testing" in meta.get_all("Classifier")
    assert "Operating System :: POSIX :: Linux" in meta.get_all("Classifier")
    requires = meta.get_all("Requires-Dist")
    assert all("extra ==" in r for r in requires if r.startswith(("torch", "numpy")))  # torch only with [torch]
    assert "pytest_freezecompat/_matrix/matrix.toml" in names and "](reports/" not in meta.get_payload()
    assert "pytest_freezecompat/_findings/README.md" in names  # `freezecompat finding` reads them there


def test_the_sdist_leaves_out_reports_and_ci() -> None:
    sdist = next(Path(DIST).glob("*.tar.gz"))
    with tarfile.open(sdist) as archive:
        names = [name.split("/", 1)[1] for name in archive.getnames() if "/" in name]
    assert "LICENSE" in names and "pytest_freezecompat/plugin.py" in names and "matrix/matrix.toml" in names
    assert not [n for n in names if n.startswith(("reports/", ".github/", ".ci/", ".nox/", ".freeze-matrix/"))]

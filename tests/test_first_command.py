"""The README's test command installs nox on a stock Debian/Ubuntu system Python, which refuses `pip install --user`
(PEP 668's EXTERNALLY-MANAGED marker): its install part runs there, twice, and the nox it installs runs."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SYSTEM_PYTHON = Path("/usr/bin/python3")
#: A stock system's PATH: no pyenv, no virtualenv's bin.
STOCK_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def readme_test_command() -> str:
    """The line of the README's first fenced block that runs the plugin's tests (`... nox -t tests`)."""
    block = re.search(r"```\w*\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    lines = [line for line in block.splitlines() if "nox" in line and "-t tests" in line and not line.startswith("#")]
    assert len(lines) == 1, f"the README's first block should have one `nox -t tests` command: {block}"
    return lines[0]


def externally_managed(python: Path) -> str:
    """Why `python` is no stock externally managed one with venv support, or '' where it is."""
    if not python.is_file():
        return f"no {python}"
    probe = ("import ensurepip, pathlib, sysconfig; "
             "print(pathlib.Path(sysconfig.get_path('stdlib'), 'EXTERNALLY-MANAGED').is_file())")
    found = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, check=False)
    if found.returncode:  # Debian/Ubuntu ship ensurepip in python3-venv, which the README names
        return f"{python} has no ensurepip (apt install python3-venv)"
    return "" if found.stdout.strip() == "True" else f"{python} has no PEP 668 EXTERNALLY-MANAGED marker"


def test_the_readme_test_command_installs_nox_on_an_externally_managed_python(tmp_path: Path):
    reason = externally_managed(SYSTEM_PYTHON)
    if reason:
        pytest.skip(f"needs a stock Debian/Ubuntu python3: {reason}")
    install, _, run = readme_test_command().rpartition(" && ")
    assert install, f"the README's test command installs nothing before nox: {run}"
    nox = shlex.split(run)  # nox's own run, e.g. `.tools/bin/nox -t tests`: its program, asked for its version
    version = [*nox[:nox.index("-t")], "--version"]
    bin_dir = tmp_path / "bin"  # `python3` is the system one
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to(SYSTEM_PYTHON)
    env = {key: value for key, value in os.environ.items()
           if not key.startswith("PYENV") and key not in {"VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "PIP_USER",
                                                         "PIP_BREAK_SYSTEM_PACKAGES", "PIP_REQUIRE_VIRTUALENV"}}
    env["PATH"] = f"{bin_dir}{os.pathsep}{STOCK_PATH}"
    work = tmp_path / "checkout"
    work.mkdir()
    for attempt in ("first", "second"):  # a rerun (the same command again) works too
        done = subprocess.run(["/bin/sh", "-c", install], cwd=work, env=env, capture_output=True, text=True,
                              timeout=600, check=False)
        assert done.returncode == 0, f"{attempt} run of `{install}` failed:\n{done.stdout}{done.stderr}"
    done = subprocess.run(version, cwd=work, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, f"`{shlex.join(version)}` failed:\n{done.stdout}{done.stderr}"
    assert re.search(r"\d{4}\.\d+\.\d+", done.stdout + done.stderr), done.stdout + done.stderr

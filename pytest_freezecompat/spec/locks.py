"""Locks: every distribution of an environment at its exact version, `matrix/locks/<env>.txt`.

An environment's `install` lines name its frameworks; the lock names everything they pulled in, so that a verdict
that changes tomorrow changed because a release did, not because a transitive dependency moved. `nox -s locks`
compiles them (uv, with the versions of the newest pinned release's time: `cutoff`), the environments sync to them,
and each run records its lock's hash and whatever it found installed that the lock does not say (`state`).

`python -m pytest_freezecompat.spec.locks freeze` prints what this interpreter has installed in the lock's own form
(the published `pip-freeze-<env>.txt`); `... check LOCK` says how it differs from LOCK (exit 1 when it does).
"""

from __future__ import annotations

import hashlib
import re
import sys
import sysconfig
from collections.abc import Iterable
from datetime import datetime, timedelta
from importlib import metadata
from pathlib import Path
from typing import Any

#: The folder beside matrix.toml that holds one lock per environment.
FOLDER = "locks"
#: The Python an environment is locked for and built with where its framework file names none: the published matrix's.
DEFAULT_PYTHON = "3.11"
#: This package is installed editable from the checkout, not from the lock.
OURSELVES = "pytest-freezecompat"
#: What a virtualenv is seeded with: locked too, so that a rebuilt environment has the same pip and setuptools (a
#: framework's ops build with setuptools; megatron 0.8 imports pkg_resources).
SEED = ("pip", "setuptools", "wheel")
#: How long after its newest pinned release an environment takes its dependencies' releases: their bug-fix releases
#: of the following weeks, none of the year after (which old frameworks never met).
SETTLING = timedelta(days=30)


def normalized(name: str) -> str:
    """PEP 503's form of a distribution name (`Typing_Extensions` -> `typing-extensions`), as uv writes locks."""
    return re.sub(r"[-_.]+", "-", name).lower()


def parse(text: str) -> dict[str, str]:
    """name -> version of each `name==version` line (a lock or a freeze); comments, options and blanks left out."""
    pins: dict[str, str] = {}
    for line in text.splitlines():
        requirement = line.split("#", 1)[0].split(";", 1)[0].strip()
        name, equals, version = requirement.partition("==")
        if equals and name and not name.startswith("-"):
            pins[normalized(name.strip())] = version.strip()
    return pins


def render(pins: dict[str, str]) -> str:
    """The lock's body, one `name==version` a line in name order: what `freeze` prints and a lock holds."""
    return "".join(f"{name}=={version}\n" for name, version in sorted(pins.items()))


def differences(locked: dict[str, str], installed: dict[str, str]) -> list[str]:
    """Each way what is installed differs from the lock, in words: `torch 2.13.0 (lock 2.13.0+cpu)`, `+ extra 1.0`
    (installed, not locked), `- missing 2.0` (locked, not installed)."""
    found = []
    for name in sorted(locked.keys() | installed.keys()):
        have, want = installed.get(name), locked.get(name)
        if want is None:
            found.append(f"+ {name} {have}")
        elif have is None:
            found.append(f"- {name} {want}")
        elif have != want:
            found.append(f"{name} {have} (lock {want})")
    return found


def header(environment: str, python: str, install: Iterable[str]) -> str:
    """A lock's first line: the install lines and Python it was compiled from. A lock that does not start with the
    line its environment gives now is stale (a pin changed in matrix/frameworks/ since)."""
    return f"# environment {environment}, python {python}: {' | '.join(install)}\n"


def cutoff(uploads: list[datetime], now: datetime) -> datetime:
    """The newest upload uv may take for an environment: `SETTLING` after its newest pinned release, never later
    than now (a lock compiled twice the same day reads the same)."""
    newest = max(uploads, default=now) + SETTLING
    return min(newest, now).replace(microsecond=0)


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def installed() -> dict[str, str]:
    """name -> version of every distribution installed in this environment's site-packages, this package left out (the
    checkout, editable). Only there: once setuptools is imported (ColossalAI imports it), its own vendored copies
    (`setuptools/_vendor`: jaraco.*, inflect, an older importlib-metadata) are on sys.path too, and would read as
    installed where pip and the lock see none."""
    site = list(dict.fromkeys(sysconfig.get_paths()[key] for key in ("purelib", "platlib")))
    found = {normalized(dist.metadata["Name"]): dist.version for dist in metadata.distributions(path=site)
             if dist.metadata["Name"]}
    found.pop(OURSELVES, None)
    return found


def path_of(matrix_file: Path, environment: str) -> Path:
    return matrix_file.parent / FOLDER / f"{environment}.txt"


def state(matrix_file: Path, environment: str) -> dict[str, Any] | None:
    """What a report records of the environment's lock: its file, its hash, and each difference from what this
    interpreter has (none where the environment was built from it); None where the environment has no lock."""
    lock = path_of(matrix_file, environment)
    if not lock.is_file():
        return None
    text = lock.read_text()
    return {"file": f"{FOLDER}/{lock.name}", "sha256": digest(text),
            "differs": differences(parse(text), installed())}


def main(argv: list[str]) -> int:
    if argv[:1] == ["freeze"]:
        sys.stdout.write(render(installed()))
        return 0
    if argv[:1] == ["check"] and len(argv) == 2:
        try:
            locked = parse(Path(argv[1]).read_text())
        except OSError as exc:
            print(f"freezecompat: {argv[1]}: cannot read the lock ({exc.strerror})", file=sys.stderr)
            return 2
        found = differences(locked, installed())
        print("\n".join(found) if found else f"as locked: {len(locked)} distributions")
        return 1 if found else 0
    print("usage: python -m pytest_freezecompat.spec.locks freeze | check LOCK", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The release watch: the releases the package index has that the matrix does not run yet, and what each changed.

A fine-tuner upgrades the morning a release ships; a compatibility table is worth what it says that day. Two kinds
of candidate come out of the index's answer (`candidates`):

- **a framework's own new release** (torch 2.15.0): a new column. Its environment, `<framework>-<major.minor>`, is
  built from the framework file's `[releases] install` and written into that file, newest first;
- **a new release of a package the framework's newest environment pins and `[releases] watch` names** (transformers
  5.24.0 for the Hugging Face row): that pin bumped in place, as a dependency bot would; the cells keep their ids.

Either is compared with the cells the published report holds for the framework's newest environment
(`report.watched`): `report.diff` says what got worse, and a regression fails the watch, named.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from ..core.candidate import Candidate
from .index import answer
from .locks import DEFAULT_PYTHON
from .matrix import Framework, Spec


@dataclass(frozen=True)
class Found:
    """A watched package's releases newer than the one the matrix holds (newest first)."""

    framework: str
    package: str
    held: str
    newer: tuple[str, ...]


def _version(text: str) -> Version | None:
    try:
        return Version(text)
    except InvalidVersion:
        return None


def ask(index: str | None, packages: list[str]) -> dict[str, dict[str, Any]]:
    """Each package's JSON answer from the index, once per package."""
    return {package: answer(package, index) for package in dict.fromkeys(packages)}


def newer(answer: Mapping[str, Any], held: str, *, pre: bool = False) -> list[str]:
    """The releases in a package index JSON answer (`/pypi/<name>/json`) newer than `held`, newest first: none whose
    files were all yanked, and pre-releases only when asked."""
    floor = _version(held)
    found = []
    for text, files in (answer.get("releases") or {}).items():
        version = _version(text)
        if version is None or (floor is not None and version <= floor) or (version.is_prerelease and not pre):
            continue
        if files and all(f.get("yanked") for f in files):
            continue
        found.append(version)
    return [str(v) for v in sorted(found, reverse=True)]


def pinned(install: tuple[str, ...], package: str) -> str | None:
    """The version `install` pins `package` at (`transformers==5.23.0` -> `5.23.0`), if it does."""
    found = re.search(rf"(?<![\w.-]){re.escape(package)}==([\w.+!-]+)", " ".join(install))
    return found.group(1) if found else None


def _bumped(install: tuple[str, ...], package: str, held: str, version: str) -> tuple[str, ...]:
    pin = re.compile(rf"(?<![\w.-]){re.escape(package)}=={re.escape(held)}(?![\w.+])")
    return tuple(pin.sub(f"{package}=={version}", line) for line in install)


def column_environment(fw: Framework, version: str, taken: set[str]) -> str:
    """`torch-2.15` for torch 2.15.0; the whole version where that name is taken (a second 2.15.x)."""
    parsed = Version(version)
    name = f"{fw.name}-{parsed.major}.{parsed.minor}"
    return name if name not in taken else f"{fw.name}-{version}"


def watched(spec: Spec) -> list[tuple[Framework, str, str]]:
    """(framework, package, held version) for each framework's own package and each `[releases] watch` package."""
    found = []
    for fw in spec.frameworks.values():
        newest = spec.environments[fw.environment]
        if fw.releases[0].version and fw.any_release:
            found.append((fw, fw.package, fw.releases[0].version))
        found += [(fw, package, held) for package in fw.watched
                  if (held := pinned(newest.install, package)) is not None]
    return found


def candidates(spec: Spec, answers: Mapping[str, Mapping[str, Any]], *,
               pre: bool = False) -> tuple[list[Found], list[Candidate]]:
    """What the index answers (package -> its JSON) hold that the matrix does not, and one candidate for the newest
    such release of each watched package. A package the answers lack is left out (`list` says so)."""
    found, made = [], []
    taken = set(spec.environments)
    for fw, package, held in watched(spec):
        if package not in answers:
            continue
        versions = newer(answers[package], held, pre=pre)
        found.append(Found(fw.name, package, held, tuple(versions)))
        if not versions:
            continue
        version = versions[0]
        base = fw.environment
        if package == fw.package:
            environment = column_environment(fw, version, taken)
            taken.add(environment)
            install = tuple(line.replace("{release}", version) for line in fw.any_release)
            python = python_for(answers[package], version, spec.environments[base].python or DEFAULT_PYTHON)
            made.append(Candidate(fw.name, package, version, held, base, environment, install, column=True,
                                  python=python))
        else:
            install = _bumped(spec.environments[base].install, package, held, version)
            made.append(Candidate(fw.name, package, version, held, base, base, install, column=False))
    return found, made


#: The Pythons a new column may be given, oldest first (the matrix's environments are 3.10 to 3.12).
PYTHONS = ("3.10", "3.11", "3.12", "3.13", "3.14")


def python_for(answer: Mapping[str, Any], version: str, current: str) -> str:
    """The Python a release needs where `current` is not one its files' `requires_python` admits (megatron-core
    0.19 requires 3.12): the oldest that is; "" where `current` is fine or the index says nothing."""
    needs = next((f.get("requires_python") for f in (answer.get("releases") or {}).get(version) or []
                  if f.get("requires_python")), None)
    if not needs:
        return ""
    try:
        admitted = SpecifierSet(needs)
    except InvalidSpecifier:
        return ""
    if admitted.contains(current):
        return ""
    return next((python for python in PYTHONS if admitted.contains(python)), "")


def apply(text: str, candidate: Candidate) -> str:
    """The framework file with the candidate in it: a new `[[environment]]` block before the newest one (the file
    lists releases newest first), or the watched pin bumped wherever the file pins that version (the newest
    environment and the `[releases]` template that follows it)."""
    if not candidate.column:
        return "".join(_bumped(tuple(text.splitlines(keepends=True)), candidate.package, candidate.held,
                               candidate.version))
    if re.search(rf'^name = "{re.escape(candidate.environment)}"$', text, re.M):
        return text  # applied already
    block = (f"# Added by the release watch ({candidate.title}): `nox -t matrix-all` runs it; a newcomer's\n"
             f"# `nox -t matrix` too once a person moves first_run here.\n"
             f"[[environment]]\nname = \"{candidate.environment}\"\nfirst_run = false\n"
             f"release = \"{candidate.version}\"\n"
             + (f"python = \"{candidate.python}\"\n" if candidate.python else "") +
             f"install = [{', '.join(_quoted(line) for line in candidate.install)}]\n\n")
    at = text.find("[[environment]]")
    if at < 0:
        raise ValueError(f"framework {candidate.framework}: its file lists no [[environment]] to add a release beside")
    return text[:at] + block + text[at:]


def _quoted(line: str) -> str:
    return '"' + line.replace("\\", "\\\\").replace('"', '\\"') + '"'

"""A release the watch tests: found by `spec.watch` on the package index, judged by `report.watched`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Candidate:
    """The environment one new release is tested in, and the published one it is compared with."""

    framework: str
    package: str
    version: str
    held: str
    #: The framework's newest environment: the published cells the candidate's are compared with.
    base: str
    environment: str
    install: tuple[str, ...]
    #: True: a new release column (a new environment); False: a pin of the base environment bumped in place.
    column: bool
    #: The Python a new column needs where its release does not take the base environment's (`3.12`); "": the same.
    python: str = ""

    @property
    def title(self) -> str:
        return f"{self.package} {self.version}"

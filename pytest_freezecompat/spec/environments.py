"""Environments: one per pin set (each framework pins its own torch), named in the framework files.

`python -m pytest_freezecompat.spec.environments` prints them as JSON (name -> install, frameworks):
the nox sessions and the nightly workflow read them from here, so the merge rule lives once.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Environment:
    name: str
    install: tuple[str, ...]
    frameworks: tuple[str, ...]
    #: `3.10`: the interpreter its virtualenv is made with, where a release cannot import on the default one
    #: (colossalai 0.3.4's legacy dataclasses fail on 3.11); "": the one running nox.
    python: str = ""


def merge_environment(environments: dict[str, Environment], env: Environment) -> None:
    """Several framework files may share an environment: the first that gives pins sets them."""
    known = environments.get(env.name)
    environments[env.name] = env if known is None else Environment(
        env.name, known.install or env.install, known.frameworks + env.frameworks, known.python or env.python)


def main(argv: list[str]) -> int:
    from .matrix import SpecError, load

    try:
        spec = load(argv[0] if argv else None)
    except SpecError as exc:
        print(f"freezecompat: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({name: {"install": list(env.install), "frameworks": list(env.frameworks), "python": env.python}
                      for name, env in spec.environments.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

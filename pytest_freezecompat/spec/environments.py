"""Environments: one per pin set (each framework pins its own torch), named in the framework files.

`python -m pytest_freezecompat.spec.environments` prints them as JSON (name -> install, frameworks, python, setup):
the nox sessions and the nightly workflow read them from here, so the merge rule lives once.

`setup`: one-time work an environment needs after its install, cached inside it. A framework's adapter package may
ship a module named `SETUP_MODULE` (`pytest_freezecompat/adapters/<name>/environment_setup.py`); nox runs
`python -m <adapter>.environment_setup` with the environment's python once, right after it built the environment
(pins and the checkout installed), and marks the environment built only when every setup module succeeded. It is
not run again while the environment is reused. DeepSpeed's builds its C++ ops into the environment there.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Iterable
from dataclasses import dataclass

#: The module an adapter package may ship for its environments' one-time setup (see the module docstring).
SETUP_MODULE = "environment_setup"


@dataclass(frozen=True)
class Environment:
    name: str
    install: tuple[str, ...]
    frameworks: tuple[str, ...]
    #: `3.10`: the interpreter its virtualenv is made with, where a release cannot import on the default one
    #: (colossalai 0.3.4's legacy dataclasses fail on 3.11); "": the one running nox.
    python: str = ""
    #: Part of a newcomer's first run (`nox -t matrix`); false: only the whole matrix (`nox -t matrix-all`, the nightly
    #: job) runs it. The framework file's `first_run`.
    first_run: bool = True


def merge_environment(environments: dict[str, Environment], env: Environment) -> None:
    """Several framework files may share an environment: the first that gives pins sets them."""
    known = environments.get(env.name)
    environments[env.name] = env if known is None else Environment(
        env.name, known.install or env.install, known.frameworks + env.frameworks, known.python or env.python,
        known.first_run and env.first_run)


def setup_modules(adapters: Iterable[str]) -> list[str]:
    """The `<adapter>.environment_setup` modules that exist among these adapter packages, in order, once each
    (found without importing them: only each adapter package's `__init__`, which imports no framework)."""
    found: list[str] = []
    for package in adapters:
        module = f"{package}.{SETUP_MODULE}"
        try:
            exists = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # the adapter package itself is not importable here
            exists = False
        if exists and module not in found:
            found.append(module)
    return found


def main(argv: list[str]) -> int:
    from .matrix import SpecError, load

    try:
        spec = load(argv[0] if argv else None)
    except SpecError as exc:
        print(f"freezecompat: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({name: {"install": list(env.install), "frameworks": list(env.frameworks), "python": env.python,
                             "first_run": env.first_run,
                             "setup": setup_modules(spec.frameworks[fw].adapter for fw in env.frameworks
                                                    if fw in spec.frameworks)}
                      for name, env in spec.environments.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The shape of the package: data flows one way, and the plugin loads no torch into a plain pytest run."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "pytest_freezecompat"
#: Layer -> the package layers its modules may import at module level (besides itself and `core`).
MAY_IMPORT = {
    "core": set(),
    "spec": set(),
    "verdict": set(),
    "report": {"verdict", "advice"},  # downstream of both: severities of older rows, the advice every report shows
    "options": set(),  # the plugin's settings, resolved before anything is collected
    "controller": {"spec", "verdict", "report", "options"},
    "models": set(),
    "adapters": {"models"},
    "rank": {"adapters", "models"},
    "plugin": {"options"},  # the controller and the user API only inside functions
    "user": {"spec", "verdict", "models"},  # a case is checked as ranks build it: the same blocks (`models.blocks_of`)
    "cli": {"spec", "report", "verdict"},
    "advice": {"verdict"},  # over a report's rows: severities, nearest safe setups
    "bisect": {"spec"},  # `freezecompat bisect`: builds environments and runs pytest in them, in subprocesses
    "__init__": set(),
}
#: What every adapter may share (the rest of `adapters/` is one package per framework).
SHARED_ADAPTER_MODULES = ("base", "loop", "views", "emulation", "materialize", "saved_files", "deepspeed_ops",
                          "deepspeed_views")
#: Modules that a plain `pytest` run (plugin installed, no matrix) or the report tools import: no torch.
TORCH_FREE = ("core", "spec", "verdict", "report", "controller", "plugin", "options", "cli", "bisect", "advice",
              "__init__")


def _layer(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return parts[0]


def _module_level_imports(path: Path) -> list[str]:
    """Absolute names of what a module imports at module level (relative imports resolved)."""
    tree = ast.parse(path.read_text())
    package = ["pytest_freezecompat", *path.relative_to(PACKAGE).parent.parts]
    found = []
    for node in tree.body:
        if isinstance(node, ast.If):  # `if TYPE_CHECKING:` / version switches: only the else branch runs here
            nodes = node.orelse if "TYPE_CHECKING" in ast.unparse(node.test) else [*node.body, *node.orelse]
        else:
            nodes = [node]
        for item in nodes:
            if isinstance(item, ast.Import):
                found += [alias.name for alias in item.names]
            elif isinstance(item, ast.ImportFrom):
                base = package[:len(package) - item.level + 1] if item.level else []
                module = ".".join([*base, *(item.module.split(".") if item.module else [])])
                found += [module] + [f"{module}.{alias.name}" for alias in item.names]
    return found


def _package_layer(name: str) -> str | None:
    parts = name.split(".")
    return parts[1] if parts[0] == "pytest_freezecompat" and len(parts) > 1 else None


MODULES = sorted(p for p in PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_only_flow_down(path: Path) -> None:
    layer = _layer(path)
    allowed = MAY_IMPORT[layer] | {layer, "core"}
    wrong = sorted({name for name in _module_level_imports(path)
                    if (target := _package_layer(name)) is not None and target in MAY_IMPORT and target not in allowed})
    assert not wrong, f"{layer} may import {sorted(allowed)} only"


@pytest.mark.parametrize("path", [p for p in MODULES if len(p.relative_to(PACKAGE).parts) == 3
                                  and p.relative_to(PACKAGE).parts[0] == "adapters"],
                         ids=lambda p: str(p.relative_to(PACKAGE)))
def test_an_adapter_imports_no_other_adapter(path: Path) -> None:
    own = path.relative_to(PACKAGE).parts[1]
    shared = (own, *SHARED_ADAPTER_MODULES)
    others = [n for n in _module_level_imports(path)
              if n.startswith("pytest_freezecompat.adapters.") and n.split(".")[2] not in shared]
    assert not others


@pytest.mark.parametrize("path", [p for p in MODULES if _layer(p) in TORCH_FREE or p.name == "__init__.py"],
                         ids=lambda p: str(p.relative_to(PACKAGE)))
def test_torch_free_layers_import_no_torch_or_framework_at_module_level(path: Path) -> None:
    heavy = [n for n in _module_level_imports(path) if n.split(".")[0] in ("torch", "numpy", "colossalai", "composer",
                                                                            "megatron", "transformers")]
    allowed_numpy = _layer(path) == "verdict"  # pure numpy verdicts
    assert not [n for n in heavy if not (allowed_numpy and n.startswith("numpy"))]


def test_core_is_stdlib_only() -> None:
    for path in (PACKAGE / "core").glob("*.py"):
        outside = [n for n in _module_level_imports(path)
                   if n.split(".")[0] not in sys.stdlib_module_names and not n.startswith("pytest_freezecompat.core")]
        assert not outside, (path.name, outside)


HELP_THEN_MODULES = """
import json, sys, pytest
code = pytest.main(["--help"])
print(json.dumps({"code": int(code), "modules": sorted(sys.modules)}))
"""


def test_pytest_help_with_the_plugin_installed_imports_no_torch(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-c", HELP_THEN_MODULES], cwd=tmp_path, capture_output=True, text=True,
                            check=False)
    found = json.loads(result.stdout.splitlines()[-1])
    assert found["code"] == 0 and "--freeze-matrix" in result.stdout
    assert "pytest_freezecompat.plugin" in found["modules"], "the plugin is not installed in this environment"
    assert not [m for m in found["modules"] if m.split(".")[0] in ("torch", "numpy")
                or m.startswith(("pytest_freezecompat.controller", "pytest_freezecompat.spec"))]


def test_no_code_unpickles_what_peers_send_over_a_socket() -> None:
    """The `*_object` collectives pickle over the process group's sockets; ranks gather with tensors and JSON."""
    pickling = re.compile(r"\b(all_gather_object|gather_object|broadcast_object_list|scatter_object_list|"
                          r"recv_object_list|send_object_list|pickle\.loads?)\(")
    assert [f"{p.relative_to(PACKAGE)}:{n}" for p in MODULES
            for n, line in enumerate(p.read_text().splitlines(), 1) if pickling.search(line)] == []

"""Locks: parsing, differences, the cutoff date, what a report records, and that every environment has a current one."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

import pytest

from pytest_freezecompat.spec import locks
from pytest_freezecompat.spec.matrix import default_spec_path, load

LOCK = """# environment torch, python 3.11: torch==2.13.0 | transformers==5.23.0
# dependencies as released by 2026-11-28
Jinja2==3.1.6
torch==2.13.0+cpu
typing_extensions==4.16.0 ; python_version < "3.12"
--find-links /opt/wheels
"""


def test_a_lock_reads_as_normalized_names_and_exact_versions() -> None:
    assert locks.parse(LOCK) == {"jinja2": "3.1.6", "torch": "2.13.0+cpu", "typing-extensions": "4.16.0"}
    assert locks.render(locks.parse(LOCK)) == "jinja2==3.1.6\ntorch==2.13.0+cpu\ntyping-extensions==4.16.0\n"


def test_each_difference_from_the_lock_is_named() -> None:
    locked = {"torch": "2.13.0+cpu", "numpy": "2.4.6", "pip": "26.3"}
    installed = {"torch": "2.13.0", "numpy": "2.4.6", "extra": "1.0"}
    assert locks.differences(locked, installed) == ["+ extra 1.0", "- pip 26.3", "torch 2.13.0 (lock 2.13.0+cpu)"]
    assert locks.differences(locked, dict(locked)) == []


def test_the_cutoff_follows_the_newest_pinned_release_and_never_passes_today() -> None:
    now = datetime(2026, 11, 28, 11, 0, 0, 123, tzinfo=timezone.utc)
    old = [datetime(2023, 11, 1, tzinfo=timezone.utc), datetime(2024, 3, 27, 21, 6, tzinfo=timezone.utc)]
    assert locks.cutoff(old, now) == datetime(2024, 4, 26, 21, 6, tzinfo=timezone.utc)
    assert locks.cutoff([datetime(2026, 11, 13, tzinfo=timezone.utc)], now) == now.replace(microsecond=0)
    assert locks.cutoff([], now) == now.replace(microsecond=0)


def test_a_report_records_the_lock_hash_and_what_the_run_had_otherwise(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "locks").mkdir()
    (tmp_path / "locks" / "torch.txt").write_text(LOCK)
    monkeypatch.setattr(locks, "installed", lambda: {"jinja2": "3.1.6", "torch": "2.13.0+cpu",
                                                     "typing-extensions": "4.15.0"})
    state = locks.state(tmp_path / "matrix.toml", "torch")
    assert state == {"file": "locks/torch.txt", "sha256": locks.digest(LOCK),
                     "differs": ["typing-extensions 4.15.0 (lock 4.16.0)"]}
    assert locks.state(tmp_path / "matrix.toml", "no-such-environment") is None


def test_every_environment_has_a_lock_compiled_from_its_pins_now() -> None:
    """A pin changed in matrix/frameworks/ without `nox -s locks -- <env>` fails here (and in nox's build)."""
    spec = load(default_spec_path())
    for name, env in spec.environments.items():
        lock = locks.path_of(spec.path, name)
        assert lock.is_file(), f"{name}: no lock: nox -s locks -- {name}"
        text = lock.read_text()
        assert text.startswith(locks.header(name, env.python or locks.DEFAULT_PYTHON, env.install)), \
            f"{name}: its lock is stale: nox -s locks -- {name}"
        pins = locks.parse(text)
        for requirement in (r for line in env.install for r in line.split() if "==" in r):
            name_, version = requirement.split("==")
            assert pins[locks.normalized(name_)].split("+")[0] == version, (name, requirement)
        assert set(locks.SEED) <= pins.keys(), name


def test_what_is_installed_is_what_site_packages_holds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A package's vendored copy on sys.path (setuptools/_vendor once setuptools is imported) is not installed."""
    vendored = tmp_path / "not-installed-9.9.dist-info"
    vendored.mkdir()
    (vendored / "METADATA").write_text("Metadata-Version: 2.1\nName: not-installed\nVersion: 9.9\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "not-installed" in {dist.metadata["Name"] for dist in metadata.distributions()}
    assert "not-installed" not in locks.installed()


def test_what_is_installed_reads_in_the_locks_own_form(capsys: pytest.CaptureFixture[str]) -> None:
    assert locks.main(["freeze"]) == 0
    frozen = capsys.readouterr().out
    assert locks.parse(frozen) == locks.installed() and frozen == locks.render(locks.installed())
    assert locks.OURSELVES not in frozen and "pytest==" in frozen


def test_each_published_environment_ran_exactly_its_lock() -> None:
    """The published report: each environment it holds names its lock's current hash with no difference, and the
    versions published beside it (reports/pip-freeze-<env>.txt) are that lock's. A lock compiled again without its
    slice run again fails here."""
    spec = load(default_spec_path())
    published = Path(spec.path).resolve().parents[1] / "reports"
    environments = json.loads((published / "matrix.json").read_text())["environments"]
    assert set(environments) <= set(spec.environments)
    for name, recorded in environments.items():
        lock = locks.path_of(spec.path, name).read_text()
        assert recorded.get("lock") == {"file": f"locks/{name}.txt", "sha256": locks.digest(lock), "differs": []}, \
            f"{name}: the published cells ran another lock, or none: run its slice again"
        assert locks.parse((published / f"pip-freeze-{name}.txt").read_text()) == locks.parse(lock), name

"""Each Lightning finding's standalone reproducer, run with this environment's python: it must show the failure on
a release inside its registry entry's range and not outside it (tests/findings_run.py)."""

import pytest

pytest.importorskip("lightning.pytorch")  # a module of the real package, not a namespace folder

from findings_run import check_reproducer, findings


@pytest.mark.parametrize("entry", findings("lightning"), ids=lambda entry: entry.id)
def test_the_finding_reproduces_where_the_registry_says(entry):
    check_reproducer("lightning", entry)

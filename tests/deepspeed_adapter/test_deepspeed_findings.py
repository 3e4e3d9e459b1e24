"""Each deepspeed finding's standalone reproducer, run with this environment's python: it must show the failure on a
release inside its registry entry's range and not outside it (tests/findings_run.py)."""

import pytest
from findings_run import check_reproducer, findings


@pytest.mark.parametrize("entry", findings("deepspeed"), ids=lambda entry: entry.id)
def test_the_finding_reproduces_where_the_registry_says(entry):
    check_reproducer("deepspeed", entry)

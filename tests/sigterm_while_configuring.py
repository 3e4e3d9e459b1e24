"""A plugin still configuring when SIGTERM comes (`-p sigterm_while_configuring`), as a slow plugin import was on
a GPU machine: after ours, so our plugin has already started its run."""

import os
import signal
import time

import pytest


@pytest.hookimpl(trylast=True)
def pytest_configure(config: pytest.Config) -> None:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)

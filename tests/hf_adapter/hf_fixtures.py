"""Fixtures of the Hugging Face adapter tests (imported by name: a conftest.py here would shadow tests/conftest.py)."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
import torch.distributed as dist


@pytest.fixture
def one_process_group(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A gloo group of one, under torchrun's variables, as Accelerate expects them; left as it was found."""
    if dist.is_initialized():  # another test of this worker holds the default group
        pytest.skip("a default process group is already initialized in this process")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1",
                        "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(name, value)
    dist.init_process_group("gloo", rank=0, world_size=1)
    from pytest_freezecompat.adapters.hf import state

    state.fresh()
    try:
        yield
    finally:
        state.fresh()
        dist.destroy_process_group()

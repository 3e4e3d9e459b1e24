"""A rank's phase board: what one process writes, another reads, whole or not at all."""

from __future__ import annotations

import os
from pathlib import Path

from pytest_freezecompat.core.board import SLOT_BYTES, PhaseBoard


def test_a_forked_writer_is_read_by_its_parent(tmp_path: Path) -> None:
    path = tmp_path / "rank0.phase"
    reader = PhaseBoard.create(path, "waiting for cell")
    assert reader.read() == "waiting for cell"
    pid = os.fork()
    if pid == 0:  # the rank: its own mapping of the file
        writer = PhaseBoard.open(path)
        writer.write("step 0: forward/backward")
        writer.write("step 1: read grads — résumé")
        os._exit(0)
    os.waitpid(pid, 0)
    assert reader.read() == "step 1: read grads — résumé"


def test_a_longer_text_is_cut_to_the_slot_and_a_shorter_one_after_it_is_whole(tmp_path: Path) -> None:
    board = PhaseBoard.create(tmp_path / "b", "")
    board.write("x" * (2 * SLOT_BYTES))
    assert board.read() == "x" * (SLOT_BYTES - 12)
    board.write("done")
    assert board.read() == "done"


def test_a_write_caught_half_way_is_read_again_until_it_is_whole(tmp_path: Path) -> None:
    """The reader sees an odd sequence number while a write is under way: it reads again, not the torn text."""
    board = PhaseBoard.create(tmp_path / "b", "resume: load")
    slot = board._slot
    sequence = int.from_bytes(slot[:8], "little")
    slot[:8] = (sequence + 1).to_bytes(8, "little")  # a writer began ...
    slot[12:16] = b"XXXX"  # ... and changed the text

    reads = []
    original = board._text

    def text() -> str:  # the writer ends its write while the reader retries
        reads.append(original())
        if len(reads) == 3:
            slot[12:16] = b"resu"
            slot[:8] = (sequence + 2).to_bytes(8, "little")
        return reads[-1]

    board._text = text  # type: ignore[method-assign]
    assert board.read() == "resume: load"
    assert len(reads) == 4 and reads[0].startswith("XXXX")

"""A rank's current phase, in a small shared file the controller reads only when it needs it.

A rank marks ~20 phases a cell (`Probe.phase`); the controller needs them only to say where a rank was when a
cell hung, crashed or ended (`RankState.phase`) and to spot a hung rendezvous. Sent over the pipe, each phase
woke the controller, which took a core from the ranks: 5-8% of a cheap cell's CPU. Here a phase is a write into
a memory-mapped file (no system call), read by the controller at the end of a cell.

The slot: a sequence number (odd while a write is under way), the text's length, the text (cut to fit). One
writer at a time: the rank during a cell, the controller between cells (the rank then waits for its next cell).
"""

from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path

#: The file's size: a phase is a line (an error's first 120 characters at most in it); longer text is cut.
SLOT_BYTES = 4096
_SEQUENCE = struct.Struct("<Q")
_LENGTH = struct.Struct("<I")
_TEXT_AT = _SEQUENCE.size + _LENGTH.size
#: Reads of a slot caught mid-write before the reader takes what it got (a rank killed mid-write stays odd).
READ_TRIES = 100


class PhaseBoard:
    """One rank's slot. `create` (the controller, before the rank starts) makes the file; the rank `open`s it."""

    def __init__(self, path: Path | str, create: bool = False) -> None:
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_TRUNC if create else 0), 0o600)
        try:
            if create:
                os.ftruncate(fd, SLOT_BYTES)
            self._slot = mmap.mmap(fd, SLOT_BYTES)
        finally:
            os.close(fd)

    @classmethod
    def create(cls, path: Path | str, text: str) -> PhaseBoard:
        board = cls(path, create=True)
        board.write(text)
        return board

    @classmethod
    def open(cls, path: Path | str) -> PhaseBoard:
        return cls(path)

    def write(self, text: str) -> None:
        data = text.encode()[:SLOT_BYTES - _TEXT_AT]
        (sequence,) = _SEQUENCE.unpack_from(self._slot)
        _SEQUENCE.pack_into(self._slot, 0, sequence + 1)
        _LENGTH.pack_into(self._slot, _SEQUENCE.size, len(data))
        self._slot[_TEXT_AT:_TEXT_AT + len(data)] = data
        _SEQUENCE.pack_into(self._slot, 0, sequence + 2)

    def read(self) -> str:
        for _ in range(READ_TRIES):
            (before,) = _SEQUENCE.unpack_from(self._slot)
            text = self._text()
            if before % 2 == 0 and _SEQUENCE.unpack_from(self._slot)[0] == before:
                return text
        return text

    def _text(self) -> str:
        (length,) = _LENGTH.unpack_from(self._slot, _SEQUENCE.size)
        length = min(length, SLOT_BYTES - _TEXT_AT)
        return bytes(self._slot[_TEXT_AT:_TEXT_AT + length]).decode(errors="replace")  # a cut may split a character

    def close(self) -> None:
        self._slot.close()

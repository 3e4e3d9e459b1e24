"""An adapter that misbehaves on purpose, to prove the runner survives hangs and crashes."""

from pytest_freezecompat.core.declaration import AdapterDeclaration

DECLARATION = AdapterDeclaration(
    plugins=("ok", "hang", "ok-after-hang", "crash", "ok-after-crash", "raise-on-rank-1", "ok-after-raise",
             "die-while-tidying", "ok-after-tidying", "pollute", "ok-after-pollute", "stray-collective",
             "ok-after-stray"),
    init=("eager",), checkpoint=("none",), implementation="faulty_adapter.adapter:FaultyAdapter")

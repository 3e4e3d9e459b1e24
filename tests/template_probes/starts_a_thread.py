"""A first use that leaves a thread behind: a template must not fork with it."""

import threading
import time


def warm_up() -> None:
    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()

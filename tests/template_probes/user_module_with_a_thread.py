"""A user's `@freeze_case` module that starts a thread when imported."""

import threading
import time

threading.Thread(target=time.sleep, args=(60,), daemon=True).start()

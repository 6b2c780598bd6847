"""A rollout loop for `test_async_compat.py` that the spawned worker child can import: it exits when told to."""

import os
import time


class ExitWhenToldLoop:
    """Stands in for TRL's `_AsyncRolloutLoop` in the child: `run()` returns (the child exits) once the file `exit_now`
    exists (the worker pickles its loop arguments, so they are plain values)."""

    def __init__(self, *, exit_now: str, **_):
        self.exit_now = exit_now

    def run(self) -> None:
        while not os.path.exists(self.exit_now):
            time.sleep(0.05)

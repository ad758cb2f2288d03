"""A watchdog for the host's waits on the device: a stalled device ends the process with a
one-line error instead of leaving a batch job (or a server, or CI) waiting forever.

The scheduler wraps every wait on the device (the first execution after a compile, each
sync of a cycle loop's figures) in `Watchdog.waiting`. Compiles are not waited on inside it,
so a long compile never trips it; a wait that lasts longer than `timeout` seconds does. The
stall is then reported from a daemon thread, because the main thread is blocked inside the
runtime and cannot raise: `on_stall(message)` runs, by default printing the message to stderr
and ending the process with exit status `STALL_EXIT_CODE`. Rows already written stay written
(outputs are flushed line by line).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from typing import Callable

STALL_EXIT_CODE = 3


def exit_on_stall(message: str):
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(STALL_EXIT_CODE)  # the main thread is stuck in the runtime: nothing else can end it


class Watchdog:
    """Calls `on_stall` once a wait inside `waiting(what)` has lasted `timeout` seconds."""

    def __init__(self, timeout: float, on_stall: Callable[[str], None] = exit_on_stall):
        if not timeout > 0:
            raise ValueError(f"watchdog timeout must be > 0 seconds, got {timeout}")
        self.timeout, self.on_stall = float(timeout), on_stall
        self._lock = threading.Condition()
        self._wait: tuple[float, str] | None = None  # (deadline, what) of the wait in progress
        threading.Thread(target=self._watch, name="dflash-watchdog", daemon=True).start()

    @contextlib.contextmanager
    def waiting(self, what: str):
        with self._lock:
            self._wait = (time.monotonic() + self.timeout, what)
            self._lock.notify()
        try:
            yield
        finally:
            with self._lock:
                self._wait = None

    def _watch(self):
        while True:
            with self._lock:
                while self._wait is None:
                    self._lock.wait()
                deadline, what = self._wait
                left = deadline - time.monotonic()
                if left > 0:
                    self._lock.wait(left)
                    continue
                self._wait = None
            self.on_stall(f"the device made no progress for {self.timeout:g} s while {what} (a stalled runtime: "
                          f"rows finished so far are written; raise --stall-timeout if the device is just slow)")
            # on_stall returned (a caller that does not exit): watch the next wait

"""One job at a time for the panel: in a thread inside a notebook kernel, inline elsewhere.

Inside a kernel a job (running transforms, generating, reloading the model) must not block the
kernel's message loop, or the Stop button's click would only arrive after the job ended; so the
job runs in a thread and the click just sets ``stop_requested``, which the job checks between
steps. Outside a kernel (tests, scripts) the job runs inline, which makes it deterministic.
"""

from __future__ import annotations

import threading
from typing import Callable, Optional


def in_kernel() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


class Worker:
    def __init__(self, background: Optional[bool] = None):
        self.background = in_kernel() if background is None else background
        self.stop_requested = False
        self._thread: Optional[threading.Thread] = None
        self._busy = False

    @property
    def busy(self) -> bool:
        return self._busy

    def start(self, job: Callable[[], None], done: Callable[[Optional[BaseException]], None]) -> bool:
        """Run ``job`` then ``done(error or None)``; False (nothing started) if a job is running."""
        if self._busy:
            return False
        self._busy, self.stop_requested = True, False

        def run() -> None:
            err: Optional[BaseException] = None
            try:
                job()
            except BaseException as e:  # noqa: BLE001 - handed to done() to show in the panel
                err = e
            finally:
                self._busy = False
            done(err)

        if self.background:
            self._thread = threading.Thread(target=run, name="workbench-panel", daemon=True)
            self._thread.start()
        else:
            run()
        return True

    def stop(self) -> None:
        self.stop_requested = True

    def join(self, timeout: Optional[float] = None) -> None:
        """Wait for the running job (background mode); a no-op inline."""
        if self._thread is not None:
            self._thread.join(timeout)

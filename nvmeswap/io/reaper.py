"""Releasing what was dropped without ``close()``, never inside a garbage collection.

Note [releasing dropped handles]
A handle (or a pin-memory handle) dropped without ``close()`` is released by its
finalizer. Dropped by its last reference going (``del handle``), the finalizer runs in
the dropping code, and releases in place: the pending writes are done when ``del``
returns, as DeepNVMe's destructor has them. Dropped in a reference cycle, it runs
wherever the garbage collector happens to run: at any allocation of any thread, perhaps
while that thread holds a lock of the process that releasing takes too (the locked
set's, the registry of writes in flight); releasing there would wait for the thread
itself, for ever. So a finalizer inside a collection (a ``gc.callbacks`` entry in C marks
it, per thread: pyx/_collection.pyx) only hands the work to the reaper, a daemon thread
of the process that does it (``SimpleQueue.put`` takes no lock a collection could find
held; the thread is started with the first handle, never from a finalizer). At interpreter exit the reaper finishes
what it was handed, and what finalizers hand it from then on is done in place.
"""
from __future__ import annotations

import atexit
import gc
import os
import queue
import threading
import warnings
from collections.abc import Callable
from typing import Any

from .._collection import in_collection, mark_collection
from . import process_state

gc.callbacks.append(mark_collection)


class Reaper:
    """The process's reaper thread (a forked child makes its own: Note [process state])."""

    def __init__(self) -> None:
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._exiting = False
        self._pid = os.getpid()
        self._thread = threading.Thread(target=self._run, name="nvmeswap-reaper", daemon=True)
        self._thread.start()
        atexit.register(self._finish)

    def call(self, release: Callable[..., Any], *args: Any) -> None:
        """Run ``release(*args)``: in place, but on the reaper's thread inside a garbage
        collection (until the interpreter exits). Safe in a finalizer."""
        if self._exiting or not in_collection():
            _run_one(release, args)
        else:
            self._work.put((release, args))

    def _run(self) -> None:
        while True:
            item = self._work.get()
            if item is None:
                return
            _run_one(*item)
            del item

    def _finish(self) -> None:
        if os.getpid() != self._pid:
            return      # a forked child's copy: the parent's thread is not here
        self._exiting = True
        self._work.put(None)
        self._thread.join()
        while True:     # handed over while the thread was stopping
            try:
                item = self._work.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                _run_one(*item)


def _run_one(release: Callable[..., Any], args: tuple) -> None:
    try:
        release(*args)
    except Exception as error:     # as a finalizer's own failure would be: reported
        warnings.warn(f"releasing a dropped nvmeswap handle failed: {error}",
                      ResourceWarning, stacklevel=1)


def reaper() -> Reaper:
    """The process's reaper, started on first use (never from a finalizer)."""
    return process_state.shared(Reaper)

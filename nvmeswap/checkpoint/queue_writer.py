"""Saves through the calling process's own kernel queue: ``QueueWriter``, what
``StreamWriter`` writes its ring with where no handle was given.

Note [saves without a handle]
``nvmeswap.save`` and ``save_safetensors`` called without a handle used to start one
for the call: workers started (20 to 44 ms here) and stopped (35 to 60 ms), and a ring
of 64 MiB of shared memory locked for them (40 to 200 ms), a fifth to a third of a 1
GiB save. Only the ring's writes need the kernel, and O_DIRECT writes need no worker:
``QueueWriter`` gives ``StreamWriter`` (image.py) its ring as private memory, locked,
and writes each slot with the calling process's own queue (requests of 1 MiB, at most
64 in flight; the unaligned tail of a file, under 4096 bytes, with one buffered write,
as Note [O_DIRECT tail]). The ring copies, the CRCs and the commit are the
Checkpointer's own. A ``Checkpointer`` made without a handle saves this way too, its
ring kept from one save to the next; where it stripes, the one queue has requests to
every stripe file in flight together (a ``StripedHandle`` started a handle, two
workers, per device).
"""
from __future__ import annotations

import contextlib
import os
from typing import Any

from ..io.files import open_target
from ..io.operation import transfer_error
from .own_queue import REQUEST_BYTES, OwnQueue, Registration, private_tensor
from .stripes import StripeSet


def _open_once(pieces):
    """``{path: TargetFile}`` of the files that ``(path, offset, _, length)`` pieces go
    to, each opened once over the span of its pieces (so that only a span that ends
    unaligned, the file's end, gets a buffered descriptor for its tail). On a failure
    none stays open."""
    spans: dict[str, tuple[int, int]] = {}
    for path, offset, _, length in pieces:
        start, end = spans.get(path, (offset, offset + length))
        spans[path] = min(start, offset), max(end, offset + length)
    files: dict[str, Any] = {}
    try:
        for path, (start, end) in spans.items():
            files[path] = open_target(path, for_write=True, offset=start, nbytes=end - start,
                                      o_direct=None)
    except BaseException:
        for file in files.values():
            file.close()
        raise
    return files


class _Write:
    """One ``submit_pwrite``: done when its requests are; holds its files open until then."""

    def __init__(self, writer: QueueWriter, files: dict[str, Any]) -> None:
        self.writer = writer
        self.files = files          # path -> TargetFile
        self.left = 0
        self.error: BaseException | None = None

    def result(self) -> None:
        while self.left:
            self.writer.settle()
        self.writer.forget(self)
        if self.error is not None:
            raise self.error


class QueueWriter:
    """The part of ``aio_handle`` that ``StreamWriter`` uses, through an ``OwnQueue``
    (Note [saves without a handle]): locked tensors of private memory, and
    ``submit_pwrite`` of one of them, whose future's ``result()`` waits for its
    requests; with ``stripes`` (a StripeSet), to the logical files striped over its
    folders (Note [stripes]). A reap cut short (a Ctrl-C) ends every write in flight
    with that error; the next ``submit_pwrite`` starts a fresh queue. ``close()`` waits
    for what is in flight and closes every file."""

    def __init__(self, what: str, stripes: StripeSet | None = None) -> None:
        self._what = what
        self.own: OwnQueue | None = OwnQueue(what)      # None after a reap cut short
        self.stripes = stripes
        self._writes: list[_Write] = []
        self._registered: dict[int, Registration] = {}    # by address

    def new_cpu_locked_tensor(self, nbytes: int, example: Any) -> Any:
        tensor = private_tensor(nbytes, locked=True)
        self._registered[tensor.data_ptr()] = Registration(tensor)
        return tensor

    def ensure_registered(self) -> None:
        """Register its tensors with CUDA where CUDA has come into use since they were
        made (a kept ring)."""
        for registration in self._registered.values():
            registration.ensure()

    def free_cpu_locked_tensor(self, tensor: Any) -> bool:
        """Unregister it from CUDA if it was; its memory goes with the tensor."""
        registration = self._registered.pop(tensor.data_ptr(), None)
        if registration is not None:
            registration.release()
        return True

    def submit_pwrite(self, buffer: Any, filename: str, file_offset: int) -> _Write:
        """Start writing ``buffer`` at ``file_offset`` (aligned, as the ring's slots are)."""
        if self.own is None:
            self.own = OwnQueue(self._what)
        nbytes = buffer.numel()
        if self.stripes is None:
            pieces = [(filename, file_offset, 0, nbytes)]
        else:
            paths = self.stripes.paths(filename)
            pieces = [(paths[device], offset, at, length) for device, offset, at, length
                      in self.stripes.pieces(nbytes, file_offset)]
        write = _Write(self, _open_once(pieces))
        self._writes.append(write)
        try:
            for path, offset, at, length in pieces:
                self._write_piece(write, write.files[path], offset, buffer[at:at + length])
        except BaseException:
            # The caller never gets this write: wait for what it started, close its files.
            with contextlib.suppress(BaseException):
                write.result()
            raise
        return write

    def _write_piece(self, write, file, offset, piece):
        nbytes = piece.numel()
        address = piece.data_ptr()
        direct = nbytes - (offset + nbytes) % file.alignment
        for at in range(0, direct, REQUEST_BYTES):
            length = min(REQUEST_BYTES, direct - at)
            while not self.own.submit(file, False, offset + at, address + at, length,
                                      length, write):
                self.settle()
            write.left += 1
        if direct < nbytes:         # the file's unaligned end (Note [O_DIRECT tail])
            tail = piece[direct:].numpy().tobytes()
            err, wrote = 0, 0
            try:
                wrote = os.pwrite(file.buffered_fd, tail, offset + direct)
            except OSError as error:
                err = error.errno
            if err or wrote != len(tail):
                write.error = write.error or transfer_error(
                    file.name, False, err, offset + direct, len(tail), wrote)

    def settle(self) -> None:
        """Wait for some requests to end, each counted against its write. A reap cut
        short (a Ctrl-C) may leave completions uncounted: then every request in flight
        is waited for, every write ended with that error and its files closed, and the
        error raised; the next ``submit_pwrite`` starts a fresh queue."""
        try:
            for write, error in self.own.reap():
                write.left -= 1
                write.error = write.error or error
        except BaseException as error:
            self._abandon(error)
            raise

    def _abandon(self, error: BaseException) -> None:
        own, self.own = self.own, None
        own.close()             # waits for what is in flight (a Ctrl-C held back)
        for write in list(self._writes):
            write.left = 0
            write.error = write.error or error
            self.forget(write)

    def close_files(self) -> None:
        """Close this process's descriptors of every write's files, and nothing else: in
        a forked child, whose parent's writes are the parent's."""
        for write in self._writes:
            for file in write.files.values():
                file.close()

    def forget(self, write: _Write) -> None:
        if write in self._writes:
            self._writes.remove(write)
            for file in write.files.values():
                file.close()

    def close(self) -> None:
        if self.own is not None:
            self.own.close()
        for write in list(self._writes):
            self.forget(write)
        registered, self._registered = self._registered, {}
        for registration in registered.values():
            registration.release()

    def __enter__(self) -> QueueWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

"""``SwapBufferPool``: locked swap buffers allocated once, checked out and returned.

For callers that swap the same sizes over and over: I/O on the buffers is zero-copy for
the handle that made them.
"""


class SwapBufferPool:
    """``count`` locked, page-aligned buffers of ``nbytes`` each, allocated once.

    ``get()`` checks one out (zeroed if ``zero``), ``put()`` returns it; ``close()``
    frees them all. I/O on them is zero-copy for the handle that made them.
    """

    def __init__(self, handle, count, nbytes, *, zero=False):
        import torch
        self._handle = handle
        self._zero = zero
        self._all = []
        try:
            for _ in range(count):
                self._all.append(handle.new_cpu_locked_tensor(
                    nbytes, torch.empty(0, dtype=torch.uint8)))
        except BaseException:
            self.close()        # the ones made: nothing else could free them
            raise
        self._free = list(self._all)
        self.nbytes = nbytes

    def get(self):
        if not self._free:
            raise RuntimeError(f"all {len(self._all)} swap buffers are in use")
        buffer = self._free.pop()
        if self._zero:
            buffer.zero_()
        return buffer

    def put(self, buffer):
        if not any(buffer is mine for mine in self._all):
            raise ValueError("this buffer does not belong to the pool")
        if any(buffer is free for free in self._free):
            raise ValueError("this buffer was returned already")
        self._free.append(buffer)

    @property
    def available(self):
        return len(self._free)

    def close(self):
        for buffer in self._all:
            self._handle.free_cpu_locked_tensor(buffer)
        self._all, self._free = [], []

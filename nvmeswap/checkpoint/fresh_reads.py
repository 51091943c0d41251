"""Reading a checkpoint's storages into fresh private memory through the calling
process's own kernel queue: the road of ``nvmeswap.load`` and ``load_safetensors``
called without a handle.

Note [fresh private reads]
A load that makes the memory its tensors live in needs nothing of a handle: its
workers reach only shared memory, and fresh shared memory is made and locked at 0.6 to
0.8 s a GiB here, in 4 KiB pages (Note [parallel population] in pyx/_memory.pyx), more
than reading the bytes. Private anonymous memory, torch's own kind, costs half that
(0.32 s a GiB here: the page faults). So such a load maps private memory, one mapping
per group of storages (Note [checkpoint reads]), and reads into it with O_DIRECT from
the calling process's own queue (the caller queue of Note [caller queue], on the engine
the environment names: kernel AIO or io_uring): aligned requests of 1 MiB, 64 in
flight, the kernel faulting the pages in as it pins them for the transfer. Each mapping
is locked once read, its pages present by then (milliseconds a GiB). No worker starts
or stops. A cold 0.69 GiB archive on the memory-backed device: 0.36 s, against 0.68 to
0.84 s through a handle's locked buffers and 0.31 to 0.46 s for ``torch.load``, which
pays the same faults (docs/checkpoints.md).

The pages are torch's kind too: 4 KiB, or 2 MiB where the kernel's THP setting is
"always" or where ``THP_MEM_ALLOC_ENABLE=1`` asks torch to advise its own large
allocations (then the mappings are advised for huge pages, MADV_HUGEPAGE). Huge pages
are not asked for otherwise: on a virtual machine whose balloon reports free memory to
its host (this one), the free 2 MiB blocks huge pages are made of are the ones the host
has taken back, and the same load took 0.17 to 0.55 s with them, ``torch.load`` 1.06 to
1.36 s.

A handle given by the caller still gets the storages in its locked set, zero-copy for
it. Where CUDA is in use, a buffer holding storages bound for a GPU is registered with
CUDA while they are copied (Note [own queue and CUDA] in own_queue.py): copies from
registered memory run about nine times faster than from private memory (shared/GPU.md).
"""
from __future__ import annotations

import os
from typing import Any

from .._memory import buffer_address
from ..io.files import open_target
from ..io.interrupts import deferred_interrupts
from ..units import ALIGNMENT, round_up
from .own_queue import OwnQueue, lock, private_memory, read_requests

#: torch's switch for advising its own large allocations to use huge pages.
TORCH_THP = "THP_MEM_ALLOC_ENABLE"


def read_fresh(paths: list[int | str], stripe_bytes: int | None,
               groups: list[tuple[int, int]]) -> list[Any]:
    """A fresh locked uint8 tensor for each ``(start, end)`` of ``groups`` (``start``
    aligned), holding those bytes of the file at ``paths[0]`` (a path or a descriptor),
    or of the file striped over ``paths`` (one per device, Note [stripes]) in stripes of
    ``stripe_bytes``."""
    import torch

    files: list[Any] = []
    memory: list[Any] = []
    own = None
    try:
        for path in paths:
            files.append(open_target(path, for_write=False, offset=0, nbytes=0,
                                     o_direct=None))
        if groups:
            own = OwnQueue(f"reading {files[0].name}")
            _read(own, _requests(files, stripe_bytes, groups, memory))
    finally:
        with deferred_interrupts():
            if own is not None:
                own.close()             # waits for the requests in flight: into `memory`
            for file in files:
                file.close()
    for mapping in memory:
        lock(mapping, f"{files[0].name}: the loaded tensors")
    return [torch.frombuffer(mapping, dtype=torch.uint8)[:end - start]
            for mapping, (start, end) in zip(memory, groups)]


def _requests(files, stripe_bytes, groups, memory):
    """``(file, file offset, address, length, bytes needed)`` of each request, group
    after group, each group's memory mapped (into ``memory``) as its requests begin."""
    huge_pages = os.environ.get(TORCH_THP, "").strip().lower() in ("1", "on", "true", "yes")
    for start, end in groups:
        size = round_up(end - start, ALIGNMENT)
        mapping = private_memory(size, huge_pages=huge_pages)
        memory.append(mapping)
        address, _ = buffer_address(mapping, True)
        yield from read_requests(files, stripe_bytes, start, start + size, address, end)


def _read(own, requests):
    """Keep ``own`` full of ``requests`` until all have ended; the first failure, or a
    read that ends short of the bytes it needs, raises (naming the file)."""
    pending = next(requests, None)
    while pending is not None or own.requests:
        while pending is not None:
            file, offset, address, length, needed = pending
            if not own.submit(file, True, offset, address, length, needed):
                break
            pending = next(requests, None)
        for _, error in own.reap():
            if error is not None:
                raise error

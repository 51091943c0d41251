"""Note [concurrent transfers]: a worker's engine runs many transfers at once on one AIO
context (or io_uring ring, Note [engines]), and reports each as it ends."""
import errno
import mmap
import os

import numpy as np
import pytest
from conftest import random_bytes

from nvmeswap._memory import buffer_address
from nvmeswap._queues import AioEngine
from nvmeswap._uring import UringEngine, probe

MiB = 1 << 20
REFUSED = probe()


@pytest.fixture(params=["aio", pytest.param("uring", marks=pytest.mark.skipif(
    REFUSED is not None, reason=f"io_uring: {REFUSED}"))])
def engine_kind(request):
    return {"aio": AioEngine, "uring": UringEngine}[request.param]


def fields(done):
    return (done.op_id, done.chunk, done.err, done.at_offset, done.requested, done.got,
            done.failed)


def _file(tmp_path, nbytes, seed=0):
    path = tmp_path / "source"
    path.write_bytes(random_bytes(nbytes, seed=seed))
    return str(path)


def _read(path):
    with open(path, "rb") as f:
        return f.read()


def _address(memory):
    return np.frombuffer(memory, dtype=np.uint8).ctypes.data


@pytest.mark.parametrize("single_submit", [False, True])
@pytest.mark.parametrize("overlap_events", [False, True])
def test_transfers_share_the_queue_and_end_one_by_one(tmp_path, engine_kind, overlap_events,
                                                     single_submit):
    """Note [concurrent transfers]: reads of many sizes and phases started together all
    land their bytes; one into memory the kernel cannot touch fails alone, with its errno
    and offset."""
    path = _file(tmp_path, 32 * MiB, seed=4)
    data = _read(path)
    engine = engine_kind(MiB, 16, single_submit, overlap_events, max_transfers=8)
    memory = mmap.mmap(-1, 40 * MiB)
    base = _address(memory)
    inaccessible = mmap.mmap(-1, 4 * MiB, prot=0)
    direct = os.open(path, os.O_RDONLY | os.O_DIRECT)
    buffered = os.open(path, os.O_RDONLY)
    reads = [(0, 8 * MiB, 0), (8 * MiB + 100, 3 * MiB + 5, 4096 + 100), (12 * MiB, 4096, 20 * MiB),
             (13 * MiB + 7, 9, 7), (14 * MiB, 17 * MiB, 15 * MiB)]
    try:
        for op_id, (at, n, offset) in enumerate(reads):
            engine.begin(op_id, 2, True, direct, buffered, base + at, n, offset, 4096)
        engine.begin(99, 0, True, direct, buffered, buffer_address(inaccessible, False)[0],
                     2 * MiB, 0, 4096)
        assert engine.busy and not engine.full
        ended = {}
        while engine.busy:
            for done in engine.advance(True):
                ended[done.op_id] = fields(done)
        assert ended.pop(99) == (99, 0, errno.EFAULT, 0, MiB, 0, True)
        assert ended == {op_id: (op_id, 2, 0, offset, n, n, False)
                         for op_id, (_, n, offset) in enumerate(reads)}
        for at, n, offset in reads:
            assert memory[at:at + n] == data[offset:offset + n]
        assert engine.advance(True) == []
    finally:
        os.close(direct)
        os.close(buffered)
        inaccessible.close()
        del base
        memory.close()


def test_a_full_engine_says_so_and_a_short_file_is_a_short_transfer(tmp_path, engine_kind):
    path = _file(tmp_path, MiB)
    engine = engine_kind(MiB, 4, False, True, max_transfers=2)
    memory = np.zeros(4 * MiB, dtype=np.uint8)
    direct = os.open(path, os.O_RDONLY | os.O_DIRECT)
    aligned = memory.ctypes.data // 4096 * 4096 + 4096
    try:
        engine.begin(1, 0, True, direct, -1, aligned, 2 * MiB, 0, 4096)
        engine.begin(2, 0, True, direct, -1, aligned, 4096, 0, 4096)
        assert engine.full
        with pytest.raises(RuntimeError, match="too many"):
            engine.begin(3, 0, True, direct, -1, aligned, 4096, 0, 4096)
        ended = {}
        while engine.busy:
            ended.update((done.op_id, fields(done)) for done in engine.advance(True))
        assert ended == {1: (1, 0, 0, MiB, MiB, 0, True), 2: (2, 0, 0, 0, 4096, 4096, False)}
        with pytest.raises(RuntimeError, match="nothing in progress"):
            engine.begin(4, 0, True, direct, -1, aligned, 4096, 0, 4096)
            engine.transfer(5, 0, True, direct, -1, aligned, 4096, 0, 4096)
        assert [fields(done) for done in engine.advance(True)] == [
            (4, 0, 0, 0, 4096, 4096, False)]
        engine.begin(6, 1, True, direct, -1, aligned + 1, 4096, 0, 4096)
        assert [fields(done) for done in engine.advance(False)] == [
            (6, 1, errno.EINVAL, 0, 4096, 0, True)]
    finally:
        os.close(direct)
    with pytest.raises(ValueError):
        engine_kind(0, 4, False, True)


BAD_ARGUMENTS_SCRIPT = """
import os, sys
sys.path.insert(0, sys.argv[1])
from nvmeswap._queues import AioEngine, CallerQueue, TransferEngine
from nvmeswap._uring import UringEngine, UringQueue
made = [lambda: AioEngine(-1, 4, True, True), lambda: UringEngine(-1, 4, True, True),
        lambda: UringEngine(4096, 4, True, True, "x"), lambda: UringQueue("x"),
        lambda: CallerQueue("x"), lambda: TransferEngine()]
for make in made:
    try:
        make()
    except (TypeError, OverflowError):
        pass
    os.fstat(0)     # EBADF if a half-made queue's finalizer closed descriptor 0
print("kept")
"""


def test_arguments_refused_before_anything_is_made_close_nothing(tmp_path):
    """Cython converts a constructor's arguments before its body runs, and the finalizer
    runs all the same: it must not take the zeroed descriptors for open ones (it closed
    the process's stdin). In a child, stdin a file of its own."""
    import subprocess
    import sys

    from conftest import PACKAGE_ROOT

    stdin = tmp_path / "stdin"
    stdin.write_bytes(b"")
    with open(stdin) as f:
        done = subprocess.run([sys.executable, "-c", BAD_ARGUMENTS_SCRIPT, str(PACKAGE_ROOT)],
                              check=False, stdin=f, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.split() == ["kept"], done.stderr

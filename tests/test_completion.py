"""One record for a transfer's outcome, whichever road it took, and one error convention at
the Cython edge: a failed call raises OSError with its errno, an outcome is a Completion."""
import errno
import mmap
import os

import numpy as np
import pytest
from conftest import random_bytes

from nvmeswap._queues import AioEngine, CallerQueue
from nvmeswap._transfers import Completion, preallocate, transfer_in_caller
from nvmeswap.workers import protocol
from nvmeswap.workers.main import Executor

KiB = 1 << 10
FILE_SIZE = 64 * KiB


def fields(done):
    assert type(done) is Completion
    return (done.op_id, done.chunk, done.err, done.at_offset, done.requested, done.got,
            done.failed)


def by_engine(fd, memory, nbytes, offset, engine_kind=AioEngine):
    engine = engine_kind(1 << 20, 4, False, True)
    return engine.transfer(7, 3, True, fd, -1, _address(memory), nbytes, offset, 4096)


def by_worker(fd, memory, nbytes, offset, engine_kind=AioEngine):
    """A worker's executor and engine, into a region of a memfd; its response datagram
    read back as the parent reads it."""
    memfd = os.memfd_create("completion-test")
    try:
        os.ftruncate(memfd, len(memory))
        executor = Executor(engine_kind(1 << 20, 4, False, True))
        executor.run(protocol.unpack_request(protocol.map_request(1, len(memory)),
                                             [os.dup(memfd)]))
        read = protocol.transfer_request(protocol.READ, 1, 7, 3, 0, nbytes, offset, 4096)
        assert executor.start(protocol.unpack_request(read, [os.dup(fd)])) is None
        (response,) = executor.advance(block=True)
        executor.run(protocol.unpack_request(protocol.unmap_request(1), []))
        executor.close()
        memory[:] = os.pread(memfd, len(memory), 0)
    finally:
        os.close(memfd)
    return protocol.unpack_response(response)


def by_caller_queue(fd, memory, nbytes, offset, queue_kind=CallerQueue):
    queue = queue_kind(4)
    try:
        assert queue.post(7, 3, True, fd, _address(memory), nbytes, offset)
        (done,) = queue.reap(wait_all=True)
    finally:
        queue.close()
    return done


def by_caller(fd, memory, nbytes, offset):
    return transfer_in_caller(7, 3, True, fd, -1, _address(memory), nbytes, offset, 4096)


def _address(memory):
    return np.frombuffer(memory, dtype=np.uint8).ctypes.data


@pytest.mark.parametrize("offset, got", [(4 * KiB, 8 * KiB), (FILE_SIZE - 4 * KiB, 4 * KiB)],
                         ids=["whole", "short-at-end-of-file"])
def test_every_road_returns_the_same_record(tmp_path, offset, got):
    """An 8 KiB read in one request: every road lands the same bytes and says so in equal
    Completions; one that meets the end of the file is short (no errno, the bytes got)."""
    path = tmp_path / "f"
    data = random_bytes(FILE_SIZE, seed=9)
    path.write_bytes(data)
    memory = mmap.mmap(-1, 8 * KiB)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        records = {}
        for road in (by_engine, by_worker, by_caller_queue, by_caller):
            memory[:] = bytes(8 * KiB)
            records[road.__name__] = fields(road(fd, memory, 8 * KiB, offset))
            assert memory[:got] == data[offset:offset + got], road.__name__
    finally:
        os.close(fd)
        memory.close()
    expected = (7, 3, 0, offset, 8 * KiB, got, got < 8 * KiB)
    assert records == dict.fromkeys(records, expected)


def test_a_record_made_in_python_is_the_same_type():
    done = Completion(1, 2, errno.EIO, 4096, 512, 0)
    assert fields(done) == (1, 2, errno.EIO, 4096, 512, 0, True)
    assert not Completion(1, 2, 0, 4096, 512, 512).failed
    assert repr(done) == ("Completion(op_id=1, chunk=2, err=5, at_offset=4096, requested=512, "
                          "got=0)")
    with pytest.raises(AttributeError):
        done.err = 0


def test_preallocate_raises_oserror_with_its_errno(tmp_path):
    with pytest.raises(OSError) as info:
        preallocate(-1, 0, 4096)
    assert info.value.errno == errno.EBADF and "fallocate" in str(info.value)
    fd = os.open(tmp_path / "f", os.O_RDONLY | os.O_CREAT, 0o644)
    try:
        with pytest.raises(OSError) as info:
            preallocate(fd, 0, 4096)        # not open for writing
        assert info.value.errno == errno.EBADF
    finally:
        os.close(fd)
    fd = os.open(tmp_path / "g", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        try:
            assert preallocate(fd, 0, 64 * KiB) is None
        except OSError as error:    # a filesystem without fallocate(2)
            assert error.errno == errno.EOPNOTSUPP
        else:
            assert os.fstat(fd).st_size == 64 * KiB
    finally:
        os.close(fd)


def test_shared_memory_calls_raise_oserror_with_their_errno():
    from nvmeswap._memory import punch_hole
    with pytest.raises(OSError) as info:
        punch_hole(-1, 0, 4096)
    assert info.value.errno == errno.EBADF and "fallocate" in str(info.value)

"""Promises kept when the world misbehaves: threads sharing a handle, full disks, files
replaced while written, resource limits, fork, folders removed under the swapper."""
import errno
import fcntl
import os
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from conftest import needs_torch, package_env, random_bytes, wait_until

KiB, MiB = 1 << 10, 1 << 20


def _worker_pids(h):
    return [w.process.pid for w in h._scheduler.workers.pool.workers]


def _signal_all(pids, signum):
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def _until(condition, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the awaited state never came"
        time.sleep(0.005)


# -- threads ---------------------------------------------------------------------------
class _WriterThread(threading.Thread):
    """Starts an async write of ``data`` to ``path`` (``submitted`` then set); once ``go``
    is set, waits, and keeps what its wait() counted and the file's bytes at that moment."""

    def __init__(self, h, data, path):
        super().__init__()
        self.h, self.data, self.path = h, data, path
        self.submitted, self.go = threading.Event(), threading.Event()
        self.count = self.content = None

    def run(self):
        self.h.async_pwrite(self.data, self.path)
        self.submitted.set()
        self.go.wait()
        self.count = self.h.wait()
        self.content = self.path.read_bytes()


@needs_torch
def test_a_threads_wait_counts_its_own_whatever_another_threads_wait_does(handle_factory,
                                                                          tmp_path):
    """Thread A's write is held up (the workers stopped); the main thread's wait() for
    its own small write returns with its own only, and A's wait() still waits for A's
    write and counts it (another thread's wait() used to take it, and A's returned 0
    at once, the write unfinished)."""
    import torch
    h = handle_factory(intra_op_parallelism=2)
    data = bytearray(random_bytes(8 * MiB, seed=3))
    small = h.new_cpu_locked_tensor(4 * KiB, torch.empty(0, dtype=torch.uint8))
    small.copy_(torch.frombuffer(bytearray(random_bytes(4 * KiB, seed=4)), dtype=torch.uint8))
    a = _WriterThread(h, data, tmp_path / "a")
    pids = _worker_pids(h)
    _signal_all(pids, signal.SIGSTOP)
    try:
        a.start()
        assert a.submitted.wait(30)
        h.async_pwrite(small, tmp_path / "main")    # the caller queue's: no worker needed
        # This thread's wait(): its own write alone, though A's is held up. (Were it to
        # take A's too, it would block: the timer lets the workers go on after a while.)
        rescue = threading.Timer(20, _signal_all, args=(pids, signal.SIGCONT))
        rescue.start()
        try:
            assert h.wait() == 1, "a wait() took another thread's operation"
        finally:
            rescue.cancel()
        assert (tmp_path / "main").read_bytes() == small.numpy().tobytes()
        a.go.set()
        a.join(0.5)
        assert a.is_alive(), "A's wait() returned while its write was held up"
    finally:
        _signal_all(pids, signal.SIGCONT)
    a.join(60)
    assert a.count == 1 and a.content == data


def test_a_thread_that_started_none_waits_for_and_counts_what_others_handed_it(
        handle_factory, tmp_path):
    """The handing-over pattern: thread S starts a write, a helper thread that started
    none waits: the helper counts it; S's own wait() still waits for it (it never
    returns early) and counts it no more."""
    h = handle_factory(intra_op_parallelism=2)
    data = bytearray(random_bytes(8 * MiB, seed=6))
    s = _WriterThread(h, data, tmp_path / "handed")
    counted = []
    pids = _worker_pids(h)
    _signal_all(pids, signal.SIGSTOP)
    try:
        s.start()
        assert s.submitted.wait(30)
        helper = threading.Thread(target=lambda: counted.append(h.wait()))
        helper.start()
        _until(lambda: not h._scheduler.books.async_ops)     # the helper took it
        s.go.set()
        s.join(0.5)
        assert s.is_alive(), "the starter's wait() returned while its write was held up"
    finally:
        _signal_all(pids, signal.SIGCONT)
    s.join(60)
    helper.join(60)
    assert s.count == 0 and s.content == data and counted == [1]


def test_eight_threads_each_wait_for_their_own_reads(handle_factory, tmp_path):
    """Eight threads share a handle, each reading its own file into zeroed memory and
    waiting: every wait() counts that thread's reads, and the bytes are there when it
    returns."""
    h = handle_factory(intra_op_parallelism=2)
    sizes = [4 * KiB, 64 * KiB, 1 * MiB + 7]
    sources = []
    for k in range(8):
        path = tmp_path / f"src{k}"
        path.write_bytes(random_bytes(2 * MiB, seed=k))
        sources.append((path, path.read_bytes()))
    failures = []

    def reader(k):
        path, data = sources[k]
        try:
            for round_number in range(30):
                size = sizes[(k + round_number) % len(sizes)]
                offsets = [(round_number * 4096 * (k + 1) + i * size) % (len(data) - size)
                           // 4096 * 4096 for i in range(2)]
                buffers = [bytearray(size) for _ in offsets]
                for buffer, offset in zip(buffers, offsets):
                    h.async_pread(buffer, path, offset)
                count = h.wait()
                if count != len(buffers):
                    failures.append(f"thread {k} round {round_number}: wait() gave {count}")
                for buffer, offset in zip(buffers, offsets):
                    if buffer != data[offset:offset + size]:
                        failures.append(f"thread {k} round {round_number}: wrong bytes "
                                        f"at {offset} when wait() returned")
        except BaseException as error:
            failures.append(repr(error))

    threads = [threading.Thread(target=reader, args=(k,)) for k in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not failures
    assert h.wait() == 0


def test_the_operations_of_a_thread_that_ended_are_counted_by_the_next_wait(
        handle_factory, tmp_path):
    h = handle_factory()
    data = bytearray(random_bytes(3 * MiB, seed=5))
    thread = threading.Thread(target=lambda: [h.async_pwrite(data, tmp_path / f"f{i}")
                                              for i in range(3)])
    thread.start()
    thread.join()
    assert h.wait() == 3
    assert all((tmp_path / f"f{i}").read_bytes() == data for i in range(3))


# -- full disks --------------------------------------------------------------------------
@pytest.fixture
def ext4(tmp_path):
    """An ext4 filesystem of 32 MiB of the test's own, no blocks reserved for root (so
    that full means full); needs root, mkfs.ext4 and a loop device."""
    if os.geteuid() != 0 or shutil.which("mkfs.ext4") is None:
        pytest.skip("an ext4 filesystem of the test's own needs root and mkfs.ext4")
    image, mount_point = tmp_path / "ext4.img", tmp_path / "ext4"
    mount_point.mkdir()
    with open(image, "wb") as f:
        f.truncate(32 * MiB)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", str(image)], check=True)
    mounted = subprocess.run(["mount", "-o", "loop", str(image), str(mount_point)],
                             capture_output=True, check=False)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a loop device here: {mounted.stderr.decode().strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=True)


def _fill(folder, spare):
    """Fill ``folder``'s filesystem to all but ``spare`` bytes."""
    with open(folder / "filler", "wb") as f:
        f.write(bytes(_free(folder) - spare))
        os.fsync(f.fileno())


def _data_bytes(path):
    """Bytes of data blocks the file holds, past its end too (FIEMAP: the blocks of the
    data alone, not the filesystem's bookkeeping of them)."""
    header, extent = struct.Struct("QQIIII"), struct.Struct("QQQ16xI12x")
    count = 64
    request = bytearray(header.pack(0, 2**64 - 1, 1, 0, count, 0)
                        + bytes(count * extent.size))       # FIEMAP_FLAG_SYNC
    with open(path, "rb") as f:
        fcntl.ioctl(f.fileno(), 0xC020660B, request)         # FS_IOC_FIEMAP
    mapped = header.unpack_from(request)[3]
    assert mapped < count
    return sum(extent.unpack_from(request, header.size + k * extent.size)[2]
               for k in range(mapped))


def _free(folder):
    info = os.statvfs(folder)
    return info.f_bavail * info.f_frsize


@pytest.mark.parametrize("nbytes", [512 * KiB + 3, 8 * MiB], ids=["written", "preallocated"])
@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
def test_a_write_the_full_disk_refuses_leaves_the_file_and_the_free_space_as_they_were(
        handle_factory, ext4, nbytes, is_async):
    """On a real full ext4 disk a write that cannot get its space (found by the workers'
    writes or by the preallocation of a large one) fails naming the file; the file keeps
    its length and its bytes, the disk its free space; an async write's failure comes at
    wait() (it used to raise at the call, and leave the file extended by the whole
    request and the disk with no space)."""
    h = handle_factory(intra_op_parallelism=2)
    folder = ext4
    _fill(folder, 200 * KiB)
    empty = _free(folder)
    path = folder / "target"
    head = random_bytes(4096, seed=1)
    path.write_bytes(head)
    free, blocks = _free(folder), path.stat().st_blocks
    data = bytearray(random_bytes(nbytes, seed=2))
    with pytest.raises(OSError) as info:
        if is_async:
            h.async_pwrite(data, path, 4096)    # must not raise here
            h.wait()
        else:
            h.sync_pwrite(data, path, 4096)
    assert info.value.errno == errno.ENOSPC and info.value.filename == str(path)
    assert path.read_bytes() == head
    # No data block stays; ext4 may keep an extent-tree block that the attempt added to
    # the file (its own bookkeeping, counted in the file's blocks, freed with the file).
    assert _data_bytes(path) == len(head)
    grown = (path.stat().st_blocks - blocks) * 512
    assert grown in (0, os.statvfs(folder).f_frsize)
    assert _free(folder) == free - grown
    # What fits still goes in, and the disk gives it all back when it is removed.
    h.sync_pwrite(data[:64 * KiB], path, 4096)
    assert path.read_bytes() == head + data[:64 * KiB]
    path.unlink()
    # The blocks come back when the file's last reference goes, and a finished request's
    # may go a moment after its completion was reported (the kernel defers dropping a
    # reference that a completion interrupt or io_uring's cleanup holds).
    wait_until(lambda: _free(folder) == empty, "the removed file's space to come back", 10)


@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
def test_a_refused_write_lets_its_buffer_go_without_the_garbage_collector(
        handle_factory, ext4, is_async):
    """The refusal's error must not tie the operation (and the caller's buffer, locked
    memory perhaps) into a reference cycle: it held the buffer until a collection."""
    import gc
    import weakref
    h = handle_factory()
    _fill(ext4, 200 * KiB)
    data = np.frombuffer(random_bytes(8 * MiB, seed=9), np.uint8).copy()
    alive = weakref.ref(data)
    gc.disable()
    try:
        with pytest.raises(OSError) as info:
            if is_async:
                h.async_pwrite(data, ext4 / "target")
                h.wait()
            else:
                h.sync_pwrite(data, ext4 / "target")
        assert info.value.errno == errno.ENOSPC
        del info, data
        assert alive() is None
    finally:
        gc.enable()


def test_a_failed_write_never_cuts_a_file_that_replaced_its_own(handle_factory, ext4):
    """The file is renamed over while a write to it is in flight and failing: the
    failure cleans up the file it wrote (gone with the rename), never the new one at its
    path (which it used to cut to its old size)."""
    h = handle_factory(intra_op_parallelism=2)
    folder = ext4
    replacement = random_bytes(600 * KiB + 7, seed=4)   # shorter than the write's end
    (folder / "replacement").write_bytes(replacement)
    _fill(folder, 200 * KiB)
    path = folder / "target"
    path.write_bytes(random_bytes(4096, seed=5))
    pids = _worker_pids(h)
    _signal_all(pids, signal.SIGSTOP)
    try:
        h.async_pwrite(bytearray(random_bytes(900 * KiB, seed=6)), path, 4096)
        os.rename(folder / "replacement", path)
    finally:
        _signal_all(pids, signal.SIGCONT)
    with pytest.raises(OSError) as info:
        h.wait()
    assert info.value.errno == errno.ENOSPC and info.value.filename == str(path)
    assert path.read_bytes() == replacement


# -- the swapper's folders ----------------------------------------------------------------
@needs_torch
@pytest.mark.parametrize("async_op", [True, False], ids=["async", "sync"])
def test_the_swapper_makes_its_folders_again_when_a_clean_up_removed_them(tmp_path, async_op):
    import torch

    from nvmeswap.training import TensorSwapper
    folder = tmp_path / "swap"
    with TensorSwapper(folder, pack_below=64 * KiB, intra_op_parallelism=1) as swapper:
        big = torch.from_numpy(np.frombuffer(random_bytes(3 * MiB, seed=7), np.uint8).copy())
        small = torch.arange(1000, dtype=torch.float32)
        swapper.swap_out("before", big, async_op=async_op)
        swapper.synchronize_writes()
        shutil.rmtree(folder)               # a clean-up job
        swapper.swap_out("big", big, async_op=async_op)
        swapper.swap_out("small", small, async_op=async_op)
        swapper.synchronize_writes()
        assert torch.equal(swapper.swap_in("big", async_op=False), big)
        assert torch.equal(swapper.swap_in("small", async_op=False), small)
        # What the clean-up removed is gone, and reading it says which file.
        with pytest.raises(FileNotFoundError) as info:
            swapper.swap_in("before", async_op=False)
        assert info.value.filename == swapper._entries["before"].path


# -- fork --------------------------------------------------------------------------------
_FORK_CHILD = r"""
import os, sys, threading
import numpy as np, torch, nvmeswap
from nvmeswap.io.process_state import shared
from nvmeswap.io.regions import Arenas

folder = sys.argv[1]
h = nvmeswap.aio_handle(intra_op_parallelism=2)
locked = h.new_cpu_locked_tensor(1 << 20, torch.empty(0, dtype=torch.uint8))
locked.numpy()[:] = 7
# Every lock the handle and the process's shared state have, held by a thread while the
# process forks: in the child that thread does not exist and they stay held for ever.
locked_memory = h._placement.locked.memory
locks = [h._scheduler._cond, locked_memory._lock, locked_memory.table._lock,
         shared(Arenas)._lock]
held, release = threading.Event(), threading.Event()
def hold():
    for lock in locks:
        lock.acquire()
    held.set()
    release.wait()
    for lock in reversed(locks):
        lock.release()
holder = threading.Thread(target=hold)
holder.start()
held.wait()
pid = os.fork()
if pid == 0:
    for name, call in [("sync_pwrite", lambda: h.sync_pwrite(locked, folder + "/child")),
                       ("async_pread", lambda: h.async_pread(locked, folder + "/parent")),
                       ("wait", h.wait), ("is_pinned", lambda: h.is_pinned(locked)),
                       ("new_cpu_locked_tensor",
                        lambda: h.new_cpu_locked_tensor(10, torch.empty(0)))]:
        try:
            call()
            print(name, "went through", flush=True)
        except RuntimeError as error:
            print(name, "refused:", error, flush=True)
    locked.numpy()[:] = 9           # the child's copy
    assert (locked.numpy() == 9).all()
    h.close()
    print("child closed", flush=True)
    sys.exit(0)                     # atexit and finalizers run: they must not hang
release.set()
holder.join()
_, status = os.waitpid(pid, 0)
print("child exit", os.waitstatus_to_exitcode(status), flush=True)
assert (locked.numpy() == 7).all(), "the child's writes reached the parent"
h.sync_pwrite(locked, folder + "/parent")
h.close()
with open(folder + "/parent", "rb") as f:
    print("parent file", set(f.read()), flush=True)
"""


@needs_torch
def test_a_forked_child_is_refused_the_handle_and_its_locked_tensors_are_its_own(tmp_path):
    """fork() while another thread holds every lock of the handle: the child's use of
    the inherited handle raises naming the parent, its close() and exit return, and its
    writes into a locked tensor stay in the child (they used to reach the parent's
    tensor, and the file the parent wrote from it)."""
    result = subprocess.run([sys.executable, "-c", _FORK_CHILD, str(tmp_path)],
                            capture_output=True, text=True, timeout=60, check=False,
                            env=package_env())
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    refused = [line for line in lines if "refused: this nvmeswap handle belongs to process" in line]
    assert len(refused) == 5, lines
    assert "child closed" in lines and "child exit 0" in lines
    assert lines[-1] == "parent file {7}"
    assert not (tmp_path / "child").exists()


# -- resource limits ---------------------------------------------------------------------
_FILE_SIZE_LIMITED = r"""
import errno, os, resource, sys
import torch, nvmeswap
folder, limit = sys.argv[1], int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
h = nvmeswap.aio_handle(intra_op_parallelism=2)
data = torch.randint(0, 255, (3 << 20,), dtype=torch.uint8)
h.sync_pwrite(data, folder + "/plain")              # staged: the staging space fits
back = torch.zeros_like(data)
h.sync_pread(back, folder + "/plain")
print("plain", torch.equal(back, data))
locked = h.new_cpu_locked_tensor(4 << 20, torch.empty(0, dtype=torch.uint8))
locked[:3 << 20] = data
h.async_pwrite(locked, folder + "/locked")          # an arena that fits the limit
print("locked", h.wait(), open(folder + "/locked", "rb").read()[:3 << 20] == data.numpy().tobytes())

def attempt(label, call, name=None):
    try:
        call()
        print(label, "went through")
    except OSError as error:
        print(label, errno.errorcode[error.errno], error.filename == name, "limit" in str(error))

with open(folder + "/big", "wb") as f:
    f.write(b"x" * 4096)
big = torch.ones(limit + (8 << 20), dtype=torch.uint8)
attempt("sync big", lambda: h.sync_pwrite(big, folder + "/big"), folder + "/big")
h.async_pwrite(big, folder + "/big")
print("async call returned")
attempt("async big", h.wait, folder + "/big")
print("big size", os.path.getsize(folder + "/big"))
with open(folder + "/edge", "wb") as f:
    f.write(b"y" * (limit - (100 << 10)))
attempt("edge", lambda: h.sync_pwrite(data[:512 << 10], folder + "/edge", limit - (100 << 10)),
        folder + "/edge")
print("edge size", os.path.getsize(folder + "/edge") - limit)
try:
    h.new_cpu_locked_tensor(2 * limit, torch.empty(0, dtype=torch.uint8))
except OSError as error:
    print("huge locked", errno.errorcode[error.errno], "RLIMIT_FSIZE" in str(error))
h.close()
"""


@needs_torch
def test_a_file_size_limit_leaves_transfers_below_it_working(tmp_path):
    """Under `ulimit -f` (16 MiB here) the handle's own shared memory fits the limit
    (it used to be sized past it: every transfer failed with a bare EFBIG); a write that
    crosses the limit fails with EFBIG naming the file (at wait() if async), and the
    file keeps its length; a locked tensor larger than the limit says which limit."""
    limit = 16 * MiB
    result = subprocess.run([sys.executable, "-c", _FILE_SIZE_LIMITED, str(tmp_path), str(limit)],
                            capture_output=True, text=True, timeout=120, check=False,
                            env=package_env())
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "plain True", "locked 1 True",
        "sync big EFBIG True True", "async call returned", "async big EFBIG True True",
        "big size 4096",
        "edge EFBIG True True", f"edge size {-(100 << 10)}",
        "huge locked EFBIG True"]


_ODD_FILE_SIZE_LIMITS = r"""
import errno, os, resource, signal, sys
import numpy as np, torch, nvmeswap
folder = sys.argv[1]
signal.signal(signal.SIGXFSZ, signal.SIG_DFL)       # a program that wants to die of it
data = np.random.default_rng(1).integers(0, 256, 1 << 20, dtype=np.uint8)
data.tofile(folder + "/source")
with open(folder + "/cross", "wb") as f:
    f.write(b"A" * 3000)
with open(folder + "/inside", "wb") as f:       # long, made before the limit
    f.write(b"B" * (256 << 10))

def attempt(label, call, name="/cross"):
    try:
        print(label, call())
    except OSError as error:
        print(label, errno.errorcode[error.errno], error.filename == folder + name,
              "100000 bytes" in str(error))

resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, resource.RLIM_INFINITY))
h = nvmeswap.aio_handle(intra_op_parallelism=2)
try:
    h.new_cpu_locked_tensor(200_000, torch.empty(0, dtype=torch.uint8))
except OSError as error:
    print("locked", errno.errorcode[error.errno], "100000 bytes" in str(error))
locked = h.new_cpu_locked_tensor(24 * 4096, torch.empty(0, dtype=torch.uint8))
attempt("sync", lambda: h.sync_pwrite(np.ones(300_000, np.uint8), folder + "/cross"))
h.async_pwrite(np.ones(300_000, np.uint8), folder + "/cross")
attempt("async", h.wait)
attempt("quick", lambda: h.sync_pwrite(locked[:4096], folder + "/cross", 98304))
attempt("batch", lambda: h.async_pwrite_many(locked, folder + "/cross",
                                             [(k + 1) * 4096 for k in range(24)],
                                             lengths=[4096] * 24))
print("size", os.path.getsize(folder + "/cross"))
# In place, inside a file that is longer than the limit: the kernel's SIGXFSZ all the same.
attempt("quick inside", lambda: h.sync_pwrite(locked[:4096], folder + "/inside", 196608),
        "/inside")
print("inside kept", open(folder + "/inside", "rb").read() == b"B" * (256 << 10))
h.close()
for limit in (12288, 4096):
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
    h = nvmeswap.aio_handle(intra_op_parallelism=2)
    back = np.zeros(9000, np.uint8)
    try:
        h.sync_pread(back, folder + "/source", 4095)
        print(limit, "read", bool((back == data[4095:13095]).all()))
    except OSError as error:
        print(limit, "read", errno.errorcode[error.errno], f"is {limit} bytes" in str(error))
    h.close()
"""


@needs_torch
def test_odd_file_size_limits_fail_writes_past_them_naming_the_limit(tmp_path):
    """A file-size limit that is not a multiple of 4096: a write past it fails with EFBIG
    naming the file and the limit (the kernel would cut an O_DIRECT request there to an
    unaligned length, EINVAL), before any I/O: the file keeps its length and a program
    with SIGXFSZ at its default action lives, as it does when a locked tensor would be
    larger than the limit. A limit of three 4 KiB units still stages
    reads; below two, the staging space is refused naming the limit, never a hang."""
    result = subprocess.run([sys.executable, "-c", _ODD_FILE_SIZE_LIMITS, str(tmp_path)],
                            capture_output=True, text=True, timeout=120, check=False,
                            env=package_env())
    assert result.returncode == 0, (result.returncode, result.stderr)
    assert result.stdout.splitlines() == [
        "locked EFBIG True",
        "sync EFBIG True True", "async EFBIG True True", "quick EFBIG True True",
        "batch EFBIG True True", "size 3000", "quick inside EFBIG True True",
        "inside kept True", "12288 read True", "4096 read EFBIG True"]


_FILE_SIZE_LIMIT_RAISED = r"""
import os, resource, sys
import numpy as np, torch, nvmeswap
folder = sys.argv[1]
resource.setrlimit(resource.RLIMIT_FSIZE, (1048676, resource.RLIM_INFINITY))   # unaligned
h = nvmeswap.aio_handle(intra_op_parallelism=2)
h.sync_pwrite(np.ones(512 << 10, np.uint8), folder + "/start")      # the workers are up
resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
data = np.random.default_rng(3).integers(0, 256, 4 << 20, dtype=np.uint8)
locked = h.new_cpu_locked_tensor(4 << 20, torch.empty(0, dtype=torch.uint8))
locked.numpy()[:] = data
for kind, buffer in (("plain", data), ("locked", locked)):
    h.async_pwrite(buffer, folder + "/" + kind)
    print(kind, h.wait(), np.array_equal(np.fromfile(folder + "/" + kind, np.uint8), data))
h.close()
"""


@needs_torch
def test_a_file_size_limit_raised_after_the_workers_started_binds_them_no_more(tmp_path):
    """The workers take the hard limit: the parent, which refuses writes past its own
    limit before any I/O, may raise it later, and its writes then go through whole
    (they used to meet the workers' copy of the old limit: a bare EINVAL)."""
    result = subprocess.run([sys.executable, "-c", _FILE_SIZE_LIMIT_RAISED, str(tmp_path)],
                            capture_output=True, text=True, timeout=120, check=False,
                            env=package_env())
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["plain 1 True", "locked 1 True"]


def _unprivileged_python():
    """A command that runs this Python as an unprivileged user, or None. (The process
    limit does not bind root: the kernel exempts it.)"""
    if os.geteuid() != 0:
        return [sys.executable]
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        return None
    for python in (sys.executable, f"/usr/bin/python{sys.version_info[0]}.{sys.version_info[1]}"):
        command = [setpriv, "--reuid", "65534", "--regid", "65534", "--clear-groups", python]
        probe = subprocess.run([*command, "-c", "import nvmeswap"], capture_output=True,
                               check=False, cwd="/", env=package_env())
        if probe.returncode == 0:
            return command
    return None


_PROCESS_LIMITED = r"""
import errno, os, resource
resource.setrlimit(resource.RLIMIT_NPROC, (1, 1))
import nvmeswap
try:
    nvmeswap.aio_handle(intra_op_parallelism=2)
except OSError as error:
    print(errno.errorcode[error.errno], error)
"""


def test_too_few_processes_allowed_says_so_and_what_to_change():
    command = _unprivileged_python()
    if command is None:
        pytest.skip("no unprivileged user can run this Python and import nvmeswap")
    result = subprocess.run([*command, "-c", _PROCESS_LIMITED], capture_output=True, text=True,
                            timeout=60, check=False, cwd="/",
                            env=package_env())
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("EAGAIN "), result.stdout
    assert "cannot start nvmeswap's I/O worker processes" in result.stdout
    assert "RLIMIT_NPROC: 1" in result.stdout and "ulimit -u" in result.stdout


# -- Ctrl-C --------------------------------------------------------------------------------
@needs_torch
def test_wait_waits_for_a_synchronous_read_that_ctrl_c_interrupted(handle_factory, tmp_path):
    """An interrupted sync_pread goes on in the background; the thread's next wait()
    returns only once it has ended (counting it not), so the buffer is the caller's
    again, with the file's bytes in it."""
    import torch
    h = handle_factory(intra_op_parallelism=2)
    data = random_bytes(16 * MiB, seed=11)
    (tmp_path / "src").write_bytes(data)
    target = h.new_cpu_locked_tensor(16 * MiB, torch.empty(0, dtype=torch.uint8))
    pids = _worker_pids(h)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # not inherited SIG_IGN
    resumed = threading.Event()

    def resume():
        resumed.set()
        _signal_all(pids, signal.SIGCONT)

    try:
        _signal_all(pids, signal.SIGSTOP)
        threading.Timer(0.2, os.kill, args=(os.getpid(), signal.SIGINT)).start()
        with pytest.raises(KeyboardInterrupt):
            h.sync_pread(target, tmp_path / "src")
        threading.Timer(0.3, resume).start()
        assert h.wait() == 0
        assert resumed.is_set(), "wait() returned while the read was held up"
        assert target.numpy().tobytes() == data
    finally:
        signal.signal(signal.SIGINT, previous)
        _signal_all(pids, signal.SIGCONT)

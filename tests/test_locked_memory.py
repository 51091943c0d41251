"""Locked tensors share a few memfd arenas (Note [memfd arenas] in io/regions.py): a
thousand of them fit under the default descriptor limit, a freed one stays readable while
its tensor lives and gives its pages back when the tensor dies, and running out of
descriptors is an EMFILE that names the limit.

Anything that lowers a process limit runs in a child process with a deadline.
"""
import errno
import gc
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs torch (pip install torch)")

from conftest import (
    may_lock,
    open_descriptors,
    random_bytes,
    stopped_workers,
    system_setting,
)

import nvmeswap
from nvmeswap._memory import Mapping
from nvmeswap.io import regions
from nvmeswap.io.limits import Limits

KiB, MiB = 1 << 10, 1 << 20
PAGE = 4096
PACKAGE_ROOT = os.path.dirname(os.path.dirname(nvmeswap.__file__))


def run_child(script, *args, timeout=180):
    """Run ``script`` in a fresh interpreter; return its stdout lines (it must exit 0)."""
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(script), PACKAGE_ROOT,
                             *map(str, args)], capture_output=True, text=True, timeout=timeout,
                            check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout.split("\n")


def memfd_descriptors(pid="self"):
    return sum("memfd:nvmeswap" in target for target in open_descriptors(pid).values())


def tensor_bytes(t):
    return t.numpy().view(np.uint8).tobytes()


def region_of(h, t):
    return h._placement.locked.containing(t.data_ptr(), 0)


THOUSAND_TENSORS = """
    import gc, os, random, resource, sys
    sys.path.insert(0, sys.argv[1])
    import numpy as np, psutil, torch
    import nvmeswap
    from nvmeswap.io.limits import DEFAULT
    folder = sys.argv[2]
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))
    rng = random.Random(13)

    def assorted_size():
        # Mostly small, some up to 1 MiB, most not a multiple of the page.
        if rng.random() < 0.95:
            return rng.randrange(4096, 32 * 1024)
        return rng.randrange(64 * 1024, 1024 * 1024 + 1)

    def round_trip(h, tensors, path):
        # Write every tensor at its own offset of one file, read each back into itself.
        expected, offset, offsets = [], 0, []
        for i, t in enumerate(tensors):
            data = np.frombuffer(rng.randbytes(t.numel()), dtype=np.uint8)
            t.numpy()[:] = data
            expected.append(data.tobytes())
            offsets.append(offset)
            assert h.is_pinned(t)
            if i % 2:
                assert h.sync_pwrite(t, path, offset) == 1
            else:
                assert h.async_pwrite(t, path, offset) == 0
            offset += -(-t.numel() // 4096) * 4096   # the phase of the memory: zero-copy
        assert h.wait() == (len(tensors) + 1) // 2
        with open(path, "rb") as f:
            written = f.read()
        for t, data, at in zip(tensors, expected, offsets):
            assert written[at:at + len(data)] == data, at
            t.zero_()
        for i, (t, at) in enumerate(zip(tensors, offsets)):
            if i % 2:
                assert h.async_pread(t, path, at) == 0
            else:
                assert h.sync_pread(t, path, at) == 1
        assert h.wait() == len(tensors) // 2
        for t, data in zip(tensors, expected):
            assert t.numpy().tobytes() == data
        return sum(t.numel() for t in tensors)

    def descriptors(process):
        return process.num_fds()

    example = torch.empty(0, dtype=torch.uint8)
    with nvmeswap.aio_handle(intra_op_parallelism=2) as h:
        tensors = [h.new_cpu_locked_tensor(assorted_size(), example) for _ in range(1000)]
        made = round_trip(h, tensors, os.path.join(folder, "first"))
        freed = tensors[::2]
        assert all(h.free_cpu_locked_tensor(t) for t in freed)
        del freed
        tensors = tensors[1::2]
        gc.collect()
        tensors += [h.new_cpu_locked_tensor(assorted_size(), example) for _ in range(500)]
        assert len(tensors) == 1000
        made += round_trip(h, tensors, os.path.join(folder, "second"))
        # Nothing went through the staging space: every transfer was zero-copy.
        assert h._placement.staging.region is None
        me = psutil.Process()
        workers = me.children()
        assert len(workers) == 2
        print("bytes", made, DEFAULT.arena_bytes)
        print("memfds", sum("memfd:nvmeswap" in os.readlink(f"/proc/self/fd/{n}")
                            for n in os.listdir("/proc/self/fd")
                            if os.path.exists(f"/proc/self/fd/{n}")))
        print("descriptors", max([descriptors(me)] + [descriptors(w) for w in workers]))
        for t in tensors:
            assert h.free_cpu_locked_tensor(t)
"""


def test_thousand_locked_tensors_under_default_descriptor_limit(tmp_path):
    out = dict(line.split(" ", 1) for line in run_child(THOUSAND_TENSORS, tmp_path) if line)
    made, arena_bytes = map(int, out["bytes"].split())
    # Every byte ever locked fits one arena, so one descriptor holds all 1500 tensors.
    assert made < arena_bytes
    assert int(out["memfds"]) == 1
    # The parent and each worker stay far below the 1024 descriptors (one per tensor
    # would have passed it).
    assert int(out["descriptors"]) < 1024 // 8


def test_freed_region_stays_readable_until_its_tensor_dies(handle, tmp_path):
    example = torch.empty(0, dtype=torch.uint8)
    keep = handle.new_cpu_locked_tensor(4096, example)      # keeps the arena open
    t = handle.new_cpu_locked_tensor(MiB, example)
    arena, offset = region_of(handle, t).arena, region_of(handle, t).offset
    assert region_of(handle, keep).arena is arena
    data = random_bytes(MiB, seed=1)
    t.numpy()[:] = np.frombuffer(data, dtype=np.uint8)
    path = str(tmp_path / "f")
    assert handle.sync_pwrite(t, path) == 1
    held = os.fstat(arena.fd).st_blocks * 512
    assert held >= MiB + 4096

    view = t[4096:]
    del t
    assert handle.free_cpu_locked_tensor(view) is True
    assert not handle.is_pinned(view)
    gc.collect()
    # Freed, but a tensor still uses the memory: its pages stay, readable and writable.
    assert os.fstat(arena.fd).st_blocks * 512 == held
    assert tensor_bytes(view) == data[4096:]
    view.zero_()
    assert handle.sync_pread(view, path, 4096) == 1     # staged now
    assert tensor_bytes(view) == data[4096:]

    held = os.fstat(arena.fd).st_blocks * 512       # the staging space may share the arena
    del view
    gc.collect()
    # The tensor is gone: its pages went back to the system, its range to the arena.
    assert os.fstat(arena.fd).st_blocks * 512 <= held - MiB
    again = handle.new_cpu_locked_tensor(MiB, example)
    assert (region_of(handle, again).arena, region_of(handle, again).offset) == (arena, offset)
    assert not again.numpy().any()      # fresh pages, nothing of the old tensor's bytes
    assert handle.free_cpu_locked_tensor(again) and handle.free_cpu_locked_tensor(keep)


def test_freeing_a_locked_tensor_an_operation_uses_is_refused(handle_factory, tmp_path):
    """Its memory would be gone under the operation: the free is refused at the call, the
    operation moves its bytes, and the tensor frees once waited for."""
    first, second = handle_factory(intra_op_parallelism=2), handle_factory()
    t = first.new_cpu_locked_tensor(8 * MiB, torch.empty(0, dtype=torch.uint8))
    data = random_bytes(8 * MiB, seed=5)
    t.numpy()[:] = np.frombuffer(data, dtype=np.uint8)
    path = str(tmp_path / "f")
    with stopped_workers(first):
        first.async_pwrite(t, path)
        for handle in (first, second):      # the locked set is the process's
            with pytest.raises(RuntimeError, match=r"in use by an operation in flight "
                                                   rf"\(write of {8 * MiB} bytes at offset 0 "
                                                   rf"of {path}\); wait\(\) for it"):
                handle.free_cpu_locked_tensor(t[MiB:])
    assert first.is_pinned(t)
    assert first.wait() == 1
    with open(path, "rb") as f:
        assert f.read() == data
    # Reads into parts of it (their operations are reaped by wait()): a run of small
    # reads, the second of which the run holds; a batch.
    first.async_pread(first.new_cpu_locked_tensor(4096, t[:0]), path, 0)
    first.async_pread(t[MiB:MiB + 4096], path, 4096)
    with pytest.raises(RuntimeError, match="in use by an operation in flight .*2 reads"):
        first.free_cpu_locked_tensor(t)
    assert first.wait() == 2
    first.async_pread_many(t[2 * MiB:], path, [0, 65536], lengths=[65536, 65536])
    with pytest.raises(RuntimeError, match="in use by an operation in flight .*batch"):
        first.free_cpu_locked_tensor(t)
    assert first.wait() == 2
    assert bytes(t[2 * MiB:2 * MiB + 131072].numpy()) == data[:131072]
    assert second.free_cpu_locked_tensor(t) is True and not first.is_pinned(t)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_ctrl_c_in_the_finalizer_giving_memory_back_still_gives_it_back(handle,
                                                                          monkeypatch):
    """A finalizer cannot raise (the Ctrl-C is lost, as Python has it), but the range
    goes back to its arena all the same: an arena it emptied is closed."""
    example = torch.empty(0, dtype=torch.uint8)
    arenas = regions.arenas().count
    t = handle.new_cpu_locked_tensor(4 * MiB, example)
    assert regions.arenas().count == arenas + 1
    real_punch = regions.punch_hole

    def interrupted(*args):
        monkeypatch.setattr(regions, "punch_hole", real_punch)
        raise KeyboardInterrupt
    monkeypatch.setattr(regions, "punch_hole", interrupted)
    assert handle.free_cpu_locked_tensor(t)
    del t
    gc.collect()
    assert regions.punch_hole is real_punch       # the finalizer ran
    assert regions.arenas().count == arenas


def test_regions_of_several_arenas_and_handles(handle_factory, tmp_path):
    arenas = regions.arenas()
    before = arenas.count
    small_arenas = Limits(arena_bytes=64 * KiB)
    a = handle_factory(intra_op_parallelism=2, _limits=small_arenas)
    b = handle_factory(_limits=small_arenas)
    example = torch.empty(0, dtype=torch.uint8)
    small = [(a if i % 2 else b).new_cpu_locked_tensor(16 * KiB - 100 * i, example)
             for i in range(8)]
    large = a.new_cpu_locked_tensor(256 * KiB + 1, example)     # an arena of its own
    tensors = small + [large]
    # Four 16 KiB regions fill an arena: two for the small ones, one for the large.
    assert arenas.count == before + 3
    assert len({region_of(a, t).arena for t in small}) == 2
    assert region_of(a, large).arena not in {region_of(a, t).arena for t in small}

    expected = []
    for i, t in enumerate(tensors):
        data = random_bytes(t.numel(), seed=i)
        t.numpy()[:] = np.frombuffer(data, dtype=np.uint8)
        expected.append(data)
        assert a.sync_pwrite(t, str(tmp_path / f"f{i}")) == 1       # a's workers map it
    for i, t in enumerate(tensors):
        t.zero_()
        assert b.async_pread(t, str(tmp_path / f"f{i}")) == 0       # and b's
    assert b.wait() == len(tensors)
    assert [tensor_bytes(t) for t in tensors] == expected
    assert a._placement.staging.region is None and b._placement.staging.region is None

    # An arena closes when its last region's tensor is gone, not before.
    first_arena = region_of(a, small[0]).arena
    mates = [i for i, t in enumerate(small) if region_of(a, t).arena is first_arena]
    assert len(mates) == 4
    for i in mates[:3]:
        assert b.free_cpu_locked_tensor(small[i])
        small[i] = None
    del t, tensors
    gc.collect()
    assert arenas.count == before + 3
    assert a.free_cpu_locked_tensor(small[mates[3]])
    small[mates[3]] = None
    gc.collect()
    assert arenas.count == before + 2
    # The others are untouched by their neighbours' going.
    assert all(tensor_bytes(t) == data for t, data in zip(small, expected) if t is not None)
    assert tensor_bytes(large) == expected[-1]
    # The rest go with the handles (the leak fixture checks mappings and descriptors).


EMFILE_CHILD = """
    import errno, os, resource, sys
    sys.path.insert(0, sys.argv[1])
    import torch
    import nvmeswap
    from nvmeswap.io import regions
    from nvmeswap.io.limits import Limits
    from nvmeswap.units import PAGE
    example = torch.empty(0, dtype=torch.uint8)
    # Every region needs an arena of its own.
    with nvmeswap.aio_handle(_limits=Limits(arena_bytes=PAGE)) as h:
        limit = len(os.listdir("/proc/self/fd")) + 16
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
        tensors = []
        try:
            for _ in range(100):
                tensors.append(h.new_cpu_locked_tensor(4096, example))
            print("no error")
        except OSError as error:
            print("errno", error.errno)
            print("message", error)
        print("made", len(tensors), "limit", limit)
        # Freeing tensors gives their descriptors back; the others still work.
        assert all(h.free_cpu_locked_tensor(t) for t in tensors[-8:])
        del tensors[-8:]
        for i, t in enumerate(tensors):
            t.fill_(i % 251)
            assert h.sync_pwrite(t, os.path.join(sys.argv[2], "f"), 4096 * i) == 1
        with open(os.path.join(sys.argv[2], "f"), "rb") as f:
            written = f.read()
        assert all(written[4096 * i:4096 * (i + 1)] == bytes([i % 251]) * 4096
                   for i in range(len(tensors)))
        assert all(h.free_cpu_locked_tensor(t) for t in tensors)
        del tensors, t
        print("after", h.new_cpu_locked_tensor(4096, example).numel())
"""


def test_running_out_of_descriptors_is_emfile_naming_the_limit(tmp_path):
    out = dict(line.split(" ", 1) for line in run_child(EMFILE_CHILD, tmp_path) if line)
    assert int(out["errno"]) == errno.EMFILE
    made, limit = out["made"].split()[0], out["made"].split()[2]
    assert 0 < int(made) < 100
    assert "RLIMIT_NOFILE" in out["message"] and f"is {limit}" in out["message"]
    assert out["after"] == "4096"


def test_forked_child_never_touches_the_parents_arenas(handle):
    t = handle.new_cpu_locked_tensor(64 * KiB, torch.empty(0, dtype=torch.uint8))
    data = random_bytes(64 * KiB, seed=3)
    t.numpy()[:] = np.frombuffer(data, dtype=np.uint8)
    arena = region_of(handle, t).arena
    pid = os.fork()
    if pid == 0:
        status = 1
        try:
            # The child's copy of the tensor dies, and it carves memory of its own.
            del t
            gc.collect()
            region = regions.SharedRegion(64 * KiB)
            fresh = bytes(memoryview(region.mapping)) == bytes(64 * KiB)
            status = 0 if region.arena is not arena and fresh else 2
            region.close()
        finally:
            os._exit(status)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert tensor_bytes(t) == data
    assert os.fstat(arena.fd).st_blocks * 512 >= 64 * KiB
    assert handle.free_cpu_locked_tensor(t)


def test_extents_first_fit_reuse_and_join():
    extents = regions.Extents(16 * 4096, 4096)
    starts = [extents.take(4096 * n) for n in (1, 2, 3, 4)]
    assert starts == [0, 4096, 3 * 4096, 6 * 4096]
    assert extents.take(7 * 4096) is None
    extents.give(starts[1], 2 * 4096)
    assert extents.take(4096 + 1) == 4096           # first fit, rounded to the alignment
    extents.give(4096, 2 * 4096)
    for start, n in zip(starts[::2] + starts[3:], (1, 3, 4)):
        extents.give(start, 4096 * n)
    assert extents.all_free
    assert extents.take(16 * 4096) == 0


def test_extents_on_a_boundary_leave_the_space_before_it_free():
    extents = regions.Extents(16 * 4096, 4096)
    assert extents.take(4096) == 0
    assert extents.take(4 * 4096, boundary=8 * 4096) == 8 * 4096    # first fit on one
    assert extents.take(7 * 4096) == 4096                            # the gap before it
    assert extents.take(4 * 4096, boundary=8 * 4096) is None          # none left on one
    assert extents.take(4 * 4096) == 12 * 4096
    for start, n in ((0, 1), (4096, 7), (8 * 4096, 4), (12 * 4096, 4)):
        extents.give(start, n * 4096)
    assert extents.all_free


# -- huge pages (Note [huge pages] in pyx/_memory.pyx) ------------------------------------
SHMEM_HUGE_PAGES = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"


def memfd_mappings(pid="self"):
    """``{start address: (file offset, VmFlags, ShmemPmdMapped kB)}`` of the process's
    mappings of nvmeswap's memfds."""
    mappings, current = {}, None
    with open(f"/proc/{pid}/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5 and ":" not in fields[0]:
                current = None
                if "memfd:nvmeswap" in line:
                    current = int(fields[0].split("-")[0], 16)
                    mappings[current] = [int(fields[2], 16), "", 0]
            elif current is not None and fields[0] == "VmFlags:":
                mappings[current][1] = " ".join(fields[1:])
            elif current is not None and fields[0] == "ShmemPmdMapped:":
                mappings[current][2] = int(fields[1])
    return mappings


def test_large_regions_are_placed_for_huge_pages_in_the_parent_and_its_workers(handle,
                                                                              tmp_path):
    """A region of 2 MiB or more is mapped, by the parent and by the worker that moves it,
    where the memfd's 2 MiB boundaries fall on the address space's and marked for huge
    pages (MADV_HUGEPAGE: VmFlags "hg"); a smaller one is left as it was."""
    large = handle.new_cpu_locked_tensor(6 * MiB + 4 * KiB, torch.empty(0, dtype=torch.uint8))
    small = handle.new_cpu_locked_tensor(64 * KiB, torch.empty(0, dtype=torch.uint8))
    for tensor, seed in ((large, 1), (small, 2)):
        tensor.copy_(torch.frombuffer(bytearray(random_bytes(tensor.numel(), seed=seed)),
                                      dtype=torch.uint8))
        handle.sync_pwrite(tensor, str(tmp_path / f"f{seed}"))      # a worker maps it
        assert (tmp_path / f"f{seed}").read_bytes() == bytes(tensor.numpy())
    worker = handle._scheduler.workers.pool.workers[0].process.pid
    for pid in ("self", worker):        # (the small write may not need the worker)
        mappings = memfd_mappings(pid)
        sizes = {start: size for start, size in _sizes(pid).items() if start in mappings}
        large_ones = [start for start, size in sizes.items() if size == 6 * MiB + 4 * KiB]
        small_ones = [start for start, size in sizes.items() if size == 64 * KiB]
        assert large_ones and (small_ones or pid != "self"), (pid, sizes)
        for start in large_ones:
            offset, flags, _ = mappings[start]
            # On a huge page boundary of the file and of the address space alike.
            assert offset % (2 * MiB) == 0 and start % (2 * MiB) == 0, (pid, offset, start)
            assert "hg" in flags.split(), (pid, flags)
        for start in small_ones:
            assert "hg" not in mappings[start][1].split()
    assert handle.free_cpu_locked_tensor(large) and handle.free_cpu_locked_tensor(small)


def _sizes(pid):
    with open(f"/proc/{pid}/maps") as maps:
        return {int(line.split("-")[0], 16): int(line.split()[0].split("-")[1], 16)
                - int(line.split("-")[0], 16) for line in maps}


@pytest.fixture
def shmem_huge_pages_on():
    """shmem_enabled=advise for the test (root only), then as it was."""
    with system_setting(SHMEM_HUGE_PAGES, "advise", "sets how all shared memory is paged"):
        yield


@pytest.mark.parametrize("engine", ["aio", "uring"])
def test_with_shmem_huge_pages_locked_memory_is_in_huge_pages_and_moves_its_bytes(
        shmem_huge_pages_on, handle_factory, tmp_path, engine):
    """With shmem_enabled=advise a locked tensor's memory is mapped in 2 MiB pages in the
    parent and in the worker (ShmemPmdMapped; all of it: its range of the memfd starts
    on a huge page), and round trips move the right bytes, through slices at any offset
    too."""
    from conftest import uring_unusable
    if engine == "uring" and uring_unusable():
        pytest.skip(uring_unusable())
    h = handle_factory(engine=engine)
    tensor = h.new_cpu_locked_tensor(8 * MiB, torch.empty(0, dtype=torch.uint8))
    data = random_bytes(8 * MiB, seed=3)
    tensor.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    path = str(tmp_path / "f")
    for _ in range(2):      # a worker registers a region by its second transfer
        assert h.sync_pwrite(tensor, path) == 1
    tensor.zero_()
    assert h.sync_pread(tensor, path) == 1 and bytes(tensor.numpy()) == data
    piece = tensor[4096 * 3 + 512:4096 * 700 + 512]
    piece.zero_()
    assert h.sync_pread(piece, path, 4096 * 3 + 512) == 1
    assert bytes(tensor.numpy()) == data
    worker = h._scheduler.workers.pool.workers[0].process.pid
    # Every byte of it, in the parent and in the worker; but a worker that moves it through
    # the parent's registration (Note [cloned buffers] in pyx/_uring.pyx) touches only the
    # two huge pages where the piece's unaligned head and tail are.
    in_worker = 4 * 1024 if h._scheduler.workers._registry else 8 * 1024
    for pid, kib in (("self", 8 * 1024), (worker, in_worker)):
        assert sum(pmd for _, _, pmd in memfd_mappings(pid).values()) == kib, pid
    assert h.free_cpu_locked_tensor(tensor)


def test_report_says_whether_locked_memory_comes_in_huge_pages():
    from nvmeswap.cli import report
    check = next(c for c in report.machine_checks() if c["name"] == "huge pages")
    try:
        with open(SHMEM_HUGE_PAGES) as f:
            setting = f.read().split("[")[1].split("]")[0]
    except OSError:
        setting = "absent"
    if setting in ("advise", "always", "within_size", "force"):
        assert check["status"] == "ok" and f"shmem_enabled={setting}" in check["found"]
    else:
        assert check["status"] == "warn" and "4 KiB pages" in check["found"]
        assert setting == "absent" or f"echo advise > {SHMEM_HUGE_PAGES}" in check["fix"]


def test_report_says_huge_pages_once_they_are_on(shmem_huge_pages_on):
    from nvmeswap.cli import report
    check = next(c for c in report.machine_checks() if c["name"] == "huge pages")
    assert check == {"name": "huge pages", "status": "ok", "fix": None,
                     "found": "locked memory comes in 2 MiB pages (shmem_enabled=advise)"}


def _resident_pages(address, nbytes):
    """How many pages of ``[address, address + nbytes)`` are in memory (mincore)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    pages = (ctypes.c_ubyte * (nbytes // PAGE))()
    if libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(nbytes), pages) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return sum(page & 1 for page in pages)


def _locked_kib():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmLck"))


@pytest.mark.skipif(not may_lock(200 * MiB), reason="needs RLIMIT_MEMLOCK >= 200 MiB")
@pytest.mark.parametrize("cpus", ["one", "all"])
def test_locking_a_mapping_makes_every_page_by_parts(cpus):
    """Note [parallel population]: locked now, every page is present and locked, however
    the range is cut into parts (one per CPU, ends not on a part's boundary), and the
    bytes are zeros."""
    size = 100 * MiB + 3 * PAGE
    fd = os.memfd_create("populate-test")
    allowed = os.sched_getaffinity(0)
    try:
        os.ftruncate(fd, size)
        mapping = Mapping(fd, size)
        assert _resident_pages(mapping.address, size) == 0
        before = _locked_kib()
        if cpus == "one":
            os.sched_setaffinity(0, {min(allowed)})
        try:
            mapping.lock()
        finally:
            os.sched_setaffinity(0, allowed)
        assert mapping.locked
        assert _resident_pages(mapping.address, size) == size // PAGE
        assert _locked_kib() - before == size // KiB
        view = np.frombuffer(mapping, dtype=np.uint8)
        assert not view.any()
        del view, mapping
    finally:
        os.close(fd)


def test_freeing_a_tensor_twice_never_frees_its_neighbour(handle):
    """Locked tensors lie side by side in an arena: a second free of one (or a free of an
    empty view at a tensor's end) finds nothing, and leaves the tensor that ends where
    it starts locked."""
    example = torch.empty(0, dtype=torch.uint8)
    tensors, neighbours = [], []
    # Each is a mapping of its own: the kernel puts one after another side by side unless
    # another thread of the process maps memory in between (earlier tests' threads).
    while not neighbours and len(tensors) < 16:
        tensors.append(handle.new_cpu_locked_tensor(1 << 20, example))
        by_address = sorted(tensors, key=lambda t: t.data_ptr())
        neighbours = [(a, b) for a, b in zip(by_address, by_address[1:])
                      if a.data_ptr() + a.numel() == b.data_ptr()]
    assert neighbours, [hex(t.data_ptr()) for t in by_address]
    before, after = neighbours[0]
    assert handle.free_cpu_locked_tensor(after) is True
    assert handle.free_cpu_locked_tensor(after) is False
    assert handle.free_cpu_locked_tensor(before[before.numel():]) is False
    assert handle.is_pinned(before)
    assert handle.free_cpu_locked_tensor(before) is True

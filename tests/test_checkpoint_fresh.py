"""The checkpoint calls made without a handle, through the process's own queue: loads
into fresh private memory (Note [fresh private reads]) and saves through a private ring
(Note [saves without a handle]). No worker starts, every byte comes back, and a failure
or a Ctrl-C leaves no descriptor, request, locked page or temporary file behind."""
import errno
import json
import os
import shutil
import subprocess
import sys
import threading
import time

import pytest

torch = pytest.importorskip("torch", reason="needs torch (pip install torch)")

from test_checkpoint import assert_same, every_dtype_state, flat_state, mixed_state, random_tensor

import nvmeswap
from nvmeswap._transfers import Completion
from nvmeswap.checkpoint import fresh_reads, own_queue, queue_reader
from nvmeswap.checkpoint.commit import TEMPORARY
from nvmeswap.checkpoint.loading import GROUP_BYTES
from nvmeswap.errors import ShortFileError


def locked_kib():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmLck"))


def temporary_files_open():
    """What this process's descriptors hold open of checkpoints' temporary files."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:         # closed meanwhile (the listing's own descriptor)
            continue
        if TEMPORARY in target:
            found.append(target)
    return found


def open_fds():
    """This process's descriptors, but for the kernel queues kept idle for the next call
    (Note [kept kernel queues]: freed first)."""
    own_queue.release_idle_queues()
    return sorted(os.listdir("/proc/self/fd"))


def two_group_state():
    """Storages past GROUP_BYTES (two mappings), an odd-sized one at the end."""
    count = GROUP_BYTES // 2 // 8 + 1234
    state = {f"t{k}": torch.arange(count, dtype=torch.int64) * (k + 1) - k for k in range(3)}
    state["odd"] = random_tensor((4099,), torch.bfloat16, 8)
    return state


def refuse_workers(monkeypatch):
    """From now on any worker pool started fails the test."""
    from nvmeswap.workers import pool

    def refuse(*args, **kwargs):
        raise AssertionError("a worker pool was started")

    monkeypatch.setattr(pool.WorkerPool, "__init__", refuse)


def test_a_load_without_a_handle_reads_into_locked_private_memory(tmp_path, monkeypatch):
    state = two_group_state()
    nvmeswap.save(state, tmp_path / "ours.pt")
    torch.save(state, tmp_path / "torch.pt")                # storages 64-byte aligned
    refuse_workers(monkeypatch)
    data_kib = sum(t.numel() * t.element_size() for t in state.values()) // 1024
    for name in ("ours.pt", "torch.pt"):
        before = locked_kib()
        loaded = nvmeswap.load(tmp_path / name)
        assert_same(state, loaded)
        assert locked_kib() - before >= data_kib, name
        del loaded
        assert locked_kib() == before, f"{name}: the locked pages went with the tensors"
    monkeypatch.undo()
    loaded = nvmeswap.load(tmp_path / "ours.pt")
    with nvmeswap.aio_handle() as handle:       # private memory: in no locked set
        assert not handle.is_pinned(loaded["t0"])


def test_a_kept_checkpointer_without_a_handle_loads_as_the_one_call_forms(tmp_path,
                                                                         monkeypatch):
    """A Checkpointer given no handle starts none for its loads either: the storages land
    in locked private memory, in no locked set (``free`` finds none), and the reads into
    given tensors go through the own queue too; a striping one reads its stripes so."""
    from safetensors import torch as safetensors_torch

    state = dict(every_dtype_state())
    flat = flat_state()
    torch.save(state, tmp_path / "torch.pt")
    safetensors_torch.save_file(flat, tmp_path / "theirs.safetensors")
    folders = stripe_folders(tmp_path)
    refuse_workers(monkeypatch)
    data_kib = sum(t.numel() * t.element_size() for t in state.values()) // 1024
    with nvmeswap.Checkpointer() as checkpointer, \
            nvmeswap.Checkpointer(stripe_folders=folders, stripe_bytes=1 << 20) as striping:
        checkpointer.save(state, tmp_path / "ours.pt")
        striping.save(state, os.path.join(folders[0], "striped.pt"))
        for loader, path in [(checkpointer, tmp_path / "ours.pt"),
                             (checkpointer, tmp_path / "torch.pt"),
                             (striping, os.path.join(folders[0], "striped.pt"))]:
            before = locked_kib()
            loaded = loader.load(path)
            assert_same(state, loaded)
            assert locked_kib() - before >= data_kib, path
            assert loader.free(loaded) == 0
            del loaded
            assert locked_kib() == before, f"{path}: the locked pages went with the tensors"
            into = zeros_like_state(state)
            assert loader.load_into(path, into) is into
            assert_same(state, into)
        loaded = checkpointer.load_safetensors(tmp_path / "theirs.safetensors")
        assert_same(flat, {k: loaded[k] for k in flat})
        into = {k: torch.zeros_like(v) for k, v in flat.items()}
        checkpointer.load_safetensors_into(tmp_path / "theirs.safetensors", into)
        assert_same(flat, into)


def test_a_queue_that_ends_idle_is_kept_for_the_next_call(tmp_path, monkeypatch):
    """Note [kept kernel queues]: saves, loads and reads into given tensors one after the
    other make one kernel queue between them; ``release_idle_queues`` frees it."""
    made = []
    real_type = own_queue.caller_queue_type

    def counting_type(engine):
        def make(capacity):
            made.append(engine)
            return real_type(engine)(capacity)
        return make

    before = open_fds()         # none kept from earlier calls
    monkeypatch.setattr(own_queue, "caller_queue_type", counting_type)
    state = dict(every_dtype_state())
    path = tmp_path / "s.pt"
    for _ in range(3):
        nvmeswap.save(state, path)
        assert_same(state, nvmeswap.load(path))
        into = zeros_like_state(state)
        nvmeswap.load_into(path, into)
        assert_same(state, into)
    assert len(made) == 1
    assert len(os.listdir("/proc/self/fd")) > len(before)      # kept: its descriptor
    assert open_fds() == before                                # freed


def test_every_container_and_dtype_comes_back(tmp_path):
    state = mixed_state()
    nvmeswap.save(state, tmp_path / "s.pt")
    loaded = nvmeswap.load(tmp_path / "s.pt")
    assert_same(state, loaded)
    views = loaded["views"]         # one storage, four views: still one
    assert len({v.untyped_storage().data_ptr() for v in views}) == 1
    moved = nvmeswap.load(tmp_path / "s.pt", map_location=lambda s, loc: s.clone())
    assert_same(state, moved)


def test_safetensors_without_a_handle(tmp_path):
    from safetensors import torch as safetensors_torch

    state = flat_state()
    safetensors_torch.save_file(state, tmp_path / "theirs.safetensors")
    nvmeswap.save_safetensors(state, tmp_path / "ours.safetensors")
    for name in ("theirs.safetensors", "ours.safetensors"):
        loaded = nvmeswap.load_safetensors(tmp_path / name)
        assert_same(state, {k: loaded[k] for k in state})


def stripe_folders(tmp_path):
    folders = [tmp_path / f"dev{k}" for k in range(3)]
    for folder in folders:
        folder.mkdir()
    return [str(f) for f in folders]


@pytest.mark.parametrize("stripe_bytes", [1 << 20, 64 << 10])
def test_a_striped_checkpoint_reads_from_every_stripe_file(tmp_path, stripe_bytes):
    """64 KiB stripes: a load_into slot's requests outnumber the queue; they wait their
    turn."""
    folders = stripe_folders(tmp_path)
    state = two_group_state()
    path = os.path.join(folders[0], "s.pt")
    with nvmeswap.Checkpointer(stripe_folders=folders, stripe_bytes=stripe_bytes) as made:
        made.save(state, path)
        made.save_safetensors(state, path + ".st")
    assert_same(state, nvmeswap.load(path))
    assert_same(state, nvmeswap.load_safetensors(path + ".st"))
    into = zeros_like_state(state)
    nvmeswap.load_into(path, into)
    assert_same(state, into)


def test_a_stripe_file_cut_short_is_an_error_naming_it(tmp_path):
    folders = stripe_folders(tmp_path)
    state = {"w": random_tensor((20 << 20,), torch.uint8, 6)}      # one record, 21 stripes
    path = os.path.join(folders[0], "s.pt")
    with nvmeswap.Checkpointer(stripe_folders=folders, stripe_bytes=1 << 20) as checkpointer:
        checkpointer.save(state, path)
    with open(path) as file:
        layout = json.load(file)
    # The records' headers lie in the first stripe and the last: cut a device holding
    # neither to its first stripe, inside the tensor's bytes.
    last = (layout["size"] - 1) // layout["stripe_bytes"] % 3
    victim = os.path.join(folders[({1, 2} - {last}).pop()], layout["name"])
    os.truncate(victim, layout["stripe_bytes"])
    before = open_fds()
    with pytest.raises(ShortFileError) as raised:
        nvmeswap.load(path)
    assert raised.value.filename == victim and "short read" in str(raised.value)
    assert open_fds() == before


class FailingQueue:
    """The real caller queue, but for its ``reap``: the ``fail_at``-th call that returns
    requests raises ``raise_`` instead, or fails the first of them with ``err``. Left
    with nothing in flight, it is freed or kept idle (Note [kept kernel queues]): a
    queue left with requests in flight is neither."""

    def __init__(self, real, fail_at, err=0, raise_=None):
        self.real, self.fail_at, self.err, self.raise_ = real, fail_at, err, raise_
        self.calls = 0

    @property
    def eventfd(self):
        return self.real.eventfd

    @property
    def in_flight(self):
        return self.real.in_flight

    def submit(self, *request):
        return self.real.submit(*request)

    def reap(self, wait_all=False):
        done = self.real.reap(wait_all)
        self.calls += bool(done)
        if done and self.calls == self.fail_at:
            if self.raise_ is not None:
                raise self.raise_
            first = done[0]
            done[0] = Completion(first.op_id, first.chunk, self.err, 4096, first.requested, 0)
        return done

    def close(self):
        self.real.close()


def fail_own_queues(monkeypatch, fail_at, err, interrupt):
    """Make every own queue from now on a FailingQueue (``interrupt``: a Ctrl-C instead of
    ``err``); the list they are put in as made. A queue holds at most 64 requests, so a
    transfer of more than 64 requests (two_group_state's: about 100 of 1 MiB) is reaped
    twice or more, whatever the engine returns at once: ``fail_at=2`` always happens."""
    made = []
    real_type = own_queue.caller_queue_type
    own_queue.release_idle_queues()     # none kept: every queue from now on is made

    def failing_type(engine):
        def make(capacity):
            queue = FailingQueue(real_type(engine)(capacity), fail_at, err,
                                 KeyboardInterrupt() if interrupt else None)
            made.append(queue)
            return queue
        return make

    monkeypatch.setattr(own_queue, "caller_queue_type", failing_type)
    return made


@pytest.mark.parametrize("failure", ["EIO", "KeyboardInterrupt"])
def test_a_failed_or_interrupted_read_leaves_nothing_behind(tmp_path, monkeypatch, failure):
    state = two_group_state()
    path = tmp_path / "s.pt"
    nvmeswap.save(state, path)
    made = fail_own_queues(monkeypatch, 2, errno.EIO, failure != "EIO")
    before_fds, before_locked = open_fds(), locked_kib()
    if failure == "EIO":
        with pytest.raises(OSError) as raised:
            nvmeswap.load(path)
        assert raised.value.errno == errno.EIO and raised.value.filename == str(path)
    else:
        with pytest.raises(KeyboardInterrupt):
            nvmeswap.load(path)
    assert len(made) == 1 and made[0].in_flight == 0
    assert open_fds() == before_fds
    assert locked_kib() == before_locked
    monkeypatch.undo()
    assert_same(state, nvmeswap.load(path))      # and the next load is whole


def test_loads_in_threads_at_once(tmp_path):
    states = [two_group_state() | {"seed": random_tensor((1 << 20,), torch.uint8, k)}
              for k in range(3)]
    for k, state in enumerate(states):
        nvmeswap.save(state, tmp_path / f"{k}.pt")
    results = [None] * 3

    def load(k):
        results[k] = nvmeswap.load(tmp_path / f"{k}.pt")

    threads = [threading.Thread(target=load, args=(k,)) for k in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for state, loaded in zip(states, results):
        assert_same(state, loaded)


def test_a_refused_lock_is_a_warning_and_the_bytes_still_come_back(tmp_path):
    """Without CAP_IPC_LOCK and under a 64 KiB RLIMIT_MEMLOCK a save's ring and the loaded
    tensors stay unlocked."""
    if shutil.which("setpriv") is None or shutil.which("prlimit") is None:
        pytest.skip("setpriv and prlimit are needed to drop CAP_IPC_LOCK")
    state = {"w": random_tensor((3 << 20,), torch.uint8, 5)}
    path = tmp_path / "s.pt"
    nvmeswap.save(state, path)
    script = (
        "import warnings, torch, nvmeswap\n"
        "from nvmeswap.errors import MemoryLockWarning\n"
        "with warnings.catch_warnings(record=True) as seen:\n"
        "    warnings.simplefilter('always')\n"
        f"    nvmeswap.save(torch.load({str(path)!r}), {str(path)!r})\n"
        f"    loaded = nvmeswap.load({str(path)!r})\n"
        f"saved = torch.load({str(path)!r})\n"
        "assert torch.equal(loaded['w'], saved['w'])\n"
        "print(sorted({w.category.__name__ for w in seen}))\n"
        "print(open('/proc/self/status').read().split('VmLck:')[1].split()[0])\n")
    done = subprocess.run(["setpriv", "--bounding-set", "-ipc_lock", "--inh-caps",
                           "-ipc_lock", "prlimit", "--memlock=65536:65536", sys.executable,
                           "-c", script], capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stderr
    categories, locked = done.stdout.splitlines()[-2:]
    assert "MemoryLockWarning" in categories
    assert int(locked) <= 64
    assert torch.equal(torch.load(path)["w"], state["w"])      # the save, resaved there


def vm_flags(address):
    """The VmFlags of the mapping holding ``address`` (/proc/self/smaps)."""
    with open("/proc/self/smaps") as smaps:
        inside = False
        for line in smaps:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                low, high = (int(x, 16) for x in head.split("-"))
                inside = low <= address < high
            elif inside and line.startswith("VmFlags:"):
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.parametrize("asked", [None, "1"])
def test_huge_pages_are_advised_as_torch_advises_its_own(tmp_path, monkeypatch, asked):
    from nvmeswap._memory import buffer_address

    path = tmp_path / "s.pt"
    nvmeswap.save({"w": random_tensor((3 << 20,), torch.uint8, 1)}, path)
    flags = []
    real_lock = fresh_reads.lock

    def noting_flags(mapping, name):
        flags.append(vm_flags(buffer_address(mapping, True)[0]))
        real_lock(mapping, name)

    monkeypatch.setattr(fresh_reads, "lock", noting_flags)
    monkeypatch.delenv(fresh_reads.TORCH_THP, raising=False)
    if asked is not None:
        monkeypatch.setenv(fresh_reads.TORCH_THP, asked)
    nvmeswap.load(path)
    assert flags and all(("hg" in f) == (asked is not None) for f in flags)


def test_a_save_without_a_handle_writes_what_torch_load_reads(tmp_path, monkeypatch):
    import zipfile

    from safetensors import torch as safetensors_torch

    refuse_workers(monkeypatch)
    state = mixed_state()
    nvmeswap.save(state, tmp_path / "s.pt")
    with zipfile.ZipFile(tmp_path / "s.pt") as archive:
        assert archive.testzip() is None          # every CRC-32 is right
    assert_same(state, torch.load(tmp_path / "s.pt"))
    flat = flat_state()
    nvmeswap.save_safetensors(flat, tmp_path / "s.safetensors", {"step": "3"})
    assert_same(flat, safetensors_torch.load_file(tmp_path / "s.safetensors"))
    assert sorted(os.listdir(tmp_path)) == ["s.pt", "s.safetensors"]


@pytest.mark.parametrize("failure", ["ENOSPC", "KeyboardInterrupt"])
def test_a_failed_or_interrupted_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch,
                                                                    failure):
    old, new = mixed_state(), two_group_state()
    path = tmp_path / "s.pt"
    nvmeswap.save(old, path)
    made = fail_own_queues(monkeypatch, 2, errno.ENOSPC, failure != "ENOSPC")
    before_fds, before_locked = open_fds(), locked_kib()
    if failure == "ENOSPC":
        with pytest.raises(OSError) as raised:
            nvmeswap.save(new, path)
        assert raised.value.errno == errno.ENOSPC
        assert os.path.dirname(raised.value.filename) == str(tmp_path)
    else:
        with pytest.raises(KeyboardInterrupt):
            nvmeswap.save(new, path)
    assert len(made) == 1 and made[0].in_flight == 0
    assert open_fds() == before_fds
    assert locked_kib() == before_locked
    assert os.listdir(tmp_path) == ["s.pt"]
    monkeypatch.undo()
    assert_same(old, nvmeswap.load(path))


def test_a_ctrl_c_just_after_a_request_is_submitted_is_raised_as_such(tmp_path,
                                                                       monkeypatch):
    """A Ctrl-C that comes as the kernel takes a request: the request is in the books, the
    save raises KeyboardInterrupt (not an error about a request it never knew), and the
    checkpointer's next save is whole."""
    import signal

    real_init = own_queue.OwnQueue.__init__
    submits = []

    class InterruptedAfterTheThird:
        def __init__(self, queue):
            self.queue = queue

        def __getattr__(self, name):
            return getattr(self.queue, name)

        def submit(self, *request):
            taken = self.queue.submit(*request)
            submits.append(taken)
            if len(submits) == 3:
                signal.raise_signal(signal.SIGINT)
            return taken

    def init(self, what):
        real_init(self, what)
        self.queue = InterruptedAfterTheThird(self.queue)

    path = tmp_path / "s.pt"
    old, new = mixed_state(), two_group_state()
    nvmeswap.save(old, path)
    with nvmeswap.Checkpointer() as checkpointer:
        monkeypatch.setattr(own_queue.OwnQueue, "__init__", init)
        with pytest.raises(KeyboardInterrupt):
            checkpointer.save(new, path)
        monkeypatch.undo()
        assert temporary_files_open() == []
        assert_same(old, nvmeswap.load(path))
        checkpointer.save(new, path)
    assert_same(new, torch.load(path))
    assert os.listdir(tmp_path) == ["s.pt"]


@pytest.mark.parametrize("space", ["allocated", "written"])
def test_a_save_past_the_file_size_limit_says_so_and_keeps_the_previous(tmp_path,
                                                                          monkeypatch, space):
    """Under `ulimit -f` a save too large is refused with EFBIG naming the limit and its
    file, before its space is allocated (also on a filesystem without fallocate, where
    a write would cross the limit, and the kernel would send SIGXFSZ); the previous
    checkpoint stays, no temporary file is left, and a save below the limit goes
    through."""
    import resource

    if space == "written":
        def unsupported(fd, offset, length):
            raise OSError(errno.EOPNOTSUPP, "not supported")
        monkeypatch.setattr(os, "posix_fallocate", unsupported)
    path = tmp_path / "s.pt"
    old = mixed_state()
    nvmeswap.save(old, path)
    limit = 16 << 20
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        with pytest.raises(OSError) as raised:
            nvmeswap.save({"w": random_tensor((limit + (3 << 20),), torch.uint8, 4)}, path)
        fits = {"w": random_tensor((limit - (1 << 20),), torch.uint8, 5)}
        assert_same(old, nvmeswap.load(path))
        nvmeswap.save(fits, tmp_path / "fits.pt")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert raised.value.errno == errno.EFBIG and "RLIMIT_FSIZE" in str(raised.value)
    assert "cannot allocate" in str(raised.value) and f"{limit} bytes" in str(raised.value)
    assert os.path.dirname(raised.value.filename) == str(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["fits.pt", "s.pt"]
    assert_same(fits, torch.load(tmp_path / "fits.pt"))


@pytest.mark.parametrize("call", ["save", "async_save"])
def test_a_kept_checkpointer_saves_again_after_an_interrupted_save(tmp_path, monkeypatch,
                                                                    call):
    """A reap cut short (a Ctrl-C) ends that save with the interrupt, once what it left
    in flight has ended and its files are closed; the checkpointer's next save starts a
    fresh queue and writes the file whole, and nothing of the first is left."""
    state = two_group_state()
    path = tmp_path / "s.pt"

    def save(checkpointer):
        if call == "save":
            checkpointer.save(state, path)
        else:
            checkpointer.async_save(state, path).result()

    made = fail_own_queues(monkeypatch, 2, 0, True)
    before_fds = open_fds()
    with nvmeswap.Checkpointer() as checkpointer:
        with pytest.raises(KeyboardInterrupt):
            save(checkpointer)
        # Its writes ended with the interrupt: no descriptor of its temporary file is left.
        assert temporary_files_open() == []
        monkeypatch.undo()
        save(checkpointer)
        assert len(made) == 1 and made[0].in_flight == 0
    assert_same(state, torch.load(path))
    assert os.listdir(tmp_path) == ["s.pt"]
    assert open_fds() == before_fds


_FORKED_SAVES = r"""
import os, sys, threading, time
import torch, nvmeswap
from nvmeswap.checkpoint import queue_writer
from nvmeswap.checkpoint.own_queue import OwnQueue
from nvmeswap.io.files import open_target

torch.set_num_threads(1)        # GNU OpenMP's threads do not survive a fork
folder = sys.argv[1]
parent_state = {"w": torch.arange(3 << 20, dtype=torch.float32)}
child_state = {"w": torch.ones(3 << 20), "step": 7}
checkpointer = nvmeswap.Checkpointer()
checkpointer.save(parent_state, folder + "/parent.pt")      # its queue and ring made here
queue = OwnQueue("a test")
# The fork comes while the parent's saving thread holds the checkpointer's lock and
# the descriptors of the temporary file it writes.
real_result = queue_writer._Write.result
writing = threading.Event()
def slow_result(self):
    writing.set()
    time.sleep(2)
    return real_result(self)
queue_writer._Write.result = slow_result
pending = checkpointer.async_save(parent_state, folder + "/parent_async.pt")
writing.wait()
queue_writer._Write.result = real_result
pid = os.fork()
if pid == 0:
    code = 1
    try:
        checkpointer.async_save(child_state, folder + "/child.pt").result()
        checkpointer.save(child_state, folder + "/child2.pt")
        checkpointer.close()
        held = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                held.append(os.readlink(f"/proc/self/fd/{fd}"))
            except OSError:         # the listing's own descriptor, closed by now
                pass
        print("child holds temporary files:", sum("nvmeswap-tmp" in name for name in held),
              flush=True)
        file = open_target(folder + "/parent.pt", for_write=False, offset=0, nbytes=0,
                           o_direct=None)
        try:
            queue.submit(file, True, 0, 0, 4096, 4096)
        except RuntimeError as error:
            print("refused:", error, flush=True)
            code = 0
    finally:
        os._exit(code)
_, status = os.waitpid(pid, 0)
print("child exit", os.waitstatus_to_exitcode(status), flush=True)
pending.result()
checkpointer.save(parent_state, folder + "/parent2.pt")
checkpointer.close()
queue.close()
"""


@pytest.mark.parametrize("engine", ["aio", "uring"])
def test_a_forked_child_saves_through_a_kept_checkpointer_with_a_queue_of_its_own(tmp_path,
                                                                                   engine):
    """A kept Checkpointer's queue and ring are its process's: a forked child that saves
    through it gets its own (the parent's kernel AIO context is not the child's, and an
    io_uring ring would be shared with the parent), and the parent's stay its own. The
    fork comes while the parent's saving thread holds the checkpointer's lock, which the
    child does not wait for (nor for that save). An own queue used in a child is
    refused, naming its process."""
    from conftest import package_env

    done = subprocess.run([sys.executable, "-c", _FORKED_SAVES, str(tmp_path)],
                          capture_output=True, text=True, timeout=120, check=False,
                          env=package_env(NVMESWAP_ENGINE=engine))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[-1] == "child exit 0", lines
    assert lines[0] == "child holds temporary files: 0", lines
    assert lines[1].startswith("refused: this kernel queue belongs to process ")
    child_state = {"w": torch.ones(3 << 20), "step": 7}
    parent_state = {"w": torch.arange(3 << 20, dtype=torch.float32)}
    for name, expected in [("child.pt", child_state), ("child2.pt", child_state),
                           ("parent_async.pt", parent_state), ("parent2.pt", parent_state)]:
        assert_same(expected, torch.load(tmp_path / name))
    assert sorted(os.listdir(tmp_path)) == ["child.pt", "child2.pt", "parent.pt",
                                            "parent2.pt", "parent_async.pt"]


def zeros_like_state(state):
    return {key: torch.zeros_like(value) for key, value in state.items()}


def test_load_into_without_a_handle_fills_every_target(tmp_path, monkeypatch):
    """Windows of the ring (16 MiB) cut the 40 MiB tensor; torch's file is 64-aligned."""
    state = dict(every_dtype_state())
    state["big"] = random_tensor(((40 << 20) + 3,), torch.uint8, 9)
    state["empty"] = torch.empty(0, 3)
    nvmeswap.save(state, tmp_path / "ours.pt")
    torch.save(state, tmp_path / "torch.pt")
    flat = {k: v for k, v in state.items() if v.dtype != torch.complex128}  # none in the format
    nvmeswap.save_safetensors(flat, tmp_path / "s.safetensors")
    refuse_workers(monkeypatch)
    for name in ("ours.pt", "torch.pt"):
        into = zeros_like_state(state)
        assert nvmeswap.load_into(tmp_path / name, into) is into
        assert_same(state, into)
    into = zeros_like_state(flat)
    nvmeswap.load_safetensors_into(tmp_path / "s.safetensors", into)
    assert_same(flat, into)


def test_a_reader_lands_ranges_near_and_far_empty_or_not(tmp_path):
    """QueueReader.read_ranges: ranges close together share a request, far ones not, an
    empty one (at an aligned offset: no request at all) lands too; each is handed the
    file's bytes, and what ``land`` raises fails the wait."""
    data = random_tensor((3 << 20,), torch.uint8, 4).numpy().tobytes()
    path = tmp_path / "bytes"
    path.write_bytes(data)
    ranges = [(5, 100), (90, 5000), (40960, 40960), (90000, 90001), (2 << 20, (2 << 20) + 77)]
    landed = {}
    with queue_reader.QueueReader(slot_bytes=64 << 10, slots=2) as reader:
        reader.read_ranges(str(path), ranges,
                           lambda index, view: landed.update({index: view.numpy().tobytes()}))
        assert reader.wait() == len(ranges)
        assert landed == {index: data[start:end] for index, (start, end) in enumerate(ranges)}

        def refuse(index, view):
            raise ValueError(f"range {index} refused")

        reader.read_ranges(str(path), ranges, refuse)
        with pytest.raises(ValueError, match=r"range \d refused"):
            reader.wait()


@pytest.mark.parametrize("failure", ["EIO", "KeyboardInterrupt"])
def test_a_failed_or_interrupted_load_into_leaves_nothing_behind(tmp_path, monkeypatch,
                                                                 failure):
    state = two_group_state()
    path = tmp_path / "s.pt"
    nvmeswap.save(state, path)
    made = fail_own_queues(monkeypatch, 2, errno.EIO, failure != "EIO")
    before_fds = open_fds()
    into = zeros_like_state(state)
    with pytest.raises(OSError if failure == "EIO" else KeyboardInterrupt) as raised:
        nvmeswap.load_into(path, into)
    if failure == "EIO":
        assert raised.value.errno == errno.EIO and raised.value.filename == str(path)
    assert len(made) == 1 and made[0].in_flight == 0
    assert open_fds() == before_fds
    monkeypatch.undo()
    nvmeswap.load_into(path, into)
    assert_same(state, into)


class Probe:
    """Sums its tensor's bytes as it is unpickled (Note [reads beside the pickle])."""

    def __init__(self, tensor):
        self.tensor = tensor
        self.total = float(tensor.double().sum())

    def __reduce__(self):
        return Probe, (self.tensor,)


def slow_submits(monkeypatch, seconds):
    """Every request of an own queue starts ``seconds`` late: the reads lag the pickle."""
    real_submit = own_queue.OwnQueue.submit

    def submit(self, *args, **kwargs):
        time.sleep(seconds)
        return real_submit(self, *args, **kwargs)
    monkeypatch.setattr(own_queue.OwnQueue, "submit", submit)


def test_the_pickle_sees_no_storage_before_its_bytes_are_read(tmp_path, monkeypatch):
    made = torch.Generator().manual_seed(3)
    state = {"first": torch.randn(4 << 20, generator=made),      # 16 requests of 1 MiB
             "probe": Probe(torch.randn(1 << 20, generator=made))}
    nvmeswap.save(state, tmp_path / "p.pt")
    slow_submits(monkeypatch, 0.005)
    loaded = nvmeswap.load(tmp_path / "p.pt", weights_only=False)
    assert loaded["probe"].total == state["probe"].total
    assert_same(state["first"], loaded["first"])
    assert_same(state["probe"].tensor, loaded["probe"].tensor)


def test_a_ctrl_c_while_the_reads_are_in_flight_leaves_nothing_behind(tmp_path, monkeypatch):
    import signal

    state = two_group_state()
    nvmeswap.save(state, tmp_path / "s.pt")
    before_fds, before_locked = open_fds(), locked_kib()
    slow_submits(monkeypatch, 0.002)
    timer = threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            nvmeswap.load(tmp_path / "s.pt")
    finally:
        timer.cancel()
    assert not [t for t in threading.enumerate() if t.name == "nvmeswap-load"]
    assert open_fds() == before_fds
    assert locked_kib() == before_locked
    monkeypatch.undo()
    assert_same(state, nvmeswap.load(tmp_path / "s.pt"))

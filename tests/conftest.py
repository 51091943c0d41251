import gc
import importlib.util
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest

import nvmeswap
from nvmeswap.io.engines import URING_MEMLOCK, has_cap_ipc_lock

#: The slow tier (the bench scripts' smoke runs, whole trainings in fresh processes):
#: run where NVMESWAP_TEST_SLOW=1, as .ci/run does; skipped, saying so, elsewhere.
SLOW_TIER = os.environ.get("NVMESWAP_TEST_SLOW") == "1"
#: The folder that holds this checkout's nvmeswap, for child interpreters to import it.
PACKAGE_ROOT = os.path.dirname(os.path.dirname(nvmeswap.__file__))

SLOW_TIER_REASON = "the slow tier: set NVMESWAP_TEST_SLOW=1 to run it (CI does)"

#: torch is optional (the package moves numpy arrays and other buffers without it): modules
#: that need it throughout begin with ``pytest.importorskip("torch", reason=...)``; single
#: tests of the others carry ``needs_torch`` and import it inside. Looked up, not imported,
#: so that a torch-free module does not pay for loading it.
needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                                 reason="needs torch (pip install torch)")


def torch_sees_a_gpu():
    """Whether torch is installed and sees a CUDA GPU: without torch the command line
    refuses GPU options as it does on a machine without a GPU."""
    if not importlib.util.find_spec("torch"):
        return False
    import torch

    return torch.cuda.is_available()


def package_env(**extra):
    """The environment for a child interpreter that imports this checkout's nvmeswap:
    the checkout first on PYTHONPATH, whatever was there kept (peers installed outside
    site-packages, as on a machine where nothing can be installed)."""
    path = os.pathsep.join(filter(None, [PACKAGE_ROOT, os.environ.get("PYTHONPATH")]))
    return dict(os.environ, PYTHONPATH=path, **extra)


@pytest.fixture(scope="session", autouse=True)
def cuda_started_first():
    """Where there is a GPU, CUDA starts before the first test: its device files and
    helper descriptors live as long as the process, so the leak check of whichever test
    first touched CUDA (through DeepSpeed's accelerator, say) would count them."""
    if torch_sees_a_gpu():
        import torch

        torch.ones(1, device="cuda").sum().item()
    yield


def pytest_collection_modifyitems(config, items):
    if SLOW_TIER:
        return
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=SLOW_TIER_REASON))


def pytest_configure(config):
    """The slow marker; and Ctrl-C behaves as on a terminal, whoever started the suite: a
    shell that runs it in the background (``nohup pytest &``, ``setsid``) starts it with
    SIGINT ignored, and an ignored signal stays ignored across exec, so the test's child
    interpreters would never see a KeyboardInterrupt. A handled signal is reset to its
    default at exec."""
    config.addinivalue_line("markers", f"slow: {SLOW_TIER_REASON}")
    if os.environ.get("NVMESWAP_ENGINE") == "uring" and not may_lock(URING_MEMLOCK):
        # The kernel charges each io_uring ring's memory to its user's RLIMIT_MEMLOCK.
        raise pytest.UsageError(
            "NVMESWAP_ENGINE=uring needs ulimit -l of 8 MiB or more (or CAP_IPC_LOCK): the "
            "kernel charges every io_uring ring to it, and under 64 KiB a user holds two "
            "rings, while the tests make dozens of handles, each with a ring per worker")
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def without_file_privileges():
    """A command prefix under which permission bits apply, even to root (whose
    CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH otherwise pass every check)."""
    if os.geteuid() != 0:
        return ()
    if shutil.which("setpriv") is None:
        pytest.skip("running as root and setpriv is not installed")
    return ("setpriv", "--bounding-set", "-dac_override,-dac_read_search",
            "--inh-caps", "-dac_override,-dac_read_search")


def open_descriptors(pid="self"):
    """``{descriptor: what it points at}`` of a process (a removed file's ends in
    " (deleted)")."""
    found = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            found[fd] = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:
            pass        # the listing's own descriptor, closed by now
    return found


def _resources():
    """What this process (tree) holds, each thing by an identity that a new one of its
    kind would not share: descriptors by what they point at, mappings by range and inode."""
    fds = {f"{fd} -> {target}" for fd, target in open_descriptors().items()}
    with open("/proc/self/maps") as maps:
        shared = {" ".join(line.split()[:5]) for line in maps if "memfd:nvmeswap" in line}
    children = {p.pid for p in psutil.Process().children(recursive=True)}
    return {
        "child processes": children,
        "file descriptors": fds,
        "shared mappings": shared,
        # Only what this test's own process tree can have made: other processes (another
        # run of the suite under pytest -n, say) add and remove their own. nvmeswap makes
        # none (its memory is memfds); torch names its own after the process.
        "/dev/shm entries": {name for name in os.listdir("/dev/shm")
                             if name.startswith("nvmeswap") or any(
                                 f"_{pid}_" in name for pid in [os.getpid(), *children])},
    }


def _added(before, after):
    return {kind: sorted(after[kind] - before[kind])
            for kind in after if after[kind] - before[kind]}


@pytest.fixture(autouse=True)
def no_leaks():
    """Nothing a test starts may outlive it: processes, descriptors, shared memory. (What
    it only released is not its leak: another test's garbage, collected meanwhile.)"""
    before = _resources()
    yield
    leaked = _added(before, _resources())
    if leaked:
        # A leak is what a collection leaves: the test's own garbage may still hold some.
        # (Collecting at every test would cost ~50 ms each with torch loaded.) Nor are
        # the kernel queues kept idle for the next call (Note [kept kernel queues]).
        gc.collect()
        own_queue = sys.modules.get("nvmeswap.checkpoint.own_queue")
        if own_queue is not None:
            own_queue.release_idle_queues()
        leaked = _added(before, _resources())
    assert not leaked, f"leaked: {leaked}"


def _closing_factory(kind):
    """Make handles of ``kind`` that are closed at the end of the test, whatever happens."""
    made = []

    def make(**kwargs):
        made.append(kind(**kwargs))
        return made[-1]

    yield make
    for handle in made:
        handle.close()


@pytest.fixture
def handle_factory():
    yield from _closing_factory(nvmeswap.aio_handle)


@pytest.fixture
def gds_factory():
    yield from _closing_factory(nvmeswap.gds_handle)


@pytest.fixture
def handle(handle_factory):
    return handle_factory()


def may_lock(nbytes):
    """Whether this process may page-lock ``nbytes`` (or have io_uring pin them): it has
    CAP_IPC_LOCK, or RLIMIT_MEMLOCK is that large (64 KiB or 8 MiB by default)."""
    if has_cap_ipc_lock():
        return True
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return soft == resource.RLIM_INFINITY or soft >= nbytes


@contextmanager
def system_setting(path, value, why):
    """``value`` written to the system file ``path`` for the block, then what was there.
    Skips where it cannot be written (not root), and under pytest -n, as the setting is
    the whole machine's: ``why`` says what the suite's other processes would meet."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        pytest.skip(f"{why}: not beside the suite's other processes (pytest -n)")
    try:
        original = Path(path).read_text()
        if "[" in original:     # sysfs lists the choices, the one in force in brackets
            original = original.split("[")[1].split("]")[0]
        Path(path).write_text(value)
    except OSError as error:
        pytest.skip(f"cannot set {path}: {error.strerror}")
    try:
        yield original
    finally:
        Path(path).write_text(original)


def uring_unusable():
    """Why handles on io_uring cannot be relied on here, or "": io_uring refused, or
    ulimit -l under 8 MiB, to which the kernel may charge every ring (a handle has one
    per worker and one of its own, and the suite's handles add up)."""
    from nvmeswap._uring import probe

    refused = probe()
    if refused:
        return f"io_uring: {refused}"
    if not may_lock(URING_MEMLOCK):
        return ("ulimit -l is under 8 MiB: the kernel may charge io_uring's rings to it, "
                "and the suite's handles would not fit")
    return ""


def wait_until(condition, what, within=60.0):
    """Wait for ``condition()`` to hold (an event, not a duration); fail the test after
    ``within`` seconds, a bound only for a hang."""
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {within} s")
        time.sleep(0.005)


def worker_processes(h):
    """The worker processes (subprocess.Popen) of handle ``h``'s pool."""
    return [w.process for w in h._scheduler.workers.pool.workers]


@contextmanager
def stopped_workers(h):
    """Every worker of ``h`` SIGSTOPped inside the block, SIGCONTed after: requests sent to
    them meanwhile stay in flight however fast the storage is (the slow device a test
    needs, by construction). Yields the processes."""
    workers = worker_processes(h)
    for worker in workers:
        worker.send_signal(signal.SIGSTOP)
    try:
        yield workers
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.send_signal(signal.SIGCONT)


def in_flight(h):
    """Whether requests of ``h`` are with its workers or its caller queue now."""
    return h._scheduler.workers.chunks_in_flight > 0


def submitting_threads():
    """How many of this process's threads are CallerQueue submitters (Note [submitter])."""
    return len(submitter_ids())


def submitter_ids():
    """The thread ids of this process's CallerQueue submitters (Note [submitter])."""
    found = set()
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as comm:
                if comm.read().strip() == "nvmeswap-submit":
                    found.add(task)
        except FileNotFoundError:
            pass    # ended meanwhile
    return found


def random_bytes(n, seed=0):
    import numpy as np
    return np.random.default_rng(seed + n).integers(0, 256, n, dtype=np.uint8).tobytes()


def device_round_trips(h, tmp_path, sizes, offsets, make_tensor, tensor_bytes, pin=False):
    """Write and read back each size x offset (every other one async), pinning the tensors
    first if asked; check the bytes in the file and in the tensor read into.

    ``make_tensor(data)`` makes a tensor holding ``data`` (bytes) or ``data`` zero bytes.
    """
    for i, (size, offset) in enumerate((s, o) for s in sizes for o in offsets):
        data = random_bytes(size, seed=i)
        path = str(tmp_path / f"f{i}")
        source, target = make_tensor(data), make_tensor(size)
        if pin:
            assert h.pin_device_tensor(source) and h.pin_device_tensor(target)
        if i % 2:
            assert h.async_pwrite(source, path, offset) == 0 and h.wait() == 1
            assert h.async_pread(target, path, offset) == 0 and h.wait() == 1
        else:
            assert h.sync_pwrite(source, path, offset) == 1
            assert h.sync_pread(target, path, offset) == 1
        assert tensor_bytes(target) == data, f"size={size} offset={offset}"
        with open(path, "rb") as written:
            assert written.read()[offset:] == data
        if pin:
            assert h.unpin_device_tensor(source) and h.unpin_device_tensor(target)


@pytest.fixture
def small_filesystem(tmp_path):
    """A 4 MiB tmpfs of the test's own, for anyone: mounted in a user and mount namespace
    of its own (``unshare -Urm``, no privilege needed), by a process that holds it while
    the test runs; the test reaches it through that process's root
    (``/proc/<pid>/root``), and the tmpfs goes with the process."""
    yield from _private_mount(tmp_path / "small", "mount -t tmpfs -o size=4m tmpfs")


@pytest.fixture
def filesystem_without_o_direct(tmp_path):
    """A ramfs of the test's own (which refuses O_DIRECT), made as ``small_filesystem``."""
    yield from _private_mount(tmp_path / "ramfs", "mount -t ramfs ramfs")


def _private_mount(mount_point, mount):
    mount_point.mkdir()
    if shutil.which("unshare") is None:
        pytest.skip("unshare (util-linux) is not installed: no private mount")
    holder = subprocess.Popen(
        ["unshare", "-Urm", "sh", "-c", mount + ' "$0" && echo mounted && exec cat',
         str(mount_point)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        if holder.stdout.readline().strip() != "mounted":
            holder.stdin.close()
            pytest.skip(f"cannot mount a private filesystem here: "
                        f"{holder.stderr.read().strip()}")
        yield Path(f"/proc/{holder.pid}/root{mount_point}")
    finally:
        if holder.stdin and not holder.stdin.closed:
            holder.stdin.close()        # cat ends, and the namespace with it
        holder.wait(30)
        holder.stdout.close()
        holder.stderr.close()

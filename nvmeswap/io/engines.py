"""Which kernel interface moves a handle's bytes: kernel AIO or io_uring, decided here.

Note [engines]
A handle's requests go to the kernel through one of two engines, chosen per handle by
``aio_handle(engine=...)`` (default: the environment variable ``NVMESWAP_ENGINE``, else
"aio"), and used by both places that submit requests: the workers' engines and the
caller queue. Both engines take the same requests, split the same way, and end each in
the same ``Completion`` record (pyx/_queues.pyx, pyx/_uring.pyx), so nothing above them
knows which one ran.

| engine  | workers run   | caller queue  | where io_uring is refused        |
|---------|---------------|---------------|----------------------------------|
| "aio"   | AioEngine     | CallerQueue   | (not asked)                      |
| "uring" | UringEngine   | UringQueue    | OSError at the handle's creation |
| "auto"  | UringEngine   | UringQueue    | "aio", one EngineFallbackWarning |

"auto" also runs on kernel AIO where io_uring works but ``ulimit -l`` is small (under
``URING_MEMLOCK``, without CAP_IPC_LOCK): the kernel may charge every ring to it, and an
ordinary user at the usual 64 KiB has room for two rings in all, while a handle wants
one per worker and one of its own.

Kernel AIO stays the default: on the machines measured (docs/performance.md, "Engines")
io_uring has not been faster by enough to change what every user gets. io_uring is
refused under many container seccomp profiles and by ``kernel.io_uring_disabled``;
``probe()`` (pyx/_uring.pyx) tries it once per process, and ``nvmeswap report`` says
what "auto" would choose.

How the rings are set up, each choice measured (bench/engines.py,
bench/studies/fixed_buffers.py and the queue alone, on a memory-backed device where the
CPU's share shows; docs/performance.md, "Engines"):

- Regions are registered as fixed buffers: the kernel then pins their pages once, not
  at every request (1 GiB transfers 1.10-1.19x faster). Where the kernel clones
  registered buffers between rings (Linux 6.13), the parent registers each region once,
  through its own page tables, when a handle makes it (``new_cpu_locked_tensor``) or
  first maps it to a worker, and every worker's ring clones that: no worker builds page
  tables for memory it moves (Note [cloned buffers] in pyx/_uring.pyx). Elsewhere a
  worker registers a region itself (``UringEngine.register_buffers``, workers/main.py)
  once a transfer has made its page tables (0.2-0.3 s a GiB in a mapping that has not
  touched them, 0.03 s after): when the worker is next idle if that transfer moved all of
  it, else at its second transfer.
- The caller queue's posted requests go to a thread of the queue's own, as
  CallerQueue's do (cdeps/ring_submitter.h; Note [submitter] in pyx/_queues.pyx): 4 KiB
  reads posted one by one, 0.99x CallerQueue's rate, 1.15x submitting them in the
  caller. A kernel submitting thread (IORING_SETUP_SQPOLL) matched it in some runs and
  ran at half its rate in others, competing with the caller for one of two cores.
- A worker's ring is made with IORING_SETUP_SINGLE_ISSUER and DEFER_TASKRUN (Linux 6.1;
  older kernels take neither): one thread submits and waits, and completions are posted
  when it waits for them instead of interrupting it wherever it is. 1 GiB sequential on
  the memory-backed device, uring / aio, fresh write, overwrite (the region's second
  transfer: it pays for registering it), read, read again: 0.99, 0.82, 1.04, 0.95x
  without, 1.05, 0.92, 1.12, 1.13x with (COOP_TASKRUN alone: 0.98, 0.89, 1.08, 1.06x).
- The caller queue's ring is made with IORING_SETUP_COOP_TASKRUN: by default each
  completion interrupts the thread that submitted its request, which costs a virtual
  machine an inter-processor interrupt (submitting in the caller: 1.11x with it).
"""
import errno
import os
import resource
import threading

from ..errors import EngineFallbackWarning, warn_once
from ..units import human_size

ENGINES = ("aio", "uring", "auto")
ENVIRONMENT = "NVMESWAP_ENGINE"
DEFAULT = "aio"

CAP_IPC_LOCK = 14       # linux/capability.h
#: The ulimit -l under which io_uring's rings may not fit.
URING_MEMLOCK = 8 << 20

_refusal_lock = threading.Lock()
_refusal = {}   # pid -> None, or (errno, why io_uring cannot be used): probed once per process


def checked_engine(engine):
    """The engine asked for, checked: ``engine`` itself, or for None the environment's
    choice (``NVMESWAP_ENGINE``), else "aio". TypeError or ValueError otherwise."""
    if engine is None:
        engine = os.environ.get(ENVIRONMENT, "").strip() or DEFAULT
        if engine not in ENGINES:
            raise ValueError(f"{ENVIRONMENT}={engine!r} is not an engine; use one of "
                             f"{', '.join(ENGINES)}")
        return engine
    if not isinstance(engine, str):
        raise TypeError(f"engine must be a str, one of {', '.join(ENGINES)}; got "
                        f"{type(engine).__name__}")
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    return engine


def uring_refusal():
    """None if io_uring works in this process; else ``(errno, why not)``. Probed once."""
    pid = os.getpid()
    with _refusal_lock:
        if pid not in _refusal:
            from .._uring import _refusal as probe_refusal
            _refusal.clear()
            _refusal[pid] = probe_refusal()
        return _refusal[pid]


def has_cap_ipc_lock():
    """Whether this process holds CAP_IPC_LOCK (may lock beyond RLIMIT_MEMLOCK), read from
    its effective capability set: being root is not enough inside many containers."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> CAP_IPC_LOCK & 1)
    except (OSError, ValueError):
        pass
    return False


def rings_memlock_shortage():
    """Why io_uring's rings may not fit under this process's ``ulimit -l``, or None."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY or soft >= URING_MEMLOCK or has_cap_ipc_lock():
        return None
    return (f"ulimit -l is {human_size(soft)} with no CAP_IPC_LOCK, and the kernel may charge "
            "io_uring's rings to it")


def auto_choice():
    """``(engine, why)``: what "auto" chooses here."""
    refused = uring_refusal()
    if refused is not None:
        return "aio", f"io_uring cannot be used: {refused[1]}"
    shortage = rings_memlock_shortage()
    if shortage is not None:
        return "aio", shortage
    return "uring", "io_uring works here"


def resolve(engine):
    """The engine a handle runs for the ``engine`` asked for (already checked): "aio" or
    "uring". "uring" refused here is an OSError with the refusal's errno; "auto" then
    falls back to "aio", saying why in one EngineFallbackWarning per process (as it does
    under a small ``ulimit -l``)."""
    if engine == "aio":
        return "aio"
    refused = uring_refusal()
    if refused is not None:
        err, why = refused
        if engine == "uring":
            raise OSError(err or errno.ENOSYS, f"engine='uring': io_uring cannot be used "
                                               f"here: {why}; use engine='aio' or 'auto'")
        warn_once("engine-fallback", f"engine='auto': io_uring cannot be used here ({why}); "
                                     "using kernel AIO", EngineFallbackWarning)
        return "aio"
    shortage = None if engine == "uring" else rings_memlock_shortage()
    if shortage is None:
        return "uring"
    warn_once("engine-fallback", f"engine='auto': {shortage}; using kernel AIO",
              EngineFallbackWarning)
    return "aio"


def check_usable(engine):
    """What ``aio_handle(engine=engine)`` would refuse, raised here without making one
    (the command line's checks before any work)."""
    engine = checked_engine(engine)
    if engine == "uring":
        resolve(engine)


def worker_engine_type(engine):
    """The class of a worker's engine for ``engine`` ("aio" or "uring")."""
    if engine == "uring":
        from .._uring import UringEngine
        return UringEngine
    from .._queues import AioEngine
    return AioEngine


def caller_queue_type(engine):
    """The class of the caller queue for ``engine`` ("aio" or "uring")."""
    if engine == "uring":
        from .._uring import UringQueue
        return UringQueue
    from .._queues import CallerQueue
    return CallerQueue

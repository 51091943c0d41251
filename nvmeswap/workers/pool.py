"""The worker processes of one handle: start, talk to, watch, and stop them."""
import errno
import os
import resource
import select
import signal
import socket
import subprocess
import sys
import time

from ..errors import WorkerDied, aio_contexts_exhausted, os_error, uring_setup_refused
from ..io.interrupts import deferred_interrupts
from . import protocol

_PACKAGE_FOLDER = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The worker needs its own modules only: a bare module object stands for the package, so
# that nvmeswap/__init__.py (the public API: the scheduler, checkpoints) does not load in
# every worker; with -S no site-packages either (nothing there is the worker's). Half a
# worker's start-up CPU, which every handle pays per worker.
_BOOT = ("import sys, types; package = types.ModuleType('nvmeswap'); "
         "package.__path__ = [sys.argv[1]]; sys.modules['nvmeswap'] = package; "
         "from nvmeswap.workers.main import main; main(sys.argv[2:])")
STARTUP_TIMEOUT = 60.0
STOP_GRACE = 1.0


class Worker:
    """One worker process, the parent's end of its socket, and a pidfd that fires at its death.

    ``mapped`` holds the regions (and set-ups) the worker has been sent, so each is sent once.
    """

    def __init__(self, engine_settings, registry_fd=-1):
        try:
            parent_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        except OSError as error:
            raise start_error(error) from None
        # Ctrl-C goes to the whole process group: the worker starts with SIGINT blocked
        # and ignores it before unblocking, so a Ctrl-C at start-up cannot kill it; ours
        # waits until Popen has returned (Note [deferred interrupts]).
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        ring = None
        try:
            ring = _worker_ring(engine_settings) if registry_fd >= 0 else None
            # -I: the worker sees our nvmeswap, not whatever the current directory holds.
            command = [sys.executable, "-I", "-S", "-c", _BOOT, _PACKAGE_FOLDER, str(child_end.fileno()),
                       str(os.getpid()), *engine_settings.to_argv(),
                       *protocol.ring_to_argv(ring, registry_fd)]
            self.process = subprocess.Popen(
                command, pass_fds=[child_end.fileno(), *([ring[0], registry_fd] if ring else [])],
                stdin=subprocess.DEVNULL)
        except BaseException as error:
            parent_end.close()
            if isinstance(error, OSError):
                raise start_error(error) from None
            raise
        finally:
            child_end.close()
            if ring is not None:
                os.close(ring[0])   # the worker's copy holds the ring now
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        self.sock = parent_end
        try:
            self.pidfd = os.pidfd_open(self.process.pid)
        except BaseException as error:
            self.process.kill()
            self.process.wait()
            parent_end.close()
            if isinstance(error, OSError):
                raise start_error(error) from None
            raise
        self.mapped = set()

    def send(self, message, fds=()):
        socket.send_fds(self.sock, [message], list(fds))

    def kill(self):
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)

    def close(self):
        self.sock.close()
        os.close(self.pidfd)
        self.process.wait()


def _worker_ring(engine_settings):
    """The ring the worker's io_uring engine adopts, made here so that it can clone our
    registered buffers (Note [cloned buffers] in pyx/_uring.pyx)."""
    from .._uring import make_worker_ring

    return make_worker_ring(engine_settings.queue_depth)


def start_error(error):
    """``error`` (from starting a worker) as an OSError that says which resource ran out
    and what to change."""
    err = error.errno
    if err == errno.EAGAIN:
        soft, _ = resource.getrlimit(resource.RLIMIT_NPROC)
        limit = "unlimited" if soft == resource.RLIM_INFINITY else soft
        detail = (f"the process limit is reached (`ulimit -u`, RLIMIT_NPROC: {limit}; or a "
                  "cgroup's pids.max, or kernel.threads-max); raise it, or give the handle a "
                  "smaller intra_op_parallelism")
    elif err == errno.ENOMEM:
        detail = ("not enough memory to start a process (a cgroup's memory.max, or "
                  "vm.overcommit_memory); free memory or raise the limit")
    elif err in (errno.EMFILE, errno.ENFILE):
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        detail = (f"too many open files (RLIMIT_NOFILE: {soft}); raise the limit with "
                  "`ulimit -n` or close some files")
    else:
        detail = str(error.strerror)
    return os_error(err, error.filename, f"cannot start nvmeswap's I/O worker processes: {detail}")


class WorkerPool:
    """``size`` workers with identical engines; one generation, replaced whole if one dies."""

    def __init__(self, size, engine_settings, registry_fd=-1):
        self.workers = []
        self._engine = engine_settings.engine
        try:
            for _ in range(size):
                self.workers.append(Worker(engine_settings, registry_fd))
            self._await_ready()
        except BaseException:
            self.kill()
            raise
        self._poller = select.poll()
        self._by_fd = {}
        for worker in self.workers:
            for fd in (worker.sock.fileno(), worker.pidfd):
                self._poller.register(fd, select.POLLIN)
                self._by_fd[fd] = worker

    def also_wake(self, fd):
        """Let ``fd`` becoming readable end ``poll()`` too (the caller queue's eventfd)."""
        self._poller.register(fd, select.POLLIN)

    def _await_ready(self):
        deadline = time.monotonic() + STARTUP_TIMEOUT
        for worker in self.workers:
            ready, _, _ = select.select([worker.sock, worker.pidfd], [], [],
                                        max(0.0, deadline - time.monotonic()))
            data = worker.sock.recv(protocol.RESPONSE_SIZE) if worker.sock in ready else b""
            if not data:
                raise WorkerDied(f"worker process {worker.process.pid} did not start "
                                 f"(exit status {worker.process.poll()})")
            err = protocol.unpack_response(data).err
            if err and self._engine == "uring":
                raise uring_setup_refused(err, " in a worker process")
            if err:
                raise aio_contexts_exhausted(err)

    def first_death(self):
        """What happened to a worker that has exited, or None; never blocks.

        (A message, not an exception: an exception held in a local while raised would
        tie the caller's frames into a cycle, Note [no reference cycle] in io/scheduler.py.)
        """
        for worker in self.workers:
            if worker.process.poll() is not None:
                return _death_message(worker.process)
        return None

    def poll(self, timeout=None):
        """Block until a worker has something to say (or has died), at most ``timeout``
        milliseconds (None: for ever); take nothing yet.

        The one place the parent blocks on its workers: an interrupt here loses nothing
        (Note [deferred interrupts] in io/interrupts.py).
        """
        return self._poller.poll(timeout)

    def read(self, events):
        """The responses ready after ``poll()``; WorkerDied if a worker has gone."""
        responses = []
        heard = False
        for fd, _ in events:
            worker = self._by_fd.get(fd)
            if worker is None:
                continue        # also_wake's: not ours to read
            heard = True
            if fd == worker.pidfd:
                continue
            while True:
                try:
                    data = worker.sock.recv(protocol.RESPONSE_SIZE, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    break
                except ConnectionResetError:
                    data = b""
                if not data:
                    break
                responses.append(protocol.unpack_response(data))
        # Responses that arrived before a death still count; the death is seen next call.
        if heard and not responses:
            death = self.first_death()
            if death is not None:
                raise WorkerDied(death)
        return responses

    def kill(self):
        """SIGKILL every worker and reap it; kernel AIO in flight ends with the process.
        A Ctrl-C meanwhile waits until all are reaped (Note [deferred interrupts]): a
        worker left half closed would have its descriptors closed twice by the caller's
        clean-up."""
        with deferred_interrupts():
            for worker in self.workers:
                worker.kill()
            for worker in self.workers:
                worker.close()
            self.workers = []

    def ask_to_stop(self):
        """Tell every worker to finish what it has and exit (EOF on its socket)."""
        for worker in self.workers:
            worker.sock.shutdown(socket.SHUT_WR)

    def reap(self):
        """Wait for the workers asked to stop to exit; TERM, then KILL, the slow ones."""
        lingering = self._exited_within(STOP_GRACE)
        for worker in lingering:
            worker.process.terminate()
        if lingering:
            self._exited_within(STOP_GRACE)
        self.kill()

    def _exited_within(self, seconds):
        """The workers still running after ``seconds``; woken by their pidfds as each
        exits (a worker's exit waits ~30 ms for the kernel to retire its AIO context:
        polling would add to that)."""
        running = {worker.pidfd: worker for worker in self.workers}
        poller = select.poll()
        for fd in running:
            poller.register(fd, select.POLLIN)
        deadline = time.monotonic() + seconds
        while running:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for fd, _ in poller.poll(left * 1000):
                poller.unregister(fd)
                del running[fd]
        return list(running.values())

def _death_message(process):
    status = process.returncode
    how = f"killed by signal {-status}" if status < 0 else f"exit status {status}"
    return f"nvmeswap worker process {process.pid} died ({how}); its operations failed"

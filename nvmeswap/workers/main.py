"""A worker process: maps the parent's shared regions and runs transfers on them.

Started by ``WorkerPool`` as a fresh interpreter (spawn semantics: nothing inherited
but one socket). It loads no torch; CUDA and cuFile only once a gds_handle asks for
them (workers/cufile_io.py).
"""
import collections
import errno
import os
import resource
import select
import signal
import socket
import threading

from .._memory import Mapping
from .._transfers import Completion
from ..io.engines import worker_engine_type
from . import protocol


def main(argv):
    """``argv``: our socket's descriptor, the parent's pid, ``EngineSettings``, and the
    ring the parent made for our io_uring engine, if it did (Note [cloned buffers] in
    pyx/_uring.pyx)."""
    sock_fd, parent_pid = int(argv[0]), int(argv[1])
    settings = protocol.EngineSettings.from_argv(argv[2:])
    ring, registry_fd = protocol.ring_from_argv(argv[2 + len(settings):])
    _exit_with_parent(parent_pid)
    _raise_descriptor_limit()
    _take_the_hard_file_size_limit()
    # Ctrl-C goes to the whole process group; the parent decides what it means. (It was
    # blocked from before our start, workers/pool.py.)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    sock = socket.socket(fileno=sock_fd)
    try:
        engine = worker_engine_type(settings.engine)(*settings[:4],
                                                     **({"ring": ring} if ring else {}))
    except OSError as error:
        sock.send(protocol.ready_response(error.errno))
        return
    sock.send(protocol.ready_response())
    _serve(sock, Executor(engine, registry_fd))


def _raise_descriptor_limit():
    """Descriptors of queued requests wait here; take all the room the hard limit allows."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _take_the_hard_file_size_limit():
    """The parent refuses a write past its own file-size limit before any I/O, and may
    raise that limit after the workers started: a worker takes the hard limit, so that
    no write the parent let through meets the worker's copy of an older soft one (a
    bare EINVAL, or EFBIG, the parent could not explain)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))


def _exit_with_parent(parent_pid):
    """Never outlive the parent, however it dies (a pidfd fires when the process exits)."""
    try:
        pidfd = os.pidfd_open(parent_pid)
    except ProcessLookupError:
        os._exit(1)
    if os.getppid() != parent_pid:
        os._exit(1)

    def watch():
        select.select([pidfd], [], [])
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _serve(sock, executor):
    """Run requests in order until the parent closes the socket; transfers run at once
    (Note [concurrent transfers] in pyx/_queues.pyx), anything else between them.

    Requests are read as soon as they arrive, even while responses wait to be sent,
    so that neither side can block the other with a full socket buffer.
    """
    requests = collections.deque()
    responses = collections.deque()
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    try:
        while True:
            if not requests and not executor.busy:
                poller.modify(sock, select.POLLIN | (select.POLLOUT if responses else 0))
                # Idle: register a region moved once, unless the parent has sent something.
                while not poller.poll(0) and executor.register_one():
                    pass
                poller.poll()
            if not _receive(sock, requests):
                while executor.busy:    # the parent is done: finish what it sent
                    executor.advance(block=True)
                return
            while responses:
                try:
                    sock.send(responses[0], socket.MSG_DONTWAIT)
                except BlockingIOError:
                    break
                responses.popleft()
            while requests and executor.can_start(requests[0]):
                response = executor.start(requests.popleft())
                if response is not None:
                    responses.append(response)
            if executor.busy:
                # Waits for a completion: new requests are read at the next one.
                responses.extend(executor.advance(block=True))
    finally:
        executor.close()


def _receive(sock, requests):
    """Queue every request waiting on the socket; False once the parent has gone."""
    while True:
        try:
            data, fds, fds_lost = protocol.receive_with_fds(sock, protocol.MAX_MESSAGE,
                                                            socket.MSG_DONTWAIT)
        except BlockingIOError:
            return True
        except ConnectionResetError:
            return False
        if not data:
            return False
        if fds_lost:
            _close_all(fds)
        requests.append(protocol.unpack_request(data, fds, fds_lost))


class Executor:
    """Carries out requests: maps and unmaps host (or device) regions, and transfers on
    them; host transfers run at once on the engine, the rest one at a time between them."""

    def __init__(self, engine, registry_fd=-1):
        self._engine = engine
        self._registry_fd = registry_fd     # the parent's BufferRegistry (Note [cloned buffers])
        # io_uring's fixed buffers (kernel AIO has none): a region the parent registered is
        # cloned from its registry (Note [cloned buffers] in pyx/_uring.pyx); any other is
        # registered here once it has been moved, when the worker is next idle, else at its
        # second transfer (UringEngine.register_buffers; Note [engines] in io/engines.py).
        self._register = getattr(engine, "register_buffers", None)
        self._moved_once = {}   # region id -> bytes of its one transfer, until the second
        self._registered = set()    # region ids registered (or refused) with the ring
        self._cloned = {}       # region id -> (parent's address, first slot, slots)
        self._regions = {}      # region id -> Mapping of its range of the parent's memfd
        self._running = {}      # (op id, chunk) of an engine transfer -> its request
        self._cufile = None     # a CufileIO once the parent sends CUFILE_SETUP

    @property
    def busy(self):
        return bool(self._running)

    def can_start(self, request):
        """Whether ``request`` can start now: a host transfer while the engine has room;
        a map any time (the region is new); anything else when no transfer runs (an
        unmap must not pull memory from under one, cuFile runs alone)."""
        if request.kind in (protocol.READ, protocol.WRITE) and request.fds is not None:
            return not self._engine.full
        return request.kind == protocol.MAP or not self._running

    def start(self, request):
        """Start or carry out ``request``; return a response to send now, or None."""
        if request.kind not in (protocol.READ, protocol.WRITE) or request.fds is None:
            return self.run(request)
        mapping = self._regions.get(request.region_id)
        if mapping is None:
            _close_all(request.fds)
            return _failure(request, errno.EMFILE)     # its MAP lost its descriptor
        buffered_fd = request.fds[1] if len(request.fds) > 1 else -1
        cloned = self._cloned.get(request.region_id)
        if cloned is not None:
            parent_address, fixed_slot, _ = cloned
        else:
            parent_address, fixed_slot = 0, -1
            if self._register is not None:
                self._count_transfer(request.region_id, mapping, request.nbytes)
        try:
            self._engine.begin(request.op_id, request.chunk, request.kind == protocol.READ,
                               request.fds[0], buffered_fd,
                               mapping.address + request.region_offset, request.nbytes,
                               request.file_offset, request.alignment, fixed_slot,
                               parent_address, parent_address + request.region_offset)
        except BaseException:
            _close_all(request.fds)
            raise
        self._running[request.op_id, request.chunk] = request
        return None

    def _count_transfer(self, region_id, mapping, nbytes):
        if region_id in self._registered:
            return
        if region_id in self._moved_once:
            self._register_region(region_id, mapping)
        else:
            self._moved_once[region_id] = nbytes

    def register_one(self):
        """Register a region moved whole once, not yet registered; False if there is none.
        For idle moments: its pages are in this worker's page tables by then, so pinning
        them costs what one transfer's pinning does (0.03 s a GiB). One moved in part waits
        for its second transfer: registering pins every page of it, allocating those never
        touched (a staging space used for one small operation)."""
        for region_id, nbytes in self._moved_once.items():
            mapping = self._regions.get(region_id)
            if mapping is not None and nbytes >= mapping.size:
                self._register_region(region_id, mapping)
                return True
        return False

    def _register_region(self, region_id, mapping):
        del self._moved_once[region_id]
        self._registered.add(region_id)
        self._register(mapping.address, mapping.size)

    def advance(self, block):
        """Responses for the transfers that have ended."""
        responses = []
        for done in self._engine.advance(block):
            _close_all(self._running.pop((done.op_id, done.chunk)).fds)
            responses.append(protocol.response(done))
        return responses

    def run(self, request):
        """Carry out a request that is not a host transfer; return the response, or None."""
        if request.fds is None:     # its descriptors did not fit under RLIMIT_NOFILE
            if request.kind == protocol.MAP:
                self._regions[request.region_id] = None     # its transfers fail alike
                return None
            return _failure(request, errno.EMFILE)
        if request.kind >= protocol.CUFILE_SETUP:
            return self._run_cufile(request)
        try:
            if request.kind == protocol.MAP:
                self._regions[request.region_id] = Mapping(request.fds[0], request.nbytes,
                                                           request.region_offset)
                registered = protocol.unpack_registered(request.payload)
                if (registered is not None and self._registry_fd >= 0
                        and self._engine.clone_buffers(self._registry_fd, *registered[1:])):
                    self._cloned[request.region_id] = registered
            elif request.kind == protocol.UNMAP:
                mapping = self._regions.pop(request.region_id, None)
                self._moved_once.pop(request.region_id, None)
                cloned = self._cloned.pop(request.region_id, None)
                if cloned is not None:
                    self._engine.drop_buffers(*cloned[1:])
                registered = request.region_id in self._registered
                self._registered.discard(request.region_id)
                if registered and mapping is not None:
                    self._engine.unregister_buffers(mapping.address)
                if self._cufile is not None:
                    self._cufile.unmap(request.region_id)
        finally:
            _close_all(request.fds)
        return None

    def _run_cufile(self, request):
        if self._cufile is None:
            from .cufile_io import CufileIO  # only cuFile workers load CUDA

            self._cufile = CufileIO()
        if request.kind == protocol.CUFILE_SETUP:
            # cuFile reads its configuration through this descriptor later: kept open.
            self._cufile.setup(request.payload, request.fds)
            return None
        try:
            if request.kind == protocol.DEVICE_MAP:
                self._cufile.map(request.region_id, request.nbytes, request.payload)
                return None
            done = self._cufile.transfer(request.op_id, request.chunk,
                                         request.kind == protocol.CUFILE_READ,
                                         request.region_id, request.region_offset,
                                         request.nbytes, request.file_offset,
                                         request.alignment, request.fds)
        finally:
            _close_all(request.fds)
        return protocol.response(done)

    def close(self):
        if self._cufile is not None:
            self._cufile.close()


def _failure(request, err):
    return protocol.response(Completion(request.op_id, request.chunk, err,
                                        request.file_offset, request.nbytes, 0))


def _close_all(fds):
    for fd in fds:
        os.close(fd)

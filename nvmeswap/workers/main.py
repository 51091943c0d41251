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

from .._engine import AioEngine
from .._memory import Mapping
from . import protocol


def main(sock_fd, parent_pid, block_size, queue_depth, single_submit, overlap_events):
    _exit_with_parent(parent_pid)
    _raise_descriptor_limit()
    # Ctrl-C goes to the whole process group; the parent decides what it means. (It was
    # blocked from before our start, workers/pool.py.)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    sock = socket.socket(fileno=sock_fd)
    try:
        engine = AioEngine(block_size, queue_depth, single_submit, overlap_events)
    except OSError as error:
        sock.send(protocol.ready_response(error.errno))
        return
    sock.send(protocol.ready_response())
    _serve(sock, Executor(engine))


def _raise_descriptor_limit():
    """Descriptors of queued requests wait here; take all the room the hard limit allows."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


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
    """Run requests in order until the parent closes the socket.

    Requests are read as soon as they arrive, even while responses wait to be sent,
    so that neither side can block the other with a full socket buffer.
    """
    requests = collections.deque()
    responses = collections.deque()
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    try:
        while True:
            if not requests:
                poller.modify(sock, select.POLLIN | (select.POLLOUT if responses else 0))
                poller.poll()
            if not _receive(sock, requests):
                return
            while responses:
                try:
                    sock.send(responses[0], socket.MSG_DONTWAIT)
                except BlockingIOError:
                    break
                responses.popleft()
            if requests:
                response = executor.run(requests.popleft())
                if response is not None:
                    responses.append(response)
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
    """Runs one request at a time: maps, unmaps and transfers on host (or device) regions."""

    def __init__(self, engine):
        self._engine = engine
        self._regions = {}      # region id -> Mapping of its range of the parent's memfd
        self._cufile = None     # a CufileIO once the parent sends CUFILE_SETUP

    def run(self, request):
        """Carry out ``request``; return the response to send, or None."""
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
                return None
            if request.kind == protocol.UNMAP:
                self._regions.pop(request.region_id, None)
                if self._cufile is not None:
                    self._cufile.unmap(request.region_id)
                return None
            mapping = self._regions[request.region_id]
            if mapping is None:
                return _failure(request, errno.EMFILE)
            address = mapping.address + request.region_offset
            buffered_fd = request.fds[1] if len(request.fds) > 1 else -1
            result = self._engine.transfer(request.kind == protocol.READ, request.fds[0],
                                           buffered_fd, address, request.nbytes,
                                           request.file_offset, request.alignment)
        finally:
            _close_all(request.fds)
        return protocol.response(request.op_id, request.chunk, *result)

    def _run_cufile(self, request):
        if self._cufile is None:
            from .cufile_io import CufileIO     # only cuFile workers load CUDA

            self._cufile = CufileIO()
        if request.kind == protocol.CUFILE_SETUP:
            # cuFile reads its configuration through this descriptor later: kept open.
            self._cufile.setup(request.payload, request.fds)
            return None
        try:
            if request.kind == protocol.DEVICE_MAP:
                self._cufile.map(request.region_id, request.nbytes, request.payload)
                return None
            result = self._cufile.transfer(request.kind == protocol.CUFILE_READ,
                                           request.region_id, request.region_offset,
                                           request.nbytes, request.file_offset,
                                           request.alignment, request.fds)
        finally:
            _close_all(request.fds)
        return protocol.response(request.op_id, request.chunk, *result)

    def close(self):
        if self._cufile is not None:
            self._cufile.close()


def _failure(request, err):
    return protocol.response(request.op_id, request.chunk, err, request.file_offset,
                             request.nbytes)


def _close_all(fds):
    for fd in fds:
        os.close(fd)

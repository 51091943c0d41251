"""A worker process: maps the parent's shared regions and runs transfers on them.

Started by ``WorkerPool`` as a fresh interpreter (spawn semantics: nothing inherited
but one socket). It imports nothing but the standard library and nvmeswap's engine.
"""
import collections
import os
import select
import signal
import socket
import threading

from . import protocol
from ._engine import AioEngine
from ._memory import Mapping


def main(sock_fd, parent_pid, block_size, queue_depth, single_submit, overlap_events):
    _exit_with_parent(parent_pid)
    # Ctrl-C goes to the whole process group; the parent decides what it means.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock = socket.socket(fileno=sock_fd)
    try:
        engine = AioEngine(block_size, queue_depth, single_submit, overlap_events)
    except OSError as error:
        sock.send(protocol.RESPONSE.pack(protocol.READY_OP, 0, error.errno, 0, 0, 0))
        return
    sock.send(protocol.RESPONSE.pack(protocol.READY_OP, 0, 0, 0, 0, 0))
    _serve(sock, engine)


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


def _serve(sock, engine):
    """Run requests in order until the parent closes the socket.

    Requests are read as soon as they arrive, even while responses wait to be sent,
    so that neither side can block the other with a full socket buffer.
    """
    regions = {}
    gds = None      # a GdsWorker once the parent sends GDS_SETUP
    requests = collections.deque()
    responses = collections.deque()
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    while True:
        if not requests:
            poller.modify(sock, select.POLLIN | (select.POLLOUT if responses else 0))
            poller.poll()
        if not _receive(sock, requests):
            if gds is not None:
                gds.close()
            return
        while responses:
            try:
                sock.send(responses[0], socket.MSG_DONTWAIT)
            except BlockingIOError:
                break
            responses.popleft()
        if requests:
            request = requests.popleft()
            if request[0][0] >= protocol.GDS_SETUP and gds is None:
                from .gds_worker import GdsWorker  # only GDS workers load CUDA
                gds = GdsWorker()
            response = _run(request, regions, engine, gds)
            if response is not None:
                responses.append(response)


def _receive(sock, requests):
    """Queue every request waiting on the socket; False once the parent has gone."""
    while True:
        try:
            data, fds = protocol.receive_with_fds(sock, protocol.MAX_MESSAGE,
                                                  socket.MSG_DONTWAIT)
        except BlockingIOError:
            return True
        except ConnectionResetError:
            return False
        if not data:
            return False
        header = protocol.REQUEST.unpack_from(data)
        requests.append((header, fds, data[protocol.REQUEST.size:]))


def _run(request, regions, engine, gds):
    (kind, region_id, op_id, chunk, region_offset, nbytes, file_offset, alignment), fds, payload \
        = request
    if kind >= protocol.GDS_SETUP:
        return _run_gds(gds, request)
    if kind == protocol.MAP:
        try:
            regions[region_id] = Mapping(fds[0], nbytes)
        finally:
            os.close(fds[0])
        return None
    if kind == protocol.UNMAP:
        regions.pop(region_id, None)
        if gds is not None:
            gds.unmap(region_id)
        return None
    try:
        address = regions[region_id].address + region_offset
        buffered_fd = fds[1] if len(fds) > 1 else -1
        result = engine.transfer(kind == protocol.READ, fds[0], buffered_fd, address, nbytes,
                                 file_offset, alignment)
    finally:
        for fd in fds:
            os.close(fd)
    return protocol.RESPONSE.pack(op_id, chunk, *result)


def _run_gds(gds, request):
    (kind, region_id, op_id, chunk, region_offset, nbytes, file_offset, alignment), fds, payload \
        = request
    try:
        if kind == protocol.GDS_SETUP:
            gds.setup(payload, fds)
            return None
        if kind == protocol.GDS_MAP:
            gds.map(region_id, nbytes, payload)
            return None
        result = gds.transfer(kind == protocol.GDS_READ, region_id, region_offset, nbytes,
                              file_offset, alignment, fds)
    finally:
        if kind != protocol.GDS_SETUP:     # cuFile reads the configuration by this fd later
            for fd in fds:
                os.close(fd)
    return protocol.RESPONSE.pack(op_id, chunk, *result)

"""Every message between a handle and its workers, packed and unpacked here.

One request or response is one datagram of a few dozen bytes on a SEQPACKET socket;
descriptors (files, memfds) travel beside it as SCM_RIGHTS. No pickling, so a chunk
costs microseconds. A response carries a transfer's ``Completion`` (nvmeswap._transfers),
the record every road returns; its error code is an errno, or ``CUFILE_ERROR`` /
``CUDA_ERROR`` plus the library's own code (errors.py maps them both ways).
"""
import array
import socket
import struct
from typing import NamedTuple

from .._transfers import Completion

MAP, UNMAP, READ, WRITE = 1, 2, 3, 4
# GPUDirect Storage: load cuFile, map a CUDA region by IPC, cuFile I/O on it.
CUFILE_SETUP, DEVICE_MAP, CUFILE_READ, CUFILE_WRITE = 5, 6, 7, 8

# kind, region id, op id, chunk index, region offset, nbytes, file offset, alignment
_REQUEST = struct.Struct("<BxxxIQIxxxxQQqQ")
# A Completion: op id, chunk index, error code, failed at offset (or the transfer's
# offset), bytes requested there, bytes got there
_RESPONSE = struct.Struct("<QIiqqq")
RESPONSE_SIZE = _RESPONSE.size
# The allocation's IPC handle, the device ordinal, the region's offset in the allocation.
_DEVICE_REGION = struct.Struct("<64sIQ")
# A region registered by the parent: its address there, the first slot, how many slots.
_REGISTERED = struct.Struct("<QII")
# A request and its payload (CUFILE_SETUP: library paths) fit in one datagram of this size.
MAX_MESSAGE = 8192
MAX_FDS = 2
_READY_OP = 0
_FD_SPACE = socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize)


class EngineSettings(NamedTuple):
    """A worker's engine, as the handle was asked for it; passed on the worker's command
    line. ``engine`` is "aio" or "uring" (Note [engines] in io/engines.py)."""
    block_size: int
    queue_depth: int
    single_submit: bool
    overlap_events: bool
    engine: str = "aio"

    def to_argv(self):
        return [*(str(int(value)) for value in self[:4]), self.engine]

    @classmethod
    def from_argv(cls, argv):
        block_size, queue_depth, single_submit, overlap_events = map(int, argv[:4])
        return cls(block_size, queue_depth, bool(single_submit), bool(overlap_events),
                   argv[4])


def ring_to_argv(ring, registry_fd):
    """The worker's command-line words for a ring made for it (``make_worker_ring`` in
    pyx/_uring.pyx) and the parent's ``BufferRegistry`` descriptor (io_uring descriptors
    cannot be sent over a socket: the worker inherits both): none for no ring."""
    return [] if ring is None else [str(ring[0]), str(ring[1]), ring[2].hex(), str(registry_fd)]


def ring_from_argv(argv):
    """What ``ring_to_argv`` wrote: ``(ring or None, registry descriptor or -1)``."""
    if not argv:
        return None, -1
    return (int(argv[0]), int(argv[1]), bytes.fromhex(argv[2])), int(argv[3])


class Request(NamedTuple):
    kind: int
    region_id: int
    op_id: int
    chunk: int
    region_offset: int
    nbytes: int
    file_offset: int
    alignment: int
    fds: list
    payload: bytes


# -- parent -> worker ----------------------------------------------------------------------
def map_request(region_id, size, offset=0, registered=None):
    """Map ``size`` bytes at ``offset`` (page-aligned) of the memfd sent beside this
    message as region ``region_id``; a MAP's ``region_offset`` is that offset. With
    ``registered`` (our address of the region, first slot, slots), the region is
    registered with the parent's registry ring (Note [cloned buffers] in pyx/_uring.pyx)."""
    message = _REQUEST.pack(MAP, region_id, 0, 0, offset, size, 0, 0)
    return message if registered is None else message + _REGISTERED.pack(*registered)


def unpack_registered(payload):
    """``(our address, first slot, slots)`` of a MAP's payload, or None."""
    return _REGISTERED.unpack(payload) if payload else None


def unmap_request(region_id):
    return _REQUEST.pack(UNMAP, region_id, 0, 0, 0, 0, 0, 0)


def transfer_request(kind, region_id, op_id, chunk, region_offset, nbytes, file_offset,
                     alignment):
    """Move ``nbytes`` at ``region_offset`` of a region; the file's descriptors go beside."""
    return _REQUEST.pack(kind, region_id, op_id, chunk, region_offset, nbytes, file_offset,
                         alignment)


def cufile_setup_request(library_paths):
    """Load cuFile and the CUDA driver from these paths; a config memfd may go beside."""
    return _REQUEST.pack(CUFILE_SETUP, 0, 0, 0, 0, 0, 0, 0) + b"\0".join(library_paths)


def device_map_request(region_id, size, ipc_handle, ordinal, offset):
    """Open a CUDA allocation by IPC and use ``size`` bytes at ``offset`` of it."""
    return (_REQUEST.pack(DEVICE_MAP, region_id, 0, 0, 0, size, 0, 0)
            + _DEVICE_REGION.pack(ipc_handle, ordinal, offset))


def unpack_request(data, fds, fds_lost=False):
    """A request; if descriptors sent with it were lost, ``fds`` is None."""
    return Request(*_REQUEST.unpack_from(data), None if fds_lost else fds, data[_REQUEST.size:])


def unpack_cufile_setup(payload):
    """The (cuFile, CUDA driver) library paths of a CUFILE_SETUP payload."""
    cufile, cuda = payload.split(b"\0")[:2]
    return cufile, cuda


def unpack_device_map(payload):
    """(IPC handle, device ordinal, offset in the allocation) of a DEVICE_MAP payload."""
    return _DEVICE_REGION.unpack(payload)


# -- worker -> parent ----------------------------------------------------------------------
def response(done):
    """The datagram of a transfer's ``Completion``; its ``err`` is 0, an errno, or
    CUFILE_ERROR / CUDA_ERROR + a library code."""
    return _RESPONSE.pack(done.op_id, done.chunk, done.err, done.at_offset, done.requested,
                          done.got)


def ready_response(error=0):
    """The first message of a worker: 0, or the errno that kept its engine from starting."""
    return response(Completion(_READY_OP, 0, error, 0, 0, 0))


def unpack_response(data):
    """The ``Completion`` a response carries."""
    return Completion(*_RESPONSE.unpack(data))


def receive_with_fds(sock, size, flags=0):
    """One datagram, the descriptors sent with it, and whether some of those were lost
    (the kernel drops what would exceed the receiver's RLIMIT_NOFILE).

    (``socket.recv_fds`` ignores its ``flags`` argument, so MSG_DONTWAIT needs this.)
    """
    data, ancillary, message_flags, _ = sock.recvmsg(size, _FD_SPACE, flags)
    fds = array.array("i")
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    return data, list(fds), bool(message_flags & socket.MSG_CTRUNC)


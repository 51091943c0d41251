"""The messages between a handle and its workers: fixed-size structs on a SEQPACKET socket.

One request or response is one datagram of a few dozen bytes; descriptors (files,
memfds) travel beside it as SCM_RIGHTS. No pickling, so a chunk costs microseconds.
"""
import array
import socket
import struct

MAP, UNMAP, READ, WRITE = 1, 2, 3, 4
# GPUDirect Storage: load cuFile, map a CUDA region by IPC, cuFile I/O on it.
GDS_SETUP, GDS_MAP, GDS_READ, GDS_WRITE = 5, 6, 7, 8

# kind, region id, op id, chunk index, region offset, nbytes, file offset, alignment
REQUEST = struct.Struct("<BxxxIQIxxxxQQqQ")
# op id, chunk index, error code, failed at offset, bytes requested there, bytes got there
RESPONSE = struct.Struct("<QIiqqq")
READY_OP = 0
MAX_FDS = 2
# What follows a GDS_MAP request: the allocation's IPC handle, the device ordinal, and the
# region's offset in the allocation.
DEVICE_REGION = struct.Struct("<64sIQ")
# A request and its payload (GDS_SETUP: library paths) fit in one datagram of this size.
MAX_MESSAGE = 8192
# Error codes in a response: an errno below CUFILE_ERROR, else one of these plus the code.
CUFILE_ERROR = 1 << 16
CUDA_ERROR = 1 << 20

_FD_SPACE = socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize)


def receive_with_fds(sock, size, flags=0):
    """One datagram and the descriptors sent with it.

    (``socket.recv_fds`` ignores its ``flags`` argument, so MSG_DONTWAIT needs this.)
    """
    data, ancillary, _, _ = sock.recvmsg(size, _FD_SPACE, flags)
    fds = array.array("i")
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    return data, list(fds)

"""A worker's cuFile side: the parent's CUDA tensors, reached by CUDA IPC, read and written
with cuFile.

Loaded only when a gds_handle sends CUFILE_SETUP, so an aio worker never touches CUDA.
Every failure is answered as an error code (errors.error_code), so the parent raises
it with its name and file.
"""
import errno
import os

from .. import _cuda, _cufile
from .._transfers import Completion, direct_split
from ..errors import CudaError, CuFileError, error_code
from . import protocol

# Unaligned heads and tails go through host memory this much at a time.
_BOUNCE = 16 << 20


class DeviceMapping:
    """One region of a parent's CUDA allocation as mapped here (and registered with cuFile)."""

    __slots__ = ("address", "ipc_handle", "ordinal", "registered")

    def __init__(self, ipc_handle, ordinal, address):
        self.ipc_handle = ipc_handle
        self.ordinal = ordinal
        self.address = address
        self.registered = False


class CufileIO:
    """cuFile I/O on CUDA regions the parent maps in; one per worker process."""

    def __init__(self):
        self._setup_error = errno.ENOPKG   # until CUFILE_SETUP succeeds
        self._regions = {}      # region id -> DeviceMapping, or the error code of its map
        self._allocations = {}  # IPC handle -> [base address here, regions using it]

    def setup(self, payload, fds):
        """Load cuFile and the driver from the parent's paths and open the driver."""
        cufile_path, cuda_path = map(os.fsdecode, protocol.unpack_cufile_setup(payload))
        if fds:
            # Note [cuFile configuration]: the parent's JSON, in a memfd, never a file on disk.
            os.environ["CUFILE_ENV_PATH_JSON"] = f"/proc/self/fd/{fds[0]}"
        for library, path in ((_cufile, cufile_path), (_cuda, cuda_path)):
            ok, _ = library.load(path)
            if not ok:
                self._setup_error = errno.ELIBACC
                return
        try:
            _cuda.initialize()
            _cufile.driver_open()
        except Exception as error:
            self._setup_error = error_code(error)
            return
        self._setup_error = 0

    def map(self, region_id, nbytes, payload):
        if self._setup_error:
            self._regions[region_id] = self._setup_error
            return
        ipc_handle, ordinal, offset = protocol.unpack_device_map(payload)
        try:
            _cuda.use_device(ordinal)
            base = self._open_allocation(ipc_handle)
        except Exception as error:
            self._regions[region_id] = error_code(error)
            return
        mapping = self._regions[region_id] = DeviceMapping(ipc_handle, ordinal, base + offset)
        try:
            _cufile.buf_register(mapping.address, nbytes)
            mapping.registered = True
        except (CuFileError, OSError):
            pass    # cuFile moves unregistered memory too, through its own bounce buffers

    def unmap(self, region_id):
        mapping = self._regions.pop(region_id, None)
        if isinstance(mapping, DeviceMapping):
            self._close(mapping)

    def transfer(self, op_id, chunk, is_read, region_id, region_offset, nbytes, file_offset,
                 alignment, fds):
        """Chunk ``chunk`` of operation ``op_id``; returns its ``Completion``.

        The aligned middle goes through cuFile on the O_DIRECT descriptor; an unaligned
        head or tail (under one block) is copied with cuMemcpy and read or written
        through the buffered one, as the aio road does (Note [O_DIRECT tail]). Where the
        filesystem refused O_DIRECT (alignment 1), all of it goes the buffered way.
        """
        mapping = self._regions.get(region_id, errno.EINVAL)
        if not isinstance(mapping, DeviceMapping):
            return Completion(op_id, chunk, mapping, file_offset, nbytes, 0)
        end = file_offset + nbytes
        buffered_fd = fds[1] if len(fds) > 1 else fds[0]
        if alignment == 1:
            pieces = [(file_offset, end, True)]
        else:
            middle_start, middle_end = direct_split(file_offset, nbytes, alignment)
            pieces = [(file_offset, middle_start, True), (middle_start, middle_end, False),
                      (middle_end, end, True)]
        try:
            _cuda.use_device(mapping.ordinal)
        except CudaError as error:
            return Completion(op_id, chunk, error_code(error), file_offset, nbytes, 0)
        for start, stop, buffered in pieces:
            if start == stop:
                continue
            address = mapping.address + region_offset + (start - file_offset)
            try:
                if buffered:
                    got = _buffered(is_read, buffered_fd, address, stop - start, start)
                else:
                    got = _with_cufile(is_read, fds[0], mapping.address,
                                       region_offset + (start - file_offset), stop - start, start)
            except Exception as error:
                return Completion(op_id, chunk, error_code(error), start, stop - start,
                                  0)
            if got != stop - start:
                return Completion(op_id, chunk, 0, start, stop - start, got)
        return Completion(op_id, chunk, 0, file_offset, nbytes, nbytes)

    def close(self):
        for region_id in list(self._regions):
            self.unmap(region_id)
        if not self._setup_error:
            _cufile.driver_close()

    def _open_allocation(self, ipc_handle):
        # A process can open an allocation once; regions of it share that mapping.
        entry = self._allocations.get(ipc_handle)
        if entry is None:
            entry = self._allocations[ipc_handle] = [_cuda.open_handle(ipc_handle), 0]
        entry[1] += 1
        return entry[0]

    def _close(self, mapping):
        # Best effort: a failure to let go must not take the worker down with it.
        if mapping.registered:
            _ignore_errors(_cufile.buf_deregister, mapping.address)
        entry = self._allocations[mapping.ipc_handle]
        entry[1] -= 1
        if entry[1] == 0:
            del self._allocations[mapping.ipc_handle]
            _ignore_errors(_cuda.close_handle, entry[0])


def _ignore_errors(call, *args):
    try:
        call(*args)
    except (CudaError, CuFileError, OSError):
        pass


def _with_cufile(is_read, fd, base, base_offset, nbytes, file_offset):
    """cuFileRead/Write until done or the end of the file; returns the bytes moved."""
    handle = _cufile.handle_register(fd)
    try:
        call = _cufile.read if is_read else _cufile.write
        done = 0
        while done < nbytes:
            got = call(handle, base, nbytes - done, file_offset + done, base_offset + done)
            if got == 0:
                break
            done += got
        return done
    finally:
        _cufile.handle_deregister(handle)


def _buffered(is_read, fd, address, nbytes, file_offset):
    """cuMemcpy and pread/pwrite, a bounce at a time; returns the bytes moved."""
    done = 0
    while done < nbytes:
        length = min(_BOUNCE, nbytes - done)
        if is_read:
            data = os.pread(fd, length, file_offset + done)
            _cuda.copy_to_device(address + done, data)
            moved = len(data)
        else:
            moved = os.pwrite(fd, _cuda.copy_to_host(address + done, length), file_offset + done)
        done += moved
        if moved < length:
            break
    return done

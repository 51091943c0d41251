"""What the caller hands us as a buffer: a torch tensor, a numpy array, any buffer object."""
import sys

from .._memory import buffer_address


class IoBuffer:
    """The address and size of a caller's buffer, and what keeps that memory alive.

    ``device`` is None for host memory, else the torch device of a CUDA tensor (whose
    address the host cannot touch). ``storage``: a tensor's storage, held so that the
    memory outlives a ``set_()`` or ``del`` of the tensor before ``wait()``.
    """

    __slots__ = ("address", "device", "nbytes", "owner", "storage")

    def __init__(self, owner, address, nbytes, device=None, storage=None):
        self.owner = owner
        self.address = address
        self.nbytes = nbytes
        self.device = device
        self.storage = storage

    def check_alive(self):
        """Raise if the memory was given up under us: a tensor's storage resized, say."""
        storage = self.storage
        if storage is None:
            return      # buffer objects are held by a memoryview: they cannot resize
        start = storage.data_ptr()
        if not start <= self.address <= self.address + self.nbytes <= start + storage.nbytes():
            raise RuntimeError("the tensor's storage was resized or freed before the "
                               "operation completed; its bytes were not copied")


def io_buffer(obj, *, writable):
    """Describe ``obj`` for I/O; ``writable`` when it is the target of a read."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        return _tensor_buffer(obj, writable)
    try:
        view = memoryview(obj)
    except TypeError:
        raise TypeError(f"expected a tensor, an array or a buffer object, "
                        f"got {type(obj).__name__}") from None
    if writable and view.readonly:
        raise TypeError(f"cannot read into a read-only buffer ({type(obj).__name__})")
    if not view.c_contiguous:
        raise ValueError(f"the {type(obj).__name__} is not C-contiguous; I/O needs one "
                         "contiguous block of memory")
    address, nbytes = buffer_address(view, writable)
    return IoBuffer(view, address, nbytes)


def _tensor_buffer(tensor, writable):
    # is_cpu / is_cuda: a tenth of the cost of tensor.device (a new object each time).
    if not (tensor.is_cpu or tensor.is_cuda):
        raise TypeError(f"nvmeswap takes CPU and CUDA tensors; got a tensor on {tensor.device}")
    if tensor.layout is not _torch().strided or tensor.is_nested:
        raise TypeError(f"nvmeswap takes dense tensors; got a {tensor.layout} tensor")
    if tensor.is_quantized:
        raise TypeError("nvmeswap does not move quantized tensors; pass tensor.int_repr() "
                        "and keep the scale and zero point beside it")
    if tensor.is_conj() or tensor.is_neg():
        # Their memory holds other values than they show (conjugation is lazy).
        if writable:
            raise ValueError("cannot read into a conjugate or negative view; read into "
                             "tensor.resolve_conj().resolve_neg() and copy it over")
        tensor = tensor.resolve_conj().resolve_neg()
    if not tensor.is_contiguous():
        # DeepNVMe reads such tensors into a temporary copy and drops the data.
        raise ValueError("the tensor is not contiguous; pass tensor.contiguous() "
                         "(and copy it back after a read)")
    device = tensor.device if tensor.is_cuda else None
    return IoBuffer(tensor, tensor.data_ptr(), tensor.nbytes, device, tensor.untyped_storage())


def _torch():
    return sys.modules["torch"]

"""What the caller hands us as a buffer: a torch tensor, a numpy array, any buffer object."""
import sys

from .._memory import buffer_address


class IoBuffer:
    """The address and size of a caller's buffer, and the object that keeps it alive.

    ``device`` is None for host memory, else the torch device of a CUDA tensor (whose
    address the host cannot touch).
    """

    __slots__ = ("owner", "address", "nbytes", "device")

    def __init__(self, owner, address, nbytes, device=None):
        self.owner = owner
        self.address = address
        self.nbytes = nbytes
        self.device = device


def io_buffer(obj, *, writable):
    """Describe ``obj`` for I/O; ``writable`` when it is the target of a read."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        return _tensor_buffer(obj)
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


def _tensor_buffer(tensor):
    if tensor.device.type not in ("cpu", "cuda"):
        raise TypeError(f"nvmeswap takes CPU and CUDA tensors; got a tensor on {tensor.device}")
    if not tensor.is_contiguous():
        # DeepNVMe reads such tensors into a temporary copy and drops the data.
        raise ValueError("the tensor is not contiguous; pass tensor.contiguous() "
                         "(and copy it back after a read)")
    device = tensor.device if tensor.device.type == "cuda" else None
    return IoBuffer(tensor, tensor.data_ptr(), tensor.numel() * tensor.element_size(), device)

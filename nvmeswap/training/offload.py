"""``OffloadedOptimizer``: a torch.optim optimizer whose state lives on disk between steps.

During ``step()`` each parameter group's state is read back into a locked swap buffer
(the next group's is prefetched while this one computes), the wrapped optimizer updates
it in place, and it is written back from the same buffer without a copy while the next
group computes. Three buffers, each the size of the largest group's state, are all the
state memory it needs; between steps the state is only on disk. The arithmetic is the
wrapped optimizer's own, group by group, so results are bit-identical to it.
"""
import math

from ..io.files import ALIGNMENT
from ..io.regions import round_up
from .swap import TensorSwapper

# Scalar state (Adam's ``step``) stays in memory; every other state tensor is swapped.
SMALL_STATE = 2
BUFFERS = 3     # the group stepping, the next one arriving, the previous one leaving


class OffloadedOptimizer:
    """Wraps ``optimizer`` (e.g. ``torch.optim.Adam``); swap files go to ``folder``.

    Use it where the optimizer was used: ``step()``, ``zero_grad()``, ``param_groups``.
    Between steps ``optimizer.state`` holds only the scalar entries; call ``close()`` at
    the end to delete the swap files and free the buffers. ``swapper_args`` go to
    ``TensorSwapper`` (handle settings, ``pack_below``).
    """

    def __init__(self, optimizer, folder, **swapper_args):
        self.optimizer = optimizer
        self.swapper = TensorSwapper(folder, **swapper_args)
        self._layouts = {}      # group index -> [(param, name, offset, shape, dtype)]
        self._buffers = []      # every swap buffer
        self._free = []         # buffers holding nothing
        self._leaving = []      # buffers whose write-back has not been waited for
        self._arriving = None   # (group index, buffer) being prefetched

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none=True):
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure=None):
        import torch
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        groups = self.optimizer.param_groups
        self._prefetch(0)
        for index, group in enumerate(groups):
            buffer = self._arrive(index)
            if index + 1 < len(groups):
                self._prefetch(index + 1)
            self._step_group(group)
            self._leave(index, group, buffer)
        self._settle_writes()
        for layout in self._layouts.values():
            for param, name, *_ in layout:
                del self.optimizer.state[param][name]     # the state leaves memory
        return loss

    def _prefetch(self, index):
        layout = self._layouts.get(index)
        if not layout:
            self._arriving = (index, None)
            return
        buffer = self._take_buffer(_layout_bytes(layout))
        for param, name, offset, shape, dtype in layout:
            self.swapper.swap_in(self._key(index, param, name),
                                 out=_view(buffer, offset, shape, dtype))
        self._arriving = (index, buffer)

    def _arrive(self, index):
        arriving_index, buffer = self._arriving
        assert arriving_index == index
        if buffer is None:
            return None
        self.swapper.synchronize_reads()
        for param, name, offset, shape, dtype in self._layouts[index]:
            self.optimizer.state[param][name] = _view(buffer, offset, shape, dtype)
        return buffer

    def _step_group(self, group):
        everything = self.optimizer.param_groups
        self.optimizer.param_groups = [group]
        try:
            self.optimizer.step()
        finally:
            self.optimizer.param_groups = everything

    def _leave(self, index, group, buffer):
        """Write the group's state back from its swap buffer (moved there on first use)."""
        if buffer is None:
            layout, offset = [], 0
            for param in group["params"]:
                for name, value in self.optimizer.state.get(param, {}).items():
                    if hasattr(value, "numel") and value.numel() >= SMALL_STATE:
                        layout.append((param, name, offset, tuple(value.shape), value.dtype))
                        offset += round_up(value.numel() * value.element_size(), ALIGNMENT)
            if not layout:
                return
            self._layouts[index] = layout
            buffer = self._take_buffer(_layout_bytes(layout))
            for param, name, offset, shape, dtype in layout:
                view = _view(buffer, offset, shape, dtype)
                view.copy_(self.optimizer.state[param][name])
                self.optimizer.state[param][name] = view
        for param, name, offset, shape, dtype in self._layouts[index]:
            self.swapper.swap_out(self._key(index, param, name), _view(buffer, offset, shape,
                                                                        dtype))
        self._leaving.append(buffer)

    def _take_buffer(self, nbytes):
        fitting = [b for b in self._free if b.numel() >= nbytes]
        if not fitting and len(self._buffers) >= BUFFERS:
            self._settle_writes()
            fitting = [b for b in self._free if b.numel() >= nbytes]
        if fitting:
            self._free.remove(fitting[0])
            return fitting[0]
        if len(self._buffers) >= BUFFERS:
            # The groups grew (a first step): swap the smallest buffer for a larger one.
            smallest = min(self._free, key=lambda b: b.numel())
            self._free.remove(smallest)
            self._buffers.remove(smallest)
            self.swapper.free_locked_tensor(smallest)
        buffer = self.swapper.new_locked_tensor(nbytes)
        self._buffers.append(buffer)
        return buffer

    def _settle_writes(self):
        self.swapper.synchronize_writes()
        self._free.extend(self._leaving)
        self._leaving = []

    def _key(self, index, param, name):
        position = next(i for i, p in enumerate(self.optimizer.param_groups[index]["params"])
                        if p is param)
        return f"group{index}.param{position}.{name}"

    def close(self):
        self._settle_writes()
        for buffer in self._buffers:
            self.swapper.free_locked_tensor(buffer)
        self._buffers, self._free = [], []
        self.swapper.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()


def _layout_bytes(layout):
    _, _, offset, shape, dtype = layout[-1]
    return offset + math.prod(shape) * dtype.itemsize


def _view(buffer, offset, shape, dtype):
    nbytes = math.prod(shape) * dtype.itemsize
    return buffer[offset:offset + nbytes].view(dtype).reshape(shape)

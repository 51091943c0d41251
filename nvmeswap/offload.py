"""``OffloadedOptimizer``: a torch.optim optimizer whose state lives on disk between steps.

During ``step()`` the state of each parameter group is read back (the next group's is
prefetched while this one computes) and written back asynchronously as soon as the group
is done; once the step ends the state tensors are dropped from memory. The arithmetic is
the wrapped optimizer's own, group by group, so results are bit-identical to it.
"""
from .swap import TensorSwapper

# Scalar state (Adam's ``step``) stays in memory; every other state tensor is swapped.
SMALL_STATE = 2


class OffloadedOptimizer:
    """Wraps ``optimizer`` (e.g. ``torch.optim.Adam``); swap files go to ``folder``.

    Use it where the optimizer was used: ``step()``, ``zero_grad()``, ``param_groups``.
    Between steps ``optimizer.state`` holds only the small entries; call ``close()`` at
    the end to delete the swap files.
    """

    def __init__(self, optimizer, folder, **handle_args):
        self.optimizer = optimizer
        self.swapper = TensorSwapper(folder, **handle_args)
        self._swapped = {}      # group index -> [(param, name)] of state now on disk

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
            self.swapper.synchronize_reads()
            self._install(index)
            if index + 1 < len(groups):
                self._prefetch(index + 1)
            self._step_group(group)
            self._write_back(index, group)
        self.swapper.synchronize_writes()
        for index in range(len(groups)):
            for param, name in self._swapped.get(index, []):
                del self.optimizer.state[param][name]     # the state leaves memory
        return loss

    def _prefetch(self, index):
        self._incoming = {}
        for param, name in self._swapped.get(index, []):
            self._incoming[param, name] = self.swapper.swap_in(self._key(index, param, name))

    def _install(self, index):
        for (param, name), tensor in self._incoming.items():
            self.optimizer.state[param][name] = tensor
        self._incoming = {}

    def _step_group(self, group):
        everything = self.optimizer.param_groups
        self.optimizer.param_groups = [group]
        try:
            self.optimizer.step()
        finally:
            self.optimizer.param_groups = everything

    def _write_back(self, index, group):
        swapped = []
        for param in group["params"]:
            for name, value in self.optimizer.state.get(param, {}).items():
                if hasattr(value, "numel") and value.numel() >= SMALL_STATE:
                    self.swapper.swap_out(self._key(index, param, name), value)
                    swapped.append((param, name))
        self._swapped[index] = swapped

    def _key(self, index, param, name):
        position = next(i for i, p in enumerate(self.optimizer.param_groups[index]["params"])
                        if p is param)
        return f"group{index}.param{position}.{name}"

    def close(self):
        self.swapper.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()

"""``OffloadedOptimizer``: a torch optimizer whose state lives on disk between steps.

During ``step()`` each parameter group's state is read back into a locked swap buffer
(the next group's is prefetched while this one computes), the wrapped optimizer updates
it in place, and it is written back from the same buffer without a copy while the next
group computes. Three buffers, each the size of the largest group's state, are all the
state memory it needs; between steps the state is only on disk. The arithmetic is the
wrapped optimizer's own, group by group, so results are bit-identical to it.

This module is the ``torch.optim.Optimizer`` face; moving the state (the records of
what is on disk, the swap buffers, the group-by-group cycle, Note [resident state]) is
``offload_state``'s.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import MutableMapping
from typing import Any, Callable

import torch

from .offload_state import OffloadedState, StateOffloading, check_state
from .swap import TensorSwapper


class OffloadedOptimizer(StateOffloading, torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` that keeps ``optimizer``'s state in files in ``folder``.

    Use it wherever ``optimizer`` would be used: ``step(closure)``, ``zero_grad()``,
    ``param_groups`` (LR schedulers read and write it), ``state``, ``state_dict()`` /
    ``load_state_dict()`` (in ``optimizer``'s own format: a checkpoint of an offloaded
    Adam loads into a plain ``torch.optim.Adam`` and the reverse), ``add_param_group()``
    and the hook registrations. Results are bit-identical to ``optimizer``'s.

    Parameters
    ----------
    optimizer : torch.optim.Optimizer
        The optimizer to offload: any whose state is, per parameter, tensors and scalars
        and whose step treats parameter groups independently (Adam, AdamW, SGD, Adagrad,
        RMSprop, ...). Its parameters must be CPU tensors. From now on use only the
        wrapper: the wrapped optimizer's own hooks and ``step`` are not called.
    folder : str or os.PathLike
        Where the swap files go; the optimizer uses a sub-folder of its own there.
    **swapper_args
        Passed to ``TensorSwapper`` (handle settings, ``pack_below``).

    Raises
    ------
    TypeError
        ``optimizer`` is not a torch optimizer, or one whose state cannot be offloaded
        (``LBFGS``); a step that leaves other values than tensors and scalars in a
        parameter's state raises it too (that state then stays in memory).
    ValueError
        A parameter is not a CPU tensor.

    Notes
    -----
    Between steps ``optimizer.state`` holds only the small entries (such as Adam's
    ``step``). ``state[param]`` brings that parameter's state back into memory, where it
    stays, and may be changed, until the next step offloads it again (Note [resident
    state]). ``state_dict()`` reads all the state into new tensors and leaves it
    offloaded. After an exception inside ``step()`` (in the wrapped optimizer or in the
    I/O) nothing is lost: state that was in memory stays there, and the next step goes
    on from it. Call ``close()`` at the end: it deletes the swap files (the state with
    them) and frees the locked buffers.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, folder: Any,
                 **swapper_args: Any) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError("OffloadedOptimizer wraps a torch.optim.Optimizer, got "
                            f"{type(optimizer).__name__}")
        if isinstance(optimizer, OffloadedOptimizer):
            raise TypeError("this optimizer is offloaded already")
        if isinstance(optimizer, torch.optim.LBFGS):
            raise TypeError("LBFGS cannot be offloaded: its state is lists of tensors kept "
                            "for all parameters together, and its step re-evaluates the "
                            "closure across them")
        for index, group in enumerate(optimizer.param_groups):
            _check_parameters(group["params"], index)
        for state in optimizer.state.values():
            for name, value in state.items():
                check_state(optimizer, name, value)
        # What torch.optim.Optimizer.__init__ sets, but the groups and the state are the
        # wrapped optimizer's (properties below), so it is not called.
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()
        self._patch_step_function()
        self._warned_capturable_if_run_uncaptured = True
        self.optimizer = optimizer
        self._inner_step = _unhooked_step(optimizer)
        self.swapper = TensorSwapper(folder, **swapper_args)
        self._closed = False
        self._init_records()
        self._state_view = OffloadedState(self)
        self._snapshot = None   # the state state_dict() sees
        if any(optimizer.state.values()):
            try:
                self._run_groups(None)      # state it had already: offloaded now
            except BaseException:
                self._give_state_back()
                raise

    def _give_state_back(self):
        """After a failed start: the state offloaded so far read back into the wrapped
        optimizer, and the swapper closed."""
        try:
            for param in list(self._records):
                self._bring_in(param)
        finally:
            self.close()

    # -- what torch.optim.Optimizer has -------------------------------------------------
    @property
    def param_groups(self) -> list:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, groups: list) -> None:
        self.optimizer.param_groups = groups

    @property
    def defaults(self) -> dict:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, defaults: dict) -> None:
        self.optimizer.defaults = defaults

    @property
    def state(self) -> MutableMapping:
        """Per-parameter state; reading a parameter's brings it into memory (lazily)."""
        return self._snapshot if self._snapshot is not None else self._state_view

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One step of the wrapped optimizer, group by group with the state swapped in
        and out; returns what ``closure`` returned (evaluated once, with grad enabled)."""
        self._check_open()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._run_groups(self._step_group)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict) -> None:
        """Add a group to the wrapped optimizer; its state is offloaded after its first
        step."""
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        _check_parameters(params, len(self.optimizer.param_groups))
        self.optimizer.add_param_group(param_group)

    def state_dict(self) -> dict:
        """The wrapped optimizer's state dict, with the offloaded state read back into
        new tensors (all of it is in memory until the dict is dropped)."""
        self._check_open()
        self._snapshot = self._read_all()
        try:
            return super().state_dict()
        finally:
            self._snapshot = None

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state dict of this optimizer or of the plain one it wraps, then offload
        the state it holds (copies are written; ``state_dict`` itself is not changed)."""
        self._check_open()
        super().load_state_dict(state_dict)

    def __setstate__(self, state: dict) -> None:
        # torch.optim.Optimizer.load_state_dict ends here with the loaded state and groups.
        if set(state) != {"state", "param_groups"}:
            raise TypeError("an OffloadedOptimizer cannot be unpickled; load a state_dict()")
        self._forget_all()
        self.optimizer.__setstate__(state)
        self._run_groups(None)

    def __getstate__(self) -> dict:
        raise TypeError("an OffloadedOptimizer cannot be pickled or copied; save its "
                        "state_dict() instead")

    def __repr__(self) -> str:
        return f"Offloaded{self.optimizer!r}"

    # -- lifetime -------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Delete the swap files (and the offloaded state with them), free the locked
        buffers and close the swapper's handles. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            for state in self.optimizer.state.values():
                for name, value in list(state.items()):
                    if self._in_buffers(value):     # left by an interrupted step
                        state[name] = value.clone()
        finally:
            self._records, self._leaving, self._arriving = {}, [], None
            self._buffers, self._free = [], []      # the swapper frees them
            self.swapper.close()

    def __enter__(self) -> OffloadedOptimizer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _check_open(self):
        if self._closed:
            raise ValueError("this OffloadedOptimizer is closed")


def _unhooked_step(optimizer):
    """The optimizer's step without torch's hook wrapper: the hooks are the wrapper's,
    and global hooks would otherwise run once per group."""
    step = type(optimizer).step
    if getattr(step, "hooked", False):
        step = step.__wrapped__
    return step.__get__(optimizer)


def _check_parameters(params, group_index):
    for position, param in enumerate(params):
        if not isinstance(param, torch.Tensor):
            raise TypeError(f"parameter {position} of group {group_index} is a "
                            f"{type(param).__name__}, not a tensor")
        if param.device.type != "cpu":
            raise ValueError(f"OffloadedOptimizer keeps state in CPU memory and files; "
                             f"parameter {position} of group {group_index} is on "
                             f"{param.device}")

"""Moving an ``OffloadedOptimizer``'s state between memory and disk, group by group.

``StateOffloading`` is the half of ``OffloadedOptimizer`` (the ``torch.optim.Optimizer``
face, in ``offload``) that keeps the records of which state is on disk, the locked swap
buffers, and the cycle each step runs per parameter group: prefetch the next group's
state, wait for this one's, step it, write it back. ``OffloadedState`` is the optimizer's
``state`` mapping over those records.

Note [resident state]: a parameter's state is either offloaded (its tensors on disk,
named in ``_records``) or resident (its tensors in the wrapped optimizer's ``state``, as
ordinary tensors). State is resident when the optimizer has just made it (a first step,
a new group), when it was loaded (``load_state_dict``), when someone read it through
``state[param]``, or when a step failed while it was in memory. The next step (or load)
uses resident state as it is and offloads it afterwards, so whatever was done to it
counts, exactly as with the plain optimizer.
"""
from __future__ import annotations

import math
from collections.abc import Iterator, MutableMapping
from typing import Any

import torch

from ..units import ALIGNMENT, round_up
from .swap import SwapState

# Tensors with fewer elements (Adam's ``step``) stay in memory; larger ones are swapped.
SMALL_STATE = 2
BUFFERS = 3     # the group stepping, the next one arriving, the previous one leaving
# State values that stay in memory as they are.
SCALARS = (bool, int, float, complex, str, type(None))


class StateOffloading:
    """The state-moving half of ``OffloadedOptimizer``.

    Works on the optimizer's ``optimizer`` (the wrapped one), ``swapper`` and
    ``_check_open``, and on the records that ``_init_records`` sets.
    """

    def _init_records(self):
        # param -> {name: (key, shape, dtype, dims)}: offloaded state, stored contiguous in
        # the order of its dims ``dims`` (``_stored_dims``) with that ``shape``
        self._records = {}
        self._order = {}        # param -> its state's names in the optimizer's order
        self._serials = {}      # param -> number in its swap keys
        self._buffers = []      # every swap buffer
        self._free = []         # buffers holding nothing
        self._leaving = []      # (buffer, [(param, name, key, view)]) being written
        self._arriving = None   # (plan, buffer) being read

    # -- the step, group by group -------------------------------------------------------
    def _run_groups(self, action):
        """Swap each group's state in, run ``action(group)`` (None: nothing), offload it."""
        groups = list(self.optimizer.param_groups)
        plans = [self._plan(group) for group in groups]
        try:
            self._prefetch(plans[0] if plans else [])
            for index, group in enumerate(groups):
                buffer = self._arrive()
                if index + 1 < len(groups):
                    self._prefetch(plans[index + 1])
                if action is not None:
                    action(group)
                # Note [one write-back in flight]: the previous group's writes had this
                # group's step to finish. Waiting for them here, before this group's
                # writes start, keeps the wait from covering writes just started (a
                # handle's wait() takes all), and frees a buffer for the next prefetch.
                self._settle_writes()
                self._leave(group, plans[index], buffer)
            self._settle_writes()
            self._trim_buffers()
        except BaseException:
            self._recover()
            raise

    def _plan(self, group):
        """Where each offloaded state tensor of the group goes in its swap buffer."""
        plan, offset = [], 0
        for param in group["params"]:
            for name, (key, shape, dtype, dims) in self._records.get(param, {}).items():
                plan.append((param, name, key, offset, shape, dtype, dims))
                offset += round_up(math.prod(shape) * dtype.itemsize, ALIGNMENT)
        return plan

    def _prefetch(self, plan):
        if not plan:
            self._arriving = (plan, None)
            return
        buffer = self._take_buffer(_plan_bytes(plan))
        self._arriving = (plan, buffer)
        for param, name, key, offset, shape, dtype, _ in plan:
            self.swapper.swap_in(key, out=_view(buffer, offset, shape, dtype))

    def _arrive(self):
        """Wait for the prefetched group and put its state views in the optimizer."""
        plan, buffer = self._arriving
        self._arriving = None
        if buffer is None:
            return None
        try:
            self.swapper.synchronize_reads()
        except BaseException:
            self._free.append(buffer)
            raise
        arrived = {}
        for param, name, key, offset, shape, dtype, dims in plan:
            arrived.setdefault(param, {})[name] = _restored(
                _view(buffer, offset, shape, dtype), dims)
        for param, views in arrived.items():
            state = self.optimizer.state[param]
            order = self._order.get(param, [])
            merged = {**views, **state}
            self.optimizer.state[param] = {
                **{n: merged[n] for n in order if n in merged}, **merged}
        return buffer

    def _step_group(self, group):
        everything = self.optimizer.param_groups
        self.optimizer.param_groups = [group]
        try:
            self._inner_step()
        finally:
            self.optimizer.param_groups = everything

    def _leave(self, group, plan, buffer):
        """Write the group's state back from a swap buffer: the one it arrived in when
        nothing moved, else a buffer it is copied into; the state then leaves memory."""
        layout, offset = [], 0
        for param in group["params"]:
            state = self.optimizer.state.get(param)
            if not state:
                continue
            for name, value in state.items():
                check_state(self.optimizer, name, value)
                if isinstance(value, torch.Tensor) and value.numel() >= SMALL_STATE:
                    dims = _stored_dims(value)
                    layout.append((param, name, offset, tuple(value.permute(dims).shape),
                                   value.dtype, dims))
                    offset += round_up(value.numel() * value.element_size(), ALIGNMENT)
        for param in group["params"]:           # entries the optimizer dropped
            names = {name for p, name, *_ in layout if p is param}
            for name in [n for n in self._records.get(param, {}) if n not in names]:
                self._forget(param, name)
        if not layout:
            if buffer is not None:
                self._free.append(buffer)
            return
        same = buffer is not None and len(layout) == len(plan) and all(
            p is q and n == m and s == t and d == e and i == j
            and self.optimizer.state[p][n].data_ptr() == buffer.data_ptr() + o
            for (p, n, o, s, d, i), (q, m, _, _, t, e, j) in zip(layout, plan))
        if not same:
            target = self._take_buffer(offset)
            for param, name, at, shape, dtype, dims in layout:
                view = _view(target, at, shape, dtype)
                view.copy_(self.optimizer.state[param][name].permute(dims))
                self.optimizer.state[param][name] = _restored(view, dims)
            if buffer is not None:
                self._free.append(buffer)
            buffer = target
        items = []
        for param, name, at, shape, dtype, _ in layout:
            items.append((param, name, self._key(param, name), _view(buffer, at, shape, dtype)))
        self._leaving.append((buffer, items))
        for (param, name, key, view), (*_, dims) in zip(items, layout):
            self.swapper.swap_out(key, view)
            self._records.setdefault(param, {})[name] = (key, tuple(view.shape), view.dtype,
                                                         dims)
        for param in {id(p): p for p, *_ in items}.values():
            state = self.optimizer.state[param]
            self._order[param] = list(state)
            for name in self._records[param]:
                del state[name]                 # the state leaves memory

    def _settle_writes(self):
        if not self._leaving:
            return
        self.swapper.synchronize_writes()
        self._free.extend(buffer for buffer, _ in self._leaving)
        self._leaving = []

    def _recover(self):
        """After an exception in a step: no I/O left in flight, and every state tensor
        that only a swap buffer holds (being stepped, or written by a write that failed)
        made resident (Note [resident state])."""
        for synchronize in (self.swapper.synchronize_reads, self.swapper.synchronize_writes):
            try:
                synchronize()
            except Exception:
                pass
        for _, items in self._leaving:
            for param, name, key, view in items:
                state = self.optimizer.state[param]
                if name not in state and key in self.swapper and \
                        self.swapper.state(key) is SwapState.FAILED:
                    state[name] = view.clone()
                    self._forget(param, name)
        for param, state in self.optimizer.state.items():
            for name, value in list(state.items()):
                if self._in_buffers(value):
                    state[name] = value.clone()
                    self._forget(param, name)
        self._leaving, self._arriving = [], None
        self._free = list(self._buffers)

    # -- buffers, keys, records ---------------------------------------------------------
    def _take_buffer(self, nbytes):
        fitting = [b for b in self._free if b.numel() >= nbytes]
        if not fitting and self._leaving and len(self._buffers) >= BUFFERS:
            self._settle_writes()
            fitting = [b for b in self._free if b.numel() >= nbytes]
        if fitting:
            buffer = min(fitting, key=lambda b: b.numel())
            self._free = [b for b in self._free if b is not buffer]
            return buffer
        if len(self._buffers) >= BUFFERS and self._free:
            # The groups grew (a first step): swap the smallest buffer for a larger one.
            self._drop_buffer(min(self._free, key=lambda b: b.numel()))
        buffer = self.swapper.new_locked_tensor(nbytes)
        self._buffers.append(buffer)
        return buffer

    def _trim_buffers(self):
        """Back to BUFFERS buffers after a step that needed more (state grew mid-step)."""
        while len(self._buffers) > BUFFERS and self._free:
            self._drop_buffer(min(self._free, key=lambda b: b.numel()))

    def _drop_buffer(self, buffer):
        self._free = [b for b in self._free if b is not buffer]
        self._buffers = [b for b in self._buffers if b is not buffer]
        self.swapper.free_locked_tensor(buffer)

    def _in_buffers(self, value):
        if not isinstance(value, torch.Tensor) or value.device.type != "cpu":
            return False
        storage = value.untyped_storage().data_ptr()
        return any(storage == b.untyped_storage().data_ptr() for b in self._buffers)

    def _key(self, param, name):
        serial = self._serials.setdefault(param, len(self._serials))
        return f"param{serial}.{name}"

    def _forget(self, param, name):
        """The parameter's ``name`` is resident now: drop its swap file."""
        record = self._records.get(param, {}).pop(name, None)
        if record is not None and record[0] in self.swapper:
            self.swapper.release(record[0])
        if param in self._records and not self._records[param]:
            del self._records[param]

    def _forget_all(self):
        for param in list(self._records):
            for name in list(self._records[param]):
                self._forget(param, name)

    def _bring_in(self, param):
        """Read ``param``'s offloaded state into new tensors; it is resident from now."""
        self._check_open()
        records = self._records.get(param)
        if not records:
            return
        state = self.optimizer.state[param]
        read = {name: _restored(self.swapper.swap_in(key, async_op=False), dims)
                for name, (key, _, _, dims) in records.items()}
        merged = {**read, **state}
        order = self._order.get(param, [])
        self.optimizer.state[param] = {**{n: merged[n] for n in order if n in merged},
                                       **merged}
        for name in read:
            self._forget(param, name)

    def _read_all(self):
        """Every parameter's state, the offloaded tensors read into new ones."""
        snapshot = {}
        pending = {}
        for param, state in self.optimizer.state.items():
            records = self._records.get(param, {})
            pending[param] = {name: (self.swapper.swap_in(key), dims)
                              for name, (key, _, _, dims) in records.items()}
            snapshot[param] = state
        if pending:
            self.swapper.synchronize_reads()
        for param, state in snapshot.items():
            read = {name: _restored(tensor, dims) for name, (tensor, dims) in pending[param].items()}
            merged = {**read, **state}
            order = self._order.get(param, [])
            snapshot[param] = {**{n: merged[n] for n in order if n in merged}, **merged}
        return snapshot


class OffloadedState(MutableMapping):
    """An ``OffloadedOptimizer``'s ``state``: parameter -> its state dict.

    Reading a parameter's entry brings its offloaded tensors back into memory, where they
    stay (and may be changed) until the next step offloads them again.
    """

    def __init__(self, owner: StateOffloading) -> None:
        self._owner = owner

    def __getitem__(self, param: torch.Tensor) -> dict:
        self._owner._bring_in(param)
        return self._owner.optimizer.state[param]

    def __setitem__(self, param: torch.Tensor, value: dict) -> None:
        self._owner._check_open()
        for name in list(self._owner._records.get(param, {})):
            self._owner._forget(param, name)
        self._owner.optimizer.state[param] = value

    def __delitem__(self, param: torch.Tensor) -> None:
        self._owner._check_open()
        for name in list(self._owner._records.get(param, {})):
            self._owner._forget(param, name)
        del self._owner.optimizer.state[param]

    def __contains__(self, param: object) -> bool:
        return param in self._owner.optimizer.state

    def get(self, param: torch.Tensor, default: Any = None) -> Any:
        return self[param] if param in self else default  # noqa: SIM401 (a Mapping's get)

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(list(self._owner.optimizer.state))

    def __len__(self) -> int:
        return len(self._owner.optimizer.state)

    def offloaded(self, param: torch.Tensor) -> list:
        """The names of ``param``'s state entries that are on disk now (not resident)."""
        return list(self._owner._records.get(param, {}))

    def __repr__(self) -> str:
        return (f"<OffloadedState of {len(self)} parameters, "
                f"{len(self._owner._records)} offloaded>")


def check_state(optimizer, name, value):
    """TypeError unless ``value``, the state ``name`` of a parameter, can be offloaded
    (a dense CPU tensor) or kept in memory as it is (a scalar)."""
    if isinstance(value, torch.Tensor):
        if value.device.type != "cpu" or value.layout != torch.strided:
            raise TypeError(f"{type(optimizer).__name__} keeps state {name!r} as a "
                            f"{value.layout} tensor on {value.device}; OffloadedOptimizer "
                            "offloads dense CPU tensors. That state stays in memory.")
    elif not isinstance(value, SCALARS):
        raise TypeError(
            f"{type(optimizer).__name__} keeps a {type(value).__name__} as state {name!r} "
            "of a parameter; OffloadedOptimizer offloads only tensors (and keeps scalars "
            "in memory). That state stays in memory.")


def _plan_bytes(plan):
    _, _, _, offset, shape, dtype, _ = plan[-1]
    return offset + math.prod(shape) * dtype.itemsize


def _view(buffer, offset, shape, dtype):
    nbytes = math.prod(shape) * dtype.itemsize
    return buffer[offset:offset + nbytes].view(dtype).reshape(shape)


def _stored_dims(tensor):
    """The order of ``tensor``'s dims in memory, outermost first: the state of a
    channels_last or transposed parameter is made in its layout, and a fused optimizer
    walks its memory in order, so it is stored contiguous in that order and comes back
    in its layout (``_restored``). The identity for a contiguous or a not dense tensor."""
    dims = tuple(sorted(range(tensor.dim()), key=lambda d: -tensor.stride(d)))
    return dims if tensor.permute(dims).is_contiguous() else tuple(range(tensor.dim()))


def _restored(stored, dims):
    """A tensor stored with ``_stored_dims`` ``dims``, in its own shape and layout."""
    return stored.permute(sorted(range(len(dims)), key=lambda d: dims[d]))

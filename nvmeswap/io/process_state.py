"""The state every handle of a process shares, in one fork-safe place.

Note [process state]
Some state belongs to the process, not to a handle: the memfd arenas (Note [memfd
arenas]), the locked set (Note [process-wide locked memory]), the writes in flight
(Note [shared growth]) and the numbering of regions. Each is made on first use by
``shared(kind)``. A forked child starts with none of its parent's (it must never use the
parent's memfds or workers), and the lock that guards them is made afresh in the child,
so a fork while another thread held it cannot leave the child stuck. Objects that hold
such state of their own (a Checkpointer's locks, its queue) ask, by ``forget_in_child``,
to be told in a child: it starts them afresh too.
"""
import itertools
import os
import threading
import weakref

_instances = {}
_lock = threading.Lock()
# Host and device regions share one numbering: a worker's UNMAP names either. (A forked
# child going on with its parent's count is harmless: ids stay unique in each process.)
region_ids = itertools.count(1)
#: This process's id, kept by the fork hook below: every call of a handle checks it, and
#: os.getpid() is a system call.
pid = os.getpid()


def shared(kind):
    """The process's one ``kind()``, made on first use."""
    made = _instances.get(kind)
    if made is None:
        with _lock:
            made = _instances.get(kind)
            if made is None:
                made = _instances[kind] = kind()
    return made


#: What ``forget_in_child`` registered, held weakly.
_forgetting = weakref.WeakSet()


def forget_in_child(holder):
    """Call ``holder.forget_parent()`` in every forked child of this process while
    ``holder`` lives: it leaves to the parent what is the parent's (its locks, threads,
    queues), in the child, before any other code runs there."""
    _forgetting.add(holder)


def _forget_in_child():
    global _lock, pid
    pid = os.getpid()
    _lock = threading.Lock()
    _instances.clear()
    for holder in list(_forgetting):
        holder.forget_parent()


os.register_at_fork(after_in_child=_forget_in_child)

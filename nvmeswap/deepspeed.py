"""DeepSpeed on nvmeswap: op builders that need no compiler, and the switch that routes
DeepSpeed's own code to them.

``AsyncIOBuilder().load()``, ``GDSBuilder().load()`` and ``PinMemoryBuilder().load()``
give what DeepSpeed's compiled ``async_io``, ``gds`` and ``pin_memory`` modules give.
``install()`` (or ``NVMESWAP_DEEPSPEED=1`` with the startup file, see
``write_startup_file``) makes every DeepSpeed import site of those builders use them:

    import nvmeswap.deepspeed
    nvmeswap.deepspeed.install()        # before or after importing deepspeed

Note [routing DeepSpeed]: DeepSpeed binds the builders at import time in many modules
(``from deepspeed.ops.op_builder import AsyncIOBuilder`` in its swappers, checkpoint
writer, ds_io engines ...), and looks some up by name later (``PinMemoryBuilder`` in
deepspeed/utils/pin_memory.py, the accelerator's ``get_op_builder``). So routing
replaces the binding in every loaded ``deepspeed.*`` module that imported a builder
(never in the module that defines it), routes each accelerator class's
``get_op_builder``/``create_op_builder`` (the CUDA accelerator's table holds the
defining modules' classes), and a finder on ``sys.meta_path`` does the same for each
``deepspeed.*`` module loaded afterwards. ``uninstall()`` puts DeepSpeed's
classes back everywhere.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import os
import site
import sys
import threading
import types
from typing import Any

from .aio import aio_handle
from .environment import switch
from .gds import gds_handle
from .gpu.discovery import gds_available
from .io.reaper import reaper
from .io.regions import locked_memory
from .locked_tensors import free_locked_tensor, is_locked, new_locked_tensor

ENVIRONMENT_SWITCH = "NVMESWAP_DEEPSPEED"
STARTUP_FILE = "nvmeswap-deepspeed.pth"
# One line, run by `site` at every interpreter start (spawned workers included): cheap
# when the switch is off, and never fatal to the interpreter when it is on.
STARTUP_LINE = (
    "import os; os.environ.get('NVMESWAP_DEEPSPEED', '').strip().lower() not in "
    "('', '0', 'false', 'no', 'off') and __import__('nvmeswap.deepspeed')"
    ".deepspeed._install_at_startup()\n")


# -- the loaded op modules ---------------------------------------------------------------
def aio_read(buffer: Any, filename: str, block_size: int, queue_depth: int,
             single_submit: bool, overlap_events: bool, validate: bool) -> int:
    """DeepSpeed's ``aio_read``: a blocking read of ``buffer``'s size from ``filename``
    with a handle of these settings; returns 0. Errors are exceptions, never -1."""
    with aio_handle(block_size, queue_depth, single_submit, overlap_events, 1) as handle:
        handle.read(buffer, filename, validate)
    return 0


def aio_write(buffer: Any, filename: str, block_size: int, queue_depth: int,
              single_submit: bool, overlap_events: bool, validate: bool) -> int:
    """DeepSpeed's ``aio_write``: a blocking write of ``buffer`` to ``filename``; returns 0."""
    with aio_handle(block_size, queue_depth, single_submit, overlap_events, 1) as handle:
        handle.write(buffer, filename, validate)
    return 0


def deepspeed_memcpy(dest: Any, src: Any) -> int:
    """DeepSpeed's ``deepspeed_memcpy``: copy ``src`` into ``dest``; returns 0."""
    dest.copy_(src)
    return 0


class pin_handle:
    """DeepSpeed's ``pin_memory`` op handle over the process-wide locked set: its tensors
    are pinned (and zero-copy) for every ``aio_handle``, and it recognises theirs.

    The handle is one user of the set (Note [process-wide locked memory] in
    io/regions.py): while it lives, the set outlives every ``aio_handle``.
    """

    def __init__(self) -> None:
        self._reaper = reaper()
        self._locked = locked_memory().join()

    def new_cpu_locked_tensor(self, num_elem: int, example_tensor: Any) -> Any:
        """A 1-D page-locked tensor of ``num_elem`` elements of ``example_tensor``'s dtype."""
        tensor, _ = new_locked_tensor(self._locked, num_elem, example_tensor)
        return tensor

    def free_cpu_locked_tensor(self, locked_tensor: Any) -> bool:
        """Take a locked tensor (made by any handle) out of the set; False if not in it."""
        return free_locked_tensor(self._locked, locked_tensor)

    def free_cpu_locked_tensor_by_ptr(self, address: int) -> bool:
        """Take out the locked allocation that begins at ``address``; False if none does."""
        return free_locked_tensor(self._locked, None, address=int(address))

    def is_pinned(self, buffer: Any) -> bool:
        """True for tensors in the process's locked set (or pinned by torch)."""
        return is_locked(self._locked, buffer)

    def __del__(self) -> None:
        locked = getattr(self, "_locked", None)
        if locked is not None and locked.memory.creator_pid == os.getpid():
            # Leaving takes the set's lock: not here (Note [releasing dropped handles]).
            self._reaper.call(_leave, locked)


def _leave(locked: Any) -> None:
    for region in locked.drain():
        region.close()


class _OpBuilder:
    """What DeepSpeed asks of a builder before ``load()``; nothing is ever compiled."""

    NAME = ""
    BUILD_VAR = ""

    def __init__(self) -> None:
        self.name = self.NAME

    def absolute_name(self) -> str:
        return f"nvmeswap.deepspeed.{self.NAME}"

    def is_compatible(self, verbose: bool = False) -> bool:
        return True

    def builder(self) -> None:
        raise RuntimeError(f"nvmeswap's {self.NAME} op is not built; load() it instead")

    def jit_load(self, verbose: bool = True) -> types.SimpleNamespace:
        return self.load(verbose)

    def load(self, verbose: bool = True) -> types.SimpleNamespace:
        raise NotImplementedError


class AsyncIOBuilder(_OpBuilder):
    """Stands in for ``deepspeed.ops.op_builder.AsyncIOBuilder``.

    ``load()`` returns what DeepSpeed's compiled ``async_io`` module holds:
    ``aio_handle``, ``aio_read``, ``aio_write`` and ``deepspeed_memcpy``.
    """

    NAME = "async_io"
    BUILD_VAR = "DS_BUILD_AIO"

    def load(self, verbose: bool = True) -> types.SimpleNamespace:
        return types.SimpleNamespace(aio_handle=aio_handle, aio_read=aio_read,
                                     aio_write=aio_write, deepspeed_memcpy=deepspeed_memcpy)


class GDSBuilder(_OpBuilder):
    """Stands in for ``deepspeed.ops.op_builder.GDSBuilder``.

    ``is_compatible()`` says whether cuFile loads here; ``load().gds_handle`` works
    either way (without cuFile it moves CUDA tensors as aio_handle does, with a warning).
    """

    NAME = "gds"
    BUILD_VAR = "DS_BUILD_GDS"

    def is_compatible(self, verbose: bool = False) -> bool:
        return gds_available()

    def load(self, verbose: bool = True) -> types.SimpleNamespace:
        return types.SimpleNamespace(gds_handle=gds_handle, aio_handle=aio_handle)


class PinMemoryBuilder(_OpBuilder):
    """Stands in for ``deepspeed.ops.op_builder.PinMemoryBuilder`` (the allocator behind
    ``DS_PIN_MEMORY_BACKEND=native``): ``load().pin_handle()`` allocates from, and
    recognises, the same process-wide locked set as every ``aio_handle``."""

    NAME = "pin_memory"
    BUILD_VAR = "DS_BUILD_PIN_MEMORY"

    def load(self, verbose: bool = True) -> types.SimpleNamespace:
        return types.SimpleNamespace(pin_handle=pin_handle)


_BUILDERS = {"AsyncIOBuilder": AsyncIOBuilder, "GDSBuilder": GDSBuilder,
             "PinMemoryBuilder": PinMemoryBuilder}


# -- routing (Note [routing DeepSpeed]) --------------------------------------------------
_lock = threading.RLock()
_installed = False
_originals: dict[str, type] = {}        # builder name -> DeepSpeed's class, as first seen
_compatible_before: dict[str, Any] = {}


def _is_deepspeed(name: str) -> bool:
    return name == "deepspeed" or name.startswith("deepspeed.")


def _route_module(module: types.ModuleType) -> None:
    """Bind nvmeswap's builders where ``module`` imported DeepSpeed's."""
    namespace = getattr(module, "__dict__", {})
    for name, ours in _BUILDERS.items():
        theirs = namespace.get(name)
        if isinstance(theirs, type) and theirs is not ours \
                and theirs.__module__ != module.__name__:
            _originals.setdefault(name, theirs)
            setattr(module, name, ours)
    if module.__name__ == "deepspeed.ops":
        _route_compatible_ops(module)
    if module.__name__.startswith("deepspeed.accelerator."):
        for value in list(namespace.values()):
            if isinstance(value, type) and value.__module__ == module.__name__:
                _route_accelerator(value)


def _route_accelerator(accelerator: type) -> None:
    """An accelerator finds builders in a table of the classes that DeepSpeed's op
    modules define (CUDA's), or by importing them (the CPU's): its ``get_op_builder``
    and ``create_op_builder`` answer with ours for the builders nvmeswap provides."""
    for method in ("get_op_builder", "create_op_builder"):
        original = accelerator.__dict__.get(method)
        if original is None or getattr(original, "_nvmeswap", False):
            continue

        def routed(self, class_name, _original=original, _make=method == "create_op_builder"):
            ours = _BUILDERS.get(class_name)
            if ours is None:
                return _original(self, class_name)
            return ours() if _make else ours

        routed._nvmeswap = True
        routed._original = original
        setattr(accelerator, method, routed)


def _unroute_accelerator(accelerator: type) -> None:
    for method in ("get_op_builder", "create_op_builder"):
        routed = accelerator.__dict__.get(method)
        if getattr(routed, "_nvmeswap", False):
            setattr(accelerator, method, routed._original)


def _route_compatible_ops(ops: types.ModuleType) -> None:
    """``deepspeed.ops.__compatible_ops__`` (computed lazily by DeepSpeed) says our ops
    are usable: DeepSpeed's tests and ds_report consult it."""
    compatible = ops.__dict__.get("__compatible_ops__")
    if compatible is None:
        probe = ops.__dict__.get("__getattr__")
        if probe is None or getattr(probe, "_nvmeswap", False):
            return

        def __getattr__(name, _probe=probe):
            value = _probe(name)
            if name == "__compatible_ops__":
                _mark_compatible(value)
            return value

        __getattr__._nvmeswap = True
        __getattr__._original = probe
        ops.__getattr__ = __getattr__
        return
    _mark_compatible(compatible)


def _mark_compatible(compatible: dict) -> None:
    for builder in _BUILDERS.values():
        if builder.NAME not in _compatible_before:
            _compatible_before[builder.NAME] = compatible.get(builder.NAME, _MISSING)
        compatible[builder.NAME] = builder().is_compatible()


_MISSING = object()


def _unroute_module(module: types.ModuleType) -> None:
    namespace = getattr(module, "__dict__", {})
    for name, ours in _BUILDERS.items():
        if namespace.get(name) is ours and name in _originals:
            setattr(module, name, _originals[name])
    if module.__name__.startswith("deepspeed.accelerator."):
        for value in list(namespace.values()):
            if isinstance(value, type) and value.__module__ == module.__name__:
                _unroute_accelerator(value)
    if module.__name__ == "deepspeed.ops":
        probe = namespace.get("__getattr__")
        if getattr(probe, "_nvmeswap", False):
            module.__getattr__ = probe._original
        compatible = namespace.get("__compatible_ops__")
        if compatible is not None:
            for op, before in _compatible_before.items():
                if before is _MISSING:
                    compatible.pop(op, None)
                else:
                    compatible[op] = before
        _compatible_before.clear()


class _RoutingLoader(importlib.abc.Loader):
    """Runs the real loader, then routes the module it made."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        with _lock:
            if _installed:
                _route_module(module)

    def __getattr__(self, name):     # get_resource_reader, is_package, get_code, ...
        return getattr(self._loader, name)


class _RoutingFinder(importlib.abc.MetaPathFinder):
    """Finds ``deepspeed.*`` modules with the other finders and wraps their loaders."""

    _busy = threading.local()

    def find_spec(self, fullname, path, target=None):
        if not _is_deepspeed(fullname) or getattr(self._busy, "active", False):
            return None
        self._busy.active = True
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
            else:
                return None
        finally:
            self._busy.active = False
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _RoutingLoader(spec.loader)
        return spec


_finder = _RoutingFinder()


def install() -> None:
    """Route every DeepSpeed import site of ``AsyncIOBuilder``, ``GDSBuilder`` and
    ``PinMemoryBuilder`` to nvmeswap, in this process: modules loaded already and those
    loaded later. Idempotent; ``uninstall()`` undoes it.

    Other processes of a job follow when they start with ``NVMESWAP_DEEPSPEED=1`` and
    the startup file is in place (``write_startup_file``).
    """
    global _installed
    with _lock:
        if _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)
        _installed = True
        for name, module in list(sys.modules.items()):
            if module is not None and _is_deepspeed(name):
                _route_module(module)


def uninstall() -> None:
    """Put DeepSpeed's own builders back everywhere ``install()`` routed them. Idempotent."""
    global _installed
    with _lock:
        _installed = False
        while _finder in sys.meta_path:
            sys.meta_path.remove(_finder)
        for name, module in list(sys.modules.items()):
            if module is not None and _is_deepspeed(name):
                _unroute_module(module)


def installed() -> bool:
    """Whether ``install()`` is in effect in this process."""
    return _installed


def _install_at_startup() -> None:
    """The startup file's call: never lets a routing problem (a value of the switch it
    does not know, say) stop the interpreter."""
    try:
        if switched_on():
            install()
    except Exception as error:
        print(f"nvmeswap: {ENVIRONMENT_SWITCH} is set but routing DeepSpeed failed: "
              f"{error!r}", file=sys.stderr)


def switched_on() -> bool:
    """Whether ``NVMESWAP_DEEPSPEED`` asks for the routing (ValueError for a value it
    does not take)."""
    return switch(ENVIRONMENT_SWITCH) is True


def startup_file(site_dir: str | None = None) -> str:
    """Where the startup file goes: ``site_dir``, or this interpreter's site-packages."""
    if site_dir is None:
        site_dir = site.getsitepackages()[0] if site.getsitepackages() else \
            site.getusersitepackages()
    return os.path.join(site_dir, STARTUP_FILE)


def write_startup_file(site_dir: str | None = None) -> str:
    """Write the one-line ``.pth`` file that applies ``NVMESWAP_DEEPSPEED=1`` in every
    Python process started from this interpreter (launchers' and spawned workers
    included); returns its path. With the variable unset it does nothing."""
    path = startup_file(site_dir)
    with open(path, "w") as out:
        out.write(STARTUP_LINE)
    return path


def deepspeed_status() -> str:
    """One line for ``nvmeswap report``: is DeepSpeed installed, and is it switched over."""
    spec = importlib.util.find_spec("deepspeed") if "deepspeed" not in sys.modules else True
    if spec is None:
        return "DeepSpeed: not installed"
    try:
        from importlib.metadata import version
        release = version("deepspeed")
    except Exception:
        release = "unknown version"
    startup = os.path.exists(startup_file())
    try:
        asked = switched_on()
    except ValueError as error:
        return f"DeepSpeed {release}: not switched: {error}"
    if _installed:
        state = "routed to nvmeswap in this process"
    elif asked:
        state = (f"{ENVIRONMENT_SWITCH} is set" + ("" if startup else
                 ", but the startup file is missing: run python -m nvmeswap.deepspeed "
                 "--write-startup-file"))
    else:
        state = f"not switched (set {ENVIRONMENT_SWITCH}=1 or call nvmeswap.deepspeed.install())"
    return (f"DeepSpeed {release}: {state}; startup file "
            f"{'present' if startup else 'absent'}")


def main(argv: list[str] | None = None) -> int:
    """``python -m nvmeswap.deepspeed [--write-startup-file [DIR]]``: status, or write the
    startup file."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--write-startup-file"]:
        print(write_startup_file(argv[1] if len(argv) > 1 else None))
    elif argv:
        print("usage: python -m nvmeswap.deepspeed [--write-startup-file [SITE_DIR]]",
              file=sys.stderr)
        return 2
    else:
        print(deepspeed_status())
    return 0


if __name__ == "__main__":
    sys.exit(main())

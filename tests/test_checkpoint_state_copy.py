"""Note [snapshot in the background]: a background save copies the state's containers
in the caller and lays the archive out on the saving thread; what the caller changes in
the containers after the call is not saved, and the file is the one the state at the
call makes."""
import collections
import copy
import fractions
import io
import pickle
import threading
import zipfile
from unittest import mock

import pytest

torch = pytest.importorskip("torch", reason="needs torch (pip install torch)")

from test_checkpoint import assert_same, mixed_state, trained_state

import nvmeswap
import nvmeswap.checkpoint.checkpointer as checkpointer_module
from nvmeswap.checkpoint import saved_tensors
from nvmeswap.checkpoint.image import StreamWriter
from nvmeswap.checkpoint.state import state_copy


def torch_pickle(obj):
    """The bytes torch's pickler makes of ``obj``, storages by reference as torch.save's."""
    buffer = io.BytesIO()
    torch.save(obj, buffer, _use_new_zipfile_serialization=False)
    return buffer.getvalue()


def shared_and_cyclic():
    shared = [torch.arange(6), {"k": (1, 2.5, None)}]
    state = collections.OrderedDict(a=shared, b=shared, key={(1, "x"): torch.ones(2)})
    state.extra = {"version": 2}
    state["self"] = state
    view = torch.arange(10.0)
    state["views"] = (view[2:5], view, view.view(2, 5).t())
    state["grad"] = [torch.ones(3, requires_grad=True), torch.zeros(2, requires_grad=True)]
    state["kinds"] = [torch.float16, torch.device("cpu"), torch.Size([2, 3]), b"\x00", 1j,
                      torch.sparse_coo, True]
    return state


@pytest.mark.parametrize("aliases", [False, True], ids=["tensors", "aliases"])
@pytest.mark.parametrize("make", [trained_state, shared_and_cyclic, mixed_state])
def test_a_copy_pickles_to_the_bytes_of_the_state(make, aliases):
    """The copy is new containers around the same tensors (or their aliases: Note
    [packed snapshot]) and values: pickled (tensors and all) it makes the state's very
    bytes, shared and self-holding containers, views and parameters too."""
    state = make()
    copied, tensors = state_copy(state, aliases=aliases)
    assert copied is not state
    assert torch_pickle(copied) == torch_pickle(state)
    assert pickle.dumps(copied, protocol=2) == pickle.dumps(state, protocol=2)
    named = dict(tensors)
    assert len(named) == len(tensors)           # each tensor once, however often held
    assert {id(t) for t in named.values()} == \
        {id(t) for t in _all_tensors(state)}


def _all_tensors(obj, seen=None):
    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):
        return [obj]
    if id(obj) in seen or not isinstance(obj, (dict, list, tuple)):
        return []
    seen.add(id(obj))
    values = list(obj.values()) + list(getattr(obj, "__dict__", {}).values()) \
        if isinstance(obj, dict) else list(obj)
    return [t for value in values for t in _all_tensors(value, seen)]


def test_the_copy_does_not_follow_the_state():
    state = trained_state()
    copied, _ = state_copy(state)
    before = torch_pickle(state)
    state["epoch"] = 4
    state["model"]["0.weight"] = torch.zeros(1)
    state["optimizer"]["param_groups"][0]["lr"] = 0.5
    state["model"]._metadata[""]["version"] = 99
    assert torch_pickle(copied) == before


class Opaque:
    """An object a copy of containers cannot vouch for."""

    def __init__(self, value):
        self.value = value


class Tagged(torch.Tensor):
    pass


@pytest.mark.parametrize("held", [
    Opaque(1), fractions.Fraction(1, 3), collections.defaultdict(list, a=[1]),
    collections.namedtuple("Point", "x y")(1, 2), {1, 2}, torch.ones(3).to_sparse(),
    torch.ones(2, dtype=torch.complex64).conj(), torch.ones(2).as_subclass(Tagged),
    {Opaque(2): 1},
], ids=["object", "fraction", "defaultdict", "namedtuple", "set", "sparse", "conj",
        "subclass", "object-key"])
def test_states_holding_anything_else_are_not_copied(held):
    assert state_copy({"w": torch.ones(4), "held": [held]}) is None


def test_a_tensor_with_attributes_or_a_tuple_holding_itself_is_not_copied():
    tagged = torch.ones(3)
    tagged.note = "kept by pickle"
    assert state_copy({"t": tagged}) is None
    loop = []
    holder = (loop,)
    loop.append(holder)
    assert state_copy({"t": holder}) is None


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
@pytest.mark.parametrize("background", [False, True])
def test_an_async_save_of_a_nested_tensor_lays_it_out_as_torch_does(tmp_path, background):
    """A nested tensor's layout is strided too, but its bytes are no storage of its own
    shape: it is not copied as a plain tensor, and saves as the synchronous form does."""
    nested = torch.nested.nested_tensor([torch.arange(2.0), torch.arange(3.0)])
    state = {"nt": nested, "w": torch.arange(5)}
    assert state_copy(state) is None
    nvmeswap.async_save(state, tmp_path / "nested.pt",
                        background_snapshot=background).result(60)
    loaded = torch.load(tmp_path / "nested.pt")
    assert all(torch.equal(a, b) for a, b in zip(loaded["nt"].unbind(), nested.unbind()))
    assert torch.equal(loaded["w"], state["w"])


def _layouts_on(monkeypatch, go=None):
    """The names of the threads each layout of an async save ran on; each waits for
    ``go``, if given."""
    threads = []
    original = checkpointer_module.layout

    def recorded(obj, *args, **kwargs):
        threads.append(threading.current_thread().name)
        assert go is None or go.wait(60), "the test never let the layout run"
        return original(obj, *args, **kwargs)

    monkeypatch.setattr(checkpointer_module, "layout", recorded)
    return threads


def test_a_background_save_lays_out_on_the_saving_thread(tmp_path, monkeypatch):
    """A state of containers and tensors is laid out off the caller's thread; a state
    holding another object in the caller's (its pickle may fail or change: the error
    comes at the call)."""
    threads = _layouts_on(monkeypatch)
    state = trained_state()
    nvmeswap.async_save(state, tmp_path / "plain.pt", background_snapshot=True).result(60)
    assert threads == ["nvmeswap-async-save"]
    assert_same(state, torch.load(tmp_path / "plain.pt"))
    state["fraction"] = fractions.Fraction(1, 3)
    nvmeswap.async_save(state, tmp_path / "other.pt", background_snapshot=True).result(60)
    assert threads == ["nvmeswap-async-save", threading.current_thread().name]
    assert torch.load(tmp_path / "other.pt", weights_only=False)["fraction"] == \
        fractions.Fraction(1, 3)
    state["unpicklable"] = lambda: None
    with pytest.raises((pickle.PicklingError, AttributeError)):
        nvmeswap.async_save(state, tmp_path / "bad.pt", background_snapshot=True)
    del state["unpicklable"], state["fraction"]
    # What torch.save refuses in a state of tensors alone is refused at the call too.
    weights = torch.ones(4)
    state["views"] = [weights, weights.view(torch.int32)]
    with pytest.raises(RuntimeError, match="view the same data as different types"):
        nvmeswap.async_save(state, tmp_path / "bad.pt", background_snapshot=True)
    assert not (tmp_path / "bad.pt").exists()
    assert threads[2:] == [threading.current_thread().name] * 2


def assert_saved_as_at_the_call(path, at_the_call):
    """``path`` is byte for byte what a synchronous save of ``at_the_call`` writes."""
    nvmeswap.save(at_the_call, path.with_name("sync.pt"))
    assert path.read_bytes() == path.with_name("sync.pt").read_bytes()
    assert_same(at_the_call, torch.load(path))


def test_containers_changed_after_the_call_are_saved_as_they_were(tmp_path, monkeypatch):
    """The caller changes the state's containers (not its tensors) before the snapshot
    is taken, as a training loop may: the file is byte for byte the one a save of the
    state at the call writes."""
    state = trained_state()
    at_the_call = copy.deepcopy(state)
    go = threading.Event()
    threads = _layouts_on(monkeypatch, go)      # the layout runs after the changes
    with nvmeswap.Checkpointer() as checkpointer:
        future = checkpointer.async_save(state, tmp_path / "bg.pt", background_snapshot=True)
        state["epoch"] = 4
        state["optimizer"]["param_groups"][0]["lr"] = 0.5
        state["model"]["0.weight"] = torch.zeros(1)
        del state["model"]["1.running_mean"]
        state["model"]._metadata[""]["version"] = 99
        state["rng"] = torch.get_rng_state()[:10]
        go.set()
        assert future.result(60) is None
    assert threads == ["nvmeswap-async-save"]
    assert_saved_as_at_the_call(tmp_path / "bg.pt", at_the_call)


def test_a_layout_leaves_torch_settings_alone(tmp_path):
    """The layout's 4096-byte alignment is its own writer's: torch's process-wide
    setting, which another thread's torch.save reads, is not changed meanwhile."""
    from torch.utils.serialization import config

    seen = []

    class Spy:
        def __reduce__(self):
            seen.append(config.save.storage_alignment)
            return (int, (5,))

    nvmeswap.save({"spy": Spy(), "t": torch.arange(100)}, tmp_path / "spied.pt")
    assert seen == [config.save.storage_alignment] == [64]
    loaded = torch.load(tmp_path / "spied.pt", weights_only=False)
    assert loaded["spy"] == 5 and torch.equal(loaded["t"], torch.arange(100))
    with zipfile.ZipFile(tmp_path / "spied.pt") as archive:
        names = {name.split("/", 1)[1]: name for name in archive.namelist()}
        assert archive.read(names[".storage_alignment"]) == b"4096"
        header = archive.getinfo(names["data/0"]).header_offset
    with open(tmp_path / "spied.pt", "rb") as file:
        file.seek(header + 26)          # the local header's name and extra lengths
        name_length, extra_length = (int.from_bytes(file.read(2), "little") for _ in range(2))
    assert (header + 30 + name_length + extra_length) % 4096 == 0     # where data/0 begins


@pytest.mark.parametrize("enabled", [True, False])
def test_a_layout_leaves_the_garbage_collector_as_it_found_it(tmp_path, enabled):
    """Note [laying out many tensors]: collection is paused while a layout and the
    write after it run, and on (or off) again after, whether they succeeded or failed."""
    import gc

    seen = []

    class Spy:
        def __reduce__(self):
            seen.append(gc.isenabled())
            return (int, (5,))

    planned = StreamWriter._plan

    def plan(image):
        seen.append(gc.isenabled())
        return planned(image)

    (gc.enable if enabled else gc.disable)()
    try:
        with mock.patch.object(StreamWriter, "_plan", staticmethod(plan)):
            nvmeswap.save({"spy": Spy(), "t": torch.arange(10)}, tmp_path / "spied.pt")
        assert seen == [False, False] and gc.isenabled() is enabled
        with pytest.raises((pickle.PicklingError, AttributeError)):
            nvmeswap.save({"bad": lambda: None}, tmp_path / "bad.pt")
        assert gc.isenabled() is enabled
    finally:
        gc.enable()


@pytest.mark.parametrize("enabled", [True, False])
@pytest.mark.parametrize("call", ["load", "load_into"])
def test_a_load_leaves_the_garbage_collector_as_it_found_it(tmp_path, enabled, call):
    """Collection is paused while a load makes its objects too (Note [laying out many
    tensors]), and as it was after, whether the load succeeded or failed."""
    import gc

    path = tmp_path / "state.pt"
    state = {"t": torch.arange(10.0), "u": torch.ones(3)}
    nvmeswap.save(state, path)
    # what the pickle names, as each road resolves it
    found = (saved_tensors._globals(stand_ins=True) if call == "load_into"
             else saved_tensors._globals_without_fake_mode())
    rebuild = found["torch._utils", "_rebuild_tensor_v2"]
    seen = []

    def spied(*args):
        seen.append(gc.isenabled())
        return rebuild(*args)

    into = {"t": torch.zeros(10), "u": torch.zeros(3)}
    (gc.enable if enabled else gc.disable)()
    try:
        with mock.patch.dict(found, {("torch._utils", "_rebuild_tensor_v2"): spied}):
            if call == "load":
                assert_same(state, nvmeswap.load(path))
            else:
                assert_same(state, nvmeswap.load_into(path, into))
        assert seen == [False, False] and gc.isenabled() is enabled
        path.write_bytes(b"not an archive")
        with pytest.raises(ValueError, match="state.pt: not a torch.save"):
            nvmeswap.load(path) if call == "load" else nvmeswap.load_into(path, into)
        assert gc.isenabled() is enabled
    finally:
        gc.enable()


@pytest.mark.parametrize("enabled", [True, False])
def test_an_async_save_pauses_the_collector_for_the_caller_s_part(tmp_path, enabled):
    import gc

    import nvmeswap.checkpoint.snapshot as snapshot_module

    seen = []
    real = snapshot_module.state_copy

    def spied(*args, **kwargs):
        seen.append(gc.isenabled())
        return real(*args, **kwargs)

    state = {"t": torch.arange(10.0), "u": torch.ones(3)}
    (gc.enable if enabled else gc.disable)()
    try:
        with mock.patch.object(snapshot_module, "state_copy", spied), \
                nvmeswap.Checkpointer(chunk_bytes=1 << 20, chunks=2) as checkpointer:
            # (not checked before the save is done: its thread pauses it for a layout)
            assert checkpointer.async_save(state, tmp_path / "state.pt").result() is None
        assert seen == [False] and gc.isenabled() is enabled
        assert_same(state, torch.load(tmp_path / "state.pt"))
    finally:
        gc.enable()


def many_small_tensors():
    """A state whose tensors average far under PACKED_BELOW_MEAN_BYTES: packed."""
    state = trained_state()
    state["layers"] = [torch.randn(64, 64, generator=torch.Generator().manual_seed(k))
                       for k in range(40)]
    state["param"] = torch.nn.Parameter(torch.arange(12.0).reshape(3, 4))
    state["views"] = (state["layers"][0][5:9], state["layers"][0].t())
    return state


@pytest.mark.parametrize("form", ["kept", "kept with a handle", "one-call"])
def test_a_packed_snapshot_saves_the_state_at_the_call(tmp_path, monkeypatch, form,
                                                       handle_factory):
    """Note [packed snapshot]: the default async form of a state of many small tensors
    copies their storages and returns; the layout runs on the saving thread, after the
    caller has changed the tensors' values and shapes and the containers (here before
    it, for certain): the file is byte for byte the one a save at the call writes."""
    state = many_small_tensors()
    at_the_call = copy.deepcopy(state)
    go = threading.Event()
    threads = _layouts_on(monkeypatch, go)
    given = handle_factory() if form == "kept with a handle" else None
    with nvmeswap.Checkpointer(given) as checkpointer:
        save = nvmeswap.async_save if form == "one-call" else checkpointer.async_save
        future = save(state, tmp_path / "packed.pt")
        assert future.snapshot_taken.done() and not future.done()
        for layer in state["layers"]:
            layer.fill_(7)
        state["layers"][1].resize_(2, 2)
        state["param"].data = torch.zeros(5)
        state["model"]["0.weight"].t_()
        state["optimizer"]["state"][0]["exp_avg"].zero_()
        state["views"] = None
        state["epoch"] = 9
        go.set()
        assert future.result(60) is None
    assert threads == ["nvmeswap-async-save"]
    assert_saved_as_at_the_call(tmp_path / "packed.pt", at_the_call)


@pytest.mark.parametrize("size", [10, 0], ids=["shrunk", "freed"])
def test_a_storage_resized_before_the_write_fails_the_save(tmp_path, monkeypatch, size):
    """A storage grown or shrunk between the call and the layout would not match the
    bytes packed at the call: the save fails, naming the file, and the previous
    checkpoint stays. Freed (resized to nothing, as FSDP frees), it lays out no bytes at
    all: it fails too (it used to replace the checkpoint with one torch.load refuses)."""
    path = tmp_path / "ckpt.pt"
    nvmeswap.save({"before": torch.ones(3)}, path)
    before = path.read_bytes()
    state = many_small_tensors()
    go = threading.Event()
    _layouts_on(monkeypatch, go)
    with nvmeswap.Checkpointer() as checkpointer:
        future = checkpointer.async_save(state, path)
        state["layers"][3].untyped_storage().resize_(size)
        go.set()
        with pytest.raises(RuntimeError, match="storage was resized") as info:
            future.result(60)
        assert str(path) in str(info.value)
    assert path.read_bytes() == before


def test_a_state_of_large_tensors_is_laid_out_in_the_caller(tmp_path, monkeypatch):
    """Few large tensors: their layout is short and the snapshot is written as it is,
    in the file's order (Note [async checkpoint snapshot])."""
    threads = _layouts_on(monkeypatch)
    state = {"a": torch.randn(1 << 20), "b": torch.randn(1 << 19), "step": 3}
    with nvmeswap.Checkpointer() as checkpointer:
        future = checkpointer.async_save(state, tmp_path / "large.pt")
        state["a"].zero_()
        assert future.result(60) is None
    assert threads == [threading.current_thread().name]
    assert not torch.load(tmp_path / "large.pt")["a"].eq(0).all()

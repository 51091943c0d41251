"""Where each saved tensor is, read from the pickle without making it (Note [reading where
tensors are]): the same as torch's weights-only unpickler finds, or left to it."""
import collections
import io
import os
import pickle
import warnings

import pytest

torch = pytest.importorskip("torch", reason="needs torch (pip install torch)")

from test_checkpoint import (
    assert_same,
    every_dtype_state,
    every_kind_state,
    mixed_state,
    random_tensor,
    raw,
    trained_state,
)

import nvmeswap
from nvmeswap.checkpoint import loading
from nvmeswap.checkpoint.saved_tensors import SavedTensor, saved_tensors
from nvmeswap.checkpoint.zip_entries import ZipEntries


def plain_state():
    base = random_tensor((6, 10), torch.float32, 1)
    return {"model": every_dtype_state(2),
            "views": [base, base[2:], base.t(), base[:, 3], base[1:2, ::2]],
            "ordered": collections.OrderedDict(w=random_tensor((3,), torch.bfloat16, 3)),
            "param": torch.nn.Parameter(random_tensor((2, 2), torch.float32, 4)),
            "grad": random_tensor((4,), torch.float32, 5).requires_grad_(),
            "u16": random_tensor((5,), torch.uint16, 6),       # rebuilt by _rebuild_tensor_v3
            "empty": torch.empty(0, 3), "scalar": torch.tensor(2.5),
            "values": (1, 2.0, "three", None, True, b"four", [5], {"six": 6})}


def tensors_of(saved, name=""):
    """``{path: tensor}`` of every tensor in nested dicts, lists and tuples."""
    if isinstance(saved, (torch.Tensor, SavedTensor)):
        return {name: saved}
    items = saved.items() if isinstance(saved, dict) else \
        enumerate(saved) if isinstance(saved, (list, tuple)) else []
    found = {}
    for key, value in items:
        found.update(tensors_of(value, f"{name}/{key}"))
    return found


def torch_s_reading(entries):
    """Each tensor as torch's weights-only unpickler makes it (over meta storages), as
    ``(key, dtype, offset, shape, strides)``."""
    keys = {}

    def make_storage(key, dtype, nbytes, location):
        storage = torch.UntypedStorage(nbytes, device="meta")
        keys[storage._cdata] = key
        return storage

    made = loading.unpickle(entries, make_storage, weights_only=True)
    return {name: (keys[tensor.untyped_storage()._cdata], tensor.dtype,
                   tensor.storage_offset(), tuple(tensor.shape), tensor.stride(),
                   tensor.is_contiguous(), tensor.numel())
            for name, tensor in tensors_of(made).items()}


@pytest.mark.parametrize("make", [plain_state, mixed_state, trained_state],
                         ids=["plain", "mixed", "trained"])
def test_each_tensor_is_where_torch_s_unpickler_finds_it(tmp_path, make):
    state = make()
    for save in (nvmeswap.save, torch.save):
        path = tmp_path / f"{save.__module__}.pt"
        save(state, path)
        entries = ZipEntries(str(path))
        read = saved_tensors(entries.pickle)
        assert read is not None
        ours = {name: (tensor.key, tensor.dtype, tensor.offset, tensor.shape, tensor.stride,
                       tensor.is_contiguous(), tensor.numel())
                for name, tensor in tensors_of(read).items()}
        assert ours == torch_s_reading(entries)
        assert len(ours) == len(tensors_of(state))


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("kind", ["device", "sparse", "quantized", "nested", "attribute",
                                  "object"])
def test_a_pickle_naming_anything_else_is_left_to_torch_s_unpickler(tmp_path, kind):
    kinds = every_kind_state()
    other = {"device": torch.device("cpu"), "sparse": kinds["coo"],
             "quantized": kinds["quantized"], "nested": kinds["nested"],
             "attribute": kinds["noted"], "object": fractions_of_three()}[kind]
    state = {"w": random_tensor((8,), torch.float32, 1), "other": other}
    path = tmp_path / "other.pt"
    nvmeswap.save(state, path)
    assert saved_tensors(ZipEntries(str(path)).pickle) is None
    into = {"w": torch.zeros(8)}
    if kind == "object":        # one weights_only refuses: torch's unpickler says so
        with pytest.raises(pickle.UnpicklingError, match="weights_only"):
            nvmeswap.load_into(path, into, strict=False)
    elif kind in ("quantized", "nested"):      # torch makes neither over meta storages
        with pytest.raises(ValueError, match="other.pt: holds a tensor load_into cannot"):
            nvmeswap.load_into(path, into, strict=False)
    elif kind == "sparse":
        nvmeswap.load_into(path, into, strict=False)
        with pytest.raises(ValueError, match="other.pt: other is a torch.sparse_coo tensor"):
            nvmeswap.load_into(path, {"w": torch.zeros(8), "other": other})
    else:
        into["other"] = torch.zeros_like(other) if kind == "attribute" else other
        nvmeswap.load_into(path, into)
        assert_same(state, into)
    if kind not in ("object", "quantized", "nested"):
        assert_same(state["w"], into["w"])


def fractions_of_three():
    import fractions

    return fractions.Fraction(1, 3)


class _Runs:
    """Pickles to a call of ``os.system``: what weights_only is there to refuse."""

    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def test_a_pickle_that_would_run_a_command_runs_nothing(tmp_path):
    marker = tmp_path / "ran"
    path = tmp_path / "evil.pt"
    torch.save({"w": torch.ones(3), "x": _Runs(f"touch {marker}")}, path)
    assert saved_tensors(ZipEntries(str(path)).pickle) is None
    with pytest.raises(pickle.UnpicklingError):
        nvmeswap.load_into(path, {"w": torch.zeros(3)}, strict=False)
    assert not marker.exists()


class _Rebuilt:
    """Pickles as torch pickles a tensor of 2 float32 elements, at ``offset`` and of
    ``stride`` in a storage of 4."""

    def __init__(self, offset, stride):
        self.offset, self.stride = offset, stride

    def __reduce__(self):
        return torch._utils._rebuild_tensor_v2, (
            torch.UntypedStorage(16), self.offset, (2,), self.stride, False,
            collections.OrderedDict())


def pickled(obj):
    class Pickler(pickle.Pickler):
        def persistent_id(self, obj):
            return ("storage", torch.FloatStorage, "0", "cpu", 4) \
                if isinstance(obj, torch.UntypedStorage) else None

    data = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")     # TypedStorage is deprecated
        Pickler(data, protocol=2).dump(obj)
    return data.getvalue()


def test_tensors_of_odd_offsets_or_strides_are_left_to_torch():
    """Not tensors torch.save makes: torch's unpickler is to judge them."""
    (read,) = saved_tensors(pickled([_Rebuilt(1, (1,))]))
    assert (read.key, read.dtype, read.offset, read.shape, read.stride) == \
        ("0", torch.float32, 1, (2,), (1,))
    assert saved_tensors(pickled([_Rebuilt(-1, (1,))])) is None
    assert saved_tensors(pickled([_Rebuilt(0, (1.5,))])) is None
    assert saved_tensors(pickled([_Rebuilt(0, (1, 1))])) is None


@pytest.mark.parametrize("make", [plain_state, mixed_state, trained_state],
                         ids=["plain", "mixed", "trained"])
def test_a_plain_state_loads_by_the_c_unpickler_as_torch_loads_it(tmp_path, make,
                                                                  monkeypatch):
    state = make()
    path = tmp_path / "plain.pt"
    nvmeswap.save(state, path)
    monkeypatch.setattr(loading, "_torch_s_unpickling", None)     # not called
    loaded = nvmeswap.load(path)
    expected = torch.load(path)
    assert_same(expected, loaded)
    for name, tensor in tensors_of(expected).items():
        ours = tensors_of(loaded)[name]
        assert type(ours) is type(tensor) and ours.requires_grad == tensor.requires_grad
        assert ours._backward_hooks == tensor._backward_hooks
        assert type(ours._backward_hooks) is type(tensor._backward_hooks)
    if make is plain_state:
        assert type(loaded["ordered"]) is collections.OrderedDict
        assert loaded["values"] == state["values"]
        assert type(loaded["param"]) is torch.nn.Parameter


def test_a_storage_that_cannot_be_read_fails_the_load_once(tmp_path, monkeypatch):
    """A failed storage read is the load's error, not a cue to unpickle again."""
    path = tmp_path / "plain.pt"
    nvmeswap.save(plain_state(), path)
    monkeypatch.setattr(loading, "_torch_s_unpickling", None)     # not called
    keys = []

    def make_storage(key, dtype, nbytes, location):
        keys.append(key)
        if len(keys) == 2:
            raise OSError(5, "Input/output error", str(path))
        return torch.UntypedStorage(nbytes)

    with pytest.raises(OSError, match="plain.pt") as raised:
        loading.unpickle(ZipEntries(str(path)), make_storage, weights_only=True)
    assert raised.value.errno == 5 and len(keys) == 2


@pytest.mark.filterwarnings("ignore")
def test_anything_else_loads_by_torch_s_unpickler(tmp_path, monkeypatch):
    kinds = every_kind_state()
    state = {"w": random_tensor((8,), torch.float32, 1), "coo": kinds["coo"],
             "noted": kinds["noted"], "device": torch.device("cpu")}
    path = tmp_path / "kinds.pt"
    nvmeswap.save(state, path)
    calls = []
    real = loading._torch_s_unpickling
    monkeypatch.setattr(loading, "_torch_s_unpickling",
                        lambda *args: calls.append(args) or real(*args))
    loaded = nvmeswap.load(path)
    assert len(calls) == 1
    assert_same({"w": state["w"], "noted": state["noted"]},
                {"w": loaded["w"], "noted": loaded["noted"]})
    assert torch.equal(loaded["coo"].to_dense(), state["coo"].to_dense())
    assert loaded["noted"].note == "kept" and loaded["device"] == torch.device("cpu")


def test_a_pickle_that_would_run_a_command_is_refused_by_load(tmp_path):
    marker = tmp_path / "ran"
    path = tmp_path / "evil.pt"
    torch.save({"w": torch.ones(3), "x": _Runs(f"touch {marker}")}, path)
    with pytest.raises(pickle.UnpicklingError, match="evil.pt: .*weights_only"):
        nvmeswap.load(path)
    assert not marker.exists()


def test_tensors_with_a_negative_or_conjugate_bit_load_as_torch_loads_them(tmp_path):
    real = random_tensor((5,), torch.float32, 3)
    complex_ = random_tensor((4,), torch.complex64, 4)
    state = {"negative": real._neg_view(), "conjugate": complex_.conj(), "plain": real}
    path = tmp_path / "bits.pt"
    nvmeswap.save(state, path)
    loaded, expected = nvmeswap.load(path), torch.load(path)
    for name, tensor in expected.items():
        assert torch.equal(loaded[name].resolve_conj().resolve_neg(),
                           tensor.resolve_conj().resolve_neg())
        assert (loaded[name].is_neg(), loaded[name].is_conj()) == \
            (tensor.is_neg(), tensor.is_conj())


def test_tensors_are_rebuilt_by_torch_where_a_fake_mode_may_be_on(tmp_path, monkeypatch):
    """Note [rebuilding without a fake mode]: torch's rebuild gives a tensor a fake
    device where a fake mode is on; nvmeswap's skips that look only where none is."""
    path = tmp_path / "plain.pt"
    state = {"a": random_tensor((4,), torch.float32, 1), "b": random_tensor((2, 3), torch.bfloat16, 2)}
    nvmeswap.save(state, path)
    restored = []
    real_restore = torch._utils._restore_device_fake_mode
    monkeypatch.setattr(torch._utils, "_restore_device_fake_mode",
                        lambda tensor: restored.append(tensor) or real_restore(tensor))
    assert_same(state, nvmeswap.load(path))
    assert restored == []
    monkeypatch.setattr(torch._guards, "detect_fake_mode", lambda inputs=None: object())
    monkeypatch.setattr(torch._utils, "_restore_device_fake_mode",
                        lambda tensor: restored.append(tensor) or tensor)
    assert_same(state, nvmeswap.load(path))
    assert len(restored) == 2


def _archive_of_pickle(path, payload):
    """A torch.save archive of no tensors whose pickle is ``payload``."""
    class Pickler:
        def __init__(self, file, protocol=2):
            self.file = file

        def dump(self, obj):
            self.file.write(payload)

    module = type(os)("crafted_pickle")
    module.Pickler = Pickler
    torch.save({}, path, pickle_module=module)
    return path


def _text(value):
    return b"X" + len(value).to_bytes(4, "little") + value.encode()


_NEG_DEFAULTS = b"}" + _text("neg") + b"\x88s\x85"        # ({"neg": True},)


@pytest.mark.parametrize("target", [
    ("torch", "FloatStorage", "dtype", b"ctorch\nint32\n"),
    ("torch", "UntypedStorage", "dtype", b"ctorch\nint32\n"),
    ("torch.storage", "UntypedStorage", "nbytes", b"ctorch\nint32\n"),
    ("torch._utils", "_rebuild_tensor_v2", "__defaults__", _NEG_DEFAULTS),
    ("torch._utils", "_rebuild_tensor_v3", "__defaults__", _NEG_DEFAULTS),
    ("torch._utils", "_rebuild_parameter", "__defaults__", _NEG_DEFAULTS),
    ("_codecs", "encode", "__defaults__", _NEG_DEFAULTS)])
@pytest.mark.parametrize("form", ["dict", "slots"])
def test_a_pickle_that_builds_on_a_global_is_refused_and_changes_nothing(tmp_path, target,
                                                                          form):
    """Note [sealed globals]: a file whose pickle sets attributes of a global it names
    (BUILD) is refused, by load and load_into, as torch.load refuses it; the globals
    later loads resolve stay as they were, and so do torch's rebuild functions."""
    module, name, attribute, value = target
    state = b"}" + _text(attribute) + value + b"s"
    if form == "slots":
        state = b"N" + state + b"\x86"          # (None, {attribute: value})
    path = _archive_of_pickle(tmp_path / "evil.pt", b"\x80\x02c" + module.encode() + b"\n"
                              + name.encode() + b"\n" + state + b"b0}.")
    expected = {"f": random_tensor((4,), torch.float32, 1),
                "u16": random_tensor((3,), torch.uint16, 2),
                "p": torch.nn.Parameter(random_tensor((2,), torch.float32, 3))}
    good = tmp_path / "good.pt"
    torch.save(expected, good)
    defaults = {name: getattr(torch._utils, name).__defaults__
                for name in ("_rebuild_tensor_v2", "_rebuild_tensor_v3", "_rebuild_parameter")}
    with pytest.raises(pickle.UnpicklingError):
        torch.load(path)
    for _ in range(2):      # the second time with every global already resolved
        with pytest.raises(pickle.UnpicklingError, match="evil.pt"):
            nvmeswap.load(path)
        with pytest.raises(pickle.UnpicklingError, match="evil.pt"):
            nvmeswap.load_into(path, {}, strict=False)
        loaded = nvmeswap.load(good)
        assert_same(expected, loaded)
        assert not any(tensor.is_neg() for tensor in loaded.values())
        into = {name: torch.zeros_like(tensor.detach()) for name, tensor in expected.items()}
        assert nvmeswap.load_into(good, into) is into
        assert all(torch.equal(raw(into[name]), raw(tensor)) for name, tensor in expected.items())
    assert defaults == {name: getattr(torch._utils, name).__defaults__ for name in defaults}

"""nvmeswap.save / load / load_into / async_save: torch.save archives, bit for bit.

Every dtype and container comes back with the same bytes; torch.load reads our files and
nvmeswap.load reads torch's; the zip's CRCs are right (zipfile checks them); bad arguments
fail before any file is touched, with the file named.
"""
import collections
import errno
import fractions
import io
import math
import os
import pickle
import struct
import subprocess
import sys
import threading
import warnings
import zipfile

import numpy as np
import pytest
from conftest import random_bytes

torch = pytest.importorskip("torch", reason="needs torch (pip install torch)")

import nvmeswap
from nvmeswap.checkpoint import commit
from nvmeswap.checkpoint.commit import TEMPORARY

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64,
          torch.complex128, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
          torch.bool, torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16, torch.uint32,
          torch.uint64]


def random_tensor(shape, dtype, seed):
    """A tensor of ``shape`` whose bytes are random (bools 0 or 1), NaN patterns included."""
    count = int(np.prod(shape, dtype=np.int64))
    itemsize = torch.empty((), dtype=dtype).element_size()
    rng = np.random.default_rng(seed)
    if dtype == torch.bool:
        return torch.from_numpy(rng.integers(0, 2, count).astype(np.bool_)).reshape(shape)
    raw = torch.from_numpy(rng.integers(0, 256, count * itemsize, dtype=np.uint8))
    return raw.view(dtype).reshape(shape)


def raw(tensor):
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_same(a, b, where="obj"):
    """``a`` and ``b`` are the same structure, tensors equal bit for bit (same dtype,
    shape, stride, storage offset)."""
    assert type(a) is type(b), f"{where}: {type(a)} vs {type(b)}"
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape, a.stride(), a.storage_offset()) == \
            (b.dtype, b.shape, b.stride(), b.storage_offset()), where
        assert torch.equal(raw(a), raw(b)), f"{where}: bytes differ"
        assert a.requires_grad == b.requires_grad, where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for key in a:
            assert_same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for index, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{index}]")
    else:
        assert a == b or (isinstance(a, float) and math.isnan(a) and math.isnan(b)), where


def every_dtype_state(seed=0):
    state = collections.OrderedDict()
    for index, dtype in enumerate(DTYPES):
        name = str(dtype).split(".")[1]
        state[name] = random_tensor((3, 1000 + index), dtype, seed + index)
    return state


#: The dtypes safetensors has no name for.
UNNAMED_IN_SAFETENSORS = {torch.complex128}


def flat_state():
    """A flat dict of tensors safetensors can hold: every dtype it names, an empty
    tensor, a scalar, and one of 3 MiB + 5 bytes."""
    state = {f"t.{str(dtype).split('.')[1]}": random_tensor((5, 999), dtype, index)
             for index, dtype in enumerate(DTYPES) if dtype not in UNNAMED_IN_SAFETENSORS}
    state["empty"] = torch.empty(0, 4)
    state["scalar"] = torch.tensor(1.5)
    state["big"] = random_tensor(((3 << 20) + 5,), torch.uint8, 7)
    return state


def mixed_state():
    """Containers, scalars, views sharing storage, odd sizes, empty and 0-d tensors."""
    base = random_tensor((64, 33), torch.float32, 1)
    return {
        "model": every_dtype_state(),
        "views": [base, base[3:9], base.t(), base[:, 5]],      # one storage, four views
        "tuple": (random_tensor((4097,), torch.int8, 2), 7, "adam"),
        "scalars": {"step": 12345, "lr": 3e-4, "nan": float("nan"), "none": None,
                    "flag": True, "name": "run-1", "bytes": b"\x00\x01"},
        "empty": torch.empty(0, 5, dtype=torch.bfloat16),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "big": random_tensor((5 << 20) + 3, torch.uint8, 3),   # crosses ring chunks
        "param": torch.nn.Parameter(random_tensor((17, 3), torch.float32, 4)),
    }


@pytest.fixture
def checkpointer():
    with nvmeswap.Checkpointer(chunk_bytes=1 << 20, chunks=3) as made:
        yield made


@pytest.fixture
def handle_checkpointer(handle):
    """A Checkpointer given a handle: its loads land in the handle's locked set."""
    with nvmeswap.Checkpointer(handle, chunk_bytes=1 << 20, chunks=3) as made:
        yield made


def test_torch_load_reads_what_save_wrote(checkpointer, tmp_path):
    state = mixed_state()
    path = tmp_path / "state.pt"
    checkpointer.save(state, path)
    with zipfile.ZipFile(path) as archive:
        assert archive.testzip() is None          # every CRC-32 is right
    loaded = torch.load(path)
    assert_same(state, loaded)
    assert loaded["views"][1].untyped_storage().data_ptr() == \
        loaded["views"][0].untyped_storage().data_ptr()


def test_load_reads_what_save_wrote_into_locked_memory(handle_checkpointer, tmp_path):
    checkpointer = handle_checkpointer
    state = mixed_state()
    path = tmp_path / "state.pt"
    checkpointer.save(state, path)
    loaded = checkpointer.load(path)
    assert_same(state, loaded)
    views = loaded["views"]
    assert all(v.untyped_storage().data_ptr() == views[0].untyped_storage().data_ptr()
               for v in views)
    assert checkpointer.handle.is_pinned(loaded["big"])
    assert checkpointer.free(loaded) >= 1
    assert not checkpointer.handle.is_pinned(loaded["big"])


def test_load_reads_what_torch_save_wrote(checkpointer, tmp_path):
    state = mixed_state()
    path = tmp_path / "torch.pt"
    torch.save(state, path)
    assert_same(state, checkpointer.load(path))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_round_trips_through_the_module_functions(tmp_path, dtype):
    tensor = random_tensor((7, 1031), dtype, 9)
    path = tmp_path / "one.pt"
    nvmeswap.save({"t": tensor, "odd": tensor[1:, 3:]}, path)
    assert_same({"t": tensor, "odd": tensor[1:, 3:]}, torch.load(path))
    assert_same({"t": tensor, "odd": tensor[1:, 3:]}, nvmeswap.load(path))


def trained_state():
    """A small model's state dict (an OrderedDict with ``_metadata``) and Adam's state
    after one step, as a training script checkpoints them."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.BatchNorm1d(4),
                                torch.nn.Linear(4, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(5, 8)).square().sum().backward()
    optimizer.step()
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": 3,
            "rng": torch.get_rng_state(), "name": "run-7", "betas": (0.9, 0.99)}


def every_kind_state():
    """Tensors of every kind torch reduces its own way, beside plain ones that share their
    storages: conj and neg bits, requiring grad (leaf and not), a hook, an attribute, a
    Parameter, sparse, quantized, nested, and the dtypes torch rebuilds untyped."""
    z = random_tensor((4, 3), torch.complex64, 11)
    leaf = random_tensor((5,), torch.float32, 12).requires_grad_()
    hooked = random_tensor((3,), torch.float32, 13).requires_grad_()
    hooked.register_hook(torch.utils.hooks.unserializable_hook(lambda grad: grad))
    noted = random_tensor((6,), torch.float32, 14)
    noted.note = "kept"
    dense = random_tensor((4, 4), torch.float32, 15)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")     # quantized, CSR and nested: deprecated or beta
        odd = {"quantized": torch.quantize_per_tensor(dense.flatten(), 0.1, 3, torch.quint8),
               "csr": dense.to_sparse_csr(),
               "nested": torch.nested.nested_tensor([dense[0], dense[1, :3]])}
    return {"conj": z.conj(), "z": z, "leaf": leaf,
            "neg": random_tensor((3,), torch.complex64, 17).conj().imag,
            "nonleaf": leaf * 2, "hooked": hooked, "noted": noted, "plain": noted[1:],
            "param": torch.nn.Parameter(dense[:2]), "coo": dense.to_sparse(),
            "u16": random_tensor((7,), torch.uint16, 16), "dense": dense, **odd}


@pytest.mark.parametrize("make", [
    lambda: {"a": random_tensor((1000,), torch.float32, 5), "b": [1, 2.0]},
    mixed_state, trained_state, every_kind_state],
    ids=["small", "mixed", "trained", "every-kind"])
def test_the_file_is_byte_identical_to_torch_save_with_the_same_alignment(tmp_path, make):
    """Note [laying out many tensors]: the layout's own pickler (and its own reduction of
    plain tensors) changes no byte."""
    assert_saved_as_torch_saves(make(), tmp_path)


def assert_saved_as_torch_saves(state, folder):
    """``nvmeswap.save(state)`` writes the bytes ``torch.save`` does with 4096-aligned
    storages."""
    from torch.utils.serialization import config

    nvmeswap.save(state, folder / "ours.pt")
    with config.patch({"save.storage_alignment": 4096}):
        torch.save(state, folder / "archive")         # torch names the records after it
    ours = (folder / "ours.pt").read_bytes()
    theirs = (folder / "archive").read_bytes()
    assert len(ours) == len(theirs)
    assert without_serialization_id(ours) == without_serialization_id(theirs)


def without_serialization_id(data):
    """A torch.save archive's bytes with its serialization id, and the id's CRC in its
    data descriptor and central directory entry, zeroed: each writer makes its own id
    (Note [own zip writer])."""
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        (info,) = [info for info in archive.infolist()
                   if info.filename.endswith("/.data/serialization_id")]
    name_len, extra_len = struct.unpack_from("<HH", data, info.header_offset + 26)
    start = info.header_offset + 30 + name_len + extra_len
    rest = data[start + info.file_size:].replace(info.CRC.to_bytes(4, "little"), bytes(4))
    return data[:start] + bytes(info.file_size) + rest


def test_plain_tensors_are_reduced_as_torch_reduces_them_or_by_torch(tmp_path, monkeypatch):
    """Note [laying out many tensors]: this torch's reduction of a plain tensor is the
    layout's own; one that reduces differently (here a wrong one) is not used, and the
    file is still torch's."""
    from nvmeswap.checkpoint import torch_zip

    assert torch_zip._tensor_reduce(2) is not None
    own = torch_zip._plain_tensor_reduce

    def wrong(protocol):
        reduce = own(protocol)

        def without_grad(tensor):
            rebuild, args = reduce(tensor)
            return rebuild, args[:4] + (False,) + args[5:]
        return without_grad

    monkeypatch.setattr(torch_zip, "_plain_tensor_reduce", wrong)
    torch_zip._tensor_reduce.cache_clear()
    try:
        assert torch_zip._tensor_reduce(2) is None
        assert_saved_as_torch_saves(
            {"w": random_tensor((9,), torch.float32, 1).requires_grad_()}, tmp_path)
    finally:
        torch_zip._tensor_reduce.cache_clear()


def test_a_tensor_s_hook_is_warned_of_as_torch_save_warns(tmp_path):
    hooked = random_tensor((3,), torch.float32, 13).requires_grad_()
    hooked.register_hook(lambda grad: grad * 2)
    with pytest.warns(UserWarning, match="will not be serialized"):
        nvmeswap.save({"hooked": hooked}, tmp_path / "hooked.pt")
    assert_same({"hooked": hooked}, torch.load(tmp_path / "hooked.pt"))


@pytest.mark.filterwarnings("ignore:TypedStorage is deprecated")
def test_storages_named_by_the_pickler_lay_out_the_same_archive(tmp_path, monkeypatch):
    """Note [CUDA state layout]: the storages learnt from the pickler, under skip_data,
    give the archive torch's own hand-over gives (run here on CPU tensors, which take
    that road only when forced)."""
    from nvmeswap.checkpoint import torch_zip

    state = mixed_state()
    state["typed"] = torch.TypedStorage(random_tensor((999,), torch.int16, 6).tolist(),
                                        dtype=torch.int16)
    nvmeswap.save(state, tmp_path / "handed.pt")
    monkeypatch.setattr(torch_zip, "_copies_cuda_storages", lambda tensors: True)
    nvmeswap.save(state, tmp_path / "named.pt")
    handed = (tmp_path / "handed.pt").read_bytes()
    named = (tmp_path / "named.pt").read_bytes()
    assert handed == named
    with zipfile.ZipFile(tmp_path / "named.pt") as archive:
        assert archive.testzip() is None
    loaded = torch.load(tmp_path / "named.pt", weights_only=False)
    assert list(loaded["typed"]) == list(state["typed"])
    del state["typed"], loaded["typed"]
    assert_same(state, loaded)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_tensor_skip_data_refuses_out_of_the_walks_sight_is_saved(tmp_path, monkeypatch):
    """A quantized tensor inside a module (where the walk of dicts and lists does not
    look) makes skip_data raise: the layout goes back to torch's own copy."""
    from nvmeswap.checkpoint import torch_zip

    module = torch.nn.Module()
    module.register_buffer("q", torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8))
    state = {"w": random_tensor((1000,), torch.float32, 8), "module": module}
    monkeypatch.setattr(torch_zip, "_copies_cuda_storages", lambda tensors: True)
    nvmeswap.save(state, tmp_path / "q.pt")
    loaded = torch.load(tmp_path / "q.pt", weights_only=False)
    assert torch.equal(loaded["w"].view(torch.int32), state["w"].view(torch.int32))
    assert torch.equal(loaded["module"].q.int_repr(), module.q.int_repr())


@pytest.mark.parametrize("how", ["save", "async_save", "background"])
def test_save_inside_skip_data_is_refused(tmp_path, how):
    """At the call, in every form: skip_data is the calling thread's, and a background
    save lays out on a thread of its own, which would not see it."""
    with torch.serialization.skip_data(), pytest.raises(TypeError, match="skip_data"):
        if how == "save":
            nvmeswap.save({"a": torch.ones(3)}, tmp_path / "a.pt")
        else:
            nvmeswap.async_save({"a": torch.ones(3)}, tmp_path / "a.pt",
                                background_snapshot=how == "background")
    assert not (tmp_path / "a.pt").exists()


def test_map_location_and_weights_only(checkpointer, tmp_path):
    state = {"w": random_tensor((10,), torch.float32, 6), "od": collections.OrderedDict(a=1)}
    path = tmp_path / "s.pt"
    checkpointer.save(state, path)
    loaded = checkpointer.load(path, map_location="cpu")
    assert_same(state, loaded)
    seen = []
    loaded = checkpointer.load(path, map_location=lambda s, loc: seen.append(loc))
    assert seen == ["cpu"] and torch.equal(raw(loaded["w"]), raw(state["w"]))
    loaded = checkpointer.load(path, map_location="meta")
    assert loaded["w"].device.type == "meta"
    torch.save({"f": fractions.Fraction(1, 3)}, tmp_path / "code.pt")
    with pytest.raises(pickle.UnpicklingError, match="weights_only=False"):
        checkpointer.load(tmp_path / "code.pt")
    with pytest.raises(pickle.UnpicklingError):
        torch.load(tmp_path / "code.pt")                # torch refuses it too
    assert checkpointer.load(tmp_path / "code.pt", weights_only=False)["f"] == \
        fractions.Fraction(1, 3)


def test_a_load_that_moves_every_storage_keeps_no_locked_memory(handle_checkpointer,
                                                                 tmp_path):
    """A CUDA checkpoint's storages move to the GPU as they load; map_location copying
    them does the same here. The locked buffers they were read into must not stay in
    the set (a kept checkpointer would hold one checkpoint's size per load)."""
    checkpointer = handle_checkpointer
    state = mixed_state()
    checkpointer.save(state, tmp_path / "s.pt")
    before = checkpointer.handle.memory_in_use
    for _ in range(2):
        moved = checkpointer.load(tmp_path / "s.pt", map_location=lambda s, loc: s.clone())
        assert_same(state, moved)
        assert checkpointer.handle.memory_in_use == before
    kept = checkpointer.load(tmp_path / "s.pt")      # returned as read: still locked
    assert checkpointer.handle.memory_in_use > before
    assert checkpointer.free(kept) >= 1
    assert checkpointer.handle.memory_in_use == before


def test_load_into_reads_straight_into_given_tensors(checkpointer, tmp_path):
    state = {"model": every_dtype_state(3), "step": 5, "list": [random_tensor((9,), torch.int32, 4)]}
    path = tmp_path / "s.pt"
    checkpointer.save(state, path)
    locked = checkpointer.handle.new_cpu_locked_tensor(3 * 1001, torch.empty(0))
    into = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()},
            "step": 0, "list": [torch.zeros(9, dtype=torch.int32)]}
    into["model"]["float32"] = locked.view(3, 1001)
    assert checkpointer.load_into(path, into) is into
    assert_same(dict(state["model"]), into["model"])
    assert_same(state["list"], into["list"])
    assert into["step"] == 0                        # non-tensor values are left alone
    assert checkpointer.handle.free_cpu_locked_tensor(locked)


def test_load_into_checks_everything_before_reading(checkpointer, tmp_path):
    path = tmp_path / "s.pt"
    checkpointer.save({"a": torch.ones(4), "b": torch.ones(2, 2)}, path)
    a = torch.zeros(4)
    with pytest.raises(ValueError, match="b is torch.float32 \\(2, 2\\) in the file"):
        checkpointer.load_into(path, {"a": a, "b": torch.zeros(4)})
    with pytest.raises(KeyError, match="in the target only \\['c'\\]"):
        checkpointer.load_into(path, {"a": a, "b": torch.zeros(2, 2), "c": a})
    with pytest.raises(ValueError, match="not contiguous"):
        checkpointer.load_into(path, {"a": a, "b": torch.zeros(2, 2).t()})
    assert torch.equal(a, torch.zeros(4))           # nothing was read
    assert checkpointer.load_into(path, {"a": a}, strict=False)["a"].sum() == 4


def _with_bits():
    """Tensors torch saves with a conjugate or negative bit (their bytes unresolved), as
    ``x.conj()`` and ``x.conj().imag`` are."""
    values = random_tensor((6,), torch.complex64, 5)
    return {"conj": values.conj(), "both": values.conj()._neg_view(),
            "neg": random_tensor((3,), torch.float32, 7)._neg_view(),
            "plain": random_tensor((5,), torch.float32, 6)}


@pytest.mark.parametrize("writer", ["torch.save", "nvmeswap.save"])
@pytest.mark.parametrize("unpickler", ["C", "torch's"])
def test_load_into_gives_tensors_saved_with_a_bit_their_values(tmp_path, monkeypatch,
                                                               writer, unpickler):
    """A tensor saved with a conjugate or negative bit is its bytes' conjugate or
    negation: load_into gives it the values torch.load gives, whichever unpickler
    placed it (Note [reading where tensors are])."""
    from nvmeswap.checkpoint import loading

    state = _with_bits()
    path = tmp_path / "bits.pt"
    (torch.save if writer == "torch.save" else nvmeswap.save)(state, path)
    if unpickler == "torch's":
        monkeypatch.setattr(loading, "saved_tensors", lambda pickled: None)
    into = {name: torch.zeros(tensor.shape, dtype=tensor.dtype)
            for name, tensor in state.items()}
    assert nvmeswap.load_into(path, into) is into
    for name, tensor in torch.load(path).items():
        assert not into[name].is_conj() and not into[name].is_neg()
        assert torch.equal(into[name], tensor.resolve_conj().resolve_neg()), name


def test_load_into_refuses_targets_it_could_not_fill(checkpointer, tmp_path):
    """A target with a conjugate or negative bit (its bytes are not its values), and a
    tensor target where the file holds something else: errors naming the entry, before
    any read. A mismatch deep in a state names where it is."""
    path = tmp_path / "s.pt"
    values = random_tensor((4,), torch.complex64, 1)
    checkpointer.save({"c": values, "bias": None, "opt": {"lr": 0.1, "state": {"m": values}}},
                      path)
    target = torch.zeros(4, dtype=torch.complex64)
    with pytest.raises(ValueError, match="the tensor for c is a conjugate or negative view"):
        checkpointer.load_into(path, {"c": target.conj()}, strict=False)
    with pytest.raises(ValueError, match="the tensor for c is on meta"):
        checkpointer.load_into(path, {"c": target.to("meta")}, strict=False)
    with pytest.raises(TypeError, match="bias is a NoneType in .*s.pt, a Tensor in memory"):
        checkpointer.load_into(path, {"c": target, "bias": torch.zeros(3)}, strict=False)
    with pytest.raises(TypeError, match="opt.lr is a float in .*s.pt, a Tensor in memory"):
        checkpointer.load_into(path, {"opt": {"lr": torch.zeros(()), "state": {}}},
                               strict=False)
    with pytest.raises(KeyError, match="differ in opt.state: in the file only \\['m'\\]"):
        checkpointer.load_into(path, {"c": target, "bias": None,
                                      "opt": {"lr": 0.0, "state": {}}})
    assert torch.equal(target, torch.zeros(4, dtype=torch.complex64))     # nothing was read
    into = {"c": target, "bias": None, "opt": {"lr": 0.0, "state": {"m": torch.zeros_like(target)}}}
    assert checkpointer.load_into(path, into) is into
    assert torch.equal(into["c"], values) and torch.equal(into["opt"]["state"]["m"], values)
    for saver in (torch.save, checkpointer.save):     # a tensor saved without bytes
        saver({"m": torch.empty(3, device="meta"), "c": values}, path)
        with pytest.raises(ValueError, match="s.pt: m was saved on the meta device, without "
                                             "bytes"):
            checkpointer.load_into(path, {"m": torch.zeros(3), "c": target})


def test_a_ctrl_c_in_close_leaves_the_save_in_flight_its_buffers(tmp_path, monkeypatch):
    """close() interrupted while an async save writes from the snapshot: the buffers stay
    until that save has ended (its thread frees them), and the file is whole."""
    state = {"w": random_tensor((1 << 20,), torch.float32, 2)}
    path = tmp_path / "async.pt"
    checkpointer = nvmeswap.Checkpointer()
    checkpointer.save(state, tmp_path / "first.pt")     # the buffers are made
    may_write = threading.Event()
    real_write = checkpointer._write_from_snapshot

    def held_write(image, target):
        may_write.wait()
        real_write(image, target)
    monkeypatch.setattr(checkpointer, "_write_from_snapshot", held_write)
    future = checkpointer.async_save(state, path)
    future.snapshot_taken.result()

    def interrupted():
        raise KeyboardInterrupt
    monkeypatch.setattr(checkpointer, "wait_in_flight", interrupted)
    with pytest.raises(KeyboardInterrupt):
        checkpointer.close()
    assert checkpointer.closed and not checkpointer._freed      # the save still needs them
    may_write.set()
    assert future.result() is None
    assert checkpointer._freed
    assert_same(state, torch.load(path))


def test_a_ctrl_c_in_a_load_through_a_handle_is_raised_and_frees_its_buffers(tmp_path,
                                                                           monkeypatch):
    state = {"w": random_tensor((4 << 20,), torch.uint8, 4)}
    path = tmp_path / "c.pt"
    with nvmeswap.aio_handle() as handle:
        checkpointer = nvmeswap.Checkpointer(handle)
        checkpointer.save(state, path)
        in_use = handle.memory_in_use
        real_submit = handle.submit_pread

        class InterruptedOnce:
            """A future whose first result() is a Ctrl-C: the read goes on."""

            def __init__(self, future):
                self.future, self.interrupted = future, False

            def result(self):
                if not self.interrupted:
                    self.interrupted = True
                    raise KeyboardInterrupt
                return self.future.result()
        monkeypatch.setattr(handle, "submit_pread",
                            lambda *args: InterruptedOnce(real_submit(*args)))
        with pytest.raises(KeyboardInterrupt):
            checkpointer.load(path)
        monkeypatch.undo()
        assert handle.memory_in_use == in_use
        loaded = checkpointer.load(path)
        assert_same(state, loaded)
        checkpointer.free(loaded)
        checkpointer.close()


def test_a_ctrl_c_as_the_saving_thread_starts_leaves_the_save_in_flight(tmp_path,
                                                                        monkeypatch):
    state = {"w": random_tensor((1 << 16,), torch.float32, 3)}
    real_start = threading.Thread.start

    def start(thread):
        real_start(thread)
        raise KeyboardInterrupt             # as a Ctrl-C in start()'s wait for the thread
    monkeypatch.setattr(threading.Thread, "start", start)
    with nvmeswap.Checkpointer() as checkpointer:
        with pytest.raises(KeyboardInterrupt):
            checkpointer.async_save(state, tmp_path / "a.pt")
        monkeypatch.undo()
        checkpointer.wait_in_flight()
        assert checkpointer._in_flight.exception() is None
    assert_same(state, torch.load(tmp_path / "a.pt"))


def test_async_save_snapshots_and_writes_in_the_background(tmp_path):
    state = mixed_state()
    expected = {"big": state["big"].clone(), "model": collections.OrderedDict(
        (k, v.clone()) for k, v in state["model"].items())}
    path = tmp_path / "async.pt"
    with nvmeswap.Checkpointer() as checkpointer:
        future = checkpointer.async_save(state, path)
        state["big"].fill_(0)                          # the snapshot is already taken
        for tensor in state["model"].values():
            tensor.zero_()
        assert future.result() is None
        loaded = torch.load(path)
        assert_same(expected["big"], loaded["big"])
        assert_same(expected["model"], loaded["model"])
        # The second save reuses the snapshot buffer.
        second = checkpointer.async_save({"x": torch.arange(10)}, path)
        second.result()
    assert_same({"x": torch.arange(10)}, torch.load(path))
    assert nvmeswap.async_save({"y": torch.arange(3)}, path).result() is None
    assert_same({"y": torch.arange(3)}, torch.load(path))


def _vm_locked_kib():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmLck"))


@pytest.mark.parametrize("background", [False, True], ids=["snapshot", "background"])
def test_an_async_save_to_a_relative_path_writes_where_it_was_called(tmp_path, monkeypatch,
                                                                      background):
    """The path is made absolute at the call: a chdir before the save is written (a
    launcher, a library) neither sends it elsewhere, over another run's file, nor fails
    it for a folder that exists only where the call was made."""
    (tmp_path / "a" / "ckpts").mkdir(parents=True)
    (tmp_path / "b").mkdir()
    torch.save({"owner": "b"}, tmp_path / "b" / "ckpt.pt")
    state = {"owner": "a", "w": torch.randn(100_000)}
    monkeypatch.chdir(tmp_path / "a")
    futures = [nvmeswap.async_save(state, name, background_snapshot=background)
               for name in ("ckpt.pt", os.path.join("ckpts", "step1.pt"))]
    monkeypatch.chdir(tmp_path / "b")
    for future in futures:
        assert future.result() is None
    for name in ("ckpt.pt", os.path.join("ckpts", "step1.pt")):
        assert torch.equal(torch.load(tmp_path / "a" / name)["w"], state["w"])
    assert torch.load(tmp_path / "b" / "ckpt.pt") == {"owner": "b"}
    assert sorted(os.listdir(tmp_path / "b")) == ["ckpt.pt"]


@pytest.mark.parametrize("road", ["own queue", "handle"])
def test_one_call_async_save_snapshots_into_plain_memory(tmp_path, monkeypatch, road,
                                                         request):
    """Note [async checkpoint snapshot]: the one-call async_save's snapshot is plain memory
    (locking a fresh buffer kept the caller longer than a whole synchronous save); a kept
    Checkpointer's snapshot is locked. Through the process's own queue (no handle) the
    snapshots are private memory and no worker starts; through a given handle the kept
    one is in the handle's locked set. Either way the state may change once the call
    returns, and the file holds it as it was."""
    from test_checkpoint_fresh import refuse_workers

    from nvmeswap.checkpoint.checkpointer import Checkpointer
    from nvmeswap.checkpoint.snapshot import Snapshot
    from nvmeswap.io.regions import locked_memory

    made = []       # (bytes, in the locked set?, page-locked?) of each snapshot, as made
    original = Snapshot.buffer

    def recorded(self, nbytes, locked):
        before = _vm_locked_kib()
        snapshot = original(self, nbytes, locked)
        made.append((snapshot.numel(), locked_memory().table.containing(
            snapshot.data_ptr(), snapshot.numel()) is not None,
            _vm_locked_kib() - before >= snapshot.numel() >> 10))
        return snapshot

    monkeypatch.setattr(Snapshot, "buffer", recorded)
    handle = request.getfixturevalue("handle") if road == "handle" else None
    if handle is None:
        refuse_workers(monkeypatch)
    state = {"w": torch.from_numpy(np.frombuffer(random_bytes(24 << 20, seed=31),
                                                 np.uint8).copy()),
             "b": torch.arange(1000, dtype=torch.float64)}
    expected = {name: tensor.clone() for name, tensor in state.items()}
    locked_before = _vm_locked_kib()
    for path in (tmp_path / "one.pt", tmp_path / "kept.pt"):
        if path.name == "one.pt":
            future = nvmeswap.async_save(state, path, handle=handle)
        else:
            checkpointer = Checkpointer(handle)
            future = checkpointer.async_save(state, path)
        state["w"].zero_()
        state["b"].fill_(-1)
        assert future.result() is None
        assert_same(expected, torch.load(path))
        state = {name: tensor.clone() for name, tensor in expected.items()}
    checkpointer.close()
    if road == "handle":
        assert [in_set for _, in_set, _ in made] == [False, True]
    else:
        assert [(in_set, locked) for _, in_set, locked in made] == [(False, False),
                                                                   (False, True)]
        assert _vm_locked_kib() == locked_before    # the snapshot went with close()
    assert all(nbytes >= 24 << 20 for nbytes, _, _ in made)


def test_one_call_async_save_of_clones_writes_through_the_ring(tmp_path, monkeypatch):
    """Note [one-off snapshot of CUDA state]: where the one-call form cloned the tensors
    on their device, the saving thread writes the clones through the ring, with no host
    snapshot. Here a CPU state takes that road (a CUDA one does on a GPU:
    tests/test_checkpoint_gpu.py); its tensors change once the call returns."""
    import nvmeswap.checkpoint.checkpointer as checkpointer_module
    from nvmeswap.checkpoint.snapshot import Snapshot

    monkeypatch.setattr(checkpointer_module, "room_on_device", lambda image: True)
    monkeypatch.setattr(checkpointer_module, "packable", lambda obj, one_off: None)
    monkeypatch.setattr(Snapshot, "buffer", lambda *args: pytest.fail("a host snapshot was made"))
    state = mixed_state()
    expected = torch.load(_saved(state, tmp_path / "expected.pt"))
    future = nvmeswap.async_save(state, tmp_path / "one.pt")
    state["big"].zero_()
    state["views"][0].fill_(-1)
    assert future.result() is None
    with zipfile.ZipFile(tmp_path / "one.pt") as archive:
        assert archive.testzip() is None
    assert_same(expected, torch.load(tmp_path / "one.pt"))


def _saved(state, path):
    nvmeswap.save(state, path)
    return path


def _held_snapshots(monkeypatch):
    """Make each snapshot copy wait for the returned event: the test decides when the
    saving thread copies."""
    import threading

    from nvmeswap.checkpoint.snapshot import Snapshot

    go = threading.Event()
    original = Snapshot.copy_image

    def held(self, image, locked):
        assert go.wait(60), "the test never let the snapshot be taken"
        return original(self, image, locked)

    monkeypatch.setattr(Snapshot, "copy_image", held)
    return go


def test_background_snapshot_returns_before_the_copy(tmp_path, monkeypatch):
    """Note [snapshot in the background]: the call returns before any tensor is copied;
    once ``snapshot_taken`` is done the state may change, and the file holds the state
    as it was at the call."""
    state = {"w": torch.from_numpy(np.frombuffer(random_bytes(8 << 20, seed=41),
                                                 np.uint8).copy()),
             "layers": [torch.arange(1000, dtype=torch.float32), torch.ones(3, 5)],
             "step": 7}
    expected = {"w": state["w"].clone(), "layers": [t.clone() for t in state["layers"]],
                "step": 7}
    go = _held_snapshots(monkeypatch)
    with nvmeswap.Checkpointer() as checkpointer:
        future = checkpointer.async_save(state, tmp_path / "bg.pt", background_snapshot=True)
        assert not future.snapshot_taken.done() and not future.done()
        go.set()
        assert future.snapshot_taken.result(60) is None
        state["w"].zero_()
        state["layers"][0].add_(1)
        assert future.result(60) is None
    assert_same(expected, torch.load(tmp_path / "bg.pt"))
    # The one-call form, not held: the same guarantee.
    later = nvmeswap.async_save(state, tmp_path / "one.pt", background_snapshot=True)
    later.snapshot_taken.result(60)
    expected = {"w": state["w"].clone(), "layers": [t.clone() for t in state["layers"]],
                "step": 7}
    state["layers"][1].mul_(3)
    assert later.result(60) is None
    assert_same(expected, torch.load(tmp_path / "one.pt"))


def test_background_snapshot_refuses_a_state_changed_too_early(tmp_path, monkeypatch):
    """A tensor changed in place before ``snapshot_taken`` fails the save, naming the
    tensor; the previous checkpoint stays and no temporary file is left."""
    path = tmp_path / "ckpt.pt"
    nvmeswap.save({"model": {"a": torch.zeros(4)}}, path)
    before = path.read_bytes()
    state = {"model": {"a": torch.ones(4), "b": torch.ones(1 << 20)}}
    go = _held_snapshots(monkeypatch)
    with nvmeswap.Checkpointer() as checkpointer:
        future = checkpointer.async_save(state, path, background_snapshot=True)
        state["model"]["b"].add_(1)        # too early: the copy has not happened
        go.set()
        with pytest.raises(RuntimeError, match="model.b changed before the snapshot") as info:
            future.result(60)
        assert future.snapshot_taken.exception(60) is info.value
        assert str(path) in str(info.value)
        # The checkpointer goes on: the next save, waited for, is whole.
        again = checkpointer.async_save(state, path, background_snapshot=True)
        again.snapshot_taken.result(60)
        assert again.result(60) is None
    assert path.read_bytes() != before
    assert_same(state, torch.load(path))
    assert not [p for p in os.listdir(tmp_path) if TEMPORARY in p]


@pytest.mark.parametrize("background", [False, True])
@pytest.mark.parametrize("closing", ["close", "with"])
def test_closing_a_checkpointer_whose_one_off_save_is_in_flight(tmp_path, background,
                                                                 closing):
    """A one-off save closes its checkpointer from its own thread once written; a close()
    of the caller's meanwhile waits for it rather than for ever."""
    state = mixed_state()
    path = tmp_path / "one.pt"
    done = []

    def save_and_close():
        if closing == "with":
            with nvmeswap.Checkpointer() as checkpointer:
                future = checkpointer.async_save(state, path, one_off=True,
                                                 background_snapshot=background)
        else:
            checkpointer = nvmeswap.Checkpointer()
            future = checkpointer.async_save(state, path, one_off=True,
                                             background_snapshot=background)
            checkpointer.close()
        done.append((future.result(), checkpointer.closed))

    caller = threading.Thread(target=save_and_close, daemon=True)
    caller.start()
    caller.join(60)
    assert not caller.is_alive(), "close() waited for ever"
    assert done == [(None, True)]
    assert_same(state, torch.load(path))


def test_a_save_that_outlives_a_close_is_refused_and_keeps_nothing(tmp_path, monkeypatch):
    """close() while another thread's save is laying its state out: that save is refused
    once the checkpointer is closed, rather than writing through (and keeping) a ring
    close() has already freed."""
    import nvmeswap.checkpoint.checkpointer as checkpointer_module

    laying_out, closed = threading.Event(), threading.Event()
    real_layout = checkpointer_module.layout

    def slow_layout(obj, *args, **kwargs):
        laying_out.set()
        assert closed.wait(60)
        return real_layout(obj, *args, **kwargs)

    checkpointer = nvmeswap.Checkpointer()
    checkpointer.save({"w": torch.ones(8)}, tmp_path / "first.pt")     # its ring made
    monkeypatch.setattr(checkpointer_module, "layout", slow_layout)
    outcome = []

    def save():
        try:
            checkpointer.save({"w": torch.ones(8)}, tmp_path / "second.pt")
            outcome.append("saved")
        except ValueError as error:
            outcome.append(str(error))

    saver = threading.Thread(target=save)
    saver.start()
    assert laying_out.wait(60)
    checkpointer.close()
    closed.set()
    saver.join(60)
    assert outcome == ["this Checkpointer is closed"]
    assert checkpointer._saver is None and checkpointer._writer is None
    assert sorted(os.listdir(tmp_path)) == ["first.pt"]


def test_background_snapshot_of_a_state_that_holds_itself(tmp_path):
    """A state may hold a container twice, or itself (pickle's memo keeps one copy):
    watching its tensors ends, and the file is torch's."""
    shared = [torch.arange(6)]
    state = {"a": shared, "b": shared}
    state["self"] = state
    future = nvmeswap.async_save(state, tmp_path / "cycle.pt", background_snapshot=True)
    assert future.result(60) is None
    loaded = torch.load(tmp_path / "cycle.pt", weights_only=False)
    assert loaded["self"] is loaded and loaded["a"] is loaded["b"]
    assert torch.equal(loaded["a"][0], torch.arange(6))


def test_background_snapshots_follow_the_save_before(tmp_path, monkeypatch):
    """Saves in flight one after another: each snapshot is taken once the save before is
    written (one snapshot buffer), whatever mix of the two forms."""
    go = _held_snapshots(monkeypatch)
    states = [{"x": torch.full((1 << 18,), float(i))} for i in range(3)]
    with nvmeswap.Checkpointer() as checkpointer:
        first = checkpointer.async_save(states[0], tmp_path / "0.pt", background_snapshot=True)
        second = checkpointer.async_save(states[1], tmp_path / "1.pt",
                                         background_snapshot=True)
        assert not first.snapshot_taken.done() and not second.snapshot_taken.done()
        go.set()
        third = checkpointer.async_save(states[2], tmp_path / "2.pt")   # waits for both
        assert first.done() and second.done() and third.snapshot_taken.done()
        for state in states:
            state["x"].zero_()
        assert third.result(60) is None
    for i in range(3):
        assert_same({"x": torch.full((1 << 18,), float(i))}, torch.load(tmp_path / f"{i}.pt"))


@pytest.mark.parametrize("background", [False, True])
def test_async_save_without_a_thread_raises_and_leaves_nothing_in_flight(
        tmp_path, monkeypatch, background):
    """No thread for the save (the process's limit): the call raises, and the
    checkpointer neither waits forever for it nor refuses the next save."""
    import threading

    import nvmeswap.checkpoint.checkpointer as checkpointer_module

    class NoThread(threading.Thread):
        def start(self):
            raise RuntimeError("can't start new thread")

    with nvmeswap.Checkpointer() as checkpointer:
        monkeypatch.setattr(checkpointer_module.threading, "Thread", NoThread)
        with pytest.raises(RuntimeError, match="can't start new thread"):
            checkpointer.async_save({"x": torch.ones(4)}, tmp_path / "a.pt",
                                    background_snapshot=background)
        monkeypatch.undo()
        checkpointer.async_save({"x": torch.arange(4)}, tmp_path / "a.pt",
                                background_snapshot=background).result(60)
    assert_same({"x": torch.arange(4)}, torch.load(tmp_path / "a.pt"))


_EXIT_WITH_A_SAVE_IN_FLIGHT = r"""
import sys, torch, nvmeswap
path, how = sys.argv[1:]
state = {"w": torch.arange(8 << 20, dtype=torch.float32)}
if how == "one call":
    nvmeswap.async_save(state, path)
elif how == "background snapshot":
    nvmeswap.async_save(state, path, background_snapshot=True)
else:
    nvmeswap.Checkpointer().async_save(state, path)     # and never closed
"""


@pytest.mark.parametrize("how", ["one call", "background snapshot", "kept"])
def test_a_program_ending_with_an_async_save_in_flight_finishes_it(tmp_path, how):
    path = tmp_path / "last.pt"
    ended = subprocess.run([sys.executable, "-c", _EXIT_WITH_A_SAVE_IN_FLIGHT, str(path), how],
                           check=False, capture_output=True, text=True, timeout=120)
    assert ended.returncode == 0, ended.stderr
    assert torch.equal(torch.load(path)["w"], torch.arange(8 << 20, dtype=torch.float32))


@pytest.mark.parametrize("background", [False, True])
def test_async_saves_from_two_threads_take_turns(tmp_path, background):
    """Two threads saving through one Checkpointer at once: the snapshot buffer is one,
    so the saves take turns, and every file holds its own state."""
    import threading

    states = {f"{thread}-{k}": {"w": random_tensor((8 << 20,), torch.uint8, 10 * thread + k),
                                "k": k}
              for thread in range(2) for k in range(6)}
    futures, errors = {}, []
    start = threading.Barrier(2)

    def save_all(thread, checkpointer):
        try:
            start.wait()
            for k in range(6):
                name = f"{thread}-{k}"
                futures[name] = checkpointer.async_save(states[name], tmp_path / f"{name}.pt",
                                                        background_snapshot=background)
        except BaseException as error:
            errors.append(error)

    with nvmeswap.Checkpointer() as checkpointer:
        threads = [threading.Thread(target=save_all, args=(thread, checkpointer))
                   for thread in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for future in futures.values():
            future.result()
    assert not errors
    for name, state in states.items():
        assert_same(state, torch.load(tmp_path / f"{name}.pt"))


def race(save, load, rounds, tolerated=()):
    """Two threads each calling ``save(k)`` ``rounds`` times (k = 0, 1) while a third
    calls ``load()`` and checks the tensor "w" it returns holds one value whole; it goes
    on past ``tolerated`` errors, and loads after the saves if none succeeded meanwhile.
    Returns (errors, the values the loads saw)."""
    import threading

    errors, seen, saving = [], [], [True]

    def save_again(k):
        try:
            for _ in range(rounds):
                save(k)
        except BaseException as error:
            errors.append(error)

    def load_meanwhile():
        late_tries = 3      # once the saves are done: three tries for one load whole
        while saving[0] or (not seen and late_tries):
            late_tries -= not saving[0]
            try:
                w = load()["w"]
            except tolerated as error:
                errors.append(error)
                continue
            except BaseException as error:
                errors.append(error)
                return
            seen.append(int(w[0]))
            if int(w.min()) != int(w.max()):
                errors.append(AssertionError("a load saw two states in one file"))
                return

    savers = [threading.Thread(target=save_again, args=(k,)) for k in range(2)]
    loader = threading.Thread(target=load_meanwhile)
    for thread in [*savers, loader]:
        thread.start()
    for thread in savers:
        thread.join()
    saving[0] = False
    loader.join()
    return errors, seen


def test_saves_of_one_path_from_two_threads_each_land_whole(tmp_path):
    """Two threads saving one path at once, while a third loads it: every save returns
    with its file whole (each has a temporary file of its own: with one name per process
    a save renamed the other's half-written file over the path), every load sees one
    state whole, and no temporary file is left."""
    path = tmp_path / "s.pt"
    states = [{"w": torch.full((4 << 20,), k, dtype=torch.uint8)} for k in range(2)]
    nvmeswap.save(states[0], path)
    errors, seen = race(lambda k: nvmeswap.save(states[k], path), lambda: torch.load(path), 12)
    assert not errors, errors
    assert seen and set(seen) <= {0, 1} and int(torch.load(path)["w"].min()) in (0, 1)
    assert os.listdir(tmp_path) == ["s.pt"]


@pytest.mark.parametrize("form", ["load", "kept load", "load_into", "safetensors"])
def test_a_load_meanwhile_a_save_replaces_the_file_reads_one_file(tmp_path, form):
    """Note [one file per load]: a save renames its new file over the path while a load
    reads it. The load opens the path once: it returns the old checkpoint or the new one,
    whole. (Opening the path again for the tensors' bytes read them from the new file at
    the old one's offsets: tensors of the old shape holding the new file's bytes.)"""
    import threading

    path = tmp_path / ("s.safetensors" if form == "safetensors" else "s.pt")
    states = [{"a": torch.full((4 << 20,), 0, dtype=torch.uint8),
               "m": torch.full((1000,), 0, dtype=torch.uint8)},
              {"a": torch.full(((6 << 20) + 12288,), 1, dtype=torch.uint8),
               "m": torch.full((1000,), 1, dtype=torch.uint8)}]
    save = nvmeswap.save_safetensors if form == "safetensors" else nvmeswap.save
    save(states[0], path)
    errors, loads, saving = [], [0], [True]

    def save_alternately():
        try:
            for index in range(40):
                save(states[index % 2], path)
        except BaseException as error:
            errors.append(error)
        finally:
            saving[0] = False

    def load_meanwhile(checkpointer):
        try:
            while saving[0]:
                if form == "load":
                    loaded = nvmeswap.load(path)
                elif form == "kept load":
                    loaded = checkpointer.load(path)
                    checkpointer.free(loaded)
                elif form == "load_into":
                    loaded = {"a": torch.empty(4 << 20, dtype=torch.uint8),
                              "m": torch.empty(1000, dtype=torch.uint8)}
                    try:
                        nvmeswap.load_into(path, loaded)
                    except ValueError:      # the other state's shape: refused before reading
                        continue
                else:
                    loaded = nvmeswap.load_safetensors(path)
                k = int(loaded["m"][0])
                assert torch.equal(loaded["a"], states[k]["a"]), "a load mixed two files"
                assert torch.equal(loaded["m"], states[k]["m"]), "a load mixed two files"
                loads[0] += 1
        except BaseException as error:
            errors.append(error)

    with nvmeswap.Checkpointer() as checkpointer:
        threads = [threading.Thread(target=save_alternately),
                   threading.Thread(target=load_meanwhile, args=(checkpointer,))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert not errors, errors
    assert loads[0] > 0


def test_a_wait_from_another_thread_does_not_let_the_next_save_in_early(tmp_path,
                                                                       monkeypatch):
    """``wait_in_flight`` from another thread, while a save is being written: the next
    async save still waits for it before copying into the snapshot it is written from
    (the wait used to clear the save in flight, and the next save's bytes then went
    into the first save's file)."""
    import threading
    import time

    from nvmeswap.checkpoint.checkpointer import QueueCheckpointer

    real_write = QueueCheckpointer.write_buffer
    writing = threading.Event()

    def slow_write(self, *args):
        writing.set()
        time.sleep(0.5)
        return real_write(self, *args)

    monkeypatch.setattr(QueueCheckpointer, "write_buffer", slow_write)
    first = {"w": torch.full((4 << 20,), 1, dtype=torch.uint8)}
    second = {"w": torch.full((4 << 20,), 2, dtype=torch.uint8)}
    with nvmeswap.Checkpointer() as checkpointer:
        pending = checkpointer.async_save(first, tmp_path / "first.pt")
        writing.wait()
        waiter = threading.Thread(target=checkpointer.wait_in_flight)
        waiter.start()
        time.sleep(0.05)
        after = checkpointer.async_save(second, tmp_path / "second.pt")
        pending.result()
        after.result()
        waiter.join()
    assert_same(first, torch.load(tmp_path / "first.pt"))
    assert_same(second, torch.load(tmp_path / "second.pt"))


def test_async_save_failure_is_raised_by_result(tmp_path, small_filesystem):
    big = {"t": torch.zeros(8 << 20, dtype=torch.uint8)}       # more than the 4 MiB tmpfs
    path = small_filesystem / "full.pt"
    future = nvmeswap.async_save(big, path)
    with pytest.raises(OSError) as raised:
        future.result()
    assert raised.value.errno == errno.ENOSPC
    assert not path.exists()
    assert not [p for p in os.listdir(small_filesystem) if TEMPORARY in p]


def test_a_failed_save_leaves_the_previous_file(tmp_path, small_filesystem):
    path = small_filesystem / "s.pt"
    nvmeswap.save({"t": torch.ones(1000)}, path)
    with pytest.raises(OSError) as raised:
        nvmeswap.save({"t": torch.zeros(8 << 20, dtype=torch.uint8)}, path)
    assert raised.value.errno == errno.ENOSPC
    assert_same({"t": torch.ones(1000)}, torch.load(path))
    assert os.listdir(small_filesystem) == ["s.pt"]


def test_bad_arguments_fail_before_any_io(tmp_path):
    missing = tmp_path / "no" / "such" / "s.pt"
    with pytest.raises(FileNotFoundError) as raised:
        nvmeswap.save({"a": torch.ones(1)}, missing)
    assert raised.value.filename == str(missing.parent)
    with pytest.raises(FileNotFoundError) as raised:
        nvmeswap.load(tmp_path / "absent.pt")
    assert raised.value.filename == str(tmp_path / "absent.pt")
    with pytest.raises(IsADirectoryError):
        nvmeswap.save({"a": torch.ones(1)}, tmp_path)
    for save in (nvmeswap.save, nvmeswap.async_save, nvmeswap.save_safetensors):
        with pytest.raises(NotADirectoryError) as raised:   # at the call, nothing written
            save({"a": torch.ones(1)}, f"{tmp_path}/s.pt/")
        assert raised.value.filename == f"{tmp_path}/s.pt/"
    with pytest.raises(TypeError, match="str or os.PathLike"):
        nvmeswap.save({"a": torch.ones(1)}, 3)
    with pytest.raises(TypeError, match="aio_handle"):
        nvmeswap.Checkpointer(handle="fast")
    with pytest.raises(ValueError, match="chunk_bytes"):
        nvmeswap.Checkpointer(chunk_bytes=100)
    (tmp_path / "junk.pt").write_bytes(b"not a zip at all")
    with pytest.raises(ValueError, match="junk.pt: not a torch.save zip archive"):
        nvmeswap.load(tmp_path / "junk.pt")
    assert os.listdir(tmp_path) == ["junk.pt"]


@pytest.mark.parametrize("call", ["save", "async_save", "save_safetensors"])
def test_an_empty_path_fails_at_the_call(tmp_path, monkeypatch, call):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError):
        getattr(nvmeswap, call)({"a": torch.ones(1)}, "")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("call", ["save", "async_save", "save_safetensors"])
def test_a_save_through_a_symbolic_link_replaces_the_file_it_names(tmp_path, call):
    """As torch.save: "latest.pt -> step2.pt" stays a link, step2.pt gets the bytes."""
    state = {"w": random_tensor((5000,), torch.float32, 2)}
    (tmp_path / "step2.pt").write_bytes(b"an older checkpoint")
    (tmp_path / "latest.pt").symlink_to("step2.pt")
    if call == "async_save":
        nvmeswap.async_save(state, tmp_path / "latest.pt").result(60)
    else:
        getattr(nvmeswap, call)(state, tmp_path / "latest.pt")
    assert os.readlink(tmp_path / "latest.pt") == "step2.pt"
    loaded = (nvmeswap.load_safetensors if call == "save_safetensors" else nvmeswap.load)(
        tmp_path / "step2.pt")
    assert torch.equal(raw(loaded["w"]), raw(state["w"]))
    assert sorted(os.listdir(tmp_path)) == ["latest.pt", "step2.pt"]


@pytest.mark.parametrize("call", ["save", "async_save", "save_safetensors", "striped save"])
def test_a_name_too_long_for_a_suffix_is_saved(tmp_path, call):
    """torch.save takes any name the filesystem takes (255 bytes); the temporary file and
    the stripes of such a checkpoint are named by a hash of it instead."""
    state = {"w": random_tensor((5000,), torch.float32, 1)}
    path = tmp_path / ("m" * 240)
    if call == "striped save":
        folders = [tmp_path, tmp_path / "second"]
        folders[1].mkdir()
        with nvmeswap.Checkpointer(stripe_folders=folders) as checkpointer:
            checkpointer.save(state, path)
            checkpointer.save(state, path)      # the first one's stripes: orphans, removed
        assert len(os.listdir(folders[1])) == 1
    elif call == "async_save":
        nvmeswap.async_save(state, path).result(60)
    else:
        getattr(nvmeswap, call)(state, path)
    loaded = (nvmeswap.load_safetensors if call == "save_safetensors" else nvmeswap.load)(path)
    assert torch.equal(raw(loaded["w"]), raw(state["w"]))
    assert not [name for name in os.listdir(tmp_path) if TEMPORARY in name]


def test_a_closed_checkpointer_refuses_work(tmp_path):
    checkpointer = nvmeswap.Checkpointer()
    checkpointer.close()
    checkpointer.close()
    with pytest.raises(ValueError, match="closed"):
        checkpointer.save({}, tmp_path / "x.pt")


@pytest.mark.parametrize("given_handle", [False, True])
def test_a_one_call_save_locks_a_ring_its_checkpoint_needs(tmp_path, monkeypatch, handle,
                                                           given_handle):
    """The one-call saves lock a ring sized by their checkpoint (two chunks of 1 MiB for
    one of just over 1 MiB), a kept Checkpointer the 4 x 16 MiB of the checkpoints to
    come; with or without a handle, the bytes land whole."""
    from nvmeswap.checkpoint.image import StreamWriter
    rings = []
    real_init = StreamWriter.__init__

    def init(self, handle, chunk_bytes, chunks):
        rings.append(chunk_bytes * chunks)
        real_init(self, handle, chunk_bytes, chunks)
    monkeypatch.setattr(StreamWriter, "__init__", init)
    given = handle if given_handle else None
    state = {"w": random_tensor((1 << 20,), torch.uint8, 7)}
    nvmeswap.save(state, tmp_path / "a.pt", handle=given)
    nvmeswap.save_safetensors(state, tmp_path / "a.safetensors", handle=given)
    with nvmeswap.Checkpointer(given) as kept:
        kept.save(state, tmp_path / "b.pt")
    assert rings == [2 << 20, 2 << 20, 64 << 20]
    assert_same(state, torch.load(tmp_path / "a.pt"))
    assert_same(state, torch.load(tmp_path / "b.pt"))
    assert_same(state, nvmeswap.load_safetensors(tmp_path / "a.safetensors"))


@pytest.mark.parametrize(("size", "striped", "shape"), [
    (100 << 20, False, (2 << 20, 4)),       # one-call: small chunks (ring_shape)
    (100 << 20, True, (16 << 20, 4)),       # striped: chunks that span the devices
    (5 << 20, True, (5 << 18, 4)),          # no larger than the checkpoint needs
    (3000, False, (1 << 20, 1))])
def test_a_one_call_ring_is_small_unless_striped(size, striped, shape):
    from types import SimpleNamespace

    from nvmeswap.checkpoint.checkpointer import ring_shape
    assert ring_shape(None, 4, SimpleNamespace(size=size), striped) == shape
    assert ring_shape(8 << 20, 3, SimpleNamespace(size=size), striped) == (8 << 20, 3)


def test_a_given_handle_stays_open(handle, tmp_path):
    nvmeswap.save({"a": torch.arange(5)}, tmp_path / "a.pt", handle=handle)
    loaded = nvmeswap.load(tmp_path / "a.pt", handle=handle)
    assert handle.is_pinned(loaded["a"])
    assert_same({"a": torch.arange(5)}, loaded)
    handle.free_cpu_locked_tensor(loaded["a"])


def test_a_load_read_in_several_groups_keeps_every_byte(handle_checkpointer, tmp_path):
    """Note [checkpoint reads]: storages past 64 MiB go into further buffers."""
    checkpointer = handle_checkpointer
    from nvmeswap.checkpoint.loading import GROUP_BYTES

    count = GROUP_BYTES // 2 // 8 + 1234
    state = {f"t{k}": torch.arange(count, dtype=torch.int64) * (k + 1) - k for k in range(3)}
    state["odd"] = random_tensor((4099,), torch.bfloat16, 8)
    path = tmp_path / "groups.pt"
    checkpointer.save(state, path)
    loaded = checkpointer.load(path)
    assert_same(state, loaded)
    assert checkpointer.free(loaded) == 2
    torch.save(state, tmp_path / "torch.pt")
    loaded = checkpointer.load(tmp_path / "torch.pt")
    assert_same(state, loaded)
    assert checkpointer.free(loaded) == 2


def dead_pid():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def other_tag():
    ours = commit.writer_name().split("-")[0]
    return "0badf00d" if ours != "0badf00d" else "0badf00e"


@pytest.fixture
def tells_unwritten_ranges(tmp_path):
    """Skips where tmp_path's filesystem cannot report a range never written."""
    probe = tmp_path / "probe"
    commit.create(str(probe), 8192)
    fd = os.open(probe, os.O_RDONLY)
    try:
        told = commit.never_written(fd, 8192)
    finally:
        os.close(fd)
        probe.unlink()
    if told != (0, 8192):
        pytest.skip("this filesystem does not report unwritten extents (FIEMAP)")


def test_a_range_never_written_fails_the_commit_naming_it(tmp_path, tells_unwritten_ranges):
    """Note [never written]: the file is allocated at its full size, so a write that left
    a range out would pass a check of its size; the range is found and the old file kept."""
    path = tmp_path / "ckpt.pt"
    path.write_bytes(b"the previous checkpoint")
    size = 5 * 4096 + 100

    def write_all_but_one_block(name):
        fd = os.open(name, os.O_WRONLY)
        try:
            os.pwrite(fd, b"a" * 4096, 0)
            os.pwrite(fd, b"b" * (size - 8192), 8192)
        finally:
            os.close(fd)

    with pytest.raises(OSError) as raised:
        commit.write_whole(str(path), size, write_all_but_one_block)
    assert raised.value.errno == errno.EIO
    assert TEMPORARY in raised.value.filename
    assert "bytes 4096 to 8192 were never written" in str(raised.value)
    assert os.listdir(tmp_path) == ["ckpt.pt"]
    assert path.read_bytes() == b"the previous checkpoint"


def test_a_save_whose_write_was_lost_fails_and_keeps_the_previous(tmp_path, monkeypatch,
                                                                  tells_unwritten_ranges):
    """A ring slot's write that never reached the file (a stand-in for a lost request)
    fails the save at its commit, and the previous checkpoint loads."""
    from nvmeswap.checkpoint.queue_writer import QueueWriter

    path = tmp_path / "ckpt.pt"
    previous = {"w": random_tensor((1 << 20,), torch.float32, 1)}
    nvmeswap.save(previous, path)
    real_submit = QueueWriter.submit_pwrite
    calls = []

    def losing_the_second(self, buffer, filename, file_offset):
        calls.append(file_offset)
        if len(calls) == 2:
            return real_submit(self, buffer[:0], filename, file_offset)
        return real_submit(self, buffer, filename, file_offset)

    monkeypatch.setattr(QueueWriter, "submit_pwrite", losing_the_second)
    with pytest.raises(OSError, match="were never written"):
        nvmeswap.save({"w": random_tensor((2 << 20,), torch.float32, 2)}, path)
    assert len(calls) > 2
    assert os.listdir(tmp_path) == ["ckpt.pt"]
    assert_same(previous, nvmeswap.load(path))


def test_a_save_removes_temporary_files_only_of_gone_writers_it_can_see(tmp_path):
    """Note [files named by their process]: a file of another machine or pid namespace
    (another tag) may be a live save's there, whatever its pid means here."""
    path = tmp_path / "ckpt.pt"
    gone = dead_pid()
    ours = commit.writer_name().split("-")[0]
    left = {f"ckpt.pt{TEMPORARY}{other_tag()}-{gone}-0",                # another machine's
            f"ckpt.pt{TEMPORARY}{other_tag()}-{os.getpid()}-0",        # its pid is ours
            f"ckpt.pt{TEMPORARY}{ours}-{os.getpid()}-999",              # this process's
            f"ckpt.pt{TEMPORARY}{ours}-{10 ** 30}-0",                   # no pid there is
            f"other.pt{TEMPORARY}{ours}-{gone}-0"}                      # another name's
    removed = {f"ckpt.pt{TEMPORARY}{ours}-{gone}-0", f"ckpt.pt{TEMPORARY}{ours}-{gone}-7"}
    for name in left | removed:
        (tmp_path / name).write_bytes(b"half a checkpoint")
    state = {"w": random_tensor((1000,), torch.float32, 2)}
    nvmeswap.save(state, path)
    assert set(os.listdir(tmp_path)) == left | {"ckpt.pt"}
    assert torch.equal(raw(nvmeswap.load(path)["w"]), raw(state["w"]))


def test_a_save_after_an_async_save_lands_after_it(tmp_path):
    """Saves of one checkpointer land in the order they were called: a synchronous save
    (or save_safetensors) after an async_save waits for it, so the file holds the later
    state."""
    path = tmp_path / "s.pt"
    older, newer = ({"w": random_tensor((8 << 20,), torch.uint8, seed)} for seed in (1, 2))
    with nvmeswap.Checkpointer() as checkpointer:
        for save, load in ((checkpointer.save, nvmeswap.load),
                           (checkpointer.save_safetensors, nvmeswap.load_safetensors)):
            pending = checkpointer.async_save(older, path)
            save(newer, path)
            assert pending.done()
            pending.result()
            assert_same(newer, load(path))

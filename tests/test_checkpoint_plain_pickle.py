"""nvmeswap's own pickle of a plain state: torch's bytes, or torch's pickler (Note [own
pickle of a plain state] in nvmeswap/checkpoint/plain_pickle.py)."""
import collections
import io
import pickle
import random

import pytest

torch = pytest.importorskip("torch")

from nvmeswap.checkpoint import plain_pickle, torch_zip


def torch_pickle(obj):
    """torch.save's pickle of ``obj`` and the names of its storage records, in order."""
    records = torch_zip._record(obj, pickle, 2, skip_data=False, name_storages=False)
    assert records.records[0][0] == "data.pkl"
    return records.records[0][1], [name for name, _ in records.records
                                   if name.startswith("data/")]


def assert_torch_pickle(obj):
    ours = plain_pickle.plain_pickle(obj)
    assert ours is not None
    data, storages = ours
    theirs, names = torch_pickle(obj)
    assert data == theirs
    assert [f"data/{key}" for key in storages] == names


def typed_dtypes():
    """Dtypes of a typed storage that a dense tensor can have."""
    left_out = torch.storage._new_dtypes() | {torch.qint8, torch.qint32, torch.quint8,
                                               torch.quint4x2, torch.quint2x4}
    return [dtype for dtype in torch.storage._dtype_to_storage_type_map()
            if dtype not in left_out]


def trained_model_state():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8),
                                torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), betas=(0.8, 0.99))
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": 3}


def test_a_trained_model_and_its_optimizer_pickle_as_torch_pickles_them():
    assert_torch_pickle(trained_model_state())


@pytest.mark.parametrize("dtype", typed_dtypes(), ids=str)
def test_every_typed_dtype_pickles_as_torch_pickles_it(dtype):
    base = torch.arange(24).to(dtype)
    assert_torch_pickle({"whole": base, "view": base[2:].view(2, 11).t(),
                         "scalar": base[5], "empty": base[:0]})


def test_views_shapes_and_repeated_objects_pickle_as_torch_pickles_them():
    base = torch.arange(120, dtype=torch.float32)
    shared = ["shared", (1, 2)]
    state = {"base": base, "again": base, "4d": base.view(2, 3, 4, 5),
             "strided": base.view(2, 3, 4, 5).permute(3, 1, 0, 2)[1:], "zero-dim": torch.ones(()),
             "grad": torch.ones(3, requires_grad=True), "other": torch.zeros(7, 1, 1, 1, 1),
             "lists": [shared, shared, (shared, base[1:])], "empty": ((), [], {}, ""),
             "cpu": "storage", "storage": "cpu"}
    assert_torch_pickle(state)


@pytest.mark.parametrize("count", [1, 2, 999, 1000, 1001, 2000, 2001])
def test_batches_of_items_pickle_as_torch_pickles_them(count):
    """The C pickler writes exact dicts, lists and OrderedDicts' items in batches of
    1000, each kind its own way at the edges."""
    assert_torch_pickle({"dict": {f"k{index}": torch.zeros(1) for index in range(count)},
                         "list": list(range(count)),
                         "ordered": collections.OrderedDict((index, -index)
                                                            for index in range(count))})


def test_numbers_strings_and_a_memo_of_over_256_entries_pickle_as_torch_pickles_them():
    numbers = [0, 1, 255, 256, 65535, 65536, -1, -(1 << 31), (1 << 31) - 1, 1 << 31,
               1 << 64, -(1 << 64), 1 << 2100, 0.0, -0.0, 1.5, float("inf"), float("nan"),
               True, False, None]
    strings = ["", "a", "é", "\ud800", "x" * 300, "日本"]
    assert_torch_pickle({"numbers": numbers, "strings": strings,
                         "many": {f"key {index}": (index, float(index)) for index in range(400)}})


def test_random_nested_states_pickle_as_torch_pickles_them():
    rng = random.Random(7)
    base = torch.arange(64, dtype=torch.float64)
    made = []

    def value(depth):
        kind = rng.randrange(9 if depth < 4 else 5)
        if kind == 0:
            return rng.randrange(-(1 << 40), 1 << 40) >> rng.randrange(40)
        if kind == 1:
            return rng.choice([rng.random(), "s" * rng.randrange(4), None, True, False])
        if kind == 2:
            start = rng.randrange(60)
            return base[start:start + rng.randrange(4)]
        if kind == 3:
            return torch.ones(rng.randrange(3), dtype=rng.choice(typed_dtypes()))
        if kind == 4 and made:
            return rng.choice(made)         # met again: the memo
        if kind in (4, 5):
            made.append([value(depth + 1) for _ in range(rng.randrange(5))])
        elif kind == 6:
            made.append(tuple(value(depth + 1) for _ in range(rng.randrange(6))))
        elif kind == 7:
            made.append({rng.choice(["a", "b", "c", 1, 2, (1, "t")]): value(depth + 1)
                         for _ in range(rng.randrange(5))})
        else:
            made.append(collections.OrderedDict(
                (str(index), value(depth + 1)) for index in range(rng.randrange(4))))
        return made[-1]

    for _ in range(60):
        made.clear()
        assert_torch_pickle({"state": value(0)})


class Subclass(torch.Tensor):
    pass


@pytest.mark.parametrize("item", [
    pytest.param(lambda: torch.nn.Parameter(torch.ones(2)), id="parameter"),
    pytest.param(lambda: torch.ones(2).as_subclass(Subclass), id="subclass"),
    pytest.param(lambda: torch.ones(2, dtype=torch.uint16), id="untyped-dtype"),
    pytest.param(lambda: torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8),
                 id="quantized"),
    pytest.param(lambda: torch.ones(2, dtype=torch.complex64).conj(), id="conjugate"),
    pytest.param(lambda: torch.ones(4).to_sparse(), id="sparse"),
    pytest.param(lambda: {1, 2}, id="set"),
    pytest.param(lambda: b"bytes", id="bytes"),
    pytest.param(lambda: collections.defaultdict(int), id="dict-subclass"),
    pytest.param(lambda: torch.float32, id="dtype"),
])
def test_states_holding_anything_else_are_left_to_torch(item):
    assert plain_pickle.plain_pickle({"plain": torch.ones(2), "other": [item()]}) is None


def test_a_tensor_with_an_attribute_of_its_own_is_left_to_torch():
    tensor = torch.ones(2)
    tensor.note = "mine"
    assert plain_pickle.plain_pickle({"tensor": tensor}) is None


def test_a_tuple_holding_itself_is_left_to_torch():
    holder = []
    looped = (holder,)
    holder.append(looped)
    assert plain_pickle.plain_pickle({"looped": looped}) is None


def test_one_storage_under_two_dtypes_is_refused_as_torch_refuses_it(tmp_path):
    import nvmeswap

    base = torch.zeros(4)
    state = {"float": base, "int": base.view(torch.int32)}
    assert plain_pickle.plain_pickle(state) is None
    with pytest.raises(RuntimeError, match="view the same data as different types"):
        nvmeswap.save(state, tmp_path / "refused.pt")
    assert not (tmp_path / "refused.pt").exists()


def test_this_torch_checks_out_against_the_probe():
    assert torch_zip._records_besides_pickle() == [
        (".format_version", b"1"), (".storage_alignment", b"4096"), ("byteorder", b"little")]


def test_a_plain_save_does_not_run_torchs_pickler_and_loads_back(tmp_path, monkeypatch):
    import nvmeswap

    state = trained_model_state()
    expected = torch_zip._rendered(torch_zip._image(
        torch_zip._record(state, pickle, 2, skip_data=False, name_storages=False)))
    torch_zip._records_besides_pickle()         # its probe is torch's to pickle

    def refused(*args, **kwargs):
        raise AssertionError("torch's pickler ran")

    monkeypatch.setattr(torch.serialization, "_save", refused)
    path = tmp_path / "plain.pt"
    nvmeswap.save(state, path)
    assert path.read_bytes() == expected
    monkeypatch.undo()
    loaded = torch.load(path, weights_only=True)
    assert loaded["epoch"] == 3
    assert loaded["optimizer"]["param_groups"] == state["optimizer"]["param_groups"]
    for name, tensor in state["model"].items():
        assert torch.equal(loaded["model"][name], tensor)
    assert loaded["model"]._metadata == state["model"]._metadata


def test_a_state_left_to_torch_still_saves_and_loads(tmp_path):
    import nvmeswap

    state = {"weights": torch.arange(6.0), "tags": {"a", "b"}, "raw": b"\x00\x01"}
    path = tmp_path / "other.pt"
    nvmeswap.save(state, path)
    loaded = torch.load(io.BytesIO(path.read_bytes()), weights_only=False)
    assert loaded["tags"] == {"a", "b"} and loaded["raw"] == b"\x00\x01"
    assert torch.equal(loaded["weights"], state["weights"])


def test_a_tensor_made_by_autograd_pickles_as_torch_pickles_it():
    leaf = torch.ones(3, requires_grad=True)
    assert_torch_pickle({"made": leaf * 2, "leaf": leaf})


def test_a_program_pickling_tensors_its_own_way_through_copyreg_is_left_to_torch(monkeypatch):
    import copyreg

    def as_list(tensor):
        return list, (tensor.tolist(),)

    monkeypatch.setitem(copyreg.dispatch_table, torch.Tensor, as_list)
    assert plain_pickle.plain_pickle({"w": torch.ones(2)}) is None
    monkeypatch.undo()
    assert plain_pickle.plain_pickle({"w": torch.ones(2)}) is not None

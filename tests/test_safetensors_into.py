"""load_safetensors_into: a safetensors file read straight into tensors the caller has;
and safetensors checkpoints striped over several folders."""
import json
import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="needs torch (pip install torch)")

from stand_in_device import copied, device_tensor, use_stand_in_device
from test_checkpoint import flat_state, random_tensor, raw

import nvmeswap


def stripe_folders(tmp_path, count):
    made = [str(tmp_path / f"dev{k}") for k in range(count)]
    for folder in made:
        os.mkdir(folder)
    return made


def zeros_like(tensors):
    return {name: torch.zeros_like(tensor) for name, tensor in tensors.items()}


def assert_bytes_equal(expected, got):
    assert list(expected) == list(got)
    for name in expected:
        assert torch.equal(raw(expected[name]), raw(got[name])), name


def writers():
    yield "nvmeswap", nvmeswap.save_safetensors
    try:
        from safetensors.torch import save_file
    except ImportError:
        return
    yield "safetensors", lambda tensors, path: save_file(tensors, str(path))


@pytest.mark.parametrize("writer", [name for name, _ in writers()])
def test_every_dtype_lands_in_the_given_tensors(tmp_path, writer):
    saved = flat_state()
    path = tmp_path / "s.safetensors"
    dict(writers())[writer](saved, path)
    into = zeros_like(saved)
    addresses = {name: tensor.data_ptr() for name, tensor in into.items()}
    assert nvmeswap.load_safetensors_into(path, into) is into
    assert_bytes_equal(saved, into)
    assert {name: tensor.data_ptr() for name, tensor in into.items()} == addresses


def test_locked_targets_and_a_kept_handle(tmp_path):
    saved = {"a": random_tensor((3 << 20,), torch.float32, 1),
             "b": random_tensor((5, 4097), torch.bfloat16, 2)}
    path = tmp_path / "s.safetensors"
    nvmeswap.save_safetensors(saved, path)
    with nvmeswap.aio_handle() as handle:
        into = {name: handle.new_cpu_locked_tensor(t.numel(), t).view(t.shape)
                for name, t in saved.items()}
        nvmeswap.load_safetensors_into(path, into, handle=handle)
        assert_bytes_equal(saved, into)
        for tensor in into.values():
            assert handle.free_cpu_locked_tensor(tensor)


def test_strict_names_and_a_part_of_the_file(tmp_path):
    saved = flat_state()
    path = tmp_path / "s.safetensors"
    nvmeswap.save_safetensors(saved, path)
    part = {"big": torch.zeros_like(saved["big"]), "t.int16": torch.zeros_like(saved["t.int16"])}
    with pytest.raises(KeyError, match="in the file only"):
        nvmeswap.load_safetensors_into(path, part)
    assert not part["big"].any() and not part["t.int16"].any()     # refused before any read
    nvmeswap.load_safetensors_into(path, part, strict=False)
    assert_bytes_equal({k: saved[k] for k in part}, part)
    extra = zeros_like(saved) | {"not.saved": torch.ones(3)}
    with pytest.raises(KeyError, match=r"in the target only \['not.saved'\]"):
        nvmeswap.load_safetensors_into(path, extra)
    nvmeswap.load_safetensors_into(path, extra, strict=False)
    assert torch.equal(extra["not.saved"], torch.ones(3))
    assert_bytes_equal(saved, {k: extra[k] for k in saved})


@pytest.mark.parametrize("wrong, match", [
    (lambda t: t.to(torch.float64), "float32 .* in the file, torch.float64"),
    (lambda t: t.reshape(-1), r"\(5, 4096\) in the file"),
    (lambda t: torch.zeros(4096, 5).t(), "not contiguous"),
    (lambda t: [0.0] * 5, "list in memory, not a tensor"),
])
def test_mismatches_are_refused_before_any_read(tmp_path, wrong, match):
    saved = {"first": random_tensor((1 << 20,), torch.uint8, 3),
             "w": random_tensor((5, 4096), torch.float32, 4)}
    path = tmp_path / "s.safetensors"
    nvmeswap.save_safetensors(saved, path)
    into = {"first": torch.zeros_like(saved["first"]),
            "w": wrong(torch.zeros_like(saved["w"]))}
    with pytest.raises((ValueError, TypeError), match=match):
        nvmeswap.load_safetensors_into(path, into)
    assert not into["first"].any()      # the tensor before the bad one was not read either


def test_a_file_shorter_than_its_header_says_names_the_file(tmp_path):
    saved = {"w": random_tensor((1 << 20,), torch.uint8, 5)}
    path = tmp_path / "s.safetensors"
    nvmeswap.save_safetensors(saved, path)
    with open(path, "r+b") as file:
        file.truncate(path.stat().st_size - 1)
    with pytest.raises(ValueError, match=f"{path}: .* bytes, but its header describes"):
        nvmeswap.load_safetensors_into(path, {"w": torch.zeros_like(saved["w"])})


def _with_header(path, header, data):
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + data)


@pytest.mark.parametrize("header, expected", [
    ({"t": {"dtype": "F32", "shape": [1000], "data_offsets": [0, 0]}},
     "t has 0 bytes for shape"),
    ({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 6]}}, "t has 6 bytes for shape"),
    ({"t": 5}, "t is not described by dtype, shape and data_offsets"),
    ({"t": {"dtype": "F32", "shape": [2]}}, "t is not described by dtype, shape and"),
    ([1, 2], "bad safetensors header: a JSON list"),
    ({"t": {"dtype": "F32", "shape": [2], "data_offsets": ["0", "8"]}},
     "t has bad data_offsets"),
    ({"t": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, "t has a bad shape"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
      "b": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, "shared with another"),
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, "a gap"),
], ids=["no bytes", "odd bytes", "not a dict", "no offsets", "a list", "text offsets",
        "negative shape", "shared bytes", "gap"])
@pytest.mark.parametrize("call", ["load", "load_into"])
def test_a_damaged_header_is_an_error_naming_the_file(tmp_path, header, expected, call):
    """Never tensors of bytes a damaged header misplaces (nor uninitialised memory)."""
    path = tmp_path / "damaged.safetensors"
    _with_header(path, header, bytes(range(8)))
    with pytest.raises(ValueError, match=f"damaged.safetensors: .*{expected}"):
        if call == "load":
            nvmeswap.load_safetensors(path)
        else:
            nvmeswap.load_safetensors_into(path, {"t": torch.zeros(2), "a": torch.zeros(2),
                                                  "b": torch.zeros(2)}, strict=False)


def test_cuda_targets_through_the_staging_space(tmp_path, monkeypatch):
    use_stand_in_device(monkeypatch)
    saved = {"w": random_tensor(((3 << 20) + 5,), torch.uint8, 6)}
    path = tmp_path / "s.safetensors"
    nvmeswap.save_safetensors(saved, path)
    with nvmeswap.aio_handle() as handle:
        target = device_tensor(handle, (3 << 20) + 5)
        nvmeswap.load_safetensors_into(path, {"w": target}, handle=handle)
        assert bytes(target.numpy()) == raw(saved["w"]).numpy().tobytes()
        assert copied(target) == (3 << 20) + 5     # through the copier, as CUDA memory


def assert_both_loads_read(checkpointer, path, saved):
    """``load_safetensors`` and ``load_safetensors_into`` of ``checkpointer`` give back
    ``saved``'s bytes."""
    loaded = checkpointer.load_safetensors(path)
    assert_bytes_equal(saved, loaded)
    checkpointer.free(loaded)
    into = zeros_like(saved)
    checkpointer.load_safetensors_into(path, into)
    assert_bytes_equal(saved, into)


def test_a_striped_safetensors_checkpoint_round_trips(tmp_path):
    folders = stripe_folders(tmp_path, 3)
    saved = flat_state()
    path = os.path.join(folders[0], "s.safetensors")
    with nvmeswap.Checkpointer(stripe_folders=folders, stripe_bytes=64 << 10) as checkpointer:
        checkpointer.save_safetensors(saved, path, metadata={"step": "7"})
        layout = json.loads(Path(path).read_text())     # the path holds the layout
        assert all(os.path.getsize(os.path.join(f, layout["name"])) > 0 for f in folders)
        assert_both_loads_read(checkpointer, path, saved)
    # Any loader finds the layout from the one path.
    into = zeros_like(saved)
    nvmeswap.load_safetensors_into(path, into)
    assert_bytes_equal(saved, into)
    assert_bytes_equal(saved, nvmeswap.load_safetensors(path))


def test_a_striped_checkpointer_reads_a_plain_file(tmp_path):
    folders = stripe_folders(tmp_path, 2)
    saved = flat_state()
    path = tmp_path / "plain.safetensors"
    nvmeswap.save_safetensors(saved, path)
    with nvmeswap.Checkpointer(stripe_folders=folders) as checkpointer:
        assert_both_loads_read(checkpointer, path, saved)

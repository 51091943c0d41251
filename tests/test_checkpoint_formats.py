"""safetensors files: the package reads ours and we read the package's, bit for bit."""
import json
import struct

import pytest

torch = pytest.importorskip("torch", reason="needs torch (pip install torch)")

from test_checkpoint import assert_same, flat_state, random_tensor

import nvmeswap

safetensors_torch = pytest.importorskip("safetensors.torch",
                                        reason="safetensors is not installed")

def test_the_package_reads_what_we_wrote(tmp_path):
    state = flat_state()
    path = tmp_path / "ours.safetensors"
    nvmeswap.save_safetensors(state, path, metadata={"format": "pt", "step": "3"})
    loaded = safetensors_torch.load_file(path)
    assert_same(state, {k: loaded[k] for k in state})
    from safetensors import safe_open

    with safe_open(str(path), "pt") as opened:
        assert opened.metadata() == {"format": "pt", "step": "3"}
    length = struct.unpack("<Q", path.read_bytes()[:8])[0]
    assert (8 + length) % 4096 == 0                     # the data starts aligned
    assert json.loads(path.read_bytes()[8:8 + length])["__metadata__"]["step"] == "3"


def test_we_read_what_the_package_wrote(tmp_path):
    state = flat_state()
    path = tmp_path / "theirs.safetensors"
    safetensors_torch.save_file(state, path)
    with nvmeswap.aio_handle() as handle:
        loaded = nvmeswap.load_safetensors(path, handle=handle)
        assert_same(state, {k: loaded[k] for k in state})
        assert handle.is_pinned(loaded["big"])
        handle.free_cpu_locked_tensor(loaded["big"])


def test_round_trip_and_refusals(tmp_path):
    state = flat_state()
    path = tmp_path / "s.safetensors"
    nvmeswap.save_safetensors(state, path)
    loaded = nvmeswap.load_safetensors(path)
    assert_same(state, {k: loaded[k] for k in state})
    shared = torch.arange(10.0)
    with pytest.raises(ValueError, match="share memory"):
        nvmeswap.save_safetensors({"a": shared, "b": shared[2:]}, tmp_path / "x")
    with pytest.raises(ValueError, match="no name for torch.complex128"):
        nvmeswap.save_safetensors({"a": torch.zeros(2, dtype=torch.complex128)}, tmp_path / "x")
    with pytest.raises(TypeError, match="keys are str"):
        nvmeswap.save_safetensors({1: shared}, tmp_path / "x")
    with pytest.raises(TypeError, match="metadata"):
        nvmeswap.save_safetensors({"a": shared}, tmp_path / "x", metadata={"a": 1})
    assert not (tmp_path / "x").exists()
    (tmp_path / "short").write_bytes(struct.pack("<Q", 50) + b"{}")
    with pytest.raises(ValueError, match="short: the safetensors header is cut short"):
        nvmeswap.load_safetensors(tmp_path / "short")


def test_a_non_contiguous_tensor_is_saved_as_its_values(tmp_path):
    base = random_tensor((30, 40), torch.float32, 3)
    nvmeswap.save_safetensors({"t": base.t(), "row": base[4]}, tmp_path / "v.safetensors")
    loaded = safetensors_torch.load_file(tmp_path / "v.safetensors")
    assert_same({"t": base.t().contiguous(), "row": base[4].clone()}, loaded)


def test_a_tensor_with_a_bit_is_saved_as_its_values(tmp_path):
    """A conjugate or negative view's bytes are not its values: the file holds its values,
    as the package and nvmeswap read them."""
    values = random_tensor((6,), torch.complex64, 4)
    state = {"conj": values.conj(), "neg": values.conj().imag}
    path = tmp_path / "bits.safetensors"
    nvmeswap.save_safetensors(state, path)
    expected = {name: tensor.resolve_conj().resolve_neg() for name, tensor in state.items()}
    assert_same(expected, safetensors_torch.load_file(path))
    assert_same(expected, dict(nvmeswap.load_safetensors(path)))
    with pytest.raises(ValueError, match="the tensor for conj is a conjugate or negative"):
        nvmeswap.load_safetensors_into(path, {"conj": torch.zeros_like(values).conj()},
                                       strict=False)
    with pytest.raises(ValueError, match="the tensor for conj is on meta"):
        nvmeswap.load_safetensors_into(path, {"conj": values.to("meta")}, strict=False)


def test_a_header_too_large_for_readers_is_refused_before_any_file(tmp_path):
    """The package reads no header over 100 MB: such a save fails at the call, and the
    file saved before stays."""
    path = tmp_path / "m.safetensors"
    nvmeswap.save_safetensors({"w": torch.ones(3)}, path)
    with pytest.raises(ValueError, match="more than readers take"):
        nvmeswap.save_safetensors({"w": torch.ones(3)}, path,
                                  metadata={"notes": "x" * 100_000_000})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors"]
    assert_same({"w": torch.ones(3)}, safetensors_torch.load_file(path))


def test_microscaling_dtypes_both_ways(tmp_path):
    """float8_e8m0fnu is "F8_E8M0"; float4_e2m1fn_x2 is "F4", whose header counts 4-bit
    values, twice torch's last dimension (Note [packed float4])."""
    generator = torch.Generator().manual_seed(3)
    state = {f"f4 {index}": torch.randint(0, 256, shape, dtype=torch.uint8,
                                          generator=generator).view(torch.float4_e2m1fn_x2)
             for index, shape in enumerate([(3, 4), (1,), (0,), (2, 0)])}
    state["e8m0"] = random_tensor((5, 7), torch.uint8, 9).view(torch.float8_e8m0fnu)
    ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
    nvmeswap.save_safetensors(state, ours)
    safetensors_torch.save_file(state, theirs)
    for path in (ours, theirs):
        header = json.loads(path.read_bytes()[8:8 + struct.unpack("<Q", path.read_bytes()[:8])[0]])
        assert header["f4 0"]["dtype"] == "F4" and header["f4 0"]["shape"] == [3, 8]
        assert header["e8m0"]["dtype"] == "F8_E8M0"
        for loaded in (safetensors_torch.load_file(path), nvmeswap.load_safetensors(path)):
            assert_same(state, {name: loaded[name] for name in state})
        into = {name: torch.empty_like(tensor) for name, tensor in state.items()}
        assert_same(state, nvmeswap.load_safetensors_into(path, into))
    with pytest.raises(ValueError, match="a 0-dim torch.float4_e2m1fn_x2 tensor has no "
                                         "safetensors form"):
        nvmeswap.save_safetensors({"x": torch.zeros((), dtype=torch.uint8).view(
            torch.float4_e2m1fn_x2)}, tmp_path / "x")
    odd = tmp_path / "odd.safetensors"
    text = json.dumps({"x": {"dtype": "F4", "shape": [3], "data_offsets": [0, 1]}}).encode()
    odd.write_bytes(struct.pack("<Q", len(text)) + text + b"\0")
    with pytest.raises(ValueError, match=r"odd.safetensors: x has shape \[3\] of 4-bit values"):
        nvmeswap.load_safetensors(odd)


@pytest.mark.parametrize(("entry", "message"), [
    ({"__metadata__": ["a"]}, "__metadata__ is not an object of strings"),
    ({"__metadata__": {"a": 1}}, "__metadata__ is not an object of strings"),
    ({"y": {"dtype": "F32", "shape": [0, 2 ** 63], "data_offsets": [8, 8]}},
     r"y has a bad shape \[0, 9223372036854775808\]"),
])
def test_a_header_the_package_refuses_is_refused_naming_the_file(tmp_path, entry, message):
    path = tmp_path / "bad.safetensors"
    header = {**entry, "x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + struct.pack("<2f", 1, 2))
    with pytest.raises(ValueError, match=f"bad.safetensors: .*{message}"):
        nvmeswap.load_safetensors(path)

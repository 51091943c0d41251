"""DCP's stream extensions and safetensors serialization through NvmeFileSystemWriter /
Reader (Note [DCP files]): the files are DCP's to the byte, moved by DCP's own file I/O
with a warning, and load back bit for bit through either reader. One process
(``no_dist``)."""
import io
import warnings

import pytest

torch = pytest.importorskip("torch", reason="needs torch (pip install torch)")
dcp = pytest.importorskip("torch.distributed.checkpoint")
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._extension import (
    ExtensionRegistry,
    StreamTransformExtension,
)
from torch.distributed.checkpoint.filesystem import SerializationFormat

from nvmeswap import BufferedIOWarning, errors
from nvmeswap.checkpoint.dcp import NvmeFileSystemReader, NvmeFileSystemWriter

KEY = 0x5A
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class XorBytes(StreamTransformExtension):
    """Every byte XORed with KEY: a transform whose output differs from its input byte
    by byte (as compression's does) and needs no extra package."""

    @staticmethod
    def registry_name():
        return "test.xor"

    @staticmethod
    def from_descriptor(version):
        return XorBytes()

    def get_descriptor(self):
        return f"{self.registry_name()}/1"

    def transform_to(self, output):
        class Writer(io.RawIOBase):
            def writable(self):
                return True

            def write(self, data):
                output.write(bytes(b ^ KEY for b in memoryview(data).cast("B")))
                return len(memoryview(data).cast("B"))

            def flush(self):
                output.flush()

        return Writer()

    def transform_from(self, stream):
        return io.BytesIO(bytes(b ^ KEY for b in stream.read()))


def state():
    made = torch.Generator().manual_seed(7)
    return {"w": torch.randn(301, 77, generator=made),
            "emb": torch.randn(65, 33, generator=made).bfloat16(),
            "step": torch.tensor(12), "lr": 0.25}


def zeroed(saved):
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None
            for k, v in saved.items()}


def raw(tensor):
    return tensor.reshape(-1).view(torch.uint8)


def assert_loaded(saved, loaded):
    for key, value in saved.items():
        if isinstance(value, torch.Tensor):
            assert value.dtype == loaded[key].dtype and torch.equal(raw(value), raw(loaded[key])), key
        else:
            assert loaded[key] == value, key


def registry():
    made = ExtensionRegistry()
    made.register(XorBytes)
    return made


def test_stream_extensions_are_written_and_read_by_dcp_itself(tmp_path, monkeypatch):
    monkeypatch.setattr(errors, "_warned", set())     # each warning once per process
    saved = state()
    with pytest.warns(BufferedIOWarning, match="NvmeFileSystemWriter: stream extensions "
                                                "test.xor/1: DCP's own file I/O"):
        dcp.save(saved, storage_writer=NvmeFileSystemWriter(tmp_path / "ours",
                                                            _extensions=[XorBytes()]),
                 no_dist=True)
    written = b"".join(p.read_bytes() for p in (tmp_path / "ours").glob("*.distcp"))
    raw_w = saved["w"].numpy().tobytes()
    assert raw_w[:4096] not in written                          # transformed, not as is
    assert bytes(b ^ KEY for b in raw_w[:4096]) in written      # ... by the extension
    for reader in (NvmeFileSystemReader, FileSystemReader):
        loaded = zeroed(saved)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", BufferedIOWarning)
            dcp.load(loaded, storage_reader=reader(tmp_path / "ours",
                                                   _extension_registry=registry()),
                     no_dist=True)
        assert_loaded(saved, loaded)


def test_our_reader_reads_dcp_files_written_with_extensions(tmp_path, monkeypatch):
    monkeypatch.setattr(errors, "_warned", set())     # each warning once per process
    saved = state()
    dcp.save(saved, storage_writer=FileSystemWriter(tmp_path / "theirs",
                                                    _extensions=[XorBytes()]), no_dist=True)
    loaded = zeroed(saved)
    with pytest.warns(BufferedIOWarning, match="NvmeFileSystemReader: stream extensions"):
        dcp.load(loaded, storage_reader=NvmeFileSystemReader(tmp_path / "theirs",
                                                             _extension_registry=registry()),
                 no_dist=True)
    assert_loaded(saved, loaded)


def test_safetensors_serialization_writes_dcp_s_own_files(tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    from safetensors import safe_open

    saved = {k: v for k, v in state().items() if isinstance(v, torch.Tensor)}
    for name, writer in (("ours", NvmeFileSystemWriter), ("theirs", FileSystemWriter)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", BufferedIOWarning)
            dcp.save(saved, storage_writer=writer(
                tmp_path / name, serialization_format=SerializationFormat.SAFETENSORS),
                no_dist=True)
    ours = sorted(p.name for p in (tmp_path / "ours").glob("*.distcp"))
    assert ours == sorted(p.name for p in (tmp_path / "theirs").glob("*.distcp")) and ours
    for file_name in ours:
        with safe_open(str(tmp_path / "ours" / file_name), "pt") as mine, \
                safe_open(str(tmp_path / "theirs" / file_name), "pt") as theirs:
            assert mine.metadata() == theirs.metadata()     # DCP's sharding info
        mine = safetensors_torch.load_file(tmp_path / "ours" / file_name)
        theirs = safetensors_torch.load_file(tmp_path / "theirs" / file_name)
        assert mine.keys() == theirs.keys()
        for key in mine:
            assert torch.equal(raw(mine[key]), raw(theirs[key]))

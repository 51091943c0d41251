"""Tensor archives from templates and DCP items read by kind (Note [tensor archives]),
and file images: the bytes are torch's own whichever way they were made."""
import pickle
import warnings
import zipfile

import pytest

torch = pytest.importorskip("torch", reason="needs torch (pip install torch)")
dcp = pytest.importorskip("torch.distributed.checkpoint")

from test_checkpoint import assert_same, mixed_state, random_tensor, raw

import nvmeswap
from nvmeswap.checkpoint import dcp as nvme_dcp
from nvmeswap.checkpoint import loading, queue_reader, torch_zip, zip_entries
from nvmeswap.checkpoint.image import TensorRun

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def written(checkpointer, image, path):
    checkpointer.write_image(image, str(path))
    return path.read_bytes()


def test_archives_from_a_template_are_torch_s_layout_byte_for_byte(tmp_path, monkeypatch):
    monkeypatch.setattr(torch_zip, "_templates", {})
    laid_out = []
    real_layout = torch_zip.layout
    monkeypatch.setattr(torch_zip, "layout",
                        lambda obj: laid_out.append(obj) or real_layout(obj))
    bases = [random_tensor((40, 50), torch.float32, seed) for seed in (9, 11)]
    tagged = random_tensor((8, 8), torch.float32, 10)
    tagged.note = "a Python attribute: pickled by another rebuild"
    tensors = [random_tensor((64, 16), torch.float32, seed) for seed in range(3)]   # a kind
    tensors += [random_tensor((16, 64), torch.float32, 3),     # same bytes, other shape
                random_tensor((64, 16), torch.bfloat16, 4),
                random_tensor((64, 16), torch.bfloat16, 5),
                random_tensor((64, 16), torch.float32, 6).requires_grad_(),
                random_tensor((64, 16), torch.float32, 7).t(),     # other strides
                bases[0][3:], bases[1][3:],                 # an offset in a storage
                torch.tensor(2.5), torch.tensor(-1.0), torch.empty(0, 3),
                torch.nn.Parameter(random_tensor((4, 4), torch.float32, 8)),
                tagged]
    with nvmeswap.Checkpointer() as checkpointer:
        for number, tensor in enumerate(tensors):
            ours = written(checkpointer, torch_zip.tensor_archive(tensor),
                           tmp_path / f"ours{number}.pt")
            torch_s = written(checkpointer, real_layout(tensor), tmp_path / f"torch{number}.pt")
            assert ours == torch_s, f"tensor {number}: the archive differs from torch's layout"
            assert_same(tensor, torch.load(tmp_path / f"ours{number}.pt", weights_only=False),
                        f"tensor {number}")
    # One layout per kind: 3 float (64, 16) and 2 bf16 shared one each, as did the two
    # views at one offset and the two scalars; an empty tensor (no bytes), a Parameter and
    # a tagged tensor have no template.
    assert len(laid_out) == len(tensors) - 5
    assert len(torch_zip._templates) == len(laid_out) - 3


def test_a_layout_has_one_header_run_between_two_tensor_runs(tmp_path):
    state = mixed_state()
    image = torch_zip.layout(state)
    kinds = [isinstance(run, TensorRun) for _, run in image.runs]
    assert not any(a is b is False for a, b in zip(kinds, kinds[1:]))
    assert sum(kinds) >= 4
    nvmeswap.save(state, tmp_path / "state.pt")
    assert_same(state, torch.load(tmp_path / "state.pt", weights_only=False))


def test_crc_places_are_found_in_a_zip64_directory_past_4_gib():
    """The central directory of a checkpoint larger than 4 GiB is found through the zip64
    end record (torch's writer writes both ends), and each storage's entry in it; the
    writer is given holes, so no bytes are made."""
    import struct
    import types

    recorder = torch_zip._Recorder()
    writer = torch._C.PyTorchFileWriter(recorder, True, torch_zip.STORAGE_ALIGNMENT)
    writer.write_record("data.pkl", b"pickle", 6)
    runs = {}
    for key, nbytes in [("0", 5 << 30), ("1", 4096), ("2", 3)]:
        recorder.pending = f"data/{key}"
        writer.write_record_metadata(f"data/{key}", nbytes)
        runs[f"data/{key}"] = types.SimpleNamespace(crc_slots=[])
    writer.write_end_of_file()
    base, segment = recorder.pieces[-1]
    _, directory, _ = zip_entries.directory_place(
        lambda offset, nbytes: bytes(segment[offset - base:offset - base + nbytes]),
        0, base + len(segment))
    assert directory > 5 << 30
    assert struct.unpack_from("<I", segment, directory - base)[0] == 0x02014B50
    torch_zip._find_central_crc_slots((base, segment), runs)
    for name, run in runs.items():
        ((found, crc_at),) = run.crc_slots
        entry = crc_at - 16         # the CRC field of a central directory entry
        name_len = struct.unpack_from("<H", found, entry + 28)[0]
        assert found is segment
        assert bytes(found[entry + 46:entry + 46 + name_len]).endswith(name.encode())


def item_lengths(path):
    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    return [info.length for info in metadata.storage_data.values()]


@pytest.mark.parametrize("writer", ["dcp", "nvmeswap"])
def test_dcp_items_of_one_length_are_told_apart_by_their_bytes(tmp_path, monkeypatch, writer):
    # (64, 16) and (16, 64) archives have one length; each has items on both sides.
    state = {}
    for number in range(4):
        state[f"wide{number}"] = random_tensor((64, 16), torch.float32, number)
        state[f"tall{number}"] = random_tensor((16, 64), torch.float32, 10 + number)
        state[f"half{number}"] = random_tensor((64, 16), torch.bfloat16, 20 + number)
    state["bytes"] = {"step": 7}
    folder = tmp_path / writer
    make = dcp.FileSystemWriter if writer == "dcp" else nvme_dcp.NvmeFileSystemWriter
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, storage_writer=make(str(folder)))
    lengths = item_lengths(folder)
    assert len(set(lengths)) < len(lengths) - 8, "the items should share lengths"
    parsed = []
    real_parse = nvme_dcp._parsed_tensor
    monkeypatch.setattr(nvme_dcp, "_parsed_tensor",
                        lambda *args: parsed.append(args[2]) or real_parse(*args))
    into = {name: torch.zeros_like(value) if isinstance(value, torch.Tensor) else {"step": 0}
            for name, value in state.items()}
    dcp.load(into, storage_reader=nvme_dcp.NvmeFileSystemReader(str(folder)))
    assert_same(state, into)
    assert len(parsed) == 3, "one parse for each kind of item"


def test_the_own_writer_is_used_only_where_it_writes_torch_s_bytes(tmp_path, monkeypatch):
    """Note [own zip writer]: checked once a process against torch's writer on a probe;
    a writer that differs by one field (here the zip64 end record's "made by") is not
    used, and the file is still torch's."""
    from test_checkpoint import assert_saved_as_torch_saves

    from nvmeswap.checkpoint import zip_writer

    assert torch_zip._own_writer_end_records() == [("version", b"3\n")]
    torch_writer = []
    real = torch_zip._torch_writer_image
    monkeypatch.setattr(torch_zip, "_torch_writer_image",
                        lambda records: torch_writer.append(records) or real(records))
    assert_saved_as_torch_saves(mixed_state(), tmp_path)
    assert torch_writer == []
    monkeypatch.setattr(zip_writer, "_ZIP64_MADE_BY", 0x0314)
    torch_zip._own_writer_end_records.cache_clear()
    try:
        assert torch_zip._own_writer_end_records() is None
        torch_writer.clear()
        assert_saved_as_torch_saves(mixed_state(), tmp_path)
        assert len(torch_writer) == 1
    finally:
        torch_zip._own_writer_end_records.cache_clear()


def test_archives_past_4_gib_or_65535_records_are_left_to_torch_s_writer():
    """Their fields take zip64's forms, which the own writer does not write: torch's
    writer lays them out (holes only: no bytes are made)."""

    from nvmeswap.checkpoint import zip_writer

    ends = torch_zip._own_writer_end_records()
    records = torch_zip._Records()
    records.records = [("data.pkl", b"pickle"), ("data/0", 5 << 30), ("data/1", 3)]
    records.storages = {"data/0": torch.UntypedStorage(5 << 30, device="meta"),
                        "data/1": torch.UntypedStorage(3)}
    assert zip_writer.archive_image(records.records, records.storages, ends) is None
    image = torch_zip._image(records)
    runs = image.tensor_runs()
    assert [run.nbytes for run in runs] == [5 << 30, 3]
    assert runs[1].offset > 5 << 30 and runs[1].offset % torch_zip.STORAGE_ALIGNMENT == 0
    _, tail = image.runs[-1]
    assert bytes(tail[-42:-38]) == b"PK\x06\x07"        # torch's zip64 end locator
    # With the two end records and the id: 65535 records in all, or one fewer.
    many = [("data.pkl", b"p")] + [(f"data/{key}", b"") for key in range(65531)]
    assert zip_writer.archive_image(many + many[-1:], {}, ends, alignment=64) is None
    assert zip_writer.archive_image(many, {}, ends, alignment=64).size > 65534 * 46


def test_the_serialization_id_is_forty_digits_of_the_records_names_and_headers(tmp_path):
    """The own writer's id (Note [own zip writer]): the same state gives the same file;
    another key another id."""
    import zipfile

    state = {"weight": random_tensor((300,), torch.float32, 1), "step": 3}
    ids = []
    for number, key in enumerate(["weight", "weight", "bias"]):
        path = tmp_path / f"{number}.pt"
        nvmeswap.save({key: state["weight"], "step": 3}, path)
        with zipfile.ZipFile(path) as archive:
            assert archive.testzip() is None
            ids.append(archive.read("archive/.data/serialization_id"))
    assert ids[0] == ids[1] != ids[2]
    assert all(len(made) == 40 and made.isdigit() for made in ids)


def records_by_zipfile(path):
    """``ZipEntries.records`` as ``zipfile`` and each record's local header give them."""
    import struct
    import zipfile

    found = {}
    with zipfile.ZipFile(path) as archive, open(path, "rb") as raw:
        for info in archive.infolist():
            raw.seek(info.header_offset)
            name_len, extra_len = struct.unpack_from("<HH", raw.read(30), 26)
            found[info.filename.partition("/")[2]] = (
                info.header_offset + 30 + name_len + extra_len, info.file_size, info.CRC)
    return found


def test_records_past_4_gib_are_found_as_zipfile_finds_them(tmp_path):
    """zip64's end records and a central record's 64-bit size and offset: torch's writer
    given a hole of 5 GiB (a sparse file)."""
    path = tmp_path / "big.pt"
    writer = torch._C.PyTorchFileWriter(str(path))
    writer.write_record("data.pkl", b"pickle", 6)
    writer.write_record_metadata("data/0", 5 << 30)
    writer.write_record("data/1", b"abc", 3)
    writer.write_end_of_file()
    del writer
    entries = zip_entries.ZipEntries(str(path))
    assert entries.records == records_by_zipfile(path)
    assert entries.records["data/0"][1] == 5 << 30
    assert entries.records["data/1"][0] > 5 << 30
    assert entries.pickle == b"pickle"


def test_records_are_found_behind_an_archive_comment_and_compression_is_refused(tmp_path):
    import zipfile

    path = tmp_path / "commented.pt"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("archive/data.pkl", b"pickled")
        archive.writestr("archive/data/0", bytes(range(256)) * 3)
        archive.comment = b"#" * 3000
    entries = zip_entries.ZipEntries(str(path))
    assert entries.records == records_by_zipfile(path)
    assert entries.pickle == b"pickled" and entries.byteorder == "little"
    with zipfile.ZipFile(path, "a") as archive:
        archive.writestr("archive/data/1", b"x" * 999, compress_type=zipfile.ZIP_DEFLATED)
    with pytest.raises(ValueError, match="commented.pt: record archive/data/1 is compressed"):
        zip_entries.ZipEntries(str(path))


@pytest.mark.parametrize("damage", ["cut in the tensor", "cut in the end record",
                                    "central directory cut out"])
def test_a_damaged_archive_is_an_error_naming_it(tmp_path, damage):
    path = tmp_path / "damaged.pt"
    nvmeswap.save({"w": random_tensor((5000,), torch.float32, 3)}, path)
    data = path.read_bytes()
    tail = 56 + 20 + 22         # zip64 end record, its locator, end record
    damaged = {"cut in the tensor": data[:len(data) // 2],
               "cut in the end record": data[:-10],
               # the end records kept, pointing past the end at what was cut out
               "central directory cut out": data[:len(data) - tail - 100] + data[-tail:]}
    path.write_bytes(damaged[damage])
    with pytest.raises(ValueError, match="damaged.pt: not a torch.save zip archive"):
        zip_entries.ZipEntries(str(path))
    with pytest.raises(ValueError, match="damaged.pt: not a torch.save zip archive"):
        nvmeswap.load(path)


@pytest.mark.parametrize("saver", ["torch.save", "nvmeswap.save"])
@pytest.mark.parametrize("damage", ["a memo index", "an opcode"])
@pytest.mark.parametrize("name", ["damaged.pt", "238"])
def test_a_damaged_pickle_is_an_error_naming_the_file(tmp_path, monkeypatch, saver, damage,
                                                      name):
    """Bytes of data.pkl changed in place (its record's length kept): whatever the
    unpickler raises comes out naming the file, from load and from load_into; also a
    file whose name is in the unpickler's message (the memo index 238 = 0xEE)."""
    import pickletools
    state = {"w": random_tensor((30, 100), torch.float32, 1), "b": torch.arange(7),
             "n": 3, "s": torch.arange(10.0)[2:6]}
    monkeypatch.chdir(tmp_path)
    path = name
    (torch.save if saver == "torch.save" else nvmeswap.save)(state, path)
    with open(path, "rb") as file:
        data = bytearray(file.read())
    pickled = zip_entries.ZipEntries(path).pickle
    start = data.find(pickled)
    ops = list(pickletools.genops(pickled))
    if damage == "a memo index":        # a BINGET of an index never put
        at = next(position for op, _, position in ops if op.name == "BINGET")
        data[start + at + 1] = 0xEE
    else:                               # a dict's SETITEMS turned into an APPENDS
        at = next(position for op, _, position in ops if op.name == "SETITEMS")
        data[start + at] = ord("e")
    with open(path, "wb") as file:
        file.write(data)
    for call in (nvmeswap.load, lambda path: nvmeswap.load_into(
            path, {key: value.clone() if isinstance(value, torch.Tensor) else value
                   for key, value in state.items()})):
        with pytest.raises((ValueError, pickle.UnpicklingError)) as raised:
            call(path)
        assert str(raised.value).startswith(f"{name}: ")


@pytest.mark.parametrize("call", ["load", "load_into"])
@pytest.mark.parametrize("at", ["the end", "far past the end"])
def test_a_record_said_to_lie_past_the_archive_s_end_is_an_error_naming_it(tmp_path, call,
                                                                           at):
    """A central directory entry whose local header would be past the file's end (its
    offset damaged): a ValueError naming the file, not a read of nothing."""
    state = {f"t{index}": random_tensor((1000,), torch.float32, index) for index in range(4)}
    path = tmp_path / "damaged.pt"
    nvmeswap.save(state, path)
    data = bytearray(path.read_bytes())
    entry = data.find(b"PK\x01\x02")
    while not data[entry + 46:entry + 46 + 14].endswith(b"data/2"):
        entry = data.find(b"PK\x01\x02", entry + 4)
    data[entry + 42:entry + 46] = (len(data) if at == "the end" else 1 << 30).to_bytes(
        4, "little")
    path.write_bytes(data)
    with pytest.raises(ValueError, match="damaged.pt: record archive/data/2 lies past the "
                                         "end of the archive"):
        if call == "load":
            nvmeswap.load(path)
        else:
            nvmeswap.load_into(path, {name: torch.zeros_like(tensor)
                                      for name, tensor in state.items()})


def storage_headers(path):
    """``{record: local header offset}`` of each storage of the archive at ``path``."""
    entries = zip_entries.ZipEntries(str(path))
    return {record: span[0] for record, span in entries.spans.items()
            if record.startswith("data/")}


@pytest.mark.parametrize("call", ["load", "load_into"])
def test_a_load_reads_no_storage_header_before_the_storages(tmp_path, monkeypatch, call):
    """Note [headers in the reads]: the headers come with the storages' bytes."""
    state = {f"t{index}": random_tensor((64,), torch.float32, index) for index in range(50)}
    path = tmp_path / "many.pt"
    nvmeswap.save(state, path)
    headers = set(storage_headers(path).values())
    reads = []
    real = zip_entries.reads_at

    def counted(file):
        read_at = real(file)
        return lambda offset, nbytes: reads.append(offset) or read_at(offset, nbytes)

    monkeypatch.setattr(zip_entries, "reads_at", counted)
    monkeypatch.setattr(loading, "reads_at", counted)
    if call == "load":
        assert_same(state, nvmeswap.load(path))
    else:
        into = {name: torch.zeros_like(tensor) for name, tensor in state.items()}
        assert nvmeswap.load_into(path, into) is into
        assert_same(state, into)
    assert reads and not headers & set(reads)
    assert len(reads) < 20


def test_load_into_gathers_records_into_ranges_and_reads_large_ones_apart(tmp_path,
                                                                        monkeypatch):
    """Records whose span fits a range are read with their neighbours, headers and all;
    larger ones (here past 64 KiB) are read after their own header, in pieces; views of
    one storage each get their own bytes; a record left out is skipped."""
    monkeypatch.setattr(queue_reader.QueueReader, "range_bytes", property(lambda _: 64 << 10))
    shared = random_tensor((6000,), torch.float32, 99)
    state = {"small": random_tensor((100,), torch.float32, 1),
             "large": random_tensor((100_000,), torch.float32, 2),      # 400 KB: apart
             "head": shared[:1000], "tail": shared[5000:],             # one storage
             "half": random_tensor((3000,), torch.bfloat16, 3),
             "bits": random_tensor((5,), torch.bool, 4),
             "left out": random_tensor((50,), torch.float32, 5),
             "last": random_tensor((7,), torch.int64, 6)}
    path = tmp_path / "mixed.pt"
    nvmeswap.save(state, path)
    into = {name: torch.zeros_like(tensor) for name, tensor in state.items()
            if name != "left out"}
    nvmeswap.load_into(path, into, strict=False)
    for name, tensor in into.items():
        assert torch.equal(raw(tensor), raw(state[name])), name


@pytest.mark.parametrize("road", ["own queue", "handle"])
def test_load_into_refuses_a_tensor_running_past_its_storage_s_record(tmp_path, request,
                                                                      road):
    """A pickle that says 1000 floats of a record of 100 (a damaged file): an error naming
    it, not the bytes after the record."""
    good, damaged = tmp_path / "good.pt", tmp_path / "damaged.pt"
    torch.save({"a": torch.arange(1000, dtype=torch.float32), "b": torch.full((2000,), 7.0)},
               good)
    with zipfile.ZipFile(good) as source, \
            zipfile.ZipFile(damaged, "w", compression=zipfile.ZIP_STORED) as cut:
        for info in source.infolist():
            data = source.read(info)
            cut.writestr(info.filename, data[:400] if info.filename.endswith("data/0")
                         else data)
    handle = request.getfixturevalue("handle") if road == "handle" else None
    into = {"a": torch.zeros(1000), "b": torch.zeros(2000)}
    with pytest.raises(ValueError, match="damaged.pt: a runs past the end of its storage"):
        nvmeswap.load_into(damaged, into, handle=handle)
    assert not into["a"].any() and not into["b"].any()


@pytest.mark.parametrize("record", [0, 8, 4096])
def test_load_refuses_a_tensor_running_past_its_storage_s_record(tmp_path, record):
    """An archive (torch's own) whose tensor runs past its storage's record, empty or
    not: refused as torch.load refuses it, never a tensor showing memory not read from
    the file (an empty storage that could grow would have given one)."""
    tensor = torch.full((2000,), 7.0)
    tensor.untyped_storage().resize_(record)
    path = tmp_path / "short.pt"
    torch.save({"t": tensor, "other": torch.full((2000,), 5.0)}, path)
    with pytest.raises(RuntimeError, match="not resizable"):
        torch.load(path)
    for weights_only in (True, False):
        with pytest.raises(ValueError, match="short.pt: its pickle .*not resizable"):
            nvmeswap.load(path, weights_only=weights_only)


@pytest.mark.parametrize("damage", ["signature", "name", "extra length"])
@pytest.mark.parametrize("road", ["own queue", "handle"])
@pytest.mark.parametrize("call", ["load", "load_into"])
def test_a_damaged_storage_header_fails_the_load_naming_it(tmp_path, request, damage, road,
                                                          call):
    state = {f"t{index}": random_tensor((1000,), torch.float32, index) for index in range(4)}
    path = tmp_path / "damaged.pt"
    nvmeswap.save(state, path)
    data = bytearray(path.read_bytes())
    at = storage_headers(path)["data/2"]
    if damage == "signature":
        data[at + 1] ^= 0xFF
    elif damage == "name":
        data[at + 30 + len("archive/data/")] = ord("7")
    else:       # the bytes start 100 bytes late: into the next record
        data[at + 28:at + 30] = (int.from_bytes(data[at + 28:at + 30], "little") + 100
                                 ).to_bytes(2, "little")
    path.write_bytes(data)
    handle = request.getfixturevalue("handle") if road == "handle" else None
    expected = ("runs past the next record" if damage == "extra length"
                else "bad local header for archive/data/2")
    with pytest.raises(ValueError, match=f"damaged.pt: .*{expected}"):
        if call == "load":
            nvmeswap.load(path, handle=handle)
        else:
            nvmeswap.load_into(path, {name: torch.zeros_like(tensor)
                                      for name, tensor in state.items()}, handle=handle)


def _with_pickle_of(path, archive, persistent_id):
    """``archive`` rebuilt at ``path`` with a data.pkl whose one tensor's storage is
    referred to by ``persistent_id`` (a damaged one)."""
    import collections
    import io
    import zipfile

    class Reference:
        def __reduce__(self):
            return (torch._utils._rebuild_tensor_v2,
                    (("reference",), 0, (8,), (1,), False, collections.OrderedDict()))

    class Pickler(pickle.Pickler):
        def persistent_id(self, value):
            return persistent_id if value == ("reference",) else None

    pickled = io.BytesIO()
    Pickler(pickled, protocol=2).dump({"a": Reference()})
    with zipfile.ZipFile(archive) as source, zipfile.ZipFile(path, "w") as target:
        for entry in source.infolist():
            target.writestr(entry.filename, pickled.getvalue()
                            if entry.filename.endswith("data.pkl") else source.read(entry))


@pytest.mark.parametrize("damage", [
    "byteorder record", "zip64 locator offset", "persistent id of 4 fields",
    "persistent id an int", "storage type an int", "numel a str", "location unknown"])
def test_damage_anywhere_in_an_archive_fails_naming_it(tmp_path, damage):
    """One damaged byte or field, wherever it is (the zip's records, the pickle's
    storage references): every load fails naming the file, never with a bare error."""
    good = tmp_path / "good.pt"
    nvmeswap.save({"a": torch.arange(8.0)}, good)
    data = bytearray(good.read_bytes())
    path = tmp_path / "damaged.pt"
    if damage == "byteorder record":
        data[data.index(b"little")] ^= 0xFF
        path.write_bytes(data)
    elif damage == "zip64 locator offset":
        data[data.rindex(b"PK\x06\x07") + 15] ^= 0xFF      # its offset's top byte
        path.write_bytes(data)
    else:
        references = {
            "persistent id of 4 fields": ("storage", torch.FloatStorage, "0", "cpu"),
            "persistent id an int": 7,
            "storage type an int": ("storage", 3, "0", "cpu", 8),
            "numel a str": ("storage", torch.FloatStorage, "0", "cpu", "8"),
            "location unknown": ("storage", torch.FloatStorage, "0", "bpu", 8)}
        _with_pickle_of(path, good, references[damage])
    calls = [nvmeswap.load]
    if damage != "location unknown":        # load_into places by its targets
        calls.append(lambda p: nvmeswap.load_into(p, {"a": torch.zeros(8)}))
    for call in calls:
        with pytest.raises((ValueError, RuntimeError, pickle.UnpicklingError)) as raised:
            call(path)
        assert str(raised.value).startswith(f"{path}: "), repr(raised.value)

"""Note [stripes] and Note [striped checkpoints]: bytes spread round-robin over several
folders come back whole, through StripedHandle, striped checkpoints and the swapper."""
import errno
import json
import os
import re
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="needs torch (pip install torch)")

from conftest import random_bytes
from test_checkpoint import assert_same, mixed_state, race, random_tensor

import nvmeswap
from nvmeswap.checkpoint.stripes import StripedHandle
from nvmeswap.errors import ShortFileError
from nvmeswap.training import TensorSwapper

STRIPE = 64 << 10
ODD_STRIPE = 48 << 10     # a multiple of 4096, not a power of two


@pytest.fixture
def folders(tmp_path):
    made = [tmp_path / f"dev{k}" for k in range(3)]
    for folder in made:
        folder.mkdir()
    return [str(f) for f in made]


@pytest.mark.parametrize("nbytes,offset", [(1, 0), (4095, 0), (STRIPE, 0), (STRIPE + 1, 0),
                                           (7 * STRIPE + 4097, 0), (5 * STRIPE, 12345),
                                           (3 * STRIPE - 1, STRIPE - 7)])
def test_striped_bytes_land_round_robin_and_come_back(folders, nbytes, offset):
    data = random_bytes(nbytes)
    with StripedHandle(folders, stripe_bytes=STRIPE) as handle:
        logical = os.path.join(folders[0], "f.bin")
        source = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        assert handle.async_pwrite(source, logical, offset) == 0
        assert handle.wait() == 1
        locked = handle.new_cpu_locked_tensor(nbytes, torch.empty(0, dtype=torch.uint8))
        assert handle.sync_pread(locked, logical, offset) == 1
        assert bytes(locked.numpy()) == data
        assert handle.size(logical) == offset + nbytes
        handle.free_cpu_locked_tensor(locked)
        # Each device's file holds exactly its stripes, densely.
        parts = [Path(p).read_bytes() if os.path.exists(p) else b""
                 for p in handle.paths(logical)]
        whole = bytearray(offset + nbytes)
        for stripe in range(-(-(offset + nbytes) // STRIPE)):
            device, row = stripe % 3, stripe // 3
            piece = parts[device][row * STRIPE:(row + 1) * STRIPE]
            whole[stripe * STRIPE:stripe * STRIPE + len(piece)] = piece
        assert bytes(whole[offset:]) == data
        handle.remove(logical)
        assert not any(os.path.exists(p) for p in handle.paths(logical))


def test_the_size_of_a_file_whose_first_part_was_never_made(folders):
    """A write whose stripes all lie on other devices makes no first part: the file is
    there, its size that write's end; missing only when every part is."""
    with StripedHandle(folders, stripe_bytes=4096) as handle:
        logical = os.path.join(folders[0], "f.bin")
        data = torch.arange(1024, dtype=torch.int32)        # one stripe: device 1's
        handle.sync_pwrite(data, logical, 4096)
        assert not os.path.exists(logical)
        assert handle.size(logical) == 8192
        back = torch.zeros_like(data)
        handle.sync_pread(back, logical, 4096)
        assert torch.equal(back, data)
        with pytest.raises(FileNotFoundError) as raised:
            handle.size(os.path.join(folders[0], "none.bin"))
        assert raised.value.filename == os.path.join(folders[0], "none.bin")


def test_striped_handle_refuses_bad_arguments(folders, tmp_path):
    with pytest.raises(FileNotFoundError) as raised:
        StripedHandle([folders[0], str(tmp_path / "missing")])
    assert raised.value.filename == str(tmp_path / "missing")
    with pytest.raises(ValueError, match="multiple of 4096"):
        StripedHandle(folders, stripe_bytes=1000)
    with pytest.raises(ValueError, match="named twice"):
        StripedHandle([folders[0], folders[0]])
    with StripedHandle(folders) as handle:
        with pytest.raises(ValueError, match="not inside"):
            handle.sync_pwrite(torch.zeros(10), str(tmp_path / "elsewhere"))
        with pytest.raises(TypeError, match="file_offset must be an int, got True"):
            handle.sync_pwrite(torch.zeros(10), os.path.join(folders[0], "f"), True)
        with pytest.raises(FileNotFoundError):
            handle.sync_pread(torch.zeros(0), os.path.join(folders[0], "missing"))
    assert all(os.listdir(folder) == [] for folder in folders)


def test_one_folder_under_two_names_is_refused(folders, tmp_path):
    """A folder and a link to it are one device: striping over both would put two
    devices' bytes in one file. Refused at the call, nothing made."""
    import subprocess
    import sys

    from conftest import package_env

    link = tmp_path / "link"
    link.symlink_to(folders[1])
    twice = [folders[0], folders[1], str(link)]
    message = f"named twice .*: {re.escape(folders[1])} and {re.escape(str(link))} are one"
    for make in (lambda: StripedHandle(twice),
                 lambda: nvmeswap.Checkpointer(stripe_folders=twice),
                 lambda: TensorSwapper(twice)):
        with pytest.raises(ValueError, match=message):
            make()
    assert all(os.listdir(folder) == [] for folder in folders)
    bench = subprocess.run([sys.executable, "-m", "nvmeswap", "bench", "--stripe",
                            ",".join(twice), "--io-size", "1M"], capture_output=True,
                           text=True, timeout=120, check=False, env=package_env())
    assert bench.returncode == 2 and "are one folder" in bench.stderr, bench.stderr
    assert all(os.listdir(folder) == [] for folder in folders)


def test_a_striped_checkpoint_round_trips_and_replaces_its_stripes(folders):
    state = mixed_state()
    path = os.path.join(folders[0], "state.pt")
    with nvmeswap.Checkpointer(stripe_folders=folders, stripe_bytes=STRIPE) as checkpointer:
        checkpointer.save(state, path)
        layout = json.loads(Path(path).read_text())
        assert layout["folders"] == folders and layout["stripe_bytes"] == STRIPE
        first = layout["name"]
        assert all(os.path.getsize(os.path.join(f, first)) > 0 for f in folders)
        loaded = checkpointer.load(path)
        assert_same(state, loaded)
        checkpointer.free(loaded)
        checkpointer.async_save(state, path).result()
        second = json.loads(Path(path).read_text())["name"]
        assert second != first
        assert sorted(os.listdir(folders[1])) == [second]     # the old stripes are gone
        into = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}}
        checkpointer.load_into(path, into, strict=False)
        assert_same(dict(state["model"]), into["model"])
    # Any loader finds the layout from the one path.
    assert_same(state, nvmeswap.load(path))


def test_the_swapper_stripes_over_folders(folders):
    tensors = {f"t{k}": random_tensor((n,), torch.float32, k)
               for k, n in enumerate([10, 100_000, 333_333])}
    with TensorSwapper(folders, stripe_bytes=STRIPE, pack_below=1024) as swapper:
        for key, tensor in tensors.items():
            swapper.swap_out(key, tensor)
        assert swapper.synchronize_writes() >= 2
        sub = os.path.basename(swapper.directory)
        assert all(os.listdir(os.path.join(f, sub)) for f in folders)
        back = {key: swapper.swap_in(key) for key in tensors}
        swapper.synchronize_reads()
        assert_same(tensors, back)
    assert all(os.listdir(f) == [] for f in folders)


def test_the_swapper_refuses_handles_and_stripes_unlike_its_own(folders):
    """Over several folders, a given handle must stripe as the swapper does (a plain
    handle, or other stripes, would read other keys' bytes), and stripe_bytes is checked
    (0 is not the default; with one folder it means nothing): refused, nothing made."""
    plain = nvmeswap.aio_handle()
    wide = StripedHandle(folders, stripe_bytes=2 * STRIPE)
    try:
        for kwargs, message in [
                ({"read_handle": plain}, ("read_handle must be a StripedHandle .* got an "
                                         "unstriped aio_handle")),
                ({"write_handle": plain}, "write_handle must be a StripedHandle"),
                ({"read_handle": wide}, (f"stripe_bytes={STRIPE}, as the swapper stripes; "
                                        f"got one over .* stripe_bytes={2 * STRIPE}")),
                ({"stripe_bytes": 0}, "multiple of 4096")]:
            with pytest.raises(ValueError, match=message):
                TensorSwapper(folders, stripe_bytes=kwargs.pop("stripe_bytes", STRIPE),
                              **kwargs)
        with pytest.raises(ValueError, match="stripe_bytes goes with a list of folders"):
            TensorSwapper(folders[0], stripe_bytes=STRIPE)
    finally:
        plain.close()
        wide.close()
    assert all(os.listdir(folder) == [] for folder in folders)


def test_a_swapper_of_relative_folders_keeps_its_files_after_a_chdir(folders, monkeypatch):
    """Folders given relative to the working folder are where they were when the swapper
    was made, whatever folder the process moves to."""
    parent = os.path.dirname(folders[0])
    for given in ([os.path.basename(folders[0])], [os.path.basename(f) for f in folders]):
        monkeypatch.chdir(parent)
        swapper = TensorSwapper(given if len(given) > 1 else given[0])
        try:
            data = random_tensor((100_000,), torch.int32, 5)
            swapper.swap_out("k", data)
            swapper.synchronize_writes()
            monkeypatch.chdir(folders[1])
            back = swapper.swap_in("k")
            swapper.synchronize_reads()
            assert torch.equal(back, data)
            swapper.swap_out("k2", data)
            swapper.synchronize_writes()
        finally:
            swapper.close()
        assert all(os.listdir(folder) == [] for folder in folders), given


def test_a_ctrl_c_in_a_striped_wait_counts_none(folders, monkeypatch):
    """As aio_handle.wait: interrupted, the next wait counts every transfer again, so a
    swapper synchronizing through striped handles keeps its counts."""
    from nvmeswap.checkpoint import stripes
    tensors = {f"k{k}": random_tensor((1 << 19,), torch.float32, k) for k in range(2)}
    real_result = stripes.StripedFuture.result

    def interrupted_once(future, *args):
        monkeypatch.setattr(stripes.StripedFuture, "result", real_result)
        real_result(future, *args)
        raise KeyboardInterrupt
    with TensorSwapper(folders, stripe_bytes=STRIPE) as swapper:
        for key, tensor in tensors.items():
            swapper.swap_out(key, tensor)
        monkeypatch.setattr(stripes.StripedFuture, "result", interrupted_once)
        with pytest.raises(KeyboardInterrupt):
            swapper.synchronize_writes()
        assert swapper.synchronize_writes() == 2
        back = {key: swapper.swap_in(key) for key in tensors}
        swapper.synchronize_reads()
        assert_same(tensors, back)


def test_a_striped_checkpointer_reads_a_plain_checkpoint(folders, tmp_path):
    state = mixed_state()
    path = tmp_path / "plain.pt"
    torch.save(state, path)
    with nvmeswap.Checkpointer(stripe_folders=folders, stripe_bytes=STRIPE) as checkpointer:
        loaded = checkpointer.load(path)
        assert_same(state, loaded)
        checkpointer.free(loaded)
        into = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}}
        checkpointer.load_into(path, into, strict=False)
        assert_same(dict(state["model"]), into["model"])


def test_a_plain_checkpointer_moving_a_striped_load_keeps_no_locked_memory(folders):
    """The striped reader a plain handle reads through is closed when the load frees the
    buffers map_location copied out of: they leave the process's locked set even so."""
    state = mixed_state()
    path = os.path.join(folders[0], "state.pt")
    with nvmeswap.Checkpointer(stripe_folders=folders, stripe_bytes=STRIPE) as checkpointer:
        checkpointer.save(state, path)
    with nvmeswap.aio_handle() as handle, nvmeswap.Checkpointer(handle) as checkpointer:
        before = checkpointer.handle.memory_in_use
        moved = checkpointer.load(path, map_location=lambda storage, location: storage.clone())
        assert_same(state, moved)
        assert checkpointer.handle.memory_in_use == before


def stripe_paths_of(path):
    """The stripe files of the striped checkpoint at ``path``, in order."""
    layout = json.loads(Path(path).read_text())
    return [os.path.join(folder, layout["name"]) for folder in layout["folders"]]


def stripe_files(path):
    return [Path(part).read_bytes() for part in stripe_paths_of(path)]


def test_a_striped_save_without_a_handle_starts_no_worker_and_lays_out_as_one(folders,
                                                                             monkeypatch):
    """Note [saves without a handle]: one queue writes every stripe file, the unaligned
    end included; the stripes are those a StripedHandle writes, byte for byte."""
    from test_checkpoint_fresh import refuse_workers

    state = mixed_state()
    path = os.path.join(folders[0], "queue.pt")
    refuse_workers(monkeypatch)
    with nvmeswap.Checkpointer(stripe_folders=folders, stripe_bytes=ODD_STRIPE,
                               chunk_bytes=1 << 20) as checkpointer:
        checkpointer.save(state, path)
        checkpointer.save(state, path)          # the kept ring, the old stripes replaced
    monkeypatch.undo()
    size = json.loads(Path(path).read_text())["size"]
    assert size % 4096 and (size - 1) // ODD_STRIPE % 3      # the tail ends off the first folder
    assert all(len(os.listdir(folder)) == 1 + (folder == folders[0]) for folder in folders)
    by_handle = os.path.join(folders[0], "handle.pt")
    with StripedHandle(folders, stripe_bytes=ODD_STRIPE) as handle, \
            nvmeswap.Checkpointer(handle) as checkpointer:
        checkpointer.save(state, by_handle)
    assert stripe_files(path) == stripe_files(by_handle)
    assert_same(state, nvmeswap.load(path))


@pytest.mark.parametrize("space", ["allocated", "written"])
def test_a_full_stripe_folder_fails_the_save_and_keeps_the_previous(folders, small_filesystem,
                                                                   monkeypatch, space):
    """A stripe folder without room (a 4 MiB tmpfs): ENOSPC naming its stripe file, when
    the stripes' space is allocated or (without fallocate) when a write meets the full
    disk; no stripe file is left anywhere and the previous checkpoint loads."""
    folders = [folders[0], folders[1], str(small_filesystem)]
    path = os.path.join(folders[0], "s.pt")
    old = {"w": random_tensor((1 << 20,), torch.uint8, 7)}
    with nvmeswap.Checkpointer(stripe_folders=folders, stripe_bytes=STRIPE) as checkpointer:
        checkpointer.save(old, path)
        kept = [sorted(os.listdir(folder)) for folder in folders]
        if space == "written":
            def unsupported(fd, offset, length):
                raise OSError(errno.EOPNOTSUPP, "not supported")
            monkeypatch.setattr(os, "posix_fallocate", unsupported)
        with pytest.raises(OSError) as raised:
            checkpointer.save({"w": random_tensor((16 << 20,), torch.uint8, 8)}, path)
    assert raised.value.errno == errno.ENOSPC
    assert os.path.dirname(raised.value.filename) == folders[2]
    assert raised.value.filename.endswith(".stripe")
    assert ("cannot allocate" in str(raised.value)) == (space == "allocated")
    assert [sorted(os.listdir(folder)) for folder in folders] == kept
    assert_same(old, nvmeswap.load(path))


@pytest.mark.parametrize("failure", ["EIO", "KeyboardInterrupt"])
def test_a_failure_after_the_layout_is_renamed_keeps_the_stripes_it_names(folders,
                                                                         monkeypatch,
                                                                         failure):
    """The fsync of the layout's folder fails (or a Ctrl-C comes) once the new layout is
    renamed over the old one: the save raises, and the checkpoint at the path, the new
    one, loads; the next save replaces it and leaves only its own stripes."""
    from nvmeswap.checkpoint import commit

    path = os.path.join(folders[0], "s.pt")
    old, new, newer = ({"w": random_tensor((300 << 10,), torch.uint8, seed)}
                       for seed in (1, 2, 3))
    real_sync = commit.sync_folder

    def failing_sync(folder):
        if folder == folders[0] and json.loads(Path(path).read_text())["name"] != first:
            if failure == "EIO":
                raise OSError(errno.EIO, "Input/output error", folder)
            raise KeyboardInterrupt
        real_sync(folder)

    with nvmeswap.Checkpointer(stripe_folders=folders, stripe_bytes=STRIPE) as checkpointer:
        checkpointer.save(old, path)
        first = json.loads(Path(path).read_text())["name"]
        monkeypatch.setattr(commit, "sync_folder", failing_sync)
        with pytest.raises(OSError if failure == "EIO" else KeyboardInterrupt):
            checkpointer.save(new, path)
        monkeypatch.undo()
        assert_same(new, nvmeswap.load(path))
        checkpointer.save(newer, path)
    assert_same(newer, nvmeswap.load(path))
    assert [len(os.listdir(folder)) for folder in folders] == [2, 1, 1]


def test_a_striped_save_without_a_handle_opens_each_stripe_file_once(folders, monkeypatch):
    """An async save writes its snapshot in one go, 384 stripe pieces here: each of the
    three stripe files is opened once for them, not once a piece."""
    from nvmeswap.checkpoint import queue_writer

    opened = []
    real_open = queue_writer.open_target

    def counted(path, **kwargs):
        opened.append(path)
        return real_open(path, **kwargs)

    monkeypatch.setattr(queue_writer, "open_target", counted)
    state = {"w": random_tensor((24 << 20,), torch.uint8, 9)}
    path = os.path.join(folders[0], "s.pt")
    with nvmeswap.Checkpointer(stripe_folders=folders, stripe_bytes=STRIPE) as checkpointer:
        checkpointer.async_save(state, path).result()
    assert sorted(opened) == sorted(stripe_paths_of(path))
    assert_same(state, nvmeswap.load(path))


def test_striped_saves_of_one_path_from_two_threads_leave_one_set_of_stripes(folders):
    """Two threads saving one striped path at once, while a third loads it: every load
    sees one state whole, and each commit deletes the stripes of the layout it replaced,
    read at its rename: one set of stripes is left."""
    path = os.path.join(folders[0], "s.pt")
    states = [{"w": torch.full((1 << 20,), k, dtype=torch.uint8)} for k in range(2)]
    with nvmeswap.Checkpointer(stripe_folders=folders, stripe_bytes=STRIPE) as checkpointer:
        checkpointer.save(states[0], path)
        own = [nvmeswap.Checkpointer(stripe_folders=folders, stripe_bytes=STRIPE)
               for _ in range(2)]
        try:
            # A load may meet stripes that a newer save removed (documented): it goes on.
            errors, seen = race(lambda k: own[k].save(states[k], path),
                                lambda: nvmeswap.load(path), 10,
                                tolerated=FileNotFoundError)
        finally:
            for each in own:
                each.close()
        assert all(isinstance(e, FileNotFoundError) for e in errors), errors
        assert seen and set(seen) <= {0, 1} and int(nvmeswap.load(path)["w"].min()) in (0, 1)
        name = json.loads(Path(path).read_text())["name"]
        assert sorted(os.listdir(folders[0])) == sorted(["s.pt", name])
        assert all(os.listdir(folder) == [name] for folder in folders[1:])
        checkpointer.save(states[1], path)
    name = json.loads(Path(path).read_text())["name"]
    assert sorted(os.listdir(folders[0])) == sorted(["s.pt", name])
    assert all(os.listdir(folder) == [name] for folder in folders[1:])
    assert_same(states[1], nvmeswap.load(path))


def test_a_striped_save_leaves_the_stripes_of_checkpoints_named_like_it_alone(folders):
    """"ckpt" and "ckpt.2024-06-01" (whose stripes start "ckpt.2024-...") in one folder:
    the saves of "ckpt" take only their own stripes for orphans."""
    states = [{"w": torch.full((1 << 16,), k, dtype=torch.uint8)} for k in range(3)]
    dated, latest = (os.path.join(folders[0], name) for name in ("ckpt.2024-06-01", "ckpt"))
    with nvmeswap.Checkpointer(stripe_folders=folders, stripe_bytes=STRIPE) as checkpointer:
        checkpointer.save(states[0], dated)
        checkpointer.save(states[1], latest)
        checkpointer.save(states[2], latest)
    assert_same(states[0], nvmeswap.load(dated))
    assert_same(states[2], nvmeswap.load(latest))
    names = {json.loads(Path(path).read_text())["name"] for path in (dated, latest)}
    assert all(set(os.listdir(folder)) - {"ckpt", "ckpt.2024-06-01"} == names
               for folder in folders)


@pytest.mark.parametrize("call", ["save", "async_save", "save_safetensors"])
def test_a_striped_save_outside_the_first_folder_fails_at_the_call(folders, tmp_path, call):
    with nvmeswap.Checkpointer(stripe_folders=folders, stripe_bytes=STRIPE) as checkpointer, \
            pytest.raises(ValueError, match="lives in the first stripe folder"):
        getattr(checkpointer, call)({"w": torch.ones(10)}, tmp_path / "elsewhere.pt")
    assert not (tmp_path / "elsewhere.pt").exists()


def test_a_save_over_a_damaged_layout_fails_naming_it(folders):
    """A layout at the path that is not one fails the save before any I/O, and a stripe
    of a pid no process has is left."""
    from nvmeswap.checkpoint import commit

    path = os.path.join(folders[0], "s.pt")
    Path(path).write_text('{"nvmeswap_stripes": 1, "name": "s.pt.')       # cut short
    stray = f"s.pt.{commit.writer_name().split('-')[0]}-{10 ** 30}-0123abcd.stripe"
    Path(folders[1], stray).write_bytes(b"?")
    with nvmeswap.Checkpointer(stripe_folders=folders, stripe_bytes=STRIPE) as checkpointer:
        with pytest.raises(ValueError, match="s.pt: a damaged stripe layout"):
            checkpointer.save({"w": torch.ones(10)}, path)
        os.unlink(path)
        state = {"w": random_tensor((100_000,), torch.float32, 4)}
        checkpointer.save(state, path)
    assert_same(state, nvmeswap.load(path))
    assert stray in os.listdir(folders[1])


@pytest.mark.parametrize("damage", [
    {"name": None}, {"name": "../x.stripe"}, {"name": ""}, {"folders": []},
    {"folders": "/mnt"}, {"folders": ["relative"]}, {"stripe_bytes": 0},
    {"stripe_bytes": "65536"}, {"size": -1}, {"size": True}, {"replaces": [1]},
    {"replaces": {"name": "x"}}, "name", "folders", "size"],
    ids=lambda damage: str(damage))
def test_a_layout_with_a_missing_or_wrong_field_is_damaged(folders, damage):
    """Every load of a layout whose fields are missing or of the wrong kind fails with a
    ValueError naming it; a save over it fails before any file is made."""
    path = os.path.join(folders[0], "s.pt")
    with nvmeswap.Checkpointer(stripe_folders=folders, stripe_bytes=STRIPE) as checkpointer:
        checkpointer.save({"w": torch.ones(10)}, path)
        layout = json.loads(Path(path).read_text())
        if isinstance(damage, dict):
            layout.update(damage)
        else:
            del layout[damage]
        Path(path).write_text(json.dumps(layout))
        before = [sorted(os.listdir(folder)) for folder in folders]
        message = re.escape(path) + ": a damaged stripe layout"
        for call in (nvmeswap.load, checkpointer.load,
                     lambda p: nvmeswap.load_into(p, {"w": torch.zeros(10)})):
            with pytest.raises(ValueError, match=message):
                call(path)
        with pytest.raises(ValueError, match=message):
            checkpointer.save({"w": torch.zeros(10)}, path)
    assert [sorted(os.listdir(folder)) for folder in folders] == before
    assert json.loads(Path(path).read_text()) == layout


_FORK_DURING_A_STRIPED_COMMIT = r"""
import os, sys, torch, nvmeswap
from nvmeswap.checkpoint import striped_checkpoints
from nvmeswap.io import process_state

torch.set_num_threads(1)        # GNU OpenMP's threads do not survive a fork
folders = sys.argv[1:]
commits = process_state.shared(striped_checkpoints._Commits)
commits.lock.acquire()          # as another thread's striped save holds it at the fork
pid = os.fork()
if pid == 0:
    code = 1
    try:
        with nvmeswap.Checkpointer(stripe_folders=folders, stripe_bytes=4096) as saver:
            saver.save({"w": torch.arange(5000)}, os.path.join(folders[0], "child.pt"))
        code = 0
    finally:
        os._exit(code)
_, status = os.waitpid(pid, 0)
commits.lock.release()
print("child exit", os.waitstatus_to_exitcode(status))
"""


def test_a_child_forked_during_a_striped_commit_saves_striped(folders):
    """The lock of this process's striped commits is made afresh in a forked child: a
    fork while another thread held it does not leave the child's striped saves waiting
    for ever."""
    import subprocess
    import sys

    from conftest import package_env

    done = subprocess.run([sys.executable, "-c", _FORK_DURING_A_STRIPED_COMMIT, *folders],
                          capture_output=True, text=True, timeout=120, check=False,
                          env=package_env())
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "child exit 0"
    assert torch.equal(nvmeswap.load(os.path.join(folders[0], "child.pt"))["w"],
                       torch.arange(5000))


def test_a_short_stripe_fails_every_load_naming_that_stripe(folders):
    state = mixed_state()
    path = os.path.join(folders[0], "state.pt")
    with nvmeswap.Checkpointer(stripe_folders=folders, stripe_bytes=STRIPE) as checkpointer:
        checkpointer.save(state, path)
    name = json.loads(Path(path).read_text())["name"]
    short = os.path.join(folders[1], name)
    os.truncate(short, os.path.getsize(short) - 1)
    into = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}}
    message = (re.escape(short) + ": short read: a stripe of [0-9]+ bytes where its "
               "checkpoint's layout needs")
    loads = [lambda: nvmeswap.load(path), lambda: nvmeswap.load_into(path, into, strict=False)]
    with nvmeswap.Checkpointer(stripe_folders=folders, stripe_bytes=STRIPE) as checkpointer:
        loads += [lambda: checkpointer.load(path),
                  lambda: checkpointer.load_into(path, into, strict=False)]
        for load in loads:
            with pytest.raises(ShortFileError, match=message) as raised:
                load()
            assert raised.value.filename == short
    assert all(not tensor.any() for tensor in into["model"].values())   # nothing read


_SAVE_AND_EXIT = r"""
import sys, torch, nvmeswap
folders, path = sys.argv[1:-1], sys.argv[-1]
with nvmeswap.Checkpointer(stripe_folders=folders, stripe_bytes=65536) as saver:
    saver.save({"w": torch.arange(50000)}, path)
"""


@pytest.mark.parametrize("how", ["renamed", "sharing a folder", "by an exited process"])
def test_a_striped_save_keeps_the_stripes_other_layouts_name(tmp_path, folders, how):
    """A save deletes only the stripes of the layout it replaces, and of its path's
    killed saves: never the stripes of a layout elsewhere, be it a checkpoint renamed
    (kept as the older one), or one of the same name whose stripes share a folder,
    written by this process or by one that has exited."""
    import subprocess
    import sys

    from conftest import package_env

    first = {"w": torch.arange(50000)}
    kept = os.path.join(folders[0], "ck.pt")
    if how == "renamed":
        saved, others = kept, folders
    else:                           # rank 0 over dev0, dev1; rank 1 over dev2, dev1
        saved, others = os.path.join(folders[2], "ck.pt"), [folders[2], folders[1]]
    if how == "by an exited process":
        done = subprocess.run([sys.executable, "-c", _SAVE_AND_EXIT, *folders[:2], kept],
                              capture_output=True, text=True, timeout=120, check=False,
                              env=package_env())
        assert done.returncode == 0, done.stderr
    else:
        with nvmeswap.Checkpointer(stripe_folders=folders[:2], stripe_bytes=STRIPE) as saver:
            saver.save(first, kept)
    if how == "renamed":
        os.replace(kept, kept + ".prev")
        kept += ".prev"
    second = {"w": torch.arange(50000) * 2}
    with nvmeswap.Checkpointer(stripe_folders=others, stripe_bytes=STRIPE) as saver:
        saver.save(second, saved)
        saver.save(second, saved)       # replacing its own: the first one's stripes go
    assert_same(first, nvmeswap.load(kept))
    assert_same(second, nvmeswap.load(saved))
    names = {json.loads(Path(path).read_text())["name"] for path in (kept, saved)}
    assert {name for folder in folders for name in os.listdir(folder)
            if name.endswith(".stripe")} == names


def test_a_striped_save_removes_what_killed_saves_of_its_path_left(folders):
    """Note [striped checkpoints]: a killed save leaves its temporary layout, naming its
    stripes; the next save removes both where the writer is gone and of this tag (Note
    [files named by their process]). A stripe no temporary layout names is left, though
    its writer be gone: another layout may name it; and a temporary layout removes only
    stripes of its own writer."""
    from test_checkpoint import dead_pid, other_tag

    from nvmeswap.checkpoint import commit

    path = os.path.join(folders[0], "state.pt")
    gone, ours = dead_pid(), commit.writer_name().split("-")[0]

    def killed_save(writer, stripe_writer=None, save=0):
        stripe = f"state.pt.{stripe_writer or writer}-0123abcd.stripe"
        temporary = f"state.pt{commit.TEMPORARY}{writer}-{save}"
        Path(folders[0], temporary).write_text(json.dumps({
            "nvmeswap_stripes": 1, "name": stripe, "size": 5, "stripe_bytes": STRIPE,
            "folders": [str(folder) for folder in folders]}))
        for folder in folders:
            Path(folder, stripe).write_bytes(b"a stripe")
        return temporary, stripe

    removed = set(killed_save(f"{ours}-{gone}"))
    left = set(killed_save(f"{other_tag()}-{gone}"))
    mismatched, foreign = killed_save(f"{ours}-{gone}", stripe_writer=f"{ours}-1", save=1)
    removed.add(mismatched)
    left.add(foreign)
    left.add(f"state.pt.{ours}-{gone}-4567abcd.stripe")         # no layout names it
    for folder in folders:
        Path(folder, f"state.pt.{ours}-{gone}-4567abcd.stripe").write_bytes(b"a stripe")
    state = mixed_state()
    with nvmeswap.Checkpointer(stripe_folders=folders, stripe_bytes=STRIPE) as checkpointer:
        checkpointer.save(state, path)
    name = json.loads(Path(path).read_text())["name"]
    assert name.startswith(f"state.pt.{commit.writer_name()}-")
    for folder in folders:
        assert not set(os.listdir(folder)) & removed
        assert set(os.listdir(folder)) - left == {name} | (
            {"state.pt"} if folder == folders[0] else set())
    assert_same(state, nvmeswap.load(path))

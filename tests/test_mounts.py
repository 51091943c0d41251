"""Reading /proc/self/mountinfo: one parser for the report's folders and cuFile's files."""
import os

from nvmeswap import mounts

# proc(5)'s layout: optional fields before "-", a mount point with a space in it.
SAMPLE = """\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
40 22 259:2 / /mnt/fast\\040disk rw,noatime shared:7 master:2 - xfs /dev/nvme0n1 rw
41 22 0:45 / /mnt/fast\\040disk/tmp rw - tmpfs tmpfs rw,size=1024k
"""


def test_fields_and_escapes():
    parsed = mounts.parse(SAMPLE.splitlines())
    assert parsed == [
        mounts.Mount("8:1", "/", "ext4", "/dev/sda1"),
        mounts.Mount("259:2", "/mnt/fast disk", "xfs", "/dev/nvme0n1"),
        mounts.Mount("0:45", "/mnt/fast disk/tmp", "tmpfs", "tmpfs"),
    ]


def test_a_folder_is_on_the_deepest_mount_above_it(monkeypatch):
    monkeypatch.setattr(mounts, "mounts", lambda: mounts.parse(SAMPLE.splitlines()))
    assert mounts.of_folder("/mnt/fast disk/a").source == "/dev/nvme0n1"
    assert mounts.of_folder("/mnt/fast disk/tmp").fs_type == "tmpfs"
    assert mounts.of_folder("/mnt/fast diskette").fs_type == "ext4"    # not a prefix of a name


def test_this_process_finds_the_filesystem_of_its_own_files(tmp_path):
    device = os.stat(tmp_path).st_dev
    mount = mounts.of_device(device)
    assert mount.device == f"{os.major(device)}:{os.minor(device)}"
    assert mounts.of_folder(str(tmp_path)).device == mount.device

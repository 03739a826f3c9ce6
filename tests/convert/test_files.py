"""Output files: written whole or not at all, with the umask's permissions, and their size on disk counted once."""

import io
import os

import pytest

from raven_convert.files import atomic_file, copy_dir, disk_bytes, format_bytes, mappings, write_json, write_png


@pytest.mark.parametrize("mask, mode", [(0o022, 0o644), (0o027, 0o640)])
def test_an_atomic_file_gets_a_new_files_mode_under_the_umask(mask, mode, tmp_path):
    old = os.umask(mask)
    try:
        write_json({"a": 1}, tmp_path / "out" / "x.json")
    finally:
        os.umask(old)
    assert (tmp_path / "out" / "x.json").stat().st_mode & 0o777 == mode


def test_a_failed_atomic_write_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError), atomic_file(tmp_path / "x.json") as f:
        f.write("half")
        raise RuntimeError("disk full")
    assert list(tmp_path.iterdir()) == []


def test_disk_bytes_counts_each_file_once(tmp_path):
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "one").write_bytes(b"x" * 10)
    (tmp_path / "a" / "b" / "two").write_bytes(b"x" * 5)
    assert disk_bytes(tmp_path / "a", tmp_path / "a" / "b", tmp_path / "missing") == 15
    os.link(tmp_path / "a" / "one", tmp_path / "a" / "b" / "three")  # a hard link takes no more space
    assert disk_bytes(tmp_path / "a") == 15 and disk_bytes(tmp_path / "a" / "b", besides=(tmp_path / "a",)) == 0
    assert format_bytes(45_200_000) == "45.2 MB" and format_bytes(3_614_000_000) == "3.61 GB"


def test_a_copied_folder_links_its_weights_and_copies_the_rest(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "model.safetensors").write_bytes(b"w" * 1000)
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "copy").mkdir()
    (tmp_path / "copy" / "stale.txt").write_text("replaced whole")
    copy_dir(tmp_path / "model", tmp_path / "copy")
    assert sorted(p.name for p in (tmp_path / "copy").iterdir()) == ["config.json", "model.safetensors"]
    assert (tmp_path / "copy" / "model.safetensors").samefile(tmp_path / "model" / "model.safetensors")
    assert not (tmp_path / "copy" / "config.json").samefile(tmp_path / "model" / "config.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["copy", "model"]  # no hidden temporary left


def test_a_written_png_is_the_figure_in_256_colours(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from PIL import Image

    fig, ax = plt.subplots(figsize=(4, 3))
    ax.imshow(np.linspace(0, 1, 64 * 64).reshape(64, 64), cmap="viridis")  # a gradient: the hardest case
    ax.plot(np.sin(np.linspace(0, 9, 200)) * 20 + 32, color="tab:red")
    full = io.BytesIO()
    fig.savefig(full, dpi=80, format="png")
    path = write_png(fig, tmp_path / "plot.png", dpi=80)
    plt.close(fig)

    written = Image.open(path)
    assert written.mode == "P" and len(written.getpalette()) // 3 <= 256
    assert path.stat().st_size < len(full.getvalue())
    got = np.asarray(written.convert("RGB"), dtype=float)
    want = np.asarray(Image.open(full).convert("RGB"), dtype=float)
    assert got.shape == want.shape and np.abs(got - want).mean() < 2.0  # of 255 levels
    assert [p.name for p in tmp_path.iterdir()] == ["plot.png"]  # no temporary file left beside it


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads Linux's /proc/self/smaps")
def test_mappings_list_a_mapped_file_with_its_inode_offset_and_fields(tmp_path):
    import mmap

    path = tmp_path / "data.bin"
    path.write_bytes(bytes(range(256)) * 64)  # 16 KiB
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        assert mapped[5000] == 5000 % 256  # a page read in
        ours = [m for m in mappings() if m["inode"] == path.stat().st_ino]
    assert len(ours) == 1 and ours[0]["path"] == str(path) and ours[0]["offset"] == 0 and ours[0]["shared"]
    assert ours[0]["end"] - ours[0]["start"] == 16384 and ours[0]["Rss"] >= 4 and ours[0]["Anonymous"] == 0

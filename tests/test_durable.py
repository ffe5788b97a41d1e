"""Durable writes shared by checkpoints, serving bundles and the write-ahead log."""
import pytest

from lightning_persia.durable import fsync_path, write_atomically


def test_write_atomically_replaces_the_whole_file_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "BASE.json"
    target.write_text("old")
    write_atomically(target, '{"segment": 3}')
    assert target.read_text() == '{"segment": 3}'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["BASE.json"]


def test_fsync_of_a_missing_path_raises_unless_best_effort(tmp_path):
    fsync_path(tmp_path)  # a folder
    with pytest.raises(FileNotFoundError):
        fsync_path(tmp_path / "gone")
    fsync_path(tmp_path / "gone", best_effort=True)

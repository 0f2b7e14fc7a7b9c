"""Atomic checkpoints on a real directory: what a resumed run would find after saves and crashes."""

import pytest

from fastgrpo.checkpoint import CheckpointManager


def write_text(text: str):
    def write(d):
        (d / "sub").mkdir()
        (d / "sub" / "x.txt").write_text(text)

    return write


def hidden(root):
    return sorted(p.name for p in root.iterdir() if p.name.startswith("."))


def test_save_then_latest(tmp_path):
    cm = CheckpointManager(tmp_path / "ckpt", keep_last=2)
    assert cm.latest() is None and cm.checkpoints() == []
    path = cm.save(4, write_text("four"))
    assert path == tmp_path / "ckpt" / "step_00000004"
    assert cm.latest() == path and CheckpointManager.step_of(path) == 4
    assert (path / "sub" / "x.txt").read_text() == "four"
    assert hidden(tmp_path / "ckpt") == []


def test_keep_last_prunes_oldest(tmp_path):
    cm = CheckpointManager(tmp_path, keep_last=2)
    for step in range(1, 6):
        cm.save(step, write_text(str(step)))
    assert [cm.step_of(p) for p in cm.checkpoints()] == [4, 5]
    assert (cm.latest() / "sub" / "x.txt").read_text() == "5"


def test_fewer_checkpoints_than_keep_last_are_all_kept(tmp_path):
    cm = CheckpointManager(tmp_path, keep_last=5)
    for step in (1, 2, 3, 4):
        cm.save(step, write_text(str(step)))
    assert [cm.step_of(p) for p in cm.checkpoints()] == [1, 2, 3, 4]


@pytest.mark.parametrize("error", [RuntimeError("disk full"), KeyboardInterrupt()])
def test_failed_write_leaves_nothing_visible(tmp_path, error):
    cm = CheckpointManager(tmp_path, keep_last=2)
    good = cm.save(1, write_text("good"))

    def crash(d):
        (d / "model.bin").write_bytes(b"half a model")
        raise error

    with pytest.raises(type(error)) as raised:
        cm.save(2, crash)
    assert raised.value is error
    assert cm.checkpoints() == [good] and cm.latest() == good
    assert (good / "sub" / "x.txt").read_text() == "good"
    assert hidden(tmp_path) == []


def test_leftover_temp_dir_ignored_then_cleaned(tmp_path):
    cm = CheckpointManager(tmp_path, keep_last=3)
    cm.save(3, write_text("3"))
    stale = tmp_path / ".tmp-step_00000007-deadbeef"  # a save killed mid-write
    (stale / "sub").mkdir(parents=True)
    (stale / "sub" / "x.txt").write_text("partial")
    assert cm.latest().name == "step_00000003"
    assert [p.name for p in cm.checkpoints()] == ["step_00000003"]
    cm.save(4, write_text("4"))
    assert not stale.exists() and hidden(tmp_path) == []
    assert [cm.step_of(p) for p in cm.checkpoints()] == [3, 4]


def test_order_is_by_step_number(tmp_path):
    cm = CheckpointManager(tmp_path, keep_last=10)
    for step in (10, 9, 99_999_999, 100_000_000):  # 9 is written last of the small ones: newest mtime
        cm.save(step, write_text(str(step)))
    assert [cm.step_of(p) for p in cm.checkpoints()] == [9, 10, 99_999_999, 100_000_000]
    assert cm.latest().name == "step_100000000"
    cm2 = CheckpointManager(tmp_path / "b", keep_last=10)
    for step in (10, 9):
        cm2.save(step, write_text(str(step)))
    assert cm2.latest().name == "step_00000010"


def test_resaving_a_step_replaces_it(tmp_path):
    cm = CheckpointManager(tmp_path, keep_last=2)
    cm.save(5, write_text("first"))
    (cm.latest() / "only_in_first").write_text("")
    path = cm.save(5, write_text("second"))
    assert cm.checkpoints() == [path]
    assert (path / "sub" / "x.txt").read_text() == "second"
    assert not (path / "only_in_first").exists()
    assert hidden(tmp_path) == []


def test_out_of_order_save_is_not_pruned_away(tmp_path):
    cm = CheckpointManager(tmp_path, keep_last=2)
    for step in (10, 11):
        cm.save(step, write_text(str(step)))
    path = cm.save(5, write_text("5"))
    assert path.is_dir() and [cm.step_of(p) for p in cm.checkpoints()] == [5, 11]


def test_invalid_arguments(tmp_path):
    with pytest.raises(ValueError):
        CheckpointManager(tmp_path, keep_last=0)
    with pytest.raises(ValueError):
        CheckpointManager.step_of(tmp_path / ".tmp-step_00000001-abc")
    with pytest.raises(ValueError):
        CheckpointManager(tmp_path, keep_last=1).save(-1, write_text("x"))

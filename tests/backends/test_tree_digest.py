"""cache_files.tree_digest: the code fingerprint the program cache keys on, memoized by file stats."""

from __future__ import annotations

import os

from symgrad.backends.build.cache_files import tree_digest


def _tree(root):
    (root / "sub").mkdir(parents=True)
    (root / "a.py").write_text("x = 1\n")
    (root / "sub" / "b.py").write_text("y = 2\n")
    (root / "notes.txt").write_text("not hashed\n")


def test_the_digest_follows_every_file_and_the_memo_returns_it_unchanged(tmp_path):
    root, memo = tmp_path / "src", tmp_path / "memo"
    _tree(root)
    plain = tree_digest(root, ".py")
    assert tree_digest(root, ".py", memo) == plain          # computed, then kept
    assert len(list(memo.iterdir())) == 1
    assert tree_digest(root, ".py", memo) == plain          # read back
    (root / "notes.txt").write_text("another suffix\n")
    assert tree_digest(root, ".py", memo) == plain
    # An edit of the same size: the modification time tells the memo apart (as a .pyc's check).
    stat = os.stat(root / "sub" / "b.py")
    (root / "sub" / "b.py").write_text("y = 3\n")
    os.utime(root / "sub" / "b.py", ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    edited = tree_digest(root, ".py", memo)
    assert edited != plain and edited == tree_digest(root, ".py")
    (root / "sub" / "b.py").rename(root / "sub" / "c.py")   # a renamed file is another tree
    assert tree_digest(root, ".py", memo) not in (plain, edited)


def test_a_damaged_memo_is_hashed_again(tmp_path):
    root, memo = tmp_path / "src", tmp_path / "memo"
    _tree(root)
    want = tree_digest(root, ".py", memo)
    (kept,) = memo.iterdir()
    kept.write_text("not a digest")
    assert tree_digest(root, ".py", memo) == want
    assert kept.read_text() == want

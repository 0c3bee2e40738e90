"""The compiles' disk cache (projection/disk_cache.py): keys, reads and its size bound.
(A whole projection read back from it: tests/test_projection.py; corrupt entries:
tests/test_bad_input_flags.py.)"""

import os
import pickle

from projection import disk_cache


def test_keys_follow_every_part_and_the_code(monkeypatch):
  key = disk_cache.key("model", 1)
  assert key == disk_cache.key("model", 1)
  assert key != disk_cache.key("model", 2)
  monkeypatch.setenv("XLA_FLAGS", "--xla_some_other_flag")
  assert key != disk_cache.key("model", 1)
  monkeypatch.delenv("XLA_FLAGS")
  monkeypatch.setattr(disk_cache, "code_digest", lambda: "other code")
  assert key != disk_cache.key("model", 1)


def test_a_written_entry_is_read_back_and_an_invalid_one_is_not(tmp_path):
  path = str(tmp_path / "sub" / "entry.pkl")
  disk_cache.write(path, {"program": [1, 2, 3]})
  assert disk_cache.read(path, lambda c: isinstance(c, dict)) == {"program": [1, 2, 3]}
  assert disk_cache.read(path, lambda c: isinstance(c, list)) is None
  assert disk_cache.read(str(tmp_path / "missing.pkl"), lambda c: True) is None
  assert os.listdir(tmp_path / "sub") == ["entry.pkl"]  # no partial file left behind


def test_the_folder_keeps_its_most_recently_used_entries(tmp_path, monkeypatch):
  entry_bytes = len(pickle.dumps(b"x" * 1000))
  monkeypatch.setattr(disk_cache, "MAX_FOLDER_BYTES", 2 * entry_bytes)
  paths = [str(tmp_path / f"{name}.pkl") for name in "abc"]
  for age, path in enumerate(paths[:2]):
    disk_cache.write(path, b"x" * 1000)
    os.utime(path, (1000 + age, 1000 + age))  # a written 1,000 s after the epoch, b 1 s later
  assert disk_cache.read(paths[0], lambda c: True) is not None  # a used now: b is the oldest
  disk_cache.write(paths[2], b"x" * 1000)
  assert sorted(os.listdir(tmp_path)) == ["a.pkl", "c.pkl"]

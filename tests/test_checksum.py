import hashlib

import pytest
import xxhash

from lightning_persia import checksum


def test_a_file_digest_is_xxh3_128_and_made_block_by_block_like_the_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(checksum, "_BLOCK", 1000)  # several blocks and a short last one
    data = bytes(range(256)) * 37
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    entry = checksum.of_file(path)
    assert entry == {"xxh3_128": xxhash.xxh3_128(data).hexdigest()} and checksum.ALGORITHM == "xxh3_128"
    digest = checksum.Digest()
    digest.update(data[:10])
    digest.update(memoryview(data)[10:])
    assert digest.entry() == entry
    assert checksum.matches({"file": "f.bin", **entry, "bytes": len(data)}, path)


def test_a_changed_byte_or_a_shorter_file_no_longer_matches(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(b"x" * 5000)
    entry = checksum.of_file(path)
    path.write_bytes(b"x" * 4999 + b"y")
    assert not checksum.matches(entry, path)
    path.write_bytes(b"x" * 4999)
    assert not checksum.matches(entry, path)


def test_an_entry_of_an_older_version_verifies_with_its_sha256(tmp_path):
    data = b"rows" * 1000
    path = tmp_path / "old.npy"
    path.write_bytes(data)
    entry = {"file": "old.npy", "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    assert checksum.algorithm_of(entry) == "sha256" and checksum.matches(entry, path)
    assert checksum.of_file(path, "sha256") == {"sha256": entry["sha256"]}


def test_an_entry_without_a_known_checksum_is_refused_naming_its_keys(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(b"data")
    entry = {"file": "f.bin", "md5": "0" * 32, "bytes": 4}
    assert checksum.algorithm_of(entry) is None
    with pytest.raises(ValueError, match=r"no checksum of a known algorithm \(xxh3_128, sha256\) in \['bytes', 'file', 'md5'\]"):
        checksum.matches(entry, path)

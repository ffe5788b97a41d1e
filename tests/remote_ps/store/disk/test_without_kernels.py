"""Without the native kernels a disk table is refused with an error saying why (the disk-tier tests skip then)."""
import pytest

from lightning_persia.remote_ps.store.disk import tier as disk_tier
from lightning_persia.remote_ps.store.errors import StoreError
from lightning_persia.remote_ps.store.table import Table
from lightning_persia.remote_ps.table_config import TableConfig


def test_a_disk_table_without_the_native_kernels_is_refused_naming_them(tmp_path, monkeypatch):
    monkeypatch.setattr(disk_tier.native, "available", lambda: False)
    with pytest.raises(StoreError, match="storage 'disk' needs the native kernels"):
        Table(TableConfig("t", 4, storage="disk", capacity=100), seed=0, disk_dir=str(tmp_path / "tier"))
    assert not (tmp_path / "tier").exists()  # refused before anything was written

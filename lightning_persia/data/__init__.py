"""Data modules yielding :class:`CriteoBatch` es (sparse KJT, dense features, labels).

* :class:`CriteoDataModule`: streaming reader of Criteo Kaggle/Terabyte TSV files (plain or gzip);
* :class:`CriteoBinaryDataModule`: TorchRec's preprocessed binary Criteo (``.npy`` per day) and MLPerf DLRM-DCNv2's
  multi-hot days (``_sparse_multi_hot.npz``), memory-mapped;
* :class:`ParquetDataModule`: Parquet files, directories and partitioned datasets on any filesystem, columns named in
  the config, one id or a list of ids per row (needs ``pyarrow``: the ``parquet`` extra);
* :class:`SyntheticCriteoDataModule`: a generated Criteo-shaped stream with a known ground-truth AUC ceiling;
* :class:`AdultDataModule`: UCI Adult census income, shipped with the package.

Each file data module's ``ids`` setting (``raw`` or ``hash``) and its :class:`DataTransform` (``datamodule.transform``:
each feature's id mode, the dense columns and their transform) say how stored values become a batch.
"""
from lightning_persia.data.adult import (
    ADULT_CARDINALITIES,
    ADULT_DENSE_FEATURES,
    ADULT_NUM_TEST,
    ADULT_NUM_TRAIN,
    ADULT_SPARSE_FEATURES,
    AdultDataModule,
    AdultDataset,
    AdultTable,
)
from lightning_persia.data.batch import CriteoBatch, hash_categorical, hash_feature_ids, make_batch, missing_ids, string_key, transform_dense
from lightning_persia.data.criteo import (
    CRITEO_DENSE_FEATURES,
    CRITEO_KAGGLE_CARDINALITIES,
    CRITEO_NUM_DENSE,
    CRITEO_NUM_SPARSE,
    CRITEO_SPARSE_FEATURES,
    CriteoDataModule,
    CriteoIterableDataset,
    parse_criteo_lines,
)
from lightning_persia.data.criteo_binary import CriteoBinaryDataModule, CriteoBinaryDataset
from lightning_persia.data.parquet import ParquetDataModule, ParquetDataset
from lightning_persia.data.transform import ID_MODES, DataTransform, TransformError, recorded_transform
from lightning_persia.data.synthetic import (
    SyntheticCriteo,
    SyntheticCriteoDataModule,
    SyntheticCriteoDataset,
    SyntheticRows,
    binary_auc,
    scaled_cardinalities,
)

#: Default 26 table sizes of the synthetic data (the Criteo Kaggle cardinalities scaled by 0.1).
SYNTHETIC_DEFAULT_CARDINALITIES = scaled_cardinalities(0.1)

__all__ = [
    "ADULT_CARDINALITIES",
    "ADULT_DENSE_FEATURES",
    "ADULT_NUM_TEST",
    "ADULT_NUM_TRAIN",
    "ADULT_SPARSE_FEATURES",
    "AdultDataModule",
    "AdultDataset",
    "AdultTable",
    "CRITEO_DENSE_FEATURES",
    "CRITEO_KAGGLE_CARDINALITIES",
    "CRITEO_NUM_DENSE",
    "CRITEO_NUM_SPARSE",
    "CRITEO_SPARSE_FEATURES",
    "CriteoBatch",
    "CriteoBinaryDataModule",
    "CriteoBinaryDataset",
    "CriteoDataModule",
    "CriteoIterableDataset",
    "DataTransform",
    "ID_MODES",
    "ParquetDataModule",
    "ParquetDataset",
    "SYNTHETIC_DEFAULT_CARDINALITIES",
    "SyntheticCriteo",
    "SyntheticCriteoDataModule",
    "SyntheticCriteoDataset",
    "SyntheticRows",
    "TransformError",
    "binary_auc",
    "hash_categorical",
    "hash_feature_ids",
    "make_batch",
    "missing_ids",
    "parse_criteo_lines",
    "recorded_transform",
    "scaled_cardinalities",
    "string_key",
    "transform_dense",
]

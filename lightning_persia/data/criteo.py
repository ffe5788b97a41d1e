"""Streaming reader of the Criteo Kaggle / Terabyte click logs (TSV) and its LightningDataModule.

Format, one example per line: ``label <TAB> I1 .. I13 <TAB> C1 .. C26``: a 0/1 label, 13 integer ("dense")
features and 26 categorical features given as 32-bit hex ids (at most 8 hex digits). Any feature may be
empty (missing). Files may be gzip-compressed (detected from the content, not the name).

* Sparse ids (``ids: hash``, the default): each categorical value is hashed, per feature, to a stable non-negative
  int64 id by :func:`~lightning_persia.data.batch.hash_categorical` (no vocabulary pass); a missing value gets a fixed
  per-feature "missing" id. ``ids: raw`` takes the hex values as the ids (a missing value: no id).
* Tokenised by ``pyarrow.csv`` a batch of lines at a time; a batch with a malformed line is parsed line by line
  instead, which names the line (or skips it: ``skip_malformed``).
* Dense values: missing -> 0, then ``log(1 + max(x, 0))``.
* Split: the lines of all files, counted as one sequence, are dealt round-robin to the readers, one reader per
  (trainer rank, DataLoader worker); every reader scans every file but parses only its own lines, so the parts
  are disjoint, complete and balanced to one line.
* Batches are assembled inside the dataset (use ``DataLoader(batch_size=None)``), never more than one batch
  of lines in memory.
"""
from __future__ import annotations

import gzip
import sys
import warnings
from typing import IO, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch.utils.data import get_worker_info

from lightning_persia.data._batching import Bags, BatchStream, Rows, cut_batches, sparse_columns
from lightning_persia.data._files import expand_files
from lightning_persia.data._loader import FileSplitDataModule
from lightning_persia.data._sharding import reader_shard
from lightning_persia.data.batch import CriteoBatch
from lightning_persia.data.transform import DataTransform, IdsSetting, resolve_ids

CRITEO_NUM_DENSE = 13
CRITEO_NUM_SPARSE = 26
CRITEO_NUM_FIELDS = 1 + CRITEO_NUM_DENSE + CRITEO_NUM_SPARSE
#: Names of the dense columns, in file order (I1..I13 of the Criteo documentation).
CRITEO_DENSE_FEATURES: List[str] = [f"int_{i}" for i in range(CRITEO_NUM_DENSE)]
#: Keys of the sparse KJT, in file order (C1..C26 of the Criteo documentation).
CRITEO_SPARSE_FEATURES: List[str] = [f"cat_{i}" for i in range(CRITEO_NUM_SPARSE)]
#: Distinct values per categorical feature in the Criteo Kaggle (Display Advertising Challenge) training set.
CRITEO_KAGGLE_CARDINALITIES: List[int] = [
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
]  # fmt: skip

_HEX_LUT = np.full(256, 255, dtype=np.uint8)
for _i, _c in enumerate(b"0123456789abcdef"):
    _HEX_LUT[_c] = _i
for _i, _c in enumerate(b"ABCDEF"):
    _HEX_LUT[_c] = 10 + _i
_DEC_LUT = np.full(256, 255, dtype=np.uint8)
for _i, _c in enumerate(b"0123456789"):
    _DEC_LUT[_c] = _i
_PAD = 254  # the NUL padding of numpy's fixed-width bytes
_HEX_LUT[0] = _DEC_LUT[0] = _PAD
_MAX_HEX_DIGITS = 8
_MAX_DEC_DIGITS = 18  # anything below 10**18 fits int64


def _digits(cells: np.ndarray, lut: np.ndarray, base: int, max_digits: int, signed: bool) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Parse ``[n, k]`` fixed-width byte strings as integers in ``base``: ``(values, empty, invalid)`` masks."""
    n, k = cells.shape
    width = cells.dtype.itemsize
    raw = np.ascontiguousarray(cells).view(np.uint8).reshape(n, k, width)
    negative = np.zeros((n, k), dtype=bool)
    if signed:
        negative = raw[..., 0] == ord("-")
        if negative.any():
            raw = raw.copy()
            # shift the digits of negative cells one place left so that all cells start with a digit
            raw[negative] = np.concatenate([raw[negative][:, 1:], np.zeros((int(negative.sum()), 1), np.uint8)], axis=1)
    nib = lut[raw]
    pad = nib == _PAD
    empty = pad[..., 0]
    invalid = (nib == 255).any(-1) | (pad[..., :-1] & ~pad[..., 1:]).any(-1)  # bad char, or a NUL inside
    invalid |= negative & empty  # a lone "-"
    if width > max_digits:
        invalid |= ~pad[..., max_digits]
    values = np.zeros((n, k), dtype=np.int64)
    for p in range(min(width, max_digits)):
        digit = nib[..., p]
        values = np.where(digit < base, values * base + digit.astype(np.int64), values)
    values = np.where(negative, -values, values)
    return values, empty & ~negative, invalid


def criteo_transform(ids: IdsSetting, default: str, dense_transform: str, text_ids: str) -> DataTransform:
    """The :class:`DataTransform` of a source with Criteo's columns (26 sparse ``cat_*``, 13 dense ``int_*``)."""
    return DataTransform(tuple(CRITEO_SPARSE_FEATURES), resolve_ids(ids, CRITEO_SPARSE_FEATURES, default),
                         tuple(CRITEO_DENSE_FEATURES), dense_transform, text_ids)


def tsv_transform(ids: IdsSetting) -> DataTransform:
    """Criteo's TSV cells: 8-hex-digit categorical values, hashed unless ``ids`` says otherwise; counts ``log1p``'d."""
    return criteo_transform(ids, "hash", "log1p", "hex")


_HASHED = tsv_transform("hash")


class _ParsedRows:
    """Featurised rows of one chunk of lines: ids (:class:`Bags` of 26 features), dense ``[n, 13]`` float32, labels ``[n]``."""

    def __init__(self, ids: Bags, dense: torch.Tensor, labels: torch.Tensor) -> None:
        self.ids, self.dense, self.labels = ids, dense, labels

    def __len__(self) -> int:
        return self.labels.shape[0]

    def as_rows(self) -> Rows:
        return self.ids, self.dense, self.labels


def parse_criteo_lines(lines: Sequence[bytes], transform: DataTransform = _HASHED) -> Tuple[_ParsedRows, List[Tuple[int, str]]]:
    """Parse raw Criteo lines; returns the rows featurised by ``transform`` (default: hashed ids) and ``(index, reason)``
    of each bad line."""
    bad: dict[int, str] = {}
    rows = []
    placeholder = [b"0"] + [b""] * (CRITEO_NUM_FIELDS - 1)
    for i, line in enumerate(lines):
        fields = line.rstrip(b"\r\n").split(b"\t")
        if len(fields) != CRITEO_NUM_FIELDS:
            bad[i] = f"expected {CRITEO_NUM_FIELDS} tab-separated fields, got {len(fields)}"
            fields = placeholder
        rows.append(fields)
    if not rows:
        empty = torch.zeros(0, dtype=torch.int64)
        return _ParsedRows(Bags.one_hot(empty.view(0, CRITEO_NUM_SPARSE)), torch.zeros(0, CRITEO_NUM_DENSE), empty.float()), []
    table = np.array(rows, dtype=np.bytes_)

    label_cells = table[:, 0]
    label_ok = (label_cells == b"0") | (label_cells == b"1")
    dense, dense_missing, dense_invalid = _digits(table[:, 1 : 1 + CRITEO_NUM_DENSE], _DEC_LUT, 10, _MAX_DEC_DIGITS, True)
    cats, cat_missing, cat_invalid = _digits(table[:, 1 + CRITEO_NUM_DENSE :], _HEX_LUT, 16, _MAX_HEX_DIGITS, False)

    for i in np.flatnonzero(~label_ok | dense_invalid.any(1) | cat_invalid.any(1)).tolist():
        if i in bad:
            continue
        if not label_ok[i]:
            bad[i] = f"label must be 0 or 1, got {bytes(label_cells[i])!r}"
        elif dense_invalid[i].any():
            j = int(np.flatnonzero(dense_invalid[i])[0])
            bad[i] = f"dense feature I{j + 1} is not an integer: {rows[i][1 + j]!r}"
        else:
            j = int(np.flatnonzero(cat_invalid[i])[0])
            bad[i] = f"categorical feature C{j + 1} is not a hex id of at most 8 digits: {rows[i][1 + CRITEO_NUM_DENSE + j]!r}"

    keep = np.ones(len(rows), dtype=bool)
    if bad:
        keep[list(bad)] = False
    ids = sparse_columns(transform, torch.from_numpy(cats[keep]), torch.from_numpy(cat_missing[keep]))
    dense_t = transform.dense(torch.from_numpy(dense[keep]), torch.from_numpy(dense_missing[keep]))
    labels = torch.from_numpy((label_cells[keep] == b"1").astype(np.float32))
    return _ParsedRows(ids, dense_t, labels), sorted(bad.items())


_COLUMN_NAMES = ["label", *CRITEO_DENSE_FEATURES, *CRITEO_SPARSE_FEATURES]


def _tokenised(lines: Sequence[bytes], transform: DataTransform) -> Optional[_ParsedRows]:
    """The rows of ``lines`` tokenised by ``pyarrow.csv``, or ``None`` when pyarrow is missing or a line is not well
    formed: the caller then parses them line by line, to name it. (47k rows/s against the line parser's 32k, batches
    of 4096, one core of a busy 2-core machine.)"""
    try:
        import pyarrow as pa
        import pyarrow.csv as csv
    except ImportError:
        return None
    types = {"label": pa.int64(), **{c: pa.int64() for c in CRITEO_DENSE_FEATURES}, **{c: pa.binary() for c in CRITEO_SPARSE_FEATURES}}
    try:
        table = csv.read_csv(
            pa.py_buffer(b"".join(lines)),
            read_options=csv.ReadOptions(column_names=_COLUMN_NAMES, use_threads=False, block_size=1 << 26),
            parse_options=csv.ParseOptions(delimiter="\t", quote_char=False, double_quote=False, ignore_empty_lines=False),
            convert_options=csv.ConvertOptions(column_types=types, strings_can_be_null=False, quoted_strings_can_be_null=False),
        )
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return None
    if table.num_rows != len(lines):
        return None
    labels = table.column("label")
    if labels.null_count or not bool(np.isin(labels.to_numpy(), (0, 1)).all()):
        return None
    dense = np.stack([table.column(c).fill_null(0).to_numpy() for c in CRITEO_DENSE_FEATURES], axis=1)
    dense_missing = np.stack([table.column(c).is_null().to_numpy(zero_copy_only=False) for c in CRITEO_DENSE_FEATURES], axis=1)
    cells = np.stack([_fixed_width(table.column(c).combine_chunks()) for c in CRITEO_SPARSE_FEATURES], axis=1)
    if cells.dtype.itemsize > _MAX_HEX_DIGITS:
        return None
    cats, cat_missing, cat_invalid = _digits(cells, _HEX_LUT, 16, _MAX_HEX_DIGITS, False)
    if cat_invalid.any():
        return None
    ids = sparse_columns(transform, torch.from_numpy(cats), torch.from_numpy(cat_missing))
    dense_t = transform.dense(torch.from_numpy(dense), torch.from_numpy(dense_missing))
    return _ParsedRows(ids, dense_t, torch.from_numpy(labels.to_numpy().astype(np.float32)))


def _fixed_width(column) -> np.ndarray:
    """A binary arrow column as numpy fixed-width bytes (``S<longest>``), built from its buffers without a Python
    loop: the cells' bytes, zero-padded, as :func:`_digits` reads them."""
    n = len(column)
    offsets = np.frombuffer(column.buffers()[1], dtype=np.int32)[column.offset : column.offset + n + 1]
    data = np.frombuffer(column.buffers()[2], dtype=np.uint8) if column.buffers()[2] is not None else np.zeros(0, np.uint8)
    data = data if len(data) else np.zeros(1, np.uint8)  # every cell empty: nothing to gather
    lengths = np.diff(offsets)
    width = max(int(lengths.max(initial=0)), 1)
    positions = offsets[:-1, None] + np.arange(width)
    cells = np.where(np.arange(width) < lengths[:, None], data[np.minimum(positions, len(data) - 1)], 0).astype(np.uint8)
    return np.ascontiguousarray(cells).view(f"S{width}")[:, 0]


def _open(path: str) -> IO[bytes]:
    with open(path, "rb") as probe:
        magic = probe.read(2)
    return gzip.open(path, "rb") if magic == b"\x1f\x8b" else open(path, "rb")


class CriteoFeatures:
    """The features of a data module whose batches have Criteo's columns: 13 dense, the 26 sparse KJT keys."""

    @property
    def sparse_feature_names(self) -> List[str]:
        return list(CRITEO_SPARSE_FEATURES)

    @property
    def num_dense_features(self) -> int:
        return CRITEO_NUM_DENSE


class CriteoIterableDataset(BatchStream):
    """Streams :class:`CriteoBatch` es from Criteo TSV files (plain or gzip), this reader's share of the lines.

    Args:
        files: TSV files, read in order as one sequence of lines.
        batch_size: rows per batch; the last batch of a pass may be smaller unless ``drop_last``.
        skip_malformed: skip (and count in :attr:`malformed_lines`) a malformed line instead of raising a
            ``ValueError`` that names the file and the 1-based line number.
        drop_last: drop the last, incomplete batch of a pass.
        rank: trainer rank; ``None`` reads it from ``torch.distributed`` (or 0 when not initialised).
        world_size: number of trainer ranks; ``None`` as ``rank``.
        ids: ``hash`` (the default) or ``raw`` (the hex values as ids), for every feature or per feature.
    """

    def __init__(
        self,
        files: Sequence[str],
        batch_size: int = 4096,
        skip_malformed: bool = False,
        drop_last: bool = False,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
        ids: IdsSetting = "hash",
    ) -> None:
        super().__init__(batch_size, drop_last, rank, world_size)
        self.files = expand_files(files, "Criteo file")
        self.skip_malformed = skip_malformed
        self.transform = tsv_transform(ids)
        #: Malformed lines skipped by the last pass of this process (``skip_malformed=True``). With
        #: ``num_workers > 0`` the workers count in their own copies; their skips are logged as warnings.
        self.malformed_lines = 0

    def _lines(self) -> Iterator[Tuple[bytes, int, int]]:
        """``(line, file index, 1-based line number)`` of this reader's lines."""
        shard, num_shards = reader_shard(self.rank, self.world_size)
        position = 0  # index of the next line in the concatenation of all files
        for file_index, path in enumerate(self.files):
            with _open(path) as handle:
                if num_shards == 1:
                    for line_no, line in enumerate(handle, 1):
                        yield line, file_index, line_no
                    continue
                first = (shard - position) % num_shards
                line_no = 0
                for line_no, line in enumerate(handle, 1):
                    if (line_no - 1) % num_shards == first:
                        yield line, file_index, line_no
                position += line_no

    def _parse(self, lines: List[bytes], where: List[Tuple[int, int]]) -> _ParsedRows:
        fast = _tokenised(lines, self.transform)
        if fast is not None:
            return fast
        rows, bad = parse_criteo_lines(lines, self.transform)
        if bad:
            index, reason = bad[0]
            file_index, line_no = where[index]
            first = f"{self.files[file_index]}, line {line_no}"
            if not self.skip_malformed:
                raise ValueError(f"{first}: malformed Criteo line: {reason} (skip_malformed=True skips and counts such lines)")
            self.malformed_lines += len(bad)
            if get_worker_info() is not None:
                warnings.warn(f"skipped {len(bad)} malformed line(s), first {first}: {reason}")
        return rows

    def __iter__(self) -> Iterator[CriteoBatch]:
        self.malformed_lines = 0
        return cut_batches(self._rows(), self.batch_size, sys.maxsize, self.drop_last, CRITEO_SPARSE_FEATURES)

    def _rows(self) -> Iterator[Rows]:
        """The featurised rows of this reader's lines, parsed a batch's worth of lines at a time."""
        lines: List[bytes] = []
        where: List[Tuple[int, int]] = []
        for line, file_index, line_no in self._lines():
            lines.append(line)
            where.append((file_index, line_no))
            if len(lines) == self.batch_size:
                yield self._parse(lines, where).as_rows()
                lines, where = [], []
        if lines:
            yield self._parse(lines, where).as_rows()


class CriteoDataModule(CriteoFeatures, FileSplitDataModule):
    """Criteo Kaggle / Terabyte TSV files as a streaming LightningDataModule of :class:`CriteoBatch` es.

    Every trainer rank (and DataLoader worker) reads a disjoint, round-robin share of the lines, so the
    number of batches per rank differs by at most one; pass ``drop_last=True`` with DDP to make the last
    incomplete batch disappear everywhere (the counts may still differ by one when a rank's share is an exact
    multiple of the batch size; use ``Trainer(limit_train_batches=...)`` to pin them).

    Args:
        ids: ``hash`` (the default: Criteo's hex values hashed per feature) or ``raw`` (the values as ids), for every
            feature or per feature (``{cat_3: raw}``); see :mod:`lightning_persia.data.transform`.
        skip_malformed: skip and count malformed lines instead of raising ``ValueError``.
        **kwargs: :class:`~lightning_persia.data._loader.FileSplitDataModule`'s: ``train_files`` (plain or gzip TSV;
            glob patterns allowed), ``val_files``, ``test_files``, ``batch_size``, ``eval_batch_size``, ``drop_last``,
            ``num_workers`` (each worker parses its own share of the lines but reads, and decompresses, every file:
            batches hold other rows with another worker count), ``pin_memory``.
    """

    def __init__(self, ids: IdsSetting = "hash", skip_malformed: bool = False, **kwargs) -> None:
        super().__init__(**kwargs)
        self.save_hyperparameters()
        #: the ``ids`` setting (:attr:`transform` gives each feature's mode)
        self.ids = ids
        self.skip_malformed = skip_malformed
        #: what the batches are made of: the hex values hashed (or raw), the counts through ``log1p``
        self.transform = tsv_transform(ids)

    def read_files(self, files: List[str], batch_size: int, drop_last: bool) -> CriteoIterableDataset:
        return CriteoIterableDataset(files, batch_size=batch_size, skip_malformed=self.skip_malformed, drop_last=drop_last,
                                     ids=self.ids)

    @property
    def malformed_lines(self) -> int:
        """Malformed lines skipped by the last pass of each split, in this process (see the dataset's note)."""
        return sum(d.malformed_lines for d in self.datasets.values() if d is not None)

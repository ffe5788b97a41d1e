"""Parquet datasets as users keep them: files, directories (Spark's and NVTabular's output, hive-partitioned
folders), patterns, on any filesystem pyarrow or fsspec opens (``file://``, ``s3://``, ``gs://``, ``memory://``...)."""
from __future__ import annotations

import fnmatch
import os
import re
from typing import Any, List, Sequence, Tuple

#: Files of a directory read as Parquet; the rest (Spark's ``_SUCCESS``, NVTabular's ``schema.pbtxt``) are not data.
PARQUET_SUFFIXES = (".parquet", ".parq", ".pq")
_GLOB = re.compile(r"[*?\[]")


def _pyarrow() -> Tuple[Any, Any, Any]:
    try:
        import pyarrow as pa
        import pyarrow.dataset as ds
        import pyarrow.fs as pafs
    except ImportError:
        raise ImportError("reading Parquet needs pyarrow: pip install 'lightning-persia[parquet]'") from None
    return pa, ds, pafs


def _natural(text: str) -> list:
    return [int(piece) if piece.isdigit() else piece for piece in re.split(r"(\d+)", text)]


def filesystem_of(source: str) -> Tuple[Any, str]:
    """``(pyarrow filesystem, path in it)`` of a local path or a URI; a scheme pyarrow lacks goes through fsspec."""
    pa, _, pafs = _pyarrow()
    if "://" not in source:
        return pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(source))
    try:
        return pafs.FileSystem.from_uri(source)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, ValueError) as arrow_error:
        try:
            import fsspec
        except ImportError:
            raise ValueError(f"{source}: pyarrow cannot open it ({arrow_error}) and fsspec is not installed") from None
        try:
            fs, path = fsspec.core.url_to_fs(source)
        except (ImportError, ValueError) as err:
            raise ValueError(f"{source}: neither pyarrow ({arrow_error}) nor fsspec ({err}) opens it") from None
        return pafs.PyFileSystem(pafs.FSSpecHandler(fs)), path


def _is_data(path: str, base: str) -> bool:
    relative = path[len(base):].lstrip("/").split("/")
    return path.endswith(PARQUET_SUFFIXES) and not any(part.startswith(("_", ".")) for part in relative)


def _listing(fs: Any, base: str) -> List[str]:
    _, _, pafs = _pyarrow()
    infos = fs.get_file_info(pafs.FileSelector(base, recursive=True))
    return [info.path for info in infos if info.type == pafs.FileType.File]


def parquet_datasets(sources: Sequence[str]) -> List[Any]:
    """One ``pyarrow.dataset.Dataset`` per source, in order: a file; a directory (its Parquet files, recursively, in
    natural order, ``key=value`` folders giving hive partition columns); or a pattern (``*``, ``?``, ``[`` in the
    path; its matches in natural order). Raises ``FileNotFoundError`` naming a source with nothing to read."""
    _, ds, pafs = _pyarrow()
    out = []
    for source in sources:
        source = str(source)
        fs, path = filesystem_of(source)
        if _GLOB.search(path):
            base = path[: _GLOB.search(path).start()].rpartition("/")[0] or "/"
            pattern = path.split("/")
            files = [p for p in _listing(fs, base) if len(p.split("/")) == len(pattern)
                     and all(fnmatch.fnmatchcase(a, b) for a, b in zip(p.split("/"), pattern))]
            if not files:
                raise FileNotFoundError(f"no file matches {source!r}")
            out.append(_open(source, sorted(files, key=_natural), filesystem=fs))
            continue
        kind = fs.get_file_info(path).type
        if kind == pafs.FileType.NotFound:
            raise FileNotFoundError(f"Parquet file or directory not found: {source!r}")
        if kind == pafs.FileType.Directory:
            files = sorted((p for p in _listing(fs, path) if _is_data(p, path)), key=_natural)
            if not files:
                raise FileNotFoundError(f"no Parquet file ({', '.join(PARQUET_SUFFIXES)}) under {source!r}")
            out.append(_open(source, files, filesystem=fs, partitioning="hive", partition_base_dir=path))
        else:
            out.append(_open(source, path, filesystem=fs))
    return out


def _open(source: str, paths: Any, **options: Any) -> Any:
    pa, ds, _ = _pyarrow()
    try:
        return ds.dataset(paths, format="parquet", **options)
    except (pa.ArrowInvalid, OSError) as err:  # pyarrow's error for a file that is not Parquet
        raise ValueError(f"{source} is not a readable Parquet file or dataset: {err}") from None

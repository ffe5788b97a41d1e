"""Errors a shard reports to its callers; the server maps each class to one gRPC status code."""


class StoreError(Exception):
    """Base of the errors a shard answers with; the message is what the user sees."""


class UnknownTableError(StoreError):
    """The request names a table the shard does not have."""


class InvalidRequestError(StoreError):
    """The request is malformed (shape, dtype, size, ownership); nothing was changed."""


class CheckpointError(StoreError):
    """A checkpoint is missing, incomplete or corrupted; the shard's data is unchanged."""


class LogWriteError(StoreError):
    """The write-ahead log cannot be written (a full disk, a file-size limit, an I/O error): the operation that
    needed it is not acknowledged, and the shard acknowledges nothing more until it is restarted."""

    def __init__(self, message: str, disk_full: bool) -> None:
        super().__init__(message)
        self.disk_full = disk_full

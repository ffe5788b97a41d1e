"""Errors a shard reports to its callers; the server maps each class to one gRPC status code."""


class StoreError(Exception):
    """Base of the errors a shard answers with; the message is what the user sees."""


class UnknownTableError(StoreError):
    """The request names a table the shard does not have."""


class InvalidRequestError(StoreError):
    """The request is malformed (shape, dtype, size, ownership); nothing was changed."""


class CheckpointError(StoreError):
    """A checkpoint is missing, incomplete or corrupted; the shard's data is unchanged."""

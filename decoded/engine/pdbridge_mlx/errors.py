"""Exceptions shared by the server and the engine (kept free of MLX imports
so `--help` and argument errors answer without loading MLX)."""


class BadRequest(Exception):
    """The request is malformed or names blocks that do not fit the spec."""


class StartupError(Exception):
    """The model cannot be served (e.g. an unsupported cache class)."""


class Cancelled(Exception):
    """The client went away or the adapter is shutting down."""


class BlockUnusable(Exception):
    """A store block file is missing, unreadable or fails its checksum: the
    store's problem, not the request's. decoded quarantines the block and
    serves the request again without it."""

    def __init__(self, index: int, message: str):
        super().__init__(message)
        self.index = index

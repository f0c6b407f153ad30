"""What went wrong inside huggingface_hub, for the data tools' one-line errors.

The client wraps a failure in its own exceptions (an HTTP error around a connection error, say):
the first cause in the chain that means something to the user is the one to tell. Each tool words
the line itself, with what it keeps and what to do.
"""

import errno

NOT_FOUND_REPO = "repository not found"
NOT_FOUND_FILE = "file not found"
DENIED = "access denied"
OFFLINE = "offline mode"
HTTP_STATUS = "http status"
DISK_FULL = "disk full"
UNREACHABLE = "unreachable"
# the HTTP client's errors for a network that does not answer, by name (its exception classes)
NETWORK_ERRORS = ("ConnectError", "ConnectTimeout", "ReadTimeout", "RemoteProtocolError")
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def first_known_cause(exc):
    """(what, the exception found, its HTTP status or 0) for the first cause in `exc`'s chain that
    one of the names above describes, or (None, exc, 0)."""
    from huggingface_hub import errors

    cause = exc
    while cause is not None:
        status = 0
        if isinstance(cause, errors.HfHubHTTPError) and cause.response is not None:
            status = cause.response.status_code
        if status in (401, 403):
            return DENIED, cause, status
        if isinstance(cause, errors.RepositoryNotFoundError):
            return NOT_FOUND_REPO, cause, status
        if isinstance(cause, errors.EntryNotFoundError):
            return NOT_FOUND_FILE, cause, status
        if isinstance(cause, errors.OfflineModeIsEnabled):
            return OFFLINE, cause, status
        if status:
            return HTTP_STATUS, cause, status
        if isinstance(cause, OSError) and cause.errno in DISK_FULL_ERRNOS:
            return DISK_FULL, cause, status
        network = isinstance(cause, (ConnectionError, TimeoutError))
        if network or type(cause).__name__ in NETWORK_ERRORS or transport_error(cause):
            return UNREACHABLE, cause, status
        cause = cause.__cause__ or cause.__context__
    return None, exc, 0


def transport_error(exc):
    """Whether `exc` is one of the HTTP client's (httpx's) transport errors."""
    try:
        from huggingface_hub.utils import httpx
    except ImportError:
        return False
    return isinstance(exc, httpx.TransportError)


def first_line(exc):
    """The exception's kind and the first line of its message."""
    return f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"

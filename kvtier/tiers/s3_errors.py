"""botocore's errors as the kvtier errors the store acts on, raised ``from`` the original.

A missing object is no error (the tier returns ``None``; see :func:`is_missing`). Timeouts
become :class:`TierTimeout`; refused credentials, throttling, server errors, refused or
dropped connections and TLS failures become :class:`TierIOError` with a message saying
which. Messages name the tier, the operation and the credential *source*, never a key: the
secret is never sent to the server, so no response can echo it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from botocore import exceptions as bc
from urllib3 import exceptions as http

from kvtier.errors import KvtierError, TierIOError, TierTimeout

MISSING = frozenset({"NoSuchKey", "NotFound", "404"})
CREDENTIALS = frozenset({
    "InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "ExpiredToken",
    "InvalidToken", "TokenRefreshRequired", "AuthorizationHeaderMalformed",
    "InvalidClientTokenId", "AllAccessDisabled", "AccountProblem",
})
THROTTLED = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded",
    "TooManyRequests", "RequestThrottled", "ServiceUnavailable",
})
TIMEOUTS = frozenset({"RequestTimeout", "RequestTimeoutException"})


def error_code(exc: Exception) -> str:
    response = getattr(exc, "response", None) or {}
    return str(response.get("Error", {}).get("Code", ""))


def http_status(exc: Exception) -> int:
    response = getattr(exc, "response", None) or {}
    return int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))


def is_missing(exc: Exception) -> bool:
    """A ``ClientError`` saying the object is not there (but the bucket is)."""
    return error_code(exc) in MISSING or (http_status(exc) == 404
                                          and error_code(exc) != "NoSuchBucket")


@contextlib.contextmanager
def s3_errors(tier: str, doing: str, *, bucket: str, source: str) -> Iterator[None]:
    """Translate what botocore raises inside the block; ``source`` is the credential source
    (``env``, ``profile:NAME``, ``file:PATH``) named when the server refuses the keys."""
    where = f"{tier} tier: {doing}"
    try:
        yield
    except KvtierError:
        raise
    except bc.ClientError as exc:
        raise _refused(where, exc, bucket, source) from exc
    except (bc.ConnectTimeoutError, bc.ReadTimeoutError, http.TimeoutError) as exc:
        raise TierTimeout(f"{where}: no answer in time ({exc})") from exc
    except (bc.NoCredentialsError, bc.PartialCredentialsError,
            bc.CredentialRetrievalError) as exc:
        raise TierIOError(f"{where}: no usable S3 credentials from {source} "
                          f"({type(exc).__name__})") from exc
    except bc.SSLError as exc:
        raise TierIOError(f"{where}: TLS failed (certificate not trusted? see ca_bundle): "
                          f"{exc}") from exc
    except (bc.BotoCoreError, http.HTTPError) as exc:  # refused or dropped connections,
        raise TierIOError(f"{where}: {type(exc).__name__}: {exc}") from exc  # torn bodies
    except OSError as exc:
        raise TierIOError(f"{where}: {exc}") from exc


def _refused(where: str, exc: Exception, bucket: str, source: str) -> TierIOError:
    code, status = error_code(exc), http_status(exc)
    what = f"({code or 'no code'}, HTTP {status})"
    if code in TIMEOUTS:
        return TierTimeout(f"{where}: the server timed out {what}")
    if code == "NoSuchBucket":
        return TierIOError(f"{where}: bucket {bucket!r} does not exist {what}; create it, "
                           "or set create_bucket: true")
    if code in CREDENTIALS or status in (401, 403):
        return TierIOError(f"{where}: the server refused the credentials from {source} {what}")
    if code in THROTTLED or status in (429, 503):
        return TierIOError(f"{where}: throttled by the server {what}")
    if status >= 500:
        return TierIOError(f"{where}: server error {what}")
    return TierIOError(f"{where}: S3 error {what}")

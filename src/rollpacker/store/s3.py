"""The S3 adapter of the object store port (MinIO in a cluster, SeaweedFS on one machine).

:class:`S3Store` talks S3 with the ``minio`` client and implements
:class:`rollpacker.store.base.ObjectStore`; it passes ``tests/store/test_store_contract.py``. Every
failure the user can fix comes out as a :class:`StoreError` that names the setting to fix
(``store.endpoint``, ``store.bucket``, the credential variables) or the ``s3://`` URI concerned.

Invariants (tests/store/test_objstore.py, tests/store/test_store_contract.py):
- a wrong endpoint fails in seconds, not after minutes of retries (short timeouts, few retries);
- ``get_bytes(k)`` after ``put_bytes(k, b)`` returns ``b``; a missing key names its ``s3://`` URI;
- ``download_dir(upload_dir(d, p), t)`` reproduces every file of ``d`` under ``t``;
- ``download_dir`` is atomic: the target directory appears complete or not at all, and an existing
  complete download of the same URI is reused, never mixed with another one;
- credentials come from the variables ``store.access_key_env`` / ``store.secret_key_env`` name, or,
  when both are unset, from the file `rollpacker up` wrote for the same endpoint.
"""

from __future__ import annotations

import builtins
import contextlib
import io
import json
import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

from rollpacker.core.config import StoreConfig
from rollpacker.store.base import (
    StoreError,
    StoreUnavailable,
    check_dir_prefix,
    check_key,
    check_range,
    download_atomically,
    dump_json,
    load_json,
    short,
    upload_plan,
)

# `rollpacker up` writes the local store's keys here (mode 0600); S3Store falls back to them when
# the credential variables are unset. $ROLLPACKER_SERVICES_DIR moves the whole services directory.
SERVICES_DIR_ENV = "ROLLPACKER_SERVICES_DIR"
DEFAULT_SERVICES_DIR = Path("build/services")
CREDENTIALS_FILE = "credentials.json"

CONNECT_TIMEOUT_S = 5.0
READ_TIMEOUT_S = 30.0
# Retries are few on purpose: a wrong endpoint must fail in seconds. Connection refusals are not
# retried at all; 5xx answers and dropped reads twice, with a short backoff.
_CREDENTIAL_CODES = frozenset(
    {"InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "InvalidToken", "ExpiredToken"}
)
_MISSING_KEY_CODES = frozenset({"NoSuchKey", "ResourceNotFound", "NoSuchObject"})
_TRANSIENT_CODES = frozenset({"InternalError", "ServiceUnavailable", "SlowDown", "RequestTimeout"})
_URI = re.compile(r"s3://([^/]+)(?:/(.*))?")


def local_credentials_path(env: Mapping[str, str] | None = None) -> Path:
    """Where `rollpacker up` keeps the local store's credentials."""
    env = os.environ if env is None else env
    return Path(env.get(SERVICES_DIR_ENV) or DEFAULT_SERVICES_DIR) / CREDENTIALS_FILE


def read_local_credentials(path: Path) -> dict[str, str]:
    """The credentials file `rollpacker up` wrote: endpoint, bucket, access_key, secret_key."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise StoreError(f"{path}: cannot read the local store credentials ({e}); run `make up` again") from e
    if not isinstance(data, dict) or not all(
        isinstance(data.get(k), str) and data.get(k) for k in ("endpoint", "access_key", "secret_key")
    ):
        raise StoreError(
            f"{path}: not a credentials file (needs endpoint, access_key, secret_key); "
            "remove it and run `make up` again"
        )
    return {k: str(v) for k, v in data.items()}


def _http_client(secure: bool) -> Any:
    import urllib3

    kw: dict[str, Any] = {}
    if secure:
        import certifi

        kw = {"cert_reqs": "CERT_REQUIRED", "ca_certs": os.environ.get("SSL_CERT_FILE") or certifi.where()}
    return urllib3.PoolManager(
        timeout=urllib3.Timeout(connect=CONNECT_TIMEOUT_S, read=READ_TIMEOUT_S),
        retries=urllib3.Retry(
            total=2,
            connect=0,
            read=2,
            status=2,
            backoff_factor=0.2,
            status_forcelist=(500, 502, 503, 504),
            raise_on_status=False,
        ),
        maxsize=10,
        **kw,
    )


class S3Store:
    """One bucket of an S3 server. Keys are plain strings (``exp/arm/state/step-000003.json``);
    URIs are ``s3://<bucket>/<key>``. Implements :class:`rollpacker.store.base.ObjectStore`."""

    def __init__(
        self,
        endpoint: str,
        bucket: str,
        access_key: str,
        secret_key: str,
        *,
        secure: bool = False,
        region: str = "",
        credentials_source: str = "the configured credentials",
    ) -> None:
        from minio import Minio

        self.endpoint = endpoint
        self.bucket = bucket
        self.secure = secure
        self.credentials_source = credentials_source
        try:
            self._client = Minio(
                endpoint,
                access_key=access_key,
                secret_key=secret_key,
                secure=secure,
                region=region or None,
                http_client=_http_client(secure),
            )
        except ValueError as e:
            raise StoreError(f"store.endpoint = {endpoint!r}: {e}; use host:port") from e

    @classmethod
    def from_config(
        cls,
        cfg: StoreConfig,
        env: Mapping[str, str] | None = None,
        credentials_file: Path | None = None,
    ) -> S3Store:
        """The store ``cfg`` names, with keys from ``$<access_key_env>`` / ``$<secret_key_env>``;
        when both are unset, from the local credentials file `rollpacker up` wrote for the same
        endpoint (``build/services/credentials.json``, or under ``$ROLLPACKER_SERVICES_DIR``)."""
        env = os.environ if env is None else env
        ak, sk = env.get(cfg.access_key_env, ""), env.get(cfg.secret_key_env, "")
        names = f"${cfg.access_key_env} / ${cfg.secret_key_env}"
        if ak and sk:
            return cls(
                cfg.endpoint,
                cfg.bucket,
                ak,
                sk,
                secure=cfg.secure,
                region=cfg.region,
                credentials_source=names,
            )
        if ak or sk:
            unset = cfg.secret_key_env if ak else cfg.access_key_env
            raise StoreError(f"${unset} is not set: set both {names} (or neither, for the local store)")
        path = credentials_file if credentials_file is not None else local_credentials_path(env)
        note = f"no local credentials at {path}"
        if path.is_file():
            creds = read_local_credentials(path)
            if creds["endpoint"] == cfg.endpoint:
                return cls(
                    cfg.endpoint,
                    cfg.bucket,
                    creds["access_key"],
                    creds["secret_key"],
                    secure=cfg.secure,
                    region=cfg.region,
                    credentials_source=str(path),
                )
            note = f"{path} holds the keys of {creds['endpoint']}, not of store.endpoint = {cfg.endpoint!r}"
        raise StoreError(
            f"no S3 credentials for store.endpoint = {cfg.endpoint!r}: set {names} ({note}; "
            "`make up` starts the local store and prints its keys)"
        )

    # -- errors ----------------------------------------------------------------------------------

    def _endpoint_error(self, detail: str) -> StoreError:
        return StoreUnavailable(
            f"store.endpoint = {self.endpoint!r}: no S3 server answers ({detail}); start the local one "
            "with `make up` or fix store.endpoint"
        )

    def _translate(self, e: Exception, what: str) -> StoreError:
        """The StoreError for a failed S3 call: which setting to fix, or which object is missing."""
        import urllib3
        from minio.error import InvalidResponseError, S3Error, ServerError

        if isinstance(e, S3Error):
            if e.code in _CREDENTIAL_CODES:
                return StoreError(
                    f"store.endpoint = {self.endpoint!r} refused the credentials in "
                    f"{self.credentials_source} ({e.code}: {e.message}); set them to that server's keys "
                    "(`rollpacker up` prints the local ones)"
                )
            if e.code == "NoSuchBucket":
                return self._bucket_error()
            if e.code in _MISSING_KEY_CODES:
                return StoreError(f"{what}: no such object")
            if e.code in _TRANSIENT_CODES:  # a server starting up or overloaded: worth a retry
                return StoreUnavailable(f"{what}: the S3 server at {self.endpoint} answered {e.code}")
            return StoreError(f"{what}: S3 error {e.code}: {e.message}")
        if isinstance(e, urllib3.exceptions.HTTPError):
            reason = getattr(e, "reason", None) or e
            return self._endpoint_error(f"{type(reason).__name__}: {short(reason)}")
        if isinstance(e, ServerError) and 500 <= e.status_code < 600:
            return StoreUnavailable(f"{what}: the S3 server at {self.endpoint} answered {e.status_code}")
        if isinstance(e, (InvalidResponseError, ServerError, ElementTree.ParseError)):
            return StoreError(
                f"store.endpoint = {self.endpoint!r}: the server there does not answer like S3 "
                f"({short(e)}); fix store.endpoint (host:port of MinIO / SeaweedFS S3)"
            )
        if isinstance(e, ValueError):
            return StoreError(f"{what}: {e}")
        return StoreError(f"{what}: {type(e).__name__}: {short(e)}")

    def _bucket_error(self) -> StoreError:
        return StoreError(
            f"store.bucket = {self.bucket!r} does not exist at {self.endpoint}; create it or fix store.bucket"
        )

    @contextlib.contextmanager
    def _s3(self, what: str) -> Iterator[None]:
        import urllib3
        from minio.error import MinioException

        try:
            yield
        except (MinioException, urllib3.exceptions.HTTPError, ValueError, ElementTree.ParseError) as e:
            raise self._translate(e, what) from e

    # -- setup -----------------------------------------------------------------------------------

    def check(self) -> None:
        """Verify, before any step runs, that the endpoint answers, accepts the credentials, and
        holds the bucket. Each failure names the setting to fix."""
        with self._s3(f"check of {self.uri('')}"):
            found = self._client.bucket_exists(self.bucket)
        if not found:
            raise self._bucket_error()

    def create_bucket(self) -> bool:
        """Create the bucket if it is missing; True when it was created now."""
        with self._s3(f"create {self.uri('')}"):
            if self._client.bucket_exists(self.bucket):
                return False
            self._client.make_bucket(self.bucket)
        return True

    # -- keys and URIs ---------------------------------------------------------------------------

    def uri(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    def key_of(self, uri: str) -> str:
        """The key of ``s3://<bucket>/<key>`` (``""`` for the bucket itself); refuses other buckets
        and anything that is not an s3:// URI."""
        m = _URI.fullmatch(uri) if isinstance(uri, str) else None
        if m is None:
            raise StoreError(f"{uri!r} is not an S3 URI; expected s3://{self.bucket}/<key>")
        if m.group(1) != self.bucket:
            raise StoreError(
                f"{uri!r} is in bucket {m.group(1)!r}, but this store is store.bucket = {self.bucket!r}; "
                "fix store.bucket or the URI"
            )
        return m.group(2) or ""

    # -- objects ---------------------------------------------------------------------------------

    def put_bytes(self, key: str, data: bytes, content_type: str = "application/octet-stream") -> str:
        check_key(key)
        with self._s3(f"write {self.uri(key)}"):
            self._client.put_object(self.bucket, key, io.BytesIO(data), len(data), content_type=content_type)
        return self.uri(key)

    def get_bytes(self, key: str) -> bytes:
        check_key(key)
        with self._s3(f"{self.uri(key)}"):
            resp = self._client.get_object(self.bucket, key)
            try:
                return bytes(resp.read())
            finally:
                resp.close()
                resp.release_conn()

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        from minio.error import S3Error

        check_key(key)
        check_range(self.uri(key), offset, length)
        try:
            with self._s3(f"{self.uri(key)}"):
                resp = self._client.get_object(self.bucket, key, offset=offset, length=length)
                try:
                    return bytes(resp.read())
                finally:
                    resp.close()
                    resp.release_conn()
        except StoreError as e:
            if isinstance(e.__cause__, S3Error) and e.__cause__.code == "InvalidRange":
                return b""  # the range starts at or past the object's end
            raise

    def exists(self, key: str) -> bool:
        from minio.error import S3Error

        check_key(key)
        with self._s3(f"stat {self.uri(key)}"):
            try:
                self._client.stat_object(self.bucket, key)
            except S3Error as e:
                if e.code in _MISSING_KEY_CODES:
                    return False
                raise
        return True

    def put_json(self, key: str, obj: Any) -> str:
        return self.put_bytes(key, dump_json(obj), "application/json")

    def get_json(self, key: str) -> Any:
        return load_json(self.get_bytes(key), self.uri(key))

    def list(self, prefix: str = "") -> builtins.list[str]:
        """Every key under ``prefix`` (recursive), sorted."""
        with self._s3(f"list {self.uri(prefix)}"):
            return sorted(
                str(o.object_name)
                for o in self._client.list_objects(self.bucket, prefix=prefix or None, recursive=True)
                if o.object_name and not o.is_dir
            )

    def delete(self, key: str) -> bool:
        check_key(key)
        if not self.exists(key):
            return False
        with self._s3(f"delete {self.uri(key)}"):
            self._client.remove_object(self.bucket, key)
        return True

    def delete_prefix(self, prefix: str) -> int:
        """Delete every object under ``prefix`` (which must end with ``/``, so that ``a/b/`` never
        takes ``a/bc/`` with it); returns how many were deleted."""
        from minio.deleteobjects import DeleteObject

        check_dir_prefix(prefix)
        keys = self.list(prefix)
        if not keys:
            return 0
        with self._s3(f"delete {self.uri(prefix)}"):
            errors = list(self._client.remove_objects(self.bucket, (DeleteObject(k) for k in keys)))
        if errors:
            raise StoreError(
                f"delete {self.uri(prefix)}: {len(errors)} object(s) not deleted, e.g. "
                f"{errors[0].name}: {errors[0].code} {errors[0].message}"
            )
        return len(keys)

    # -- directories -----------------------------------------------------------------------------

    def upload_dir(self, local_dir: Path | str, prefix: str) -> str:
        """Upload every file under ``local_dir`` (recursive) to ``prefix/<relative path>``; returns
        the prefix's URI (ending in ``/``)."""
        prefix, files = upload_plan(local_dir, prefix)
        for path, key in files:
            with self._s3(f"upload {path} to {self.uri(key)}"):
                self._client.fput_object(self.bucket, key, str(path))
        return self.uri(prefix + "/")

    def download_dir(self, uri: str, local_dir: Path | str) -> Path:
        """Download every object under ``uri`` into ``local_dir``, atomically: into a temporary
        sibling first, renamed into place when complete. A ``local_dir`` that already holds a
        complete download of the same URI is reused as it is; one that holds anything else is refused.
        """

        def fetch(key: str, target: Path) -> None:
            with self._s3(f"download {self.uri(key)}"):
                self._client.fget_object(self.bucket, key, str(target))

        return download_atomically(self, uri, local_dir, fetch)

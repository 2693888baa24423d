"""Credentials out of what rollpacker prints, logs and records.

Credentials reach rollpacker only through environment variables (``store.access_key_env`` and
friends, ``$KFP_TOKEN``, MLflow's ``$MLFLOW_TRACKING_PASSWORD`` / ``_TOKEN``) and through the one
place a user may write them into a setting: the user-info part of a URL
(``http://user:password@mlflow:5000``). ``redact_uri`` masks that part wherever a URL is shown: in
error messages, MLflow params, comparison reports.

Invariants (tests/test_secrets.py):
- ``redact_uri`` never returns the password or token of ``scheme://user:password@host`` or
  ``scheme://token@host``; the scheme, host, port, path and query stay as they were;
- a string that is not such a URL comes back unchanged (``sqlite:///x.db``, ``127.0.0.1:8333``).
"""

from __future__ import annotations

import re

MASK = "***"
# scheme://<userinfo>@ — userinfo without '/', '@' or whitespace (RFC 3986 allows no '/' there)
_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]*://)(?P<info>[^/@\s]+)@")


def redact_uri(text: str) -> str:
    """``text`` with the user-info of every URL in it masked: ``user:***@`` (a user name stays, so
    the message still says which account), ``***@`` for a bare token."""

    def mask(m: re.Match[str]) -> str:
        user, sep, _ = m.group("info").partition(":")
        return f"{m.group('scheme')}{user}:{MASK}@" if sep else f"{m.group('scheme')}{MASK}@"

    return _USERINFO.sub(mask, text)

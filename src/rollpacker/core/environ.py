"""``environ_set``: environment variables set for the duration of a block, then put back as they
were (unset ones unset again). Child processes started inside the block inherit the values, which
is what engines and task runners that read their settings from the environment at start need.

Invariants (tests/core/test_environ.py): inside the block each variable has its value; after it,
even when the block raised, every variable is back to its value before, or unset if it was."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping


@contextlib.contextmanager
def environ_set(values: Mapping[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

"""``rollpacker.core.environ.environ_set``."""

from __future__ import annotations

import os

import pytest

from rollpacker.core.environ import environ_set


def test_values_hold_inside_and_are_put_back_after_even_on_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RP_ENV_KEPT", "before")
    monkeypatch.delenv("RP_ENV_NEW", raising=False)
    with pytest.raises(RuntimeError), environ_set({"RP_ENV_KEPT": "inside", "RP_ENV_NEW": "x"}):
        assert os.environ["RP_ENV_KEPT"] == "inside" and os.environ["RP_ENV_NEW"] == "x"
        raise RuntimeError("the block fails")
    assert os.environ["RP_ENV_KEPT"] == "before" and "RP_ENV_NEW" not in os.environ

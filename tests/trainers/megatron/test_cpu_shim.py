"""The CPU shim is pinned to the megatron-core version it was checked against."""

from __future__ import annotations

import pytest

from rollpacker.trainers.megatron import cpu_shim


def test_shim_is_pinned_to_the_installed_megatron_core() -> None:
    # A new megatron-core must fail here first: re-check the CUDA-only call sites in cpu_shim.py.
    assert cpu_shim.megatron_version() == cpu_shim.PINNED_VERSION == "0.16.1"


def test_another_version_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_shim, "megatron_version", lambda: "0.17.0")
    with pytest.raises(cpu_shim.ShimError, match=r"megatron-core 0.17.0 is installed.*0.16.1"):
        cpu_shim.apply()


def test_not_applied_on_gpu() -> None:
    assert cpu_shim.apply(use_cuda=True) is False

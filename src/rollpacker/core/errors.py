"""Typed errors raised at boundaries. Each message says what is wrong and what to do next."""

from __future__ import annotations


class RollpackerError(Exception):
    """Base class of every error rollpacker raises on purpose."""


class ConfigError(RollpackerError, ValueError):
    """A configuration value or key is invalid."""


class RunExistsError(ConfigError):
    """A new start of a run that already has committed steps: the message says what is there; the
    command line adds the exact commands that continue it (``--resume``) and start it over
    (``--fresh``)."""


class TraceError(RollpackerError, ValueError):
    """A replay trace (or dataset line) is malformed or cannot serve the configured policy."""


class EngineError(RollpackerError, RuntimeError):
    """The rollout engine failed or was used against its contract."""


class PolicyError(RollpackerError, RuntimeError):
    """A policy was driven out of order (an event for an unknown request, a step without a plan)."""


class TrainerError(RollpackerError, RuntimeError):
    """The trainer was driven out of order, or a checkpoint is missing or does not match."""


class SandboxError(RollpackerError, RuntimeError):
    """The code sandbox cannot run here (no nsjail, no usable interpreter) or was misused."""


class TrackingUnavailable(ConfigError):
    """The MLflow server does not answer (or answers with an error). Before an arm's first step
    it stops the run (nothing can be compared without it); after that a step still commits, and
    the next plan logs the steps MLflow missed from their commit records."""


class RewardError(RollpackerError, RuntimeError):
    """A reward could not be computed, or a reward service was driven out of order."""

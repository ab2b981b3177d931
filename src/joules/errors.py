"""Exceptions raised by joules. Each message names the problem and, where there is one, the fix."""

from __future__ import annotations


class JoulesError(Exception):
    """Base class of every error joules raises on purpose."""


class NotSupportedError(JoulesError):
    """The device does not support this query or setting."""


class DevicePermissionError(JoulesError):
    """The process lacks the permission to read or change a device; the message says how to fix it."""


class DeviceNotFoundError(JoulesError):
    """A device index, UUID or name does not match any device found."""


class InvalidSpecError(JoulesError, ValueError):
    """A simulated-hardware specification string could not be parsed."""


class WindowError(JoulesError):
    """A measurement window was misused (ended twice, never begun, name reused while open)."""


class NothingMeasuredWarning(RuntimeWarning):
    """A monitor found no GPU and no CPU package to measure: every window would read 0 J."""

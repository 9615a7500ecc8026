"""Canonical forwards for the ssm family (see the package docstring)."""

from __future__ import annotations

PATCHES: tuple = ()

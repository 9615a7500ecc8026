"""Canonical forwards for the delta_rule family (see the package docstring)."""

from __future__ import annotations

PATCHES: tuple = ()

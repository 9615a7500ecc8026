"""Tiny random configs of the ssm families (merged into ``workbench.models.tiny.TINY_ARCHS``)."""

from __future__ import annotations

ARCHS: dict = {}

"""Onboarding many models at once: the model registry (``workbench/models/registry.yaml``) and
``workbench check``, which runs every entry end to end and writes a summary report."""

from .check import CheckResult, CheckSettings, check_entry, check_registry, exit_code
from .registry import DEFAULT_REGISTRY, Registry, RegistryEntry, RegistryError, load_registry
from .report import markdown_table, write_reports

__all__ = [
    "CheckResult",
    "CheckSettings",
    "DEFAULT_REGISTRY",
    "Registry",
    "RegistryEntry",
    "RegistryError",
    "check_entry",
    "check_registry",
    "exit_code",
    "load_registry",
    "markdown_table",
    "write_reports",
]

"""Mamba-2 selective state space ops (the SSD scan and its cached forms); see README.md."""

from .ssm_scan import SSM  # noqa: F401  (defines torch_ssm and its cached forms)

"""Helpers for users (and the project's tests) checking a model of their own against a reference."""

from .equivalence import (EquivalenceError, assert_rmse_close, check_block, check_export, check_layer,  # noqa: F401
                          check_model, copy_weights, rmse_ratio)

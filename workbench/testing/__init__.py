"""Helpers for users (and the project's tests) checking a model of their own against a reference."""

from .equivalence import (  # noqa: F401
    EquivalenceError,
    assert_rmse_close,
    check_block,
    check_export,
    check_layer,
    check_model,
    copy_weights,
    rmse_ratio,
)

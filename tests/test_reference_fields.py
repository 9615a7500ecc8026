"""Every config field the reference documents for a transform key is accepted by that key's config.

``tests/data/reference_fields.json`` holds the reference's key-specific fields with their defaults
and documented values (``tools/reference_fields.py`` extracts it from the reference pages, which are
not in the repository). A field the reference documents and our config rejects would make a
reference YAML fail with an "extra fields not permitted" error; the config must also take the
reference's default and every documented value (a value this machine cannot serve is accepted and
refused or replaced at run time, with the reason, by the transform). Whether a field does what the
reference says is each transform's own tests' job.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import workbench.pipeline  # noqa: F401  (registers every transform)
from workbench.pipeline.interface import TRANSFORMS, Stages

REFERENCE = json.loads((Path(__file__).parent / "data" / "reference_fields.json").read_text())
# (key, field, a value the reference documents for it): its default and each of its enum values
CASES = [
    (key, field, value)
    for key, fields in sorted(REFERENCE.items())
    for field, spec in fields.items()
    for value in ([spec["default"]] if "default" in spec else [])
    + [v for v in spec.get("values", []) if v != spec.get("default")]
]


def test_every_reference_key_is_registered():
    assert len(REFERENCE) == 49
    assert [k for k in REFERENCE if k not in TRANSFORMS] == []


def test_every_reference_field_has_a_case():
    assert {(k, f) for k, f, _ in CASES} == {(k, f) for k, fields in REFERENCE.items() for f in fields}


@pytest.mark.parametrize(("key", "field", "value"), CASES, ids=[f"{k}.{f}={v}" for k, f, v in CASES])
def test_reference_field_takes_the_documented_values(key, field, value):
    config_class = TRANSFORMS.get(key).config_class
    assert field in config_class.model_fields, f"{key} rejects the reference field {field!r}"
    config = config_class.model_validate({"stage": Stages.CACHE_INIT, field: value})
    assert getattr(config, field) == value


def test_residual_add_backend_names_what_it_accepts():
    """The reference gives ``insert_cached_residual_add`` the cached-attention config (``backend``); the
    write is one ``index_copy_`` everywhere, so a kernel name is refused with the choices."""
    from pydantic import ValidationError

    config_class = TRANSFORMS.get("insert_cached_residual_add").config_class
    assert config_class.model_validate({"stage": Stages.CACHE_INIT, "backend": "torch"}).backend == "torch"
    with pytest.raises(
        ValidationError, match="unknown backend 'flashinfer' for the hidden-state write; choose auto or torch"
    ):
        config_class.model_validate({"stage": Stages.CACHE_INIT, "backend": "flashinfer"})

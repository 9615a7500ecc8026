"""User YAML that is empty, duplicated, unreadable or of the wrong shape: each case either merges
nothing (the default pipeline survives) or fails with a ConfigError naming the file, the line and
the key. Only the config loader runs here, except one Workbench built without stepping."""

from pathlib import Path

import pytest

from workbench.pipeline.config import ConfigError, resolve_pipeline


@pytest.fixture(scope="module")
def default():
    return resolve_pipeline()


def write(tmp_path, text, name="user.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def entry(entries, key):
    return next(e.config for e in entries if e.key == key)


# ---------------------------------------------------------------- empty transforms: / empty bodies


def test_empty_transforms_keeps_the_default_pipeline(tmp_path, default):
    # every entry commented out: 'transforms:' is null, which used to replace all 60 steps with none
    p = write(tmp_path, "transforms:\n  # fuse_swiglu:\n  #   enabled: false\n")
    assert resolve_pipeline([p]) == default
    assert resolve_pipeline([{"transforms": None}]) == default


def test_transforms_braces_keep_the_default_pipeline(tmp_path, default):
    assert resolve_pipeline([write(tmp_path, "transforms: {}\n")]) == default


def test_empty_body_keeps_the_default_entry_as_it_is(tmp_path, default):
    p = write(tmp_path, "transforms:\n  fuse_swiglu:\n  fuse_gemms:\n    enabled: false\n")
    entries = resolve_pipeline([p])
    assert len(entries) == len(default)
    assert entry(entries, "fuse_swiglu") == entry(default, "fuse_swiglu")
    assert entry(entries, "fuse_gemms").enabled is False  # the other key still merges
    assert resolve_pipeline([{"transforms": {"fuse_swiglu": None}}]) == default


def test_empty_body_keeps_an_entry_an_earlier_yaml_added(tmp_path, default):
    first = write(tmp_path, "transforms:\n  detect_hf_attn_layers:\n    stage: factory\n", "first.yaml")
    second = write(tmp_path, "transforms:\n  detect_hf_attn_layers:\n", "second.yaml")
    entries = resolve_pipeline([first, second])
    assert len(entries) == len(default) + 1
    assert entry(entries, "detect_hf_attn_layers").stage.value == "factory"


def test_empty_body_for_a_key_not_in_the_pipeline_says_what_to_write(tmp_path):
    p = write(tmp_path, "transforms:\n  fuse_gemms:\n    enabled: false\n  detect_hf_attn_layers:\n")
    with pytest.raises(ConfigError) as e:
        resolve_pipeline([p])
    msg = str(e.value)
    assert "transform 'detect_hf_attn_layers' (" in msg and "user.yaml, line 4)" in msg
    assert "empty body" in msg and "not in the pipeline so far" in msg
    assert "\n  detect_hf_attn_layers:\n    stage: <factory|export|" in msg and "or remove the line" in msg
    assert "not a registered transform" not in msg  # it is registered, only not in default.yaml


def test_empty_body_for_an_unregistered_key_also_suggests_the_right_one(tmp_path):
    p = write(tmp_path, "transforms:\n  fuse_swiglus:\n")
    with pytest.raises(ConfigError) as e:
        resolve_pipeline([p])
    msg = str(e.value)
    assert "transform 'fuse_swiglus' (" in msg and "user.yaml, line 2)" in msg and "stage:" in msg
    assert "'fuse_swiglus' is not a registered transform. Did you mean 'fuse_swiglu'" in msg


# ---------------------------------------------------------------- duplicate keys


@pytest.mark.parametrize(
    "text, line, column, key, first",
    [
        ("transforms:\n  fuse_swiglu:\n    enabled: false\ntransforms:\n  fuse_gemms: {}\n", 4, 1, "transforms", 1),
        ("transforms:\n  fuse_swiglu:\n    enabled: false\n  fuse_swiglu:\n    enabled: true\n", 4, 3, "fuse_swiglu", 2),
        ("transforms:\n  fuse_swiglu:\n    enabled: false\n    enabled: true\n", 4, 5, "enabled", 3),
    ],
    ids=["top_level", "transform_key", "field"],
)
def test_duplicate_keys_are_errors_naming_file_line_and_key(tmp_path, text, line, column, key, first):
    p = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        resolve_pipeline([p])
    assert str(e.value).startswith(
        f"{p}: not valid YAML (line {line}, column {column}): duplicate key '{key}' (first at line {first})"
    )
    assert "write each key once" in str(e.value)


def test_a_merge_key_overridden_below_is_not_a_duplicate(tmp_path):
    # '<<: *anchor' then the same key written out is YAML's way to override, not a repeated key
    text = (
        "transforms:\n  fuse_gemms: &fusion\n    stage: post_load_fusion\n    enabled: false\n"
        "  fuse_swiglu:\n    <<: *fusion\n    enabled: true\n"
    )
    entries = resolve_pipeline([write(tmp_path, text)])
    assert entry(entries, "fuse_gemms").enabled is False and entry(entries, "fuse_swiglu").enabled is True


# ---------------------------------------------------------------- files that are not YAML text


def test_binary_file_is_a_config_error(tmp_path):
    p = tmp_path / "x.yaml"
    p.write_bytes(b"\x7fELF\x02\x01\x01\x00" + bytes(range(200, 256)))
    with pytest.raises(ConfigError) as e:
        resolve_pipeline([p])
    assert str(e.value).startswith(f"{p}: not UTF-8 text (byte 0xc8 on line 1)")
    assert "save it as UTF-8, or leave it out of --yaml-extra" in str(e.value)


def test_latin1_file_names_the_line(tmp_path):
    p = tmp_path / "latin1.yaml"
    p.write_bytes("transforms:\n  fuse_swiglu:\n    enabled: false  # café\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"latin1\.yaml: not UTF-8 text \(byte 0xe9 on line 3\)"):
        resolve_pipeline([p])


def test_control_character_names_line_and_column(tmp_path):
    p = write(tmp_path, "transforms:\n  fuse_sw\x00iglu: {}\n")
    with pytest.raises(ConfigError) as e:
        resolve_pipeline([p])
    assert str(e.value).startswith(f"{p}: not valid YAML (line 2, column 10): character U+0000")


def test_directory_is_a_config_error(tmp_path):
    d = tmp_path / "configs.yaml"
    d.mkdir()
    with pytest.raises(ConfigError, match=r"configs\.yaml: is a directory, not a YAML file; give the path of a"):
        resolve_pipeline([d])


def test_unreadable_file_is_a_config_error(tmp_path, monkeypatch):
    p = write(tmp_path, "transforms: {}\n")

    def denied(self):
        raise PermissionError(13, "Permission denied", str(self))

    # patched rather than chmod 000: the tests may run as root, who reads any file
    monkeypatch.setattr(Path, "read_bytes", denied)
    with pytest.raises(ConfigError) as e:
        resolve_pipeline([p])
    assert str(e.value) == f"{p}: cannot be read (Permission denied); make it readable, or leave it out of --yaml-extra"


# ---------------------------------------------------------------- wrong shapes


@pytest.mark.parametrize(
    "body, shown",
    [("[1, 2]", "list [1, 2]"), ("false", "bool False"), ("''", "str ''")],
    ids=["list", "bool", "empty_string"],
)
def test_transform_body_that_is_not_a_mapping(tmp_path, body, shown):
    p = write(tmp_path, f"transforms:\n  fuse_gemms:\n    enabled: false\n  fuse_swiglu: {body}\n")
    with pytest.raises(ConfigError) as e:
        resolve_pipeline([p])
    assert str(e.value).startswith(
        f"transform 'fuse_swiglu' ({p}, line 4): expected a mapping of fields, got {shown}. "
        "Write its fields indented below 'fuse_swiglu:'"
    )


@pytest.mark.parametrize(
    "value, shown", [("\n  - fuse_swiglu", "list ['fuse_swiglu']"), (" []", "list []")], ids=["items", "empty"]
)
def test_transforms_that_is_a_list(tmp_path, value, shown):
    # 'transforms: []' used to pass the check and leave an empty pipeline
    p = write(tmp_path, f"# a comment\ntransforms:{value}\n")
    with pytest.raises(ConfigError) as e:
        resolve_pipeline([p])
    assert str(e.value).startswith(f"{p}, line 2: 'transforms:' must be a mapping of transform key -> fields, got {shown}")


@pytest.mark.parametrize(
    "text, shown", [("false\n", "bool"), ("[]\n", "list"), ("0\n", "int")], ids=["false", "empty_list", "zero"]
)
def test_document_that_is_not_a_mapping(tmp_path, text, shown):
    # these used to be read as an empty file and ignored
    p = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        resolve_pipeline([p])
    assert str(e.value).startswith(f"{p}: expected a mapping with a 'transforms:' mapping")
    assert f"got {shown}. Start the file with 'transforms:'" in str(e.value)


def test_empty_or_comment_only_file_merges_nothing(tmp_path, default):
    assert resolve_pipeline([write(tmp_path, ""), write(tmp_path, "# nothing\n", "c.yaml")]) == default


def test_transform_key_that_is_not_a_string(tmp_path):
    p = write(tmp_path, "transforms:\n  1:\n    stage: export\n")
    with pytest.raises(ConfigError) as e:
        resolve_pipeline([p])
    assert str(e.value).startswith(f"{p}, line 2: transform key 1 under 'transforms:' is not a name (got int)")


# ---------------------------------------------------------------- one path / one override


def test_single_yaml_extra_is_a_list_of_one(tmp_path):
    p = write(tmp_path, "transforms:\n  fuse_swiglu:\n    enabled: false\n")
    for extra in (str(p), p, {"transforms": {"fuse_swiglu": {"enabled": False}}}):
        assert entry(resolve_pipeline(extra), "fuse_swiglu").enabled is False, extra


def test_single_override_string_is_one_override():
    assert entry(resolve_pipeline(overrides="fuse_swiglu.enabled=false"), "fuse_swiglu").enabled is False


def test_yaml_extra_and_override_items_of_the_wrong_type():
    with pytest.raises(ConfigError, match=r"^yaml_extra\[1\]: expected a YAML file path or a mapping, got int 3$"):
        resolve_pipeline([{"transforms": {}}, 3])
    with pytest.raises(ConfigError, match=r"^override 3: expected a 'transform_key\.field=value' string, got int$"):
        resolve_pipeline(overrides=["fuse_swiglu.enabled=false", 3])


def test_workbench_with_an_empty_transforms_file_keeps_the_default_pipeline(tmp_path, default):
    from workbench import Workbench

    p = write(tmp_path, "transforms:\n  # fuse_swiglu:\n  #   enabled: false\n")
    wb = Workbench("tiny:llama", device="cpu", yaml_extra=str(p))  # a plain string, not a list
    assert len(wb.entries) == len(default)

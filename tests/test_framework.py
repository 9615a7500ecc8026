"""Framework semantics: ordering, merge, validation errors, skip_on_error, rewind/invalidate/resume,
snapshots that share parameter storage, failures that lose nothing."""

import pytest
import torch

from workbench import ConfigError, TransformError, Workbench
from workbench.pipeline.config import deep_merge, parse_override, resolve_pipeline
from workbench.pipeline.interface import (
    TRANSFORMS, Stages, Transform, TransformInfo,
)


# ---------------------------------------------------------------- configuration
def test_default_pipeline_is_ordered_by_stage():
    entries = resolve_pipeline()
    assert entries[0].key == "export_to_gm"
    orders = [e.config.stage.order for e in entries]
    assert orders == sorted(orders)
    assert list(Stages)[0] == Stages.FACTORY and list(Stages)[-1] == Stages.COMPILE
    assert Stages.EXPORT < Stages.COMPILE


def test_yaml_extra_entry_lands_in_its_stage(tmp_path):
    # cleanup_noop_slice moved to the compile stage by a user file: it now runs after post_export.
    f = tmp_path / "extra.yaml"
    f.write_text("transforms:\n  cleanup_noop_slice:\n    stage: compile\n    skip_on_error: true\n")
    entries = resolve_pipeline([f])
    keys = [e.key for e in entries]
    assert keys.index("cleanup_noop_slice") > keys.index("cleanup_input_constraints")
    cfg = entries[keys.index("cleanup_noop_slice")].config
    assert cfg.skip_on_error is True and cfg.stage == Stages.COMPILE


def test_deep_merge_and_overrides():
    base = {"transforms": {"a": {"stage": "export", "patches": {"x": True, "y": True}}}}
    merged = deep_merge(base, {"transforms": {"a": {"patches": {"y": False}}}})
    assert merged["transforms"]["a"]["patches"] == {"x": True, "y": False}
    assert base["transforms"]["a"]["patches"]["y"] is True  # inputs untouched
    assert parse_override("export_to_gm.strict=true") == ("export_to_gm.strict", True)
    assert parse_override("export_to_gm.max_seq_len=128") == ("export_to_gm.max_seq_len", 128)
    entries = resolve_pipeline(
        [{"transforms": {"export_to_gm": {"example_seq_len": 4}}}],
        ["export_to_gm.example_seq_len=6", "export_to_gm.patches.eval_mode=false"],
    )
    cfg = entries[0].config
    assert cfg.example_seq_len == 6 and cfg.patches == {"eval_mode": False}


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["export_to_gm.strct=true"], ["export_to_gm", "unknown field 'strct'", "did you mean 'strict'"]),
        (["export_to_gm.example_seq_len=many"], ["export_to_gm", "field 'example_seq_len'", "'many'"]),
        (["export_to_gm.enabled=maybe"], ["export_to_gm", "field 'enabled'"]),
        (["export_to_gm.patches.no_such_patch=true"], ["unknown export patch", "no_such_patch"]),
        (["noop"], ["expected transform_key.field=value"]),
    ],
)
def test_validation_errors_name_key_and_field(overrides, expected):
    with pytest.raises(ConfigError) as e:
        resolve_pipeline([], overrides)
    for text in expected:
        assert text in str(e.value)


def test_unknown_transform_key_suggests_the_right_one():
    with pytest.raises(ConfigError, match=r"unknown transform 'cleanup_noop_slise'.*'cleanup_noop_slice'"):
        resolve_pipeline([{"transforms": {"cleanup_noop_slise": {"stage": "post_export"}}}])


def test_bad_yaml_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("transforms:\n  export_to_gm: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        resolve_pipeline([bad])
    with pytest.raises(ConfigError, match="not found"):
        resolve_pipeline([tmp_path / "missing.yaml"])
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        resolve_pipeline([wrong])


def test_config_rejects_unknown_fields_and_has_descriptions():
    for key, cls in TRANSFORMS.items():
        for name, field in cls.config_class.model_fields.items():
            assert field.description, f"{key}.{name} has no description"
        with pytest.raises(Exception, match="extra"):
            cls.config_class(stage="export", not_a_field=1)


# ---------------------------------------------------------------- stepping
@pytest.fixture()
def wb(tiny_llama):
    return Workbench(tiny_llama)


def test_step_run_to_and_snapshot_contents(wb):
    snap = wb.step()
    assert snap.key == "export_to_gm" and snap.stage == Stages.EXPORT and wb.position == 1
    assert isinstance(snap.module, torch.fx.GraphModule)
    assert snap.num_nodes == len(snap.module.graph.nodes)
    assert snap.op_histogram["aten.linear.default"] == 2 * 7 + 1  # q,k,v,o,gate,up,down + lm_head
    assert snap.times.apply > 0 and snap.times.total >= snap.times.apply
    # traced on meta: the graph holds no bytes until load_weights binds the model's tensors
    assert snap.mem_before.param_bytes == snap.mem_after.param_bytes == 0
    assert snap.info.details["trace_device"] == "meta"
    assert snap.mem_after.rss_bytes > 0 and snap.mem_warning is None
    assert snap.numerics.max_abs == 0.0 and snap.numerics.top1_agreement == 1.0
    assert all(n.meta["wb_created_by"] == "export_to_gm" for n in snap.module.graph.nodes)
    wb.run_to("cleanup_noop_add")
    assert [s.key for s in wb.snapshots][-1] == "cleanup_noop_add"
    assert wb.status("cleanup_input_constraints") == "pending"
    wb.run()
    assert wb.done and len(wb.snapshots) == len(wb.entries)
    table = wb.table()
    assert list(table["transform"]) == wb.keys
    load = wb.snapshot("load_weights")
    # the graph holds the model's tensors that it reads (export's copy drops unread buffers such as
    # rotary_emb.original_inv_freq): tied ones once
    read = {str(n.target) for n in load.graph.nodes if n.op == "get_attr"}
    named = [*wb.loaded.model.named_parameters(remove_duplicate=False), *wb.loaded.model.named_buffers()]
    held = {t.data_ptr(): t.numel() * t.element_size() for name, t in named if f"model.{name}" in read}
    model_bytes = sum(held.values())
    assert 0 < wb.loaded.parameter_bytes - model_bytes <= 64  # only the unread rotary buffer is left out
    assert load.stage == Stages.WEIGHT_LOAD and load.mem_delta == model_bytes and load.mem_warning is None
    assert load.info.details["bytes"] == model_bytes and load.info.details["bytes_copied"] == 0  # CPU: shared
    assert load.info.details["device"] == "cpu" and load.info.details["device_args_retargeted"] > 0
    with pytest.raises(StopIteration):
        wb.step()


def test_snapshot_graph_shares_parameter_storage(wb, tiny_llama):
    wb.run()
    # The embedding table is read by the embedding lookup in every snapshot (the fusion transforms
    # replace the linears' weights with fused / transposed copies).
    o = tiny_llama.model.lm_head.weight  # tied: export keeps one name for both
    loaded_from = wb.index("load_weights")
    for snap in wb.snapshots:
        p = snap.module.get_parameter("model.lm_head.weight")
        if snap.index < loaded_from:
            assert p.is_meta  # traced on meta: no storage before load_weights
        else:
            assert p.data_ptr() == o.data_ptr()
    # Snapshots are independent graphs: the live graph is not any snapshot's graph object.
    assert all(s.module.graph is not wb.module.graph for s in wb.snapshots)


def test_configure_invalidates_only_later_snapshots_and_resumes(wb):
    wb.run()
    export_snap = wb.snapshots[0]
    n_slice = wb.snapshots[1]
    wb.configure("cleanup_noop_add", enabled=False)
    assert [s.key for s in wb.snapshots] == ["export_to_gm", "cleanup_noop_slice"]
    assert wb.status("cleanup_noop_add") == "pending"
    wb.run()
    assert wb.snapshots[0] is export_snap and wb.snapshots[1] is n_slice  # not re-exported
    assert wb.snapshot("cleanup_noop_add").status == "skipped"
    assert wb.snapshot("cleanup_noop_add").info.skip_reason == "disabled"
    # Disabled: the noop adds survive into later snapshots.
    adds_after = wb.snapshot("cleanup_input_constraints").op_histogram.get("aten.add.Tensor", 0)
    wb.enable("cleanup_noop_add", True)
    wb.run()
    assert wb.snapshot("cleanup_noop_add").info.num_matches == 2
    assert wb.snapshot("cleanup_input_constraints").op_histogram["aten.add.Tensor"] == adds_after - 2
    # Setting a field to its current value does not invalidate anything.
    n = len(wb.snapshots)
    wb.configure("cleanup_noop_add", enabled=True)
    assert len(wb.snapshots) == n


def test_rewind_and_reset(wb):
    wb.run()
    wb.rewind("cleanup_input_constraints")
    assert wb.position == wb.index("cleanup_input_constraints")
    # The live graph is back to the state after cleanup_noop_add: export's input checks still on.
    assert any(n.target == "_guards_fn" for n in wb.module.graph.nodes)
    wb.run()
    assert not any(n.target == "_guards_fn" for n in wb.module.graph.nodes)
    wb.reset()
    assert wb.position == 0 and not isinstance(wb.module, torch.fx.GraphModule)


def test_configure_validation_error_changes_nothing(wb):
    wb.run()
    n = len(wb.snapshots)
    with pytest.raises(ConfigError, match="(?s)export_to_gm.*example_seq_len"):
        wb.configure("export_to_gm", example_seq_len=-3)
    with pytest.raises(ConfigError, match="unknown field 'bogus'"):
        wb.configure("cleanup_noop_add", bogus=1)
    with pytest.raises(KeyError, match="not in this pipeline"):
        wb.configure("no_such_transform", enabled=False)
    assert len(wb.snapshots) == n


class _Explode(Transform):
    """Test-only transform that half-rewrites the graph, then raises."""

    def _apply(self, gm, ctx):
        for node in list(gm.graph.nodes):
            if node.op == "call_function" and node.target is torch.ops.aten.silu.default:
                node.target = torch.ops.aten.relu.default  # a partial rewrite ...
                break
        raise ValueError("boom on purpose")  # ... then a failure


def _registry_with_explode():
    reg = TRANSFORMS.copy()
    reg.register("explode_on_purpose")(type("ExplodeOnPurpose", (_Explode,), {}))
    return reg


def test_failing_transform_raises_named_error_and_loses_nothing(tiny_llama):
    reg = _registry_with_explode()
    extra = {"transforms": {"explode_on_purpose": {"stage": "post_export"}}}
    wb = Workbench(tiny_llama, yaml_extra=[extra], registry=reg)
    with pytest.raises(TransformError) as e:
        wb.run()
    msg = str(e.value)
    assert "transform=explode_on_purpose" in msg and "stage=post_export" in msg
    assert "boom on purpose" in msg
    done = [s.key for s in wb.snapshots]
    assert "export_to_gm" in done and wb.status("explode_on_purpose") == "failed"
    # The half-rewrite was undone: the live graph still has its silu nodes.
    assert sum(n.target is torch.ops.aten.silu.default for n in wb.module.graph.nodes) == 2
    # Fix (skip it) and continue from where it stopped, without re-exporting.
    export_snap = wb.snapshots[0]
    wb.enable("explode_on_purpose", False)
    wb.run()
    assert wb.done and wb.snapshots[0] is export_snap


def test_skip_on_error_records_the_error_and_continues(tiny_llama):
    reg = _registry_with_explode()
    extra = {"transforms": {"explode_on_purpose": {"stage": "post_export", "skip_on_error": True}}}
    wb = Workbench(tiny_llama, yaml_extra=[extra], registry=reg)
    wb.run()
    snap = wb.snapshot("explode_on_purpose")
    assert snap.status == "failed" and "boom on purpose" in snap.info.skip_reason
    assert snap.numerics.max_abs == 0.0  # graph restored before the probe
    assert wb.snapshots[-1].numerics.rmse_ratio < 1e-5  # the CPU kernels sum in another order


def test_failing_export_keeps_the_model_and_can_be_fixed(tiny_llama):
    wb = Workbench(tiny_llama, overrides=["export_to_gm.max_seq_len=4"])  # example seq 8 > max 4
    with pytest.raises(TransformError, match="transform=export_to_gm"):
        wb.step()
    assert wb.position == 0
    wb.configure("export_to_gm", max_seq_len=64)
    wb.run()
    assert wb.done


def test_memory_warning_when_a_transform_allocates(tiny_llama):
    class AddBuffer(Transform):
        def _apply(self, gm, ctx):
            gm.register_buffer("scratch", torch.zeros(1024))
            return gm, TransformInfo(num_matches=0)

    reg = TRANSFORMS.copy()
    reg.register("add_buffer_on_purpose")(AddBuffer)
    extra = {"transforms": {"add_buffer_on_purpose": {"stage": "post_export"}}}
    wb = Workbench(tiny_llama, yaml_extra=[extra], registry=reg)
    wb.run()
    snap = wb.snapshot("add_buffer_on_purpose")
    assert snap.mem_delta == 4096 and "changed by" in snap.mem_warning
    wb.configure("add_buffer_on_purpose", expect_mem_change=True)
    wb.run()
    assert wb.snapshot("add_buffer_on_purpose").mem_warning is None


def test_bisect_finds_the_first_transform_that_breaks_numerics(tiny_llama):
    class BreakNumerics(Transform):
        """Swap silu for relu: the first place numerics diverge (declared: the stepper's guard on
        re-spelling transforms would otherwise fail the step, test_match_meaning.py)."""

        changes_numerics = True

        def _apply(self, gm, ctx):
            n = 0
            for node in gm.graph.nodes:
                if node.op == "call_function" and node.target is torch.ops.aten.silu.default:
                    node.target = torch.ops.aten.relu.default
                    n += 1
            return gm, TransformInfo(num_matches=n)

    reg = TRANSFORMS.copy()
    reg.register("break_numerics_on_purpose")(BreakNumerics)
    extra = {"transforms": {"break_numerics_on_purpose": {"stage": "post_export"}}}
    wb = Workbench(tiny_llama, yaml_extra=[extra], registry=reg)
    bad = wb.bisect(tol=1e-5)
    assert bad is not None and bad.key == "break_numerics_on_purpose"
    assert bad.numerics.rmse_ratio > 1e-5
    wb.enable("break_numerics_on_purpose", False)
    assert wb.bisect(tol=1e-5) is None


def test_numerics_can_be_switched_off(tiny_llama):
    wb = Workbench(tiny_llama, numerics=False)
    wb.step()
    assert wb.snapshots[0].numerics is None
    with pytest.raises(RuntimeError, match="numerics are off"):
        wb.bisect()


class _InsertScale(Transform):
    """Test-only: multiply the logits by 1.0 with a new node that has no shape metadata."""

    def _apply(self, gm, ctx):
        out = next(n for n in gm.graph.nodes if n.op == "output")
        (src,) = out.args[0]  # exported graphs return a pytree-flattened tuple
        with gm.graph.inserting_before(out):
            new = gm.graph.call_function(torch.ops.aten.mul.Tensor, (src, 1.0))
        out.replace_input_with(src, new)
        return gm, TransformInfo(num_matches=1)


@pytest.mark.parametrize("shape_prop", [True, False])
def test_shape_propagation_runs_when_the_flag_says(tiny_llama, shape_prop):
    reg = TRANSFORMS.copy()
    reg.register("insert_scale_on_purpose")(_InsertScale)
    extra = {"transforms": {"insert_scale_on_purpose": {"stage": "post_export", "run_shape_prop": shape_prop}}}
    wb = Workbench(tiny_llama, yaml_extra=[extra], registry=reg, numerics=False)
    snap = wb.run_to("insert_scale_on_purpose")[-1]
    assert snap.info.has_valid_shapes is shape_prop
    new = [n for n in snap.graph.nodes if n.name in snap.added_nodes]
    assert len(new) == 1 and new[0].meta["wb_created_by"] == "insert_scale_on_purpose"
    val = new[0].meta.get("val")
    if shape_prop:  # symbolic batch/seq dims survive propagation
        assert val is not None and val.shape[-1] == 512 and not isinstance(val.shape[0], int)
    else:
        assert val is None


def test_snapshot_copies_keep_buffers_registered(wb):
    wb.run_to("cleanup_noop_slice")
    live = {n: b.data_ptr() for n, b in wb.module.named_buffers()}
    snap = wb.snapshots[-1]
    for copy in (snap.module, snap.graph_copy.materialize()):
        bufs = {n: b.data_ptr() for n, b in copy.named_buffers()}
        # the graph's buffers (unused ones like original_inv_freq are not carried), same storage
        assert "model.model.rotary_emb.inv_freq" in bufs and bufs.items() <= live.items()


def test_memory_warning_rules_on_a_gpu_are_checkable_on_cpu():
    """The CUDA branch of the memory check, fed hand-made stats: tracked bytes must not move,
    untracked allocator growth above 1 MiB is flagged, untracked shrinkage (freed temporaries) not."""
    from workbench.pipeline.memory import MemoryStats, unexpected_change

    def stats(params=0, cache=0, cuda=0):
        return MemoryStats(params, 0, cache, rss_bytes=0, cuda_allocated=cuda, cuda_reserved=cuda, cuda_free=0)

    assert unexpected_change(stats(cuda=100 << 20), stats(cuda=(100 << 20) - (8 << 20))) is None
    assert unexpected_change(stats(cuda=0), stats(cuda=512 << 10)) is None  # allocator noise
    grew = unexpected_change(stats(cuda=0), stats(cuda=64 << 20))
    assert grew is not None and "+64.0 MiB" in grew and "outside parameters" in grew
    assert "parameter+buffer+cache" in unexpected_change(stats(params=0, cuda=0), stats(params=4096, cuda=4096))


def test_post_load_transforms_refuse_a_graph_without_weights(tiny_llama):
    wb = Workbench(tiny_llama, numerics=False, overrides=["load_weights.enabled=false"])
    with pytest.raises(TransformError, match=r"fuse_gemms \(stage post_load_fusion\) needs the model's weights.*"
                                             r"enable load_weights"):
        wb.run()
    assert wb.status("fuse_gemms") == "failed" and wb.status("load_weights") == "skipped"
    wb.configure("load_weights", enabled=True)  # fixing it resumes from there
    wb.run()
    assert wb.done


def test_a_pipeline_that_orders_a_need_before_its_provider_is_refused(tiny_llama):
    # initialize_cache moved to post_load_fusion: it would run before insert_cached_attention declares specs
    with pytest.raises(ConfigError, match="initialize_cache needs the cache specs that insert_cached_attention"
                                          ".*runs before"):
        Workbench(tiny_llama, yaml_extra=[{"transforms": {"initialize_cache": {"stage": "post_load_fusion"}}}])
    # a need with no enabled provider is not an order problem: the transform reports itself skipped
    wb = Workbench(tiny_llama, numerics=False, overrides=["insert_cached_attention.enabled=false"])
    wb.run_to("initialize_cache")
    assert "no cache inputs declared" in wb.snapshot("initialize_cache").info.skip_reason


def test_without_snapshots_the_whole_pipeline_runs(tiny_llama):
    """snapshots=False (the bench mode) used to start over at every transform that reported itself
    skipped with a reason (the CUDA-only ones on CPU): only a skip *on error* undoes anything."""
    wb = Workbench(tiny_llama, snapshots=False, numerics=False)
    wb.run()
    assert wb.done and wb.snapshot("fuse_causal_conv_activation").status == "skipped"
    assert wb.generate([[1, 2, 3]], max_new_tokens=3, stop_token_ids=[]).token_ids[0]


def test_unchanged_transforms_carry_the_previous_numerics(tiny_llama):
    from workbench import Workbench

    wb = Workbench(tiny_llama)
    wb.run()
    snaps = wb.snapshots
    carried = [s for s in snaps if s.numerics.carried_from is not None]
    assert carried, "some transforms of the default pipeline change nothing on tiny:llama"
    for s in carried:
        prev = snaps[s.index - 1]
        assert s.info.num_matches == 0 and not s.added_nodes and not s.removed_nodes
        assert (s.numerics.rmse_ratio, s.numerics.max_abs) == (prev.numerics.rmse_ratio, prev.numerics.max_abs)
        assert s.numerics.carried_from in {x.key for x in snaps[: s.index]}
    # every transform that rewrote the graph ran the probe itself
    assert all(s.numerics.carried_from is None for s in snaps if s.info.num_matches > 0)

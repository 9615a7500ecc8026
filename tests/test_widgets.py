"""The notebook panel, driven as a user would: checkboxes set, buttons clicked (their handlers run
inline outside a kernel), selectors picked; asserting the workbench's state and snapshots."""

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("ipywidgets", reason="the panel needs ipywidgets (pip install -e '.[notebooks]')")

from workbench import Workbench  # noqa: E402
from workbench.pipeline.interface import TRANSFORMS, Stages, Transform, TransformInfo  # noqa: E402
from workbench.viz.svg_viewer import page_of_viewer  # noqa: E402
from workbench.widgets import TABS, WorkbenchPanel  # noqa: E402
from workbench.pipeline.config import resolve_pipeline  # noqa: E402
from workbench.widgets.choices import (  # noqa: E402
    NO_CUDA, NOT_IN_PIPELINE, attention_backend_reason, compile_backend_reason,
)

RMSNORM = "workbench.torch_rmsnorm.default"
REPO = Path(__file__).resolve().parents[1]


def rms_count(wb) -> int:
    return wb.snapshots[-1].op_histogram.get(RMSNORM, 0)


def up_to_pattern_matching(entries):
    """Export .. pattern_matcher: the part of the pipeline these tests drive (quick on tiny:llama;
    the later stages have their own tests)."""
    return [e for e in entries if e.config.stage.order <= Stages.PATTERN_MATCHER.order]


@pytest.fixture
def wb(tiny_llama):
    return Workbench(tiny_llama, entries=up_to_pattern_matching(resolve_pipeline()))


@pytest.fixture
def ran(wb):
    wb.run()
    return wb


def statuses(panel):
    return {r.key: r.status for r in panel.rows(panel.tol.value)}


def test_fresh_panel_lists_every_transform_by_stage_all_pending(tiny_llama):
    wb = Workbench(tiny_llama)  # the whole default pipeline
    panel = wb.ui()
    assert isinstance(panel, WorkbenchPanel) and hasattr(panel, "_ipython_display_")
    assert list(panel.pipeline.checkboxes) == wb.keys
    headers = [c.value for c in panel.pipeline.box.children if not hasattr(c, "children")]
    for stage in ("export", "post_export", "pattern_matcher", "compile"):
        assert any(f"<b>{stage}</b>" in h for h in headers), stage
    assert set(statuses(panel).values()) == {"pending"}
    assert not panel.pipeline.checkboxes["split_moe_fused_for_sharding"].value  # disabled in yaml
    assert panel.stop_button.disabled and not panel.step_button.disabled
    assert "Nothing has run yet" in panel.graph.value


def test_step_button_exports_and_shows_the_graph(wb):
    panel = WorkbenchPanel(wb, background=False)
    panel.step_button.click()
    assert wb.position == 1 and panel.selected == "export_to_gm"
    assert statuses(panel)["export_to_gm"] == "done"
    assert panel.progress.value == 1 and panel.progress.max == len(wb.keys)
    assert "<svg" in page_of_viewer(panel.graph.value) and "export_to_gm" in panel.facts.value
    panel.layer.value = 1  # open decoder layer 1: its nodes are drawn one by one
    shown = page_of_viewer(panel.graph.value)
    assert "<svg" in shown and "layers.1" in shown


def test_unchecking_rmsnorm_reruns_from_there_and_the_op_count_comes_back(ran):
    panel = WorkbenchPanel(ran, background=False)
    i = ran.index("match_rmsnorm_pattern")
    before = list(ran.snapshots)
    assert rms_count(ran) == 5

    panel.toggle("match_rmsnorm_pattern", False)
    assert not ran.entries[i].config.enabled
    assert ran.done, "the edit re-ran the pipeline back to where it was"
    assert all(a is b for a, b in zip(ran.snapshots[:i], before[:i])), "earlier steps did not re-run"
    assert all(a is not b for a, b in zip(ran.snapshots[i:], before[i:]))
    assert ran.snapshot("match_rmsnorm_pattern").status == "skipped"
    assert statuses(panel)["match_rmsnorm_pattern"] == "skipped"
    assert rms_count(ran) == 0

    panel.toggle("match_rmsnorm_pattern", True)
    assert ran.entries[i].config.enabled and ran.done
    assert rms_count(ran) == 5
    assert ran.snapshot("match_rmsnorm_pattern").info.num_matches == 5
    assert all(a is b for a, b in zip(ran.snapshots[:i], before[:i]))


def test_edits_mark_later_snapshots_stale_until_rerun(ran):
    panel = WorkbenchPanel(ran, background=False, auto_rerun=False)
    i = ran.index("match_rmsnorm_pattern")
    panel.toggle("match_rmsnorm_pattern", False)
    assert ran.position == i
    st = statuses(panel)
    assert all(st[k] == "done" for k in ran.keys[:i] if k != "split_moe_fused_for_sharding")
    assert all(st[k] == "stale" for k in ran.keys[i:])
    assert "stale" in panel.pipeline.cells["match_swiglu_pattern"].value
    assert "stale until re-run" in panel.message.value
    panel.run_all_button.click()
    assert ran.done and "stale" not in statuses(panel).values()
    assert rms_count(ran) == 0


def test_invalid_config_value_shows_an_error_and_changes_nothing(ran):
    panel = WorkbenchPanel(ran, background=False)
    panel.select("export_to_gm")
    panel.tabs.selected_index = TABS.index("Config")
    entries, snaps = list(ran.entries), list(ran.snapshots)

    panel.form.set("example_batch_size", "abc")
    assert panel.apply_config() is False
    assert "example_batch_size" in panel.config_error.value
    assert "valid integer" in panel.config_error.value
    assert ran.entries == entries and all(a is b for a, b in zip(ran.snapshots, snaps))
    assert len(ran.snapshots) == len(snaps)

    panel.form.set("example_batch_size", "2")
    panel.form.set("patches", "{not yaml")  # cannot even be parsed: nothing is applied
    assert panel.apply_config() is False and "not valid YAML" in panel.config_error.value
    assert ran.entries == entries and ran.snapshots == snaps


def test_config_form_is_generated_from_the_schema_and_applies(ran):
    import ipywidgets as W

    panel = WorkbenchPanel(ran, background=False)
    panel.select("match_moe_routing_pattern")
    eds = panel.form.editors
    assert isinstance(eds["backend"].widget, W.Dropdown)  # Literal['torch', 'triton']
    assert eds["backend"].widget.options == ("torch", "triton")
    assert isinstance(eds["stage"].widget, W.Dropdown) and eds["stage"].widget.disabled  # enum
    assert isinstance(eds["skip_on_error"].widget, W.Checkbox)
    assert isinstance(eds["debug_visualize_dir"].widget, W.Text)

    panel.select("export_to_gm")
    assert isinstance(panel.form.editors["example_seq_len"].widget, W.Text)
    first = ran.snapshots[0]
    panel.form.set("example_seq_len", "12")
    assert panel.apply_config() is True and panel.config_error.value == ""
    assert ran.entries[0].config.example_seq_len == 12
    assert ran.done and ran.snapshots[0] is not first  # invalidated from 0, re-run to the end


def test_layout_selector_sets_attention_and_rope_layout_and_reruns(ran):
    panel = WorkbenchPanel(ran, background=False)
    assert panel.selectors.buttons["layout"]["bsnd"].value
    panel.selectors.buttons["layout"]["bnsd"].value = True  # a click on the button
    cfg = {e.key: e.config for e in ran.entries}
    assert cfg["match_attention_layout"].attn_layout == "bnsd"
    assert cfg["match_rope_layout"].expected_layout == "bnsd"
    assert ran.done and panel.selectors.buttons["layout"]["bnsd"].value
    assert not panel.selectors.buttons["layout"]["bsnd"].value
    assert ran.snapshots[-1].numerics.rmse_ratio < 1e-5


def test_selectors_for_missing_stages_are_disabled_with_the_reason(tiny_llama):
    panel = WorkbenchPanel(Workbench(tiny_llama, entries=up_to_pattern_matching(resolve_pipeline())),
                           background=False)
    for name in ("attention", "compile"):
        assert all(b.disabled for b in panel.selectors.buttons[name].values())
        assert NOT_IN_PIPELINE in panel.selectors.notes[name].value
        assert panel.pick(name, next(iter(panel.selectors.buttons[name]))) is False
        assert NOT_IN_PIPELINE in panel.message.value
    assert not any(b.disabled for b in panel.selectors.buttons["layout"].values())
    assert not any(b.disabled for b in panel.selectors.buttons["dtype"].values())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the reasons shown on a CPU-only machine")
def test_cuda_only_options_are_disabled_with_the_reason_on_cpu(tiny_llama):
    wb = Workbench(tiny_llama)  # the whole default pipeline
    cpu = torch.device("cpu")
    assert "needs a CUDA device; this pipeline runs on cpu" in compile_backend_reason("torch-cudagraph", cpu)
    assert "needs a CUDA device" in compile_backend_reason("torch-opt", cpu)
    assert compile_backend_reason("torch-simple", cpu) is None
    assert attention_backend_reason("torch", cpu) is None
    assert attention_backend_reason("flashinfer", cpu).startswith(NO_CUDA)
    panel = WorkbenchPanel(wb, background=False)
    if "insert_cached_attention" in wb.keys:  # the cache stage is in the default pipeline
        flashinfer = panel.selectors.buttons["attention"]["flashinfer"]
        assert flashinfer.disabled and NO_CUDA in flashinfer.tooltip
        assert NO_CUDA in panel.selectors.notes["attention"].value
        assert not panel.selectors.buttons["attention"]["torch"].disabled
        assert panel.pick("attention", "flashinfer") is False and NO_CUDA in panel.message.value


def test_run_to_rewind_and_reset_buttons(wb):
    panel = WorkbenchPanel(wb, background=False)
    panel.select("match_repeat_kv")
    panel.run_to_button.click()
    assert wb.position == wb.index("match_repeat_kv") + 1 and panel.selected == "match_repeat_kv"
    panel.select("cleanup_noop_add")
    panel.rewind_button.click()
    assert wb.position == wb.index("cleanup_noop_add")
    st = statuses(panel)
    assert st["cleanup_noop_slice"] == "done" and st["cleanup_noop_add"] == "stale"
    assert st["match_repeat_kv"] == "stale" and st["match_rope_pattern"] == "pending"
    panel.reset_button.click()
    assert wb.position == 0 and set(statuses(panel).values()) == {"pending"}


def test_stop_interrupts_between_steps(wb):
    panel = WorkbenchPanel(wb, background=False)
    wb.on_snapshot.append(lambda snap: snap.index == 2 and panel.stop())
    panel.run_all()
    assert wb.position == 3 and "stopped" in panel.message.value
    assert panel.progress.value == 3 and not panel.worker.busy


def test_background_jobs_run_in_a_thread_and_finish(wb):
    panel = WorkbenchPanel(wb, background=True)
    assert panel.run_to_position(2)
    panel.worker.join(120)
    assert wb.position == 2 and not panel.worker.busy and not panel.step_button.disabled


def _broken_registry():
    """The pipeline plus a transform that scales the first RMSNorm output (a numerics bug)."""
    registry = TRANSFORMS.copy()

    def scale_first_norm(declared):
        class ScaleFirstNorm(Transform):
            # declared: the stepper's guard on re-spelling steps lets it through; undeclared, a
            # pattern matcher that changes the answer fails its own step
            changes_numerics = declared

            def _apply(self, gm, ctx):
                node = next(n for n in gm.graph.nodes if n.target == torch.ops.workbench.torch_rmsnorm.default)
                with gm.graph.inserting_after(node):
                    scaled = gm.graph.call_function(torch.ops.aten.mul.Tensor, (node, 1.5))
                node.replace_all_uses_with(scaled, delete_user_cb=lambda u: u is not scaled)
                gm.recompile()
                return gm, TransformInfo(num_matches=1)

        return ScaleFirstNorm

    registry.register("scale_first_norm")(scale_first_norm(True))
    registry.register("scale_first_norm_undeclared")(scale_first_norm(False))

    @registry.register("always_fails")
    class AlwaysFails(Transform):
        def _apply(self, gm, ctx):
            raise RuntimeError("broken on purpose")

    return registry


def _with(registry, key, stage):
    extra = [{"transforms": {key: {"stage": stage}}}]
    return up_to_pattern_matching(resolve_pipeline(extra, registry=registry))


def test_numerics_column_highlights_the_first_divergent_transform(tiny_llama):
    registry = _broken_registry()
    wb = Workbench(tiny_llama, registry=registry,
                   entries=_with(registry, "scale_first_norm", "pattern_matcher"))
    panel = WorkbenchPanel(wb, background=False)
    panel.run_all()
    flagged = [r.key for r in panel.rows(panel.tol.value) if r.divergent]
    assert flagged == ["scale_first_norm"] == [wb.bisect(1e-3).key]
    assert "first divergent" in panel.pipeline.cells["scale_first_norm"].value
    panel.tabs.selected_index = TABS.index("Numerics")
    assert "first transform past" in panel.numerics.value and "scale_first_norm" in panel.numerics.value
    panel.toggle("scale_first_norm", False)  # and the fix: nothing diverges any more
    assert wb.done and not any(r.divergent for r in panel.rows(panel.tol.value))


def test_a_matcher_that_moves_the_logits_is_shown_failed_in_red(tiny_llama):
    registry = _broken_registry()
    wb = Workbench(tiny_llama, registry=registry, entries=_with(registry, "scale_first_norm_undeclared", "pattern_matcher"))
    panel = WorkbenchPanel(wb, background=False)
    panel.run_all()
    assert statuses(panel)["scale_first_norm_undeclared"] == "failed"
    assert "changed the model" in panel.message.value and panel.progress.bar_style == "danger"


def test_a_failing_transform_is_shown_failed_with_its_error(tiny_llama):
    registry = _broken_registry()
    wb = Workbench(tiny_llama, registry=registry, entries=_with(registry, "always_fails", "post_export"))
    panel = WorkbenchPanel(wb, background=False)
    panel.run_all()
    assert statuses(panel)["always_fails"] == "failed" and panel.selected == "always_fails"
    assert "broken on purpose" in panel.message.value and panel.progress.bar_style == "danger"
    assert wb.position == wb.index("always_fails")
    panel.toggle("always_fails", False)  # the fix: the failed run resumes and completes
    assert statuses(panel)["always_fails"] == "skipped" and wb.done
    assert panel.progress.bar_style == "success"


def test_diff_and_chart_panes(ran):
    panel = WorkbenchPanel(ran, background=False)
    panel.select("match_rmsnorm_pattern")
    panel.tabs.selected_index = TABS.index("Diff")
    html = panel.diff.value
    i = ran.index("match_rmsnorm_pattern")
    assert f"#{i - 1:02d} match_rope_layout -&gt; #{i:02d} match_rmsnorm_pattern" in html
    assert "workbench.torch_rmsnorm.default" in html and "<svg" in page_of_viewer(html) and "replacement" in html
    panel.compare.value = 0  # against the export snapshot instead of the previous one
    assert f"#00 export_to_gm -&gt; #{i:02d} match_rmsnorm_pattern" in panel.diff.value
    panel.tabs.selected_index = TABS.index("Charts")
    assert panel.chart.value[:8] == b"\x89PNG\r\n\x1a\n"
    assert "match_rmsnorm_pattern" in panel.chart_table.value and "delta_MiB" in panel.chart_table.value


def test_generate_box_is_disabled_with_the_reason_without_generate(tiny_llama):
    class NoGenerate:  # a workbench of a build without the runtime: same API, no generate()
        def __init__(self, wb):
            self._wb = wb

        def __getattr__(self, name):
            if name == "generate":
                raise AttributeError(name)
            return getattr(self._wb, name)

    wb = Workbench(tiny_llama, entries=up_to_pattern_matching(resolve_pipeline()))
    panel = WorkbenchPanel(NoGenerate(wb), background=False)
    box = panel.generate_box
    assert box.button.disabled and box.prompt.disabled and "no generate()" in box.reason.value
    assert box.generate() is False


class StreamingWorkbench(Workbench):
    """A stand-in for the runtime's generate(): one event per token to ``stream``."""

    def generate(self, prompts, max_new_tokens=16, stream=None, **kwargs):
        assert prompts == [[5, 6, 7]]  # tiny models have no tokenizer: the box sends token ids
        pieces = [" The", " capital", " is", " Paris", "."][:max_new_tokens]
        for i, p in enumerate(pieces):
            stream(SimpleNamespace(index=0, token_id=i, text=p, finished=i == len(pieces) - 1))
        return SimpleNamespace(text="".join(pieces), stats="4 tokens for 1 prompt(s)")


def test_generate_box_streams_the_output_with_tokens_per_second(tiny_llama):
    panel = WorkbenchPanel(StreamingWorkbench(tiny_llama, entries=up_to_pattern_matching(resolve_pipeline())),
                           background=False)
    box = panel.generate_box
    assert not box.button.disabled and box.reason.value == ""
    box.prompt.value = "5, 6 7"
    box.max_new_tokens.value = 4
    box.button.click()
    assert "The capital is Paris" in box.output.value and "Paris." not in box.output.value
    assert re.search(r"4 tokens in [\d.]+ s .*tokens/s", box.stats.value)
    assert "4 tokens for 1 prompt(s)" in box.stats.value
    box.prompt.value = "five six"
    assert box.generate() is False and "token ids" in box.output.value


def test_dtype_selector_reloads_the_model_and_reruns():
    wb = Workbench("tiny:llama", entries=up_to_pattern_matching(resolve_pipeline()))
    wb.run_to("cleanup_noop_add")
    panel = WorkbenchPanel(wb, background=False)
    panel.selectors.buttons["dtype"]["bfloat16"].value = True
    assert panel.wb is not wb and panel.wb.ctx.dtype == torch.bfloat16
    assert wb.ctx.dtype == torch.float32  # the one passed in is left as it was
    assert panel.wb.position == wb.position and "panel.wb" in panel.message.value
    assert panel.selectors.buttons["dtype"]["bfloat16"].value and not panel.selectors.buttons["dtype"]["float32"].value


def test_nothing_imports_the_widgets_package():
    for path in (REPO / "workbench").rglob("*.py"):
        if "widgets" in path.parts:
            continue
        text = path.read_text()
        imports = re.findall(r"^\s*(?:from|import)\s+([\w.]*widgets[\w.]*)", text, re.M)
        if path.name == "api.py":  # Workbench.ui() imports it lazily, inside the method
            assert imports == [".widgets"] and "    from .widgets import" in text, imports
        else:
            assert not imports and "ipywidgets" not in text, path


def test_max_batch_size_survives_a_dtype_reload_into_the_runner_and_scheduler():
    wb = Workbench("tiny:llama", max_batch_size=8, numerics=False)
    panel = WorkbenchPanel(wb, background=False)
    panel.selectors.buttons["dtype"]["bfloat16"].value = True
    new = panel.wb
    assert new is not wb and new.ctx.dtype == torch.bfloat16
    assert new.limits.max_batch_size == 8 and new.numerics_enabled is False  # every argument kept
    new.run()
    assert new.ctx.limits.max_batch_size == 8 and new.ctx.cache.config.max_batch_size == 8
    from workbench.runtime import runner_for

    runner = runner_for(new.module, new.ctx)
    assert runner.seq_info.max_batch_size == 8 and runner.scheduler().cfg.max_batch_size == 8
    out = new.generate([[i + 1, i + 2] for i in range(10)], max_new_tokens=2, stop_token_ids=[])
    assert out.stats.max_concurrency == 8  # 10 prompts, at most 8 in flight

"""Hint-driven sharding: ``torch_hint_*`` ops, ``apply_sharding_hints`` and the sharding-aware models.

What a user relies on:

* the hint ops compute the plain op (hints never change the unsharded result), and the two
  sharding-aware models (``LlamaIRForCausalLM``, ``Qwen3MoeIRForCausalLM``) give HF's logits exactly;
* world size 2 with ``configs/enable_sharder_ir.yaml`` gives the world-size-1 greedy tokens, every
  rank's numerics probe matches the eager model after the rewrite, and each rank holds the same
  sharded bytes as the detected sharding (``detect_sharding`` on HF's class) of the same model: the
  table of the three runs is printed (``pytest -s``);
* ``shard_layers`` keeps the other layer types replicated (and lowered);
* a fused colwise projection with ``output_sizes`` + a shardable split gives each rank its slice of
  every part (the per-rank partial results sum to the whole), a size that does not divide is
  refused by name, and bad configs / registry entries fail with the field named.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from workbench import Workbench
from workbench.models import load_model
from workbench.models.custom import SHARDING_IR_MODELS
from workbench.onboarding.registry import RegistryError, load_registry
from workbench.pipeline.config import ConfigError, resolve_pipeline
from workbench.pipeline.transforms.sharding.hints import HintError, HintTarget, apply_hints
from workbench.pipeline.weights import tensor_bindings

OPS = torch.ops.workbench
FRAGMENT = "workbench/models/configs/enable_sharder_ir.yaml"
IR = dict(SHARDING_IR_MODELS)
PROMPTS = [[1, 2, 3, 4, 5], [17, 3, 99, 400, 12, 7, 250], [400, 12, 7]]
NEW = 12
LIMITS = dict(max_batch_size=3, max_seq_len=64)


def tokens(out):
    assert all(r.error is None for r in out.results), [r.error for r in out.results]
    return [r.token_ids for r in out.results]


# ---------------------------------------------------------------------------------------------- ops
def test_hint_ops_compute_the_plain_ops():
    torch.manual_seed(0)
    x, w, b = torch.randn(2, 3, 8), torch.randn(6, 8), torch.randn(6)
    assert torch.equal(OPS.torch_hint_linear(x, w, b, "colwise", "mha", 2, [3, 3]), F.linear(x, w, b))
    parts = OPS.torch_hint_split_with_sizes(x, [2, 6], -1, True, "mlp")
    assert [torch.equal(p, q) for p, q in zip(parts, x.split([2, 6], -1))] == [True, True]
    assert torch.equal(OPS.torch_hint_view(x, [2, 3, 2, 4], 2, "mha"), x.view(2, 3, 2, 4))
    assert torch.equal(OPS.torch_hint_all_reduce(x, "mlp"), x) and torch.equal(OPS.torch_hint_all_gather(x, -1), x)
    ids, wts = torch.tensor([[0, 2], [1, 3]]), torch.rand(2, 2)
    w13, w2, t = torch.randn(4, 10, 8), torch.randn(4, 8, 5), torch.randn(2, 8)
    assert torch.equal(
        OPS.torch_hint_moe(t, ids, wts, w13, w2, "silu", "ep", "moe"), OPS.torch_moe_fused(t, ids, wts, w13, w2)
    )
    with pytest.raises(ValueError, match="tp_mode 'cols' is not one of"):
        OPS.torch_hint_linear(x, w, None, "cols", "mha")
    with pytest.raises(ValueError, match="layer_type 'attn' is not one of"):
        OPS.torch_hint_all_reduce(x, "attn")


@pytest.mark.parametrize("spec", ["tiny:llama", "tiny:qwen3_moe"])
def test_sharding_aware_model_gives_hf_logits(spec):
    lm = load_model(spec, dtype="float32", custom_models=IR)
    assert type(lm.export_model).__name__ in {"LlamaIRForCausalLM", "Qwen3MoeIRForCausalLM"}
    ids = torch.tensor([PROMPTS[1], PROMPTS[1][::-1]])
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    with torch.no_grad():
        want = lm.model(input_ids=ids, position_ids=pos).logits
        got = lm.export_model(ids, pos).logits
    # the same computation in another order (hint ops, a fused MoE): fp32 round-off, 3.3e-6 with
    # torch's AVX2 kernels
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


# ---------------------------------------------------------------------------------------------- world size 2
def _rank_bytes(wb, key):
    return [s.info.details["sharded_weight_bytes_this_rank"] for s in wb.snapshot(key).ranks]


@pytest.fixture(scope="module", params=["tiny:llama", "tiny:qwen3_moe"])
def runs(request):
    """(spec, {run: (tokens, per-rank sharded bytes)}, the hinted workbench's snapshot of the rewrite)."""
    spec = request.param
    one = Workbench(
        load_model(spec, dtype="float32", custom_models=IR), yaml_extra=[FRAGMENT], numerics=False, **LIMITS
    )
    out = {"ws1 (IR model)": (tokens(one.generate(PROMPTS, max_new_tokens=NEW, stop_token_ids=[])), None)}
    del one
    with Workbench(spec, world_size=2, custom_models=IR, yaml_extra=[FRAGMENT], **LIMITS) as wb:
        got = tokens(wb.generate(PROMPTS, max_new_tokens=NEW, stop_token_ids=[]))
        out["ws2 hinted (IR model)"] = (got, _rank_bytes(wb, "apply_sharding_hints"))
        hinted = wb.snapshot("apply_sharding_hints")
        probes = {k: [s.numerics for s in wb.snapshot(k).ranks] for k in ("apply_sharding_hints", "load_weights")}
        off = [wb.status(k) for k in ("detect_sharding", "sharding_transform_executor")]
    with Workbench(spec, world_size=2, numerics=False, **LIMITS) as wb:
        got = tokens(wb.generate(PROMPTS, max_new_tokens=NEW, stop_token_ids=[]))
        out["ws2 detected (HF class)"] = (got, _rank_bytes(wb, "sharding_transform_executor"))
    print(f"\n{spec}: run | tokens equal ws1 | sharded weight bytes per rank")
    for name, (toks, per_rank) in out.items():
        print(f"  {name:24s} | {toks == out['ws1 (IR model)'][0]} | {per_rank}")
    return spec, out, hinted, probes, off


def test_world_size_2_hinted_gives_world_size_1_tokens_and_detected_bytes(runs):
    spec, out, hinted, probes, off = runs
    ws1 = out["ws1 (IR model)"][0]
    assert len({len(t) for t in ws1}) == 1 and len(set(ws1[0])) >= 4, ws1  # a non-degenerate oracle
    assert out["ws2 hinted (IR model)"][0] == ws1
    assert out["ws2 detected (HF class)"][0] == ws1
    hinted_bytes, detected_bytes = out["ws2 hinted (IR model)"][1], out["ws2 detected (HF class)"][1]
    assert hinted_bytes == detected_bytes, (hinted_bytes, detected_bytes)
    d = hinted.ranks[0].info.details
    assert d["sharded_weight_bytes_this_rank"] * 2 == d["sharded_weight_bytes"]
    want_layers = {"mha", "lm_head", "moe" if "moe" in spec else "mlp"}
    assert set(d["sharded_nodes_by_layer_type"]) == want_layers
    assert d["allreduce_backend"] == "gloo" and d["allreduce_strategy"] == "AUTO"
    assert off == ["skipped", "skipped"]  # the fragment disabled the detected sharding


def test_every_rank_probe_matches_eager_after_the_rewrite(runs):
    for key, numerics in runs[3].items():
        assert all(n is not None and n.ok and n.rmse_ratio < 1e-5 for n in numerics), (key, numerics)


def test_shard_layers_keeps_other_layer_types_replicated():
    overrides = {"apply_sharding_hints.shard_layers": ["mlp"]}
    with Workbench(
        "tiny:llama",
        world_size=2,
        custom_models=IR,
        yaml_extra=[FRAGMENT],
        overrides=overrides,
        numerics=False,
        **LIMITS,
    ) as wb:
        got = tokens(wb.generate(PROMPTS, max_new_tokens=NEW, stop_token_ids=[]))
        d = wb.snapshot("apply_sharding_hints").ranks[1].info.details
    one = Workbench(load_model("tiny:llama", dtype="float32", custom_models=IR), numerics=False, **LIMITS)
    assert got == tokens(one.generate(PROMPTS, max_new_tokens=NEW, stop_token_ids=[]))
    assert d["sharded_nodes_by_layer_type"] == {"mlp": 6}  # 2 layers x gate, up, down
    assert d["all_reduce"] == 2 and "all_gather" not in d and d["hinted_linear"] == 15  # every linear lowered


# ---------------------------------------------------------------------------------------------- the rewrite alone
class FusedMLP(nn.Module):
    """gate|up fused in one colwise projection (``output_sizes``), split by a shardable split."""

    def __init__(self, hidden=16, inter=8):
        super().__init__()
        self.inter = inter
        self.gate_up = nn.Linear(hidden, 2 * inter, bias=False)
        self.down = nn.Linear(inter, hidden, bias=True)

    def forward(self, x):
        h = OPS.torch_hint_linear(x, self.gate_up.weight, None, "colwise", "mlp", 1, [self.inter, self.inter])
        g, u = OPS.torch_hint_split_with_sizes(h, [self.inter, self.inter], -1, True, "mlp")
        y = OPS.torch_hint_linear(F.silu(g) * u, self.down.weight, self.down.bias, "rowwise", "mlp")
        return OPS.torch_hint_all_reduce(y, "mlp")


def _meta_graph():
    with torch.device("meta"):
        m = FusedMLP()
    return torch.export.export(m, (torch.empty(2, 3, 16, device="meta"),)).module()


def _rank_partial(gm, full: dict, *inputs):
    """Run one rank's rewritten graph with its bound slices, its all-reduce taken as the identity."""
    for target, binding in tensor_bindings(gm).items():
        owner, _, name = target.rpartition(".")
        mod = gm.get_submodule(owner) if owner else gm
        t = binding.convert(*[full[i] for i in binding.inputs], **dict(binding.kwargs))
        setattr(mod, name, nn.Parameter(t, requires_grad=False))
    for n in gm.graph.nodes:
        if n.target is OPS.torch_dist_all_reduce.default:
            n.replace_all_uses_with(n.args[0])
            gm.graph.erase_node(n)
    gm.recompile()
    return gm(*inputs)


def test_fused_colwise_split_gives_each_rank_its_slice_of_every_part():
    torch.manual_seed(0)
    ref = FusedMLP()
    full = dict(ref.state_dict())
    x = torch.randn(2, 3, 16)
    partials = []
    for rank in (0, 1):
        gm = _meta_graph()
        counts = apply_hints(gm, HintTarget(2, rank, "g"))
        assert counts["split_sizes_scaled"] == 1 and counts["all_reduce"] == 1 and counts["tensors_cut"] == 3
        split = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.split_with_sizes.default)
        assert list(split.args[1]) == [4, 4]
        partials.append(_rank_partial(gm, full, x))
    torch.testing.assert_close(partials[0] + partials[1], ref(x))


class ToyMoE(nn.Module):
    """4 stacked experts (intermediate 6) behind a fixed routing, as ``torch_hint_moe`` + one all_reduce."""

    def __init__(self, moe_mode: str):
        super().__init__()
        self.moe_mode = moe_mode
        self.w13 = nn.Parameter(torch.randn(4, 12, 8))
        self.w2 = nn.Parameter(torch.randn(4, 8, 6))

    def forward(self, x, ids, weights):
        y = OPS.torch_hint_moe(x, ids, weights, self.w13, self.w2, "silu", self.moe_mode, "moe")
        return OPS.torch_hint_all_reduce(y, "moe")


@pytest.mark.parametrize("moe_mode", ["ep", "tp"])
def test_hinted_moe_partials_sum_to_the_whole(moe_mode):
    torch.manual_seed(0)
    ref = ToyMoE(moe_mode)
    x, ids, weights = torch.randn(5, 8), torch.randint(0, 4, (5, 2)), torch.rand(5, 2)
    partials = []
    for rank in (0, 1):
        with torch.device("meta"):
            meta = ToyMoE(moe_mode)
        gm = torch.export.export(meta, (x.to("meta"), ids.to("meta"), weights.to("meta"))).module()
        counts = apply_hints(gm, HintTarget(2, rank, "g"))
        assert counts[f"moe_{moe_mode}"] == 1 and counts["tensors_cut"] == 2
        partials.append(_rank_partial(gm, dict(ref.state_dict()), x, ids, weights))
    torch.testing.assert_close(partials[0] + partials[1], ref(x, ids, weights))


def test_sizes_that_do_not_divide_are_refused_by_name():
    with pytest.raises(HintError, match=r"output features 8 does not split into 3 equal parts"):
        apply_hints(_meta_graph(), HintTarget(3, 0, "g"))


# ---------------------------------------------------------------------------------------------- configs
def test_config_validation_names_the_field_and_the_choices():
    with pytest.raises(ConfigError, match=r"allreduce_strategy"):
        resolve_pipeline([FRAGMENT], {"apply_sharding_hints.allreduce_strategy": "FASTEST"})
    with pytest.raises(ConfigError, match=r"shard_layers"):
        resolve_pipeline([FRAGMENT], {"apply_sharding_hints.shard_layers": ["attention"]})
    entries = {e.key: e.config for e in resolve_pipeline([FRAGMENT])}
    assert entries["apply_sharding_hints"].enabled and entries["apply_sharding_hints"].allreduce_strategy == "AUTO"
    assert not entries["detect_sharding"].enabled and not entries["sharding_transform_executor"].enabled
    assert not {e.key: e.config for e in resolve_pipeline()}["apply_sharding_hints"].enabled  # opt-in


def test_registry_validates_world_size_and_custom_models(tmp_path):
    reg = tmp_path / "registry.yaml"
    reg.write_text(
        "models:\n"
        "  - {name: 'tiny:llama', world_size: 0}\n"
        "  - {name: 'tiny:llama', label: b, custom_models: hinted}\n"
        "  - {name: 'tiny:llama', label: c, custom_models: sharding_ir, world_size: 2}\n"
    )
    with pytest.raises(RegistryError) as e:
        load_registry(reg)
    msg = str(e.value)
    assert "2 problem(s)" in msg and "world_size" in msg and "custom_models must be true, false or 'sharding_ir'" in msg
    shipped = {e.key: e for e in load_registry().entries}
    assert shipped["llama_ir_tp2"].world_size == 2 and shipped["llama_ir_tp2"].custom_models == IR

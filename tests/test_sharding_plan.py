"""The sharding stage in one process: the plan and the rewritten graph of one rank.

``detect_sharding`` / ``sharding_transform_executor`` need only ``ctx.dist`` (rank, world size and a
group name), not a live process group, until a collective runs: so the plan, the cut weights, the
bindings and the inserted collectives are checked here without starting ranks (numerics off: the
probe would run the collectives). Multi-rank runs that generate are in ``test_sharding.py``.
"""

import pytest
import torch

from workbench import Workbench
from workbench.pipeline.context import DistInfo
from workbench.pipeline.graph.utils import op_histogram
from workbench.pipeline.transforms.sharding.plans import split_evenly, take_shard
from workbench.pipeline.weights import tensor_bindings

ONE_THREAD = True


def sharded(model, rank=0, world_size=2, until="sharding_transform_executor", **kw):
    wb = Workbench(model, dist=DistInfo(rank, world_size, "test-group", "gloo"), numerics=False,
                   max_batch_size=2, max_seq_len=64, **kw)
    wb.run_to(until)
    return wb


def by_kind(plan, kind):
    return [r for r in plan.regions if r.kind == kind]


def test_split_evenly_and_take_shard():
    assert split_evenly(9, 2) == [(0, 5), (5, 9)]
    assert split_evenly(1536, 2, align=32) == [(0, 768), (768, 1536)]
    assert split_evenly(100, 3, align=32) == [(0, 64), (64, 96), (96, 100)]  # group-aligned cuts
    t = torch.arange(24.0).reshape(4, 6)
    assert torch.equal(take_shard(t, dim=1, ranges=((0, 2), (4, 6))), t[:, [0, 1, 4, 5]])
    assert torch.equal(take_shard(t, dim=0, ranges=((1, 3),), zero=True), torch.zeros(2, 6))
    assert take_shard(t, dim=0, ranges=((0, 2),)).untyped_storage().data_ptr() != t.untyped_storage().data_ptr()


def test_world_size_one_leaves_the_graph_alone(tiny_llama):
    wb = Workbench(tiny_llama, numerics=False, max_batch_size=2, max_seq_len=64)
    wb.run_to("sharding_transform_executor")
    for key in ("detect_sharding", "sharding_transform_executor"):
        snap = wb.snapshot(key)
        assert snap.info.num_matches == 0 and "world size 1" in snap.info.skip_reason
    assert wb.ctx.sharding is None
    assert not any("torch_dist" in op for op in op_histogram(wb.module))


@pytest.mark.parametrize("rank", [0, 1])
def test_llama_plan_and_rewrite(tiny_llama, rank):
    wb = sharded(tiny_llama, rank=rank, until="load_weights")
    plan = wb.ctx.sharding
    assert plan.applied and plan.counts() == {"mha": 2, "mlp": 2, "lm_head": 1}
    assert [r.shard for r in by_kind(plan, "embedding")] == [False]
    mha = by_kind(plan, "mha")[0]
    assert mha.per_rank == ("q heads 0-1, kv heads 0", "q heads 2-3, kv heads 1")
    hist = op_histogram(wb.snapshot("sharding_transform_executor").module)
    assert hist["workbench.torch_dist_all_reduce.default"] == 4  # 2 x (o_proj, MLP down)
    assert hist["workbench.torch_dist_all_gather.default"] == 1  # the LM head's logits
    # After load_weights the rank holds its slices of the eager weights, copied (not views).
    gm, eager = wb.module, dict(tiny_llama.model.named_parameters(remove_duplicate=False))
    q = gm.get_parameter("model.model.layers.0.self_attn.q_proj.weight")
    head_dim = 16
    rows = slice(rank * 2 * head_dim, (rank + 1) * 2 * head_dim)
    assert torch.equal(q, eager["model.layers.0.self_attn.q_proj.weight"][rows])
    down = gm.get_parameter("model.model.layers.1.mlp.down_proj.weight")
    assert torch.equal(down, eager["model.layers.1.mlp.down_proj.weight"][:, rank * 64:(rank + 1) * 64])
    # The LM head is tied to the embedding: the embedding keeps the whole table, the head a new slice.
    emb = [n for n in gm.graph.nodes if n.target is torch.ops.aten.embedding.default][0]
    assert tuple(emb.args[0].meta["val"].shape) == (512, 64)
    head = gm.get_parameter("model.lm_head.weight_shard")
    assert torch.equal(head, eager["lm_head.weight"][rank * 256:(rank + 1) * 256])
    details = wb.snapshot("sharding_transform_executor").info.details
    whole, local = details["sharded_weight_bytes"], details["sharded_weight_bytes_this_rank"]
    assert local == whole // 2
    load = wb.snapshot("load_weights").info.details
    assert load["bytes_made"] >= local  # the shards are the rank's own copies, not views of the eager model


def test_sharded_graph_cannot_run_without_a_process_group(tiny_llama):
    wb = sharded(tiny_llama)
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(RuntimeError, match="needs a torch.distributed process group"):
        wb.forward(ids, torch.arange(3)[None])


def test_smollm2_q4_uneven_heads_and_int4_row_split(smollm2_q4):
    wb = sharded(smollm2_q4, rank=1, until="sharding_transform_executor")
    plan = wb.ctx.sharding
    assert plan.counts() == {"mha": 30, "mlp": 30, "lm_head": 1}
    mha = by_kind(plan, "mha")[0]
    assert mha.per_rank == ("q heads 0-5, kv heads 0-1", "q heads 6-8, kv heads 2")
    o_cut = [c for c in mha.cuts if c.kind == "row"][0]
    qweight, scales = o_cut.tensors[0], o_cut.tensors[1]
    # rank 1's 3 query heads x 64 input features of o_proj: 192 features = 96 packed bytes, 6 groups of 32
    assert qweight.ranges == ((6 * 64 // 2, 9 * 64 // 2),) and scales.ranges == ((12, 18),)
    bindings = tensor_bindings(wb.module)
    assert "model.model.layers.0.self_attn.o_proj.qweight" in bindings


def test_gqa_with_fewer_kv_heads_than_ranks_copies_them(tiny_llama):
    plan = sharded(tiny_llama, rank=3, world_size=4, until="detect_sharding").ctx.sharding
    mha = by_kind(plan, "mha")[0]
    assert mha.shard and "KV heads copied" in mha.how
    assert mha.per_rank == ("q heads 0, kv heads 0", "q heads 1, kv heads 0", "q heads 2, kv heads 1",
                            "q heads 3, kv heads 1")


def test_heads_that_cannot_be_split_stay_replicated_with_the_reason(tiny_llama):
    plan = sharded(tiny_llama, rank=0, world_size=3, until="detect_sharding").ctx.sharding
    mha = by_kind(plan, "mha")[0]
    assert not mha.shard and "2 KV heads cannot be copied evenly to 3 ranks" in mha.how
    assert all(r.shard for r in by_kind(plan, "mlp"))  # the rest still splits (uneven widths are fine)


def test_moe_experts_per_rank():
    wb = sharded("tiny:qwen3_moe", rank=1, until="sharding_transform_executor")
    moe = by_kind(wb.ctx.sharding, "moe")[0]
    assert moe.per_rank == ("experts 0-1", "experts 2-3")
    node = [n for n in wb.module.graph.nodes if n.target is torch.ops.workbench.torch_moe_fused.default][0]
    assert node.args[1].target is torch.ops.workbench.torch_moe_local_experts.default
    assert node.args[1].args[1:] == (2, 2)
    assert tuple(node.args[3].meta["val"].shape)[0] == 2


def test_torch_moe_local_experts_skips_other_ranks_experts():
    from workbench.ops.moe.torch_moe import torch_moe_fused

    torch.manual_seed(0)
    x, w13, w2 = torch.randn(5, 8), torch.randn(4, 12, 8), torch.randn(4, 8, 6)
    sel = torch.tensor([[0, 3], [1, 2], [2, 0], [3, 1], [1, 3]])
    w = torch.rand(5, 2)
    whole = torch_moe_fused(x, sel, w, w13, w2)
    parts = [torch_moe_fused(x, torch.ops.workbench.torch_moe_local_experts(sel, e0, 2), w, w13[e0:e0 + 2],
                             w2[e0:e0 + 2]) for e0 in (0, 2)]
    torch.testing.assert_close(parts[0] + parts[1], whole)


def test_selected_layers_only(tiny_llama):
    plan = sharded(tiny_llama, until="detect_sharding", overrides={"detect_sharding.shard_layers": ["mlp"]}).ctx.sharding
    assert plan.counts() == {"mlp": 2}
    assert all("not selected" in r.how for r in by_kind(plan, "mha"))


def test_render_marks_sharded_nodes(tiny_llama):
    from workbench.viz.render import render_snapshot

    wb = sharded(tiny_llama)
    src = render_snapshot(wb.snapshot("sharding_transform_executor")).source
    assert "shard: column q heads 0-1" in src and "shard: all_reduce over 2 ranks" in src
    assert "#c62828" in src  # the collectives' border


def test_sharded_layer_render_and_report(tiny_llama, tmp_path):
    from workbench.viz.report import write_report
    from workbench.viz.sharding import render_sharded_layer

    wb = sharded(tiny_llama)
    src = render_sharded_layer(wb.snapshot("sharding_transform_executor")).source
    assert "rank 0 of 2: layer" in src and "shard: row q heads 0-1" in src and "torch_dist_all_reduce" in src
    html = write_report(wb, tmp_path).read_text()
    assert "Sharding plan: rank 0 of 2" in html and "q heads 2-3, kv heads 1" in html
    assert 'id="sharding-graph"' in html
    with pytest.raises(ValueError, match="holds no applied sharding plan"):
        render_sharded_layer(wb.snapshot("detect_sharding"))


def test_per_expert_lists_keep_this_ranks_experts():
    """split_moe_fused_for_sharding's list form: the MoE node keeps rank 1's 2 experts of 4."""
    wb = sharded("tiny:qwen3_moe", rank=1, overrides={"split_moe_fused_for_sharding.enabled": True})
    node = [n for n in wb.module.graph.nodes if n.target is torch.ops.workbench.torch_moe.default][0]
    assert [len(node.args[i]) for i in (3, 4, 5)] == [2, 2, 2]
    assert all("_2" in w.target or "_3" in w.target for w in node.args[3])
    assert wb.snapshot("sharding_transform_executor").info.details["expert_tensors_dropped"] == 12

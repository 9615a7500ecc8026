"""Export (stage ``export``): ``export_to_gm`` traces a weightless meta twin of the model with
``torch.export`` behind the ``(input_ids, position_ids) -> logits`` contract.

    export_to_gm.py        export_to_gm
    patches.py             the export patches applied while tracing (canonical module forwards, literals)
    stamp.py               layer stamping: trace one layer, stamp the rest (large models)
    device_branches.py     rewrites that give a meta trace a CPU trace's ops
    forward_constants.py   tensors made inside the forward, recovered from a CPU trace
    few_experts.py         num_moe_experts_for_export: trace with a few experts, restore the rest
    export_cache.py        the exported graph kept on disk (graph_record.py: the graph as plain data;
                           graph_from_record.py: built back from it)
"""

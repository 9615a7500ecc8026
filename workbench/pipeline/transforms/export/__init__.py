"""Export (stage ``export``): ``export_to_gm`` traces a weightless meta twin of the model with
``torch.export`` behind the ``(input_ids, position_ids) -> logits`` contract.

    export_to_gm.py   export_to_gm
    patches.py        the export patches applied while tracing (canonical module forwards, literals)
    stamp.py          layer stamping: trace one layer, stamp the rest (large models)
"""

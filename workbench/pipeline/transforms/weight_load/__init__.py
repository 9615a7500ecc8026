"""Weight load (stage ``weight_load``).

load_weights.py   load_weights: binds the meta-traced graph to the model's tensors on the device
"""

"""The graph library the framework and every family share.

utils.py     node and fake-value helpers, op histograms, graph modules of a module
weights.py   the graph's tensors: fetch, concatenate, release (no copies of real weights)
copy.py      snapshot copies of a graph that share parameter storage
"""

"""The version-gated library patches restore what they change."""

import transformers.masking_utils as mu

from workbench._compat import hf_packed_sequence_detection_disabled


def test_packed_sequence_detection_disabled_and_restored():
    import torch

    original = mu.find_packed_sequence_indices
    packed = torch.tensor([[0, 1, 2, 0, 1]])  # two sequences packed into one row
    assert original(packed) is not None
    with hf_packed_sequence_detection_disabled():
        assert mu.find_packed_sequence_indices(packed) is None
    assert mu.find_packed_sequence_indices is original

"""The tiny-model builders' defaults (speculant/testing/tiny.py)."""

from speculant.testing.tiny import target_layer_ids_for


def test_default_target_layer_ids_follow_the_published_rule_and_stay_in_range():
    assert target_layer_ids_for(36, 5) == [1, 9, 17, 25, 33]  # evenly from layer 1 to layer N-3
    for layers in range(1, 8):  # targets too small for the rule: every id is still one of their layers
        for features in range(1, 4):
            ids = target_layer_ids_for(layers, features)
            assert len(ids) == features and all(0 <= i < layers for i in ids), (layers, features, ids)

"""Metal memory limits: the numbers, and nothing done without Metal."""

import mlx.core as mx

from node.memory import apply_metal_limits, metal_limits


def test_limits_are_85_percent_of_the_recommended_working_set():
    assert metal_limits({"max_recommended_working_set_size": 100 * 2**30}) == int(85 * 2**30)
    assert metal_limits({"architecture": "x86_64"}) is None


def test_no_metal_no_limits():
    if mx.metal.is_available():
        return  # on a Mac this would really set them
    assert apply_metal_limits() is None

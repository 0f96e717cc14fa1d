"""Metal memory limits: the numbers; set for real where Metal is, nothing done without it."""

import mlx.core as mx

from node.memory import apply_metal_limits, metal_limits


def test_limits_are_85_percent_of_the_recommended_working_set():
    assert metal_limits({"max_recommended_working_set_size": 100 * 2**30}) == int(85 * 2**30)
    assert metal_limits({"architecture": "x86_64"}) is None


def test_limits_are_set_where_metal_is_and_not_elsewhere():
    if not mx.metal.is_available():
        assert apply_metal_limits() is None
        return
    expected = metal_limits(mx.device_info())
    memory_before = mx.set_memory_limit(mx.device_info()["memory_size"])
    mx.set_memory_limit(memory_before)
    limit = apply_metal_limits()
    assert limit == expected and limit > 0
    # each setter returns the limit in force: the one apply_metal_limits set
    assert mx.set_memory_limit(memory_before) == limit
    wired_before = mx.set_wired_limit(0)
    assert wired_before == limit

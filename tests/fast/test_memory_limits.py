"""A rank's memory limits from its device: the numbers (Metal's working set, a CUDA GPU's free
memory, 85% of each); set for real where Metal or CUDA is, nothing done on a CPU."""

import mlx.core as mx

from node.rank.memory import apply_memory_limits, cuda_limit, device_limit, metal_limits


def test_limits_are_85_percent_of_the_recommended_working_set():
    assert metal_limits({"max_recommended_working_set_size": 100 * 2**30}) == int(85 * 2**30)
    assert metal_limits({"architecture": "x86_64"}) is None


def test_a_cuda_gpus_limit_is_85_percent_of_its_free_memory():
    info = {"device_name": "NVIDIA H100 80GB HBM3", "free_memory": 80 * 10**9,
            "total_memory": 85 * 10**9}  # fmt: skip
    assert cuda_limit(info) == 68 * 10**9
    assert cuda_limit({"total_memory": 10**10}) == int(0.85 * 10**10)  # no free figure
    assert cuda_limit({"device_name": "AMD EPYC"}) is None


def test_limits_are_set_where_metal_is_and_not_on_a_cpu():
    if not mx.metal.is_available() and not mx.cuda.is_available():
        assert device_limit() is None and apply_memory_limits() is None
        return
    if mx.cuda.is_available():  # 85% of what the GPU has free as the rank starts, set
        info = mx.device_info()
        expected = cuda_limit(info)
        assert expected is not None and 0 < expected < info["total_memory"], info
        before = mx.set_memory_limit(expected)
        mx.set_memory_limit(before)
        kind, limit = apply_memory_limits()
        assert kind == "CUDA" and abs(limit - expected) <= 0.02 * expected, (limit, expected)
        assert mx.set_memory_limit(before) == limit  # the setter returns the limit in force
        return
    expected = metal_limits(mx.device_info())
    memory_before = mx.set_memory_limit(mx.device_info()["memory_size"])
    mx.set_memory_limit(memory_before)
    assert apply_memory_limits() == ("Metal", expected) and expected > 0
    # each setter returns the limit in force: the one apply_memory_limits set
    assert mx.set_memory_limit(memory_before) == expected
    wired_before = mx.set_wired_limit(0)
    assert wired_before == expected

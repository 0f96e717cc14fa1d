"""Ranks of one job on one GPU: the GPU a rank reports (nvidia-smi, CUDA_VISIBLE_DEVICES)
and the launcher's warning once every rank of a host said its GPU. Doctor's side:
tests/fast/test_doctor.py; a launch with the stand-in nvidia-smi: tests/e2e/test_launch.py."""

from cluster.core.protocol import Gpu
from cluster.job.state import JobState, RankState, on_event
from node.rank.gpu import this_gpu
from tests.support.gpu import fake_nvidia_smi

H100 = "NVIDIA H100 80GB HBM3"


def test_a_rank_reports_the_gpu_cuda_gives_it_first(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", fake_nvidia_smi(tmp_path))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert this_gpu(True) == Gpu(0, H100, 81559 / 1024, True)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    assert this_gpu(False) == Gpu(1, H100, 81559 / 1024, False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU visible: nothing to share
    assert this_gpu(True) is None
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")  # not on this host
    assert this_gpu(True) is None
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))  # a Mac, a host without a driver
    assert this_gpu(True) is None


def job(hosts: list[str]) -> JobState:
    return JobState([RankState(i, h) for i, h in enumerate(hosts)])


def test_the_warning_comes_once_every_rank_of_the_host_said_its_gpu():
    j = job(["gpubox", "gpubox", "gpubox", "other"])
    gpu = Gpu(0, H100, 79.6, True)
    assert on_event(j, 2, gpu, 1.0) == []  # in any order: rank 2 first
    assert on_event(j, 3, gpu, 1.0) == []  # another host's GPU 0 is another GPU
    assert on_event(j, 0, Gpu(1, H100, 79.6, True), 1.0) == []
    (said,) = on_event(j, 1, gpu, 1.2)
    assert said.text.startswith("ranks 1 and 2 on gpubox share GPU 0 (NVIDIA H100 80GB HBM3, "
                                "80 GB): each gets part of its memory bandwidth")  # fmt: skip
    assert "0.44x" in said.text and "0.06x" in said.text and "-n 1" in said.text


def test_ranks_on_a_gpu_host_with_mlx_s_cpu_build_are_told_how_to_use_the_gpu():
    j = job(["gpubox", "gpubox"])
    on_event(j, 0, Gpu(0, H100, 79.6, False), 1.0)
    (said,) = on_event(j, 1, Gpu(0, H100, 79.6, False), 1.0)
    assert "run on its CPU" in said.text and "mlx-cluster[cuda]" in said.text


def test_one_rank_per_gpu_is_no_warning():
    j = job(["gpubox", "gpubox"])
    assert on_event(j, 0, Gpu(0, H100, 79.6, True), 1.0) == []
    assert on_event(j, 1, Gpu(1, H100, 79.6, True), 1.0) == []

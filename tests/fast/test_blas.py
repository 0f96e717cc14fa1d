"""Linux ranks preload the host's OpenBLAS (cluster.core.blas) unless asked not to."""

from cluster.core.blas import MARK, blas_env, find_openblas


def test_blas_env_on_linux_only_when_asked_and_found():
    library = find_openblas()
    env = blas_env("auto", 2, {}, "linux", 8)
    if library is None:
        assert env is None
    else:
        assert env == {"LD_PRELOAD": library, "OPENBLAS_NUM_THREADS": "4", MARK: library}
        kept = blas_env("auto", 3, {"LD_PRELOAD": "x.so", "OPENBLAS_NUM_THREADS": "7"}, "linux", 2)
        assert kept["LD_PRELOAD"] == f"x.so {library}" and kept["OPENBLAS_NUM_THREADS"] == "7"
        assert blas_env("auto", 4, {}, "linux", 2)["OPENBLAS_NUM_THREADS"] == "1"
    assert blas_env("reference", 1, {}, "linux", 8) is None
    assert blas_env("auto", 1, {}, "darwin", 8) is None
    assert blas_env("auto", 1, {MARK: "done"}, "linux", 8) is None


def test_the_launcher_gives_local_ranks_their_blas_and_leaves_remote_ones_to_choose():
    """A rank on this machine starts with OpenBLAS already preloaded by the launcher (no
    second start of its process); a remote rank decides on its own host."""
    import os
    import sys

    from cluster.core.hostfile import parse_hostfile
    from cluster.core.spec import JobSpec, LaunchSettings
    from cluster.job.launcher import rank_launches

    hosts = [{"ssh": "localhost", "ips": ["127.0.0.1"], "slots": 2},
             {"ssh": "far.example", "ips": ["10.9.9.9"]}]  # fmt: skip
    hf = parse_hostfile({"hosts": hosts}, "h.yaml")
    spec = JobSpec(model="", command="generate", world_size=3)
    local, _, remote = rank_launches(hf, spec, LaunchSettings(starting_port=40100))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    expected = blas_env("auto", 2, dict(os.environ), sys.platform, cores)
    if expected is None:
        assert MARK not in local.extra_env
    else:
        assert local.extra_env[MARK] == expected[MARK]
        assert local.extra_env["LD_PRELOAD"].endswith(expected[MARK])
    assert MARK not in remote.extra_env

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

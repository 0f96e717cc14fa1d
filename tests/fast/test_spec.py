"""The job spec, the event protocol and the launcher's bookkeeping, without any process."""

import ast
import dataclasses
from pathlib import Path

import click
import pytest

from cluster.commands import cli
from cluster.commands.options import HOST, OPTIONS
from cluster.commands.run import job_spec
from cluster.core import protocol
from cluster.core.blas import MARK, blas_env, find_openblas
from cluster.core.hostfile import parse_hostfile
from cluster.core.spec import (
    BenchSettings,
    JobRequest,
    JobSpec,
    LaunchSettings,
    Sampling,
    ServeSettings,
    Template,
    from_dict,
    to_dict,
)
from cluster.job.launcher import plan
from cluster.job.state import JobState, RankState, on_event, on_text, overdue

ROOT = Path(__file__).resolve().parent.parent.parent


def test_spec_round_trip_with_bytes_and_nesting():
    spec = JobSpec(
        model="/m",
        command="generate",
        split=[3, 2],
        request=JobRequest(
            prompt="hi",
            sampling=Sampling(temp=0.7, stop=["###"], seed=5),
            template=Template(system="be brief", tools=[{"type": "function"}]),
            image=b"\x89PNG\x00\xff",
        ),
        bench=BenchSettings(prompt_tokens=8),
    )
    back = JobSpec.from_json(spec.to_json())
    assert back == spec
    assert isinstance(back.request.sampling, Sampling) and back.request.image == b"\x89PNG\x00\xff"


def test_missing_fields_take_defaults_and_unknown_ones_are_refused():
    assert from_dict(JobSpec, {"model": "m"}) == JobSpec(model="m")
    with pytest.raises(ValueError, match="Sampling: unknown field"):
        from_dict(Sampling, {"temperature": 1.0})


def test_only_rank_0_gets_the_request_and_serve_settings():
    spec = JobSpec(
        model="m", request=JobRequest(prompt="secret"), serve=ServeSettings(api_key="k", port=1)
    )
    assert spec.for_rank(0).request.prompt == "secret"
    other = spec.for_rank(1)
    assert other.request == JobRequest() and other.serve == ServeSettings()


def test_every_option_default_is_its_dataclass_default():
    """A default lives in cluster.core.spec only: each click option named like a field shows it."""
    owners = (Sampling, Template, ServeSettings, LaunchSettings, BenchSettings, JobSpec)
    fields = {f.name: (cls, f) for cls in owners for f in dataclasses.fields(cls)}
    checked = 0
    for name, decorator in OPTIONS.items():
        if name not in fields or name in HOST:  # --hostfile, -n, --backend: the hostfile's
            continue
        param = decorator(lambda **_: None).__click_params__[0]
        cls, f = fields[name]
        if f.default_factory is not dataclasses.MISSING:
            expected = f.default_factory()
        elif f.default is not dataclasses.MISSING:
            expected = f.default
        else:  # no default (the model: the CLI's is the embedded one)
            continue
        if param.multiple:
            assert list(param.default or []) == expected, name
        else:
            assert param.default == expected or (param.is_flag and not expected), name
        checked += 1
    assert checked >= 20


def parsed(command: click.Command, *args: str) -> dict:
    return dict(command.make_context(command.name, list(args)).params)


def test_a_sampling_option_reaches_the_rank_spec():
    values = parsed(cli.commands["launch"], "--temp", "0.5", "--frequency-penalty", "0.25", "hi")
    for key in ("prompt", "logits", "as_json", "hostfile", "num_ranks", "backend"):
        values.pop(key)
    for f in dataclasses.fields(LaunchSettings):
        values.pop(f.name)
    spec = job_spec("generate", {**values, "prompt": "hi"})
    assert spec.request.sampling == Sampling(temp=0.5, frequency_penalty=0.25)
    launches = plan(
        parse_hostfile({"hosts": [{"ssh": "localhost", "slots": 2}]}), spec, LaunchSettings()
    )
    rank0, rank1 = (JobSpec.from_json(x.spec) for x in launches)
    assert rank0.request.sampling.frequency_penalty == 0.25 and rank0.request.prompt == "hi"
    assert rank1.request == JobRequest() and rank0.ranks_on_host == rank1.ranks_on_host == 2
    assert rank0.world_size == 2


def test_events_round_trip_and_log_lines_stay_lines():
    events = [
        protocol.Beat(),
        protocol.Phase("loading"),
        protocol.Ready(1.5, layers=[0, 3], files=["a.safetensors"]),
        protocol.Stats("length", {"prompt_tokens": 3}, {"prompt_n": 3}, 0.1),
        protocol.Error("boom", t=1.0, peer=True),
        protocol.BenchComm({"send": 1}, allsum_bytes=4),
    ]
    for event in events:
        line = protocol.encode_event(event)
        assert line.endswith("\n") and line.count("\n") == 1
        assert protocol.decode_event(line) == event
    assert protocol.decode_event("Traceback (most recent call last):\n") is None
    assert protocol.decode_event(protocol.EVENT_PREFIX + '{"event": "nope"}\n') is None
    assert protocol.decode_event(protocol.EVENT_PREFIX + "{broken\n") is None


def job(n: int = 2) -> JobState:
    return JobState([RankState(r, f"mac{r}") for r in range(n)])


def test_bookkeeping_follows_phases_ready_and_stats():
    state = job()
    assert on_event(state, 1, protocol.Phase("loading"), 0.5) == []
    assert state.ranks[1].phase == "loading"
    on_event(state, 0, protocol.Ready(1.0), 1.0)
    said = on_event(state, 1, protocol.Ready(2.0), 2.5)
    assert [s.text for s in said] == ["all ranks ready after 2.5 s"]
    assert state.result.ready_s == 2.5 and state.ranks[1].load_s == 2.0
    assert on_text(state, 1, b"not for the user\n", 3.0) is False
    assert list(state.ranks[1].tail) == ["not for the user"]
    assert on_text(state, 0, b"Hi", 3.0) is True and state.result.first_token_s == 3.0
    stats = protocol.Stats(
        "stop",
        {},
        {
            "prompt_n": 4,
            "prompt_per_second": 10.0,
            "cache_n": 0,
            "predicted_n": 2,
            "predicted_per_second": 5.0,
        },
    )
    said = on_event(state, 0, stats, 4.0)
    assert state.result.stats is stats
    assert said[0].text.startswith("prompt 4 tokens at 10.0 tok/s, cache 0, generated 2")
    on_event(state, 1, protocol.Error("bad model", t=7.0, cause="model"), 5.0)
    assert state.ranks[1].bad_model and state.ranks[1].error_t == 7.0


def test_the_rank_silent_longest_is_given_up_on_and_the_others_named():
    state = job(3)
    for s, seen in zip(state.ranks, (100.0, 80.0, 90.0), strict=True):
        s.last_seen = seen
    assert overdue(state, 105.0, 5.0, heartbeat_timeout=30, start_timeout=60) is None
    late = overdue(state, 115.0, 25.0, heartbeat_timeout=30, start_timeout=60)
    assert late.rank == 1 and late.unresponsive
    assert "also silent" not in late.error
    late = overdue(state, 131.0, 25.0, heartbeat_timeout=30, start_timeout=60)
    assert "also silent: rank 2 on mac2" in late.error


def test_start_timeout_names_a_rank_not_ready():
    state = job(2)
    for s in state.ranks:
        s.last_seen = 100.0
    on_event(state, 0, protocol.Ready(1.0), 1.0)
    late = overdue(state, 101.0, 61.0, heartbeat_timeout=30, start_timeout=60)
    assert late.rank == 1 and "--start-timeout" in late.error


def imports(path: Path) -> set[str]:
    """The absolute module names a file imports (relative imports resolved)."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    if path.name == "__init__.py":
        package += ".__init__"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: -node.level]
                name = ".".join(base + ([node.module] if node.module else []))
                names = [name] if node.module else [f"{name}.{a.name}" for a in node.names]
            else:
                names = [node.module]
            found.update(names)
    return found


LAYERS = (  # lowest first: a module imports its own package and the layers below it only
    ("cluster.core",),  # plain data and logic; node/ imports these and nothing else of cluster
    ("cluster.job",),  # running one job
    ("cluster.serve", "cluster.rig"),  # side by side: neither imports the other
    ("cluster.commands",),
)
NODE_LAYERS = (  # the rank's packages, lowest first (docs/architecture.md)
    ("node.rank",),  # the group, share_object, the watchdog, memory limits, links
    ("node.model",),  # this rank's share of the model
    ("node.decode",),  # one answer: template, loop, sampling, grammar, text
    ("node.jobs",),  # what a command does on a rank
    ("node.__main__",),  # one rank's life: a job from the table
)


def layer_of(module: str, layers=LAYERS) -> tuple[int, str] | None:
    """(layer, package) of a module; None for a package root."""
    for level, packages in enumerate(layers):
        for package in packages:
            if module == package or module.startswith(package + "."):
                return level, package
    return None


def test_each_module_lives_in_a_layer_and_imports_only_down():
    for path in [*ROOT.glob("cluster/**/*.py"), *ROOT.glob("node/**/*.py")]:
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        deps = {d for d in imports(path) if d.startswith("cluster.")}
        if name.startswith("node"):
            wrong = [d for d in deps if not d.startswith("cluster.core")]
            assert not wrong, f"{name} imports {wrong}: node/ may import cluster.core only"
            if name in ("node", "node.__init__"):
                continue
            here = layer_of(name, NODE_LAYERS)
            assert here is not None, f"{name} is in no layer: put it in a package of NODE_LAYERS"
            for d in {d for d in imports(path) if d.startswith("node.")}:
                there = layer_of(d, NODE_LAYERS)
                if there is None or there[1] == here[1]:
                    continue
                assert there[0] < here[0], f"{name} ({here[1]}) imports {d} ({there[1]})"
            continue
        if name == "cluster":
            continue
        here = layer_of(name)
        assert here is not None, f"{name} is in no layer: put it in a package of LAYERS"
        for d in deps:
            there = layer_of(d)
            if there is None or there[1] == here[1]:
                continue
            assert there[0] < here[0], f"{name} (layer {here[1]}) imports {d} (layer {there[1]})"


def test_layers_import_only_down_and_without_a_cycle():
    modules = {}
    for path in [*ROOT.glob("cluster/**/*.py"), *ROOT.glob("node/**/*.py")]:
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        modules[name] = imports(path)
    for name, deps in modules.items():
        if name.startswith("cluster"):
            assert not any(d == "mlx" or d.startswith(("mlx.", "mlx_lm", "node")) for d in deps), (
                name
            )
        else:
            assert not any(d.startswith("paramiko") for d in deps), name
    graph = {
        name: {m for d in deps for m in modules if d == m or d.startswith(m + ".")} - {name}
        for name, deps in modules.items()
    }
    # a package's __init__ may gather its submodules; the edges that matter run between modules
    graph = {n: {d for d in ds if not n.startswith(d + ".")} for n, ds in graph.items()}
    state: dict[str, int] = {}

    def visit(n: str, path: list[str]) -> None:
        state[n] = 1
        for d in sorted(graph[n]):
            assert state.get(d) != 1, "import cycle: " + " -> ".join([*path, n, d])
            if d not in state:
                visit(d, [*path, n])
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n, [])


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


def test_a_sampling_dict_is_every_field_once():
    assert set(to_dict(Sampling())) == {f.name for f in dataclasses.fields(Sampling)}


def test_the_cleanup_fixture_sees_only_the_sessions_own_ranks():
    """A user's own job beside the tests (not below this session) is never ours to kill."""
    from tests.support.processes import descendant_ranks

    tree = {1: [10, 50], 10: [11, 12], 11: [13], 50: [51]}
    cmd = {
        11: "mlx-cluster launch hi",
        12: "python -m node run --spec a.json",
        13: "/v/python -m node run --spec b.json",
        51: "python -m node run --spec users-own.json",  # the user's job, under another parent
    }
    assert sorted(descendant_ranks(10, tree, lambda p: cmd.get(p, ""))) == [12, 13]

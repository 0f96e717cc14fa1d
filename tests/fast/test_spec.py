"""The job spec: its dataclasses, their defaults and options, and what each rank gets."""

import dataclasses

import click
import pytest

from cluster.commands import cli
from cluster.commands.options import HOST, OPTIONS
from cluster.commands.run import job_spec
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
from cluster.job.launcher import rank_launches


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
    launches = rank_launches(
        parse_hostfile({"hosts": [{"ssh": "localhost", "slots": 2}]}), spec, LaunchSettings()
    )
    rank0, rank1 = (JobSpec.from_json(x.spec) for x in launches)
    assert rank0.request.sampling.frequency_penalty == 0.25 and rank0.request.prompt == "hi"
    assert rank1.request == JobRequest() and rank0.ranks_on_host == rank1.ranks_on_host == 2
    assert rank0.world_size == 2


def test_a_sampling_dict_is_every_field_once():
    assert set(to_dict(Sampling())) == {f.name for f in dataclasses.fields(Sampling)}

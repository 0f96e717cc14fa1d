"""Options shared by the commands, each defined once and selected by name (``with_options``).

Defaults come from the dataclasses of ``cluster.core.spec``, so a default lives in one place.
"""

from __future__ import annotations

import dataclasses
import io
import json
import sys
import time
from collections.abc import Callable

import click

from cluster.core import grammar
from cluster.core.backends import BACKENDS
from cluster.core.hostfile import Hostfile, HostfileError, load_hostfile, local_hostfile
from cluster.core.modelcheck import default_draft_path, default_model_path
from cluster.core.params import Param, params
from cluster.core.spec import (
    Constraint,
    Draft,
    JobSpec,
    KVQuant,
    LaunchSettings,
    Sampling,
    ServeSettings,
    Template,
    pick,
)
from cluster.core.text import valid_text
from cluster.job.launcher import LaunchError, run_job

STARTED = time.perf_counter()
MAX_IMAGE_BYTES = 64 * 1024 * 1024


class HostfileParam(click.ParamType):
    """A hostfile path, loaded and validated: its error (file, host, field) is a usage error."""

    name = "hostfile"

    def convert(self, value, param, ctx) -> Hostfile:
        if isinstance(value, Hostfile):
            return value
        try:
            return load_hostfile(value)
        except HostfileError as e:
            self.fail(str(e), param, ctx)


HOSTFILE = HostfileParam()


def resolve_hostfile(
    hostfile: Hostfile | None, num_ranks: int | None, backend: str | None
) -> Hostfile:
    """--hostfile, or -n N ranks on this machine (2 by default, as hostfiles/local.yaml)."""
    if hostfile is not None and num_ranks is not None:
        raise click.UsageError("give either --hostfile or -n/--num-ranks, not both")
    hf = hostfile if hostfile is not None else local_hostfile(num_ranks or 2)
    if backend:
        hf.backend = backend
    return hf


def model_or_default(model: str | None) -> str:
    return model or str(default_model_path())


def run_or_exit(hf: Hostfile, spec: JobSpec, launch: LaunchSettings, stdout=None):
    """Run the job; on failure print its report and exit with its code."""
    try:
        return run_job(hf, spec, launch, stdout=stdout, started=STARTED)
    except LaunchError as e:
        if str(e):
            click.echo(str(e), err=True)
        sys.exit(e.exit_code)


def parse_split(ctx, param, value):
    if value is None:
        return None
    try:
        return [int(x) for x in value.split(",")]
    except ValueError:
        raise click.BadParameter(f"{value!r}: give layer counts like 20,12") from None


def read_tools(ctx, param, path: str | None) -> list | None:
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            # a "\ud800" escape decodes to a lone surrogate: made U+FFFD, as the API refuses it
            tools = json.loads(f.read(), object_hook=valid_strings)
    except (OSError, ValueError) as e:
        raise click.BadParameter(f"{path}: {e}") from None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise click.BadParameter(f"{path}: want a JSON list of tool objects, like OpenAI's `tools`")
    return tools


def valid_strings(obj: dict) -> dict:
    """A JSON object with its keys and string values made valid Unicode (a json hook)."""
    return {
        valid_text(k): [valid_text(x) if isinstance(x, str) else x for x in v]
        if isinstance(v, list)
        else (valid_text(v) if isinstance(v, str) else v)
        for k, v in obj.items()
    }


def names_list(value: str | None) -> list[str]:
    """A comma-separated option as its items (blanks dropped)."""
    return [x.strip() for x in (value or "").split(",") if x.strip()]


def read_image(ctx, param, path: str | None) -> bytes | None:
    if path is None:
        return None
    data = open(path, "rb").read()
    if not data:
        raise click.BadParameter(f"{path} is empty")
    if len(data) > MAX_IMAGE_BYTES:
        raise click.BadParameter(
            f"{path} is {len(data) / 2**20:.0f} MiB; images up to "
            f"{MAX_IMAGE_BYTES // 2**20} MiB are shared with the ranks (scale it down)"
        )
    try:  # fail before any rank starts (PIL comes with mlx-vlm)
        from PIL import Image

        Image.open(io.BytesIO(data)).verify()
    except ImportError:
        pass
    except Exception as e:
        raise click.BadParameter(
            f"{path} is not an image file PIL can read ({type(e).__name__}); "
            "give a PNG, JPEG or another common format"
        ) from None
    return data


def options(cls: type, *names: str, **extra: dict) -> dict:
    """The click options of ``cls``'s fields (cluster.core.params: each declared once on its
    field), by field name; ``names``: only those; ``extra``: a field's click arguments that
    the declaration cannot hold (a file's type, a parsing callback)."""
    made = {}
    for name, (f, p) in params(cls).items():
        if (names and name not in names) or p.flag == "":
            continue
        made[name] = option_of(name, f, p, **extra.get(name, {}))
    return made


def option_of(name: str, f: dataclasses.Field, p: Param, **extra) -> Callable:
    value = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    decls = p.toggle.split("/")[0] if p.toggle and "/" not in p.toggle else p.toggle
    flags = [decls] if decls else [p.flag or "--" + name.replace("_", "-")]
    if flags[0].startswith("-v/"):
        flags = flags[0].split("/")
    kw: dict = {"help": p.help + (f" ({p.range.meaning})" if p.range and p.range.meaning else ""),
                "show_default": p.show_default, "default": value}  # fmt: skip
    if p.toggle and "/" not in p.toggle or (p.toggle or "").startswith("-v/"):
        kw["is_flag"] = True
    if p.metavar:
        kw["metavar"] = p.metavar
    if p.envvar:
        kw["envvar"] = p.envvar
    if p.choices:
        kw["type"] = click.Choice([str(c) for c in p.choices])
        kw["default"] = None if value is None else str(value)
        if all(isinstance(c, int) for c in p.choices):
            kw["callback"] = lambda _ctx, _param, v: None if v is None else int(v)
    elif p.range is not None:
        r = p.range
        kind = click.IntRange if r.integer else click.FloatRange
        kw["type"] = kind(r.low, r.high, min_open=r.low_open)
    if p.multiple:
        kw["multiple"] = True
        kw["default"] = tuple(value or ())
        if p.commas:
            kw["callback"] = lambda _ctx, _param, v: [x for item in v for x in names_list(item)]
        else:
            kw["callback"] = lambda _ctx, _param, v: list(v)
    kw.update(extra)
    return click.option(*flags, name, **kw)


HOST = {
    "hostfile": click.option(
        "--hostfile",
        type=HOSTFILE,
        help="YAML (or mlx.launch JSON) hostfile; default: 2 ranks on this machine.",
    ),
    "num_ranks": click.option(
        "-n",
        "--num-ranks",
        type=click.IntRange(min=1),
        help="Run N ranks on this machine (no hostfile). Default 2.",
    ),
    "backend": click.option(
        "--backend",
        type=click.Choice(list(BACKENDS)),
        default=None,
        help="Collective backend; default: the hostfile's, else ring. "
        + "; ".join(f"{b.name}: {b.help}" for b in BACKENDS.values())
        + ".",
    ),
}
MODEL = {
    "model": click.option(
        "--model",
        default=None,
        metavar="PATH_OR_REPO",
        help="MLX checkpoint directory or Hugging Face repo; default: the tiny "
        "model embedded in mlx-cluster.",
    ),
    **options(JobSpec, "mode", "split", "prefill_step", "blas", split={"callback": parse_split}),
}
LAUNCH = options(LaunchSettings)  # how the launcher runs and watches the ranks
HOST["accept_new_host_keys"] = LAUNCH.pop("accept_new_host_keys")  # every command reaching hosts
SAMPLING = options(Sampling)
TEMPLATE = options(
    Template, tools={"type": click.Path(exists=True, dir_okay=False), "callback": read_tools}
)
SERVE = {**options(ServeSettings), **options(JobSpec, "measure_links", "micro_batches")}
KV = options(KVQuant)  # a quantized KV cache
DRAFT = options(Draft)  # speculative decoding
DISK = options(JobSpec, "prompt_cache_disk_gb", "prompt_cache_dir")  # the disk tier
CACHE = {**options(JobSpec, "prompt_cache_gb"), **DISK}  # chat's and serve's prompt cache


def read_schema(ctx, param, path: str | None) -> str | None:
    """--json-schema FILE: the grammar of the JSON that schema allows (checked here)."""
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return grammar.json_schema(f.read())
    except OSError as e:
        raise click.BadParameter(f"{path}: {e.strerror or e}") from None
    except grammar.BadGrammar as e:
        raise click.BadParameter(f"{path}: {e}") from None


def read_regex(ctx, param, pattern: str | None) -> str | None:
    if pattern is None:
        return None
    try:
        return grammar.regex(pattern)
    except grammar.BadGrammar as e:
        raise click.BadParameter(str(e)) from None


CONSTRAIN = {  # JobRequest.constraint
    "json_schema": click.option(
        "--json-schema",
        type=click.Path(exists=True, dir_okay=False),
        callback=read_schema,
        help="JSON schema file: every answer is JSON that follows it, decoded under its "
        "grammar on every rank (llguidance). Keys come in the schema's order.",
    ),
    "regex": click.option(
        "--regex",
        callback=read_regex,
        help="Every answer matches this regular expression (decoded under it on every rank).",
    ),
}


OPTIONS = {**HOST, **MODEL, **LAUNCH, **SAMPLING, **TEMPLATE, **SERVE, **DRAFT, **KV, **CACHE,
           **CONSTRAIN}  # fmt: skip


def with_options(*names: str):
    """Decorate a command with the named shared options, in this order."""

    def apply(f):
        for name in reversed(names):
            f = OPTIONS[name](f)
        return f

    return apply


def job_options(f):
    """What every command that runs a job takes: hosts, model, how to launch."""
    return with_options(*HOST, *MODEL, *LAUNCH, *DRAFT, *KV, *DISK)(f)


def draft_of(values: dict) -> Draft:
    """--draft-model, --num-draft-tokens, --prompt-lookup (one proposer at most)."""
    draft = pick(Draft, values)
    if draft.draft_model and draft.prompt_lookup:
        raise click.UsageError("--draft-model and --prompt-lookup: choose one proposer")
    if draft.draft_model == "default":
        draft.draft_model = str(default_draft_path())
    return draft


def constraint_of(values: dict) -> Constraint | None:
    """--json-schema or --regex (one of them) as the request's constraint."""
    schema, pattern = values.pop("json_schema", None), values.pop("regex", None)
    if schema is not None and pattern is not None:
        raise click.UsageError("--json-schema and --regex: choose one")
    if schema is None and pattern is None:
        return None
    return Constraint(grammar=schema or pattern, source="--json-schema" if schema else "--regex")


def sampling_options(f):
    return with_options(*SAMPLING, *TEMPLATE, *CONSTRAIN)(f)

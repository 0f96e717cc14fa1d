"""The real agents against a live 2-rank serve, in each mode: Claude Code (``claude -p``), Codex
CLI (``codex exec``) and OpenCode (``opencode run``, an openai-compatible provider), the
releases from the npm registry, and Aider (``aider --message``, from PyPI, in a venv of its
own), which .ci/run installs (skipped, saying so, where they are missing). Each answers a
one-shot question, and each that has tools (all but Aider) does a turn whose output is a tool
call: the agent runs its own shell tool and sends the result back, and the next turn answers
from it. The model is tests/support/agentmodel.py (it calls each agent's own shell
tool). Consecutive Claude-Code-shaped turns share their prompt's start in the prompt cache,
its billing line dropped."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.agentmodel import ANSWER, COMMAND, OUTPUT, PRINTED, QUESTION, RUN
from tests.support.processes import ROOT
from tests.support.serving import Served

AGENTS_DIR = Path(
    os.environ.get("MLX_CLUSTER_AGENTS", Path.home() / ".cache" / "mlx-cluster-agents")
)
BIN = AGENTS_DIR / "node_modules" / ".bin"
QUIET = {  # no telemetry, update check or other traffic: the rig has no internet
    "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1", "DISABLE_ERROR_REPORTING": "1",
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "NO_COLOR": "1",
}  # fmt: skip


def agent(name: str) -> str:
    path = AGENTS_DIR / "aider" / "bin" / "aider" if name == "aider" else BIN / name
    if not path.exists():
        pytest.skip(f"{name} is not installed in {AGENTS_DIR} (.ci/run installs the agents: "
                    "npm install --prefix ~/.cache/mlx-cluster-agents "
                    "@anthropic-ai/claude-code @openai/codex opencode-ai, and "
                    "aider-chat in a venv at ~/.cache/mlx-cluster-agents/aider)")  # fmt: skip
    return str(path)


@pytest.fixture(scope="session")
def agent_model(tmp_path_factory):
    """Trained in a subprocess, with OpenBLAS as ranks have it (seconds, not a minute)."""
    from cluster.core.blas import blas_env

    out = tmp_path_factory.mktemp("agentmodel") / "am"
    env = {**os.environ}
    env.update(blas_env("auto", 1, env, sys.platform, os.cpu_count()) or {})
    subprocess.run([sys.executable, "-m", "tests.support.agentmodel", str(out)], env=env,
                   check=True, timeout=600, cwd=ROOT)  # fmt: skip
    return out


@pytest.fixture(scope="module", params=["pipeline", "tensor"])
def served(request, agent_model):
    # Claude Code asks for max_tokens 128000 under its own model names: the door lowers it
    # to --max-tokens-cap, rank 0 to what the context leaves
    server = Served(agent_model, "--mode", request.param, "--served-model-name", "claude-*")
    yield server
    server.stop_clean()


@pytest.fixture(autouse=True)
def no_stray_ranks():  # the server's ranks live for the module; checked when it stops
    yield


def claude(served, tmp_path, *args: str, model: str | None = "am") -> dict:
    """Claude Code, headless, against ``served``; ``model`` None: its own model names (the
    server answers to claude-*)."""
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    url = f"http://127.0.0.1:{served.port}"
    env = {**os.environ, **QUIET, "HOME": str(home), "ANTHROPIC_API_KEY": "none",
           "ANTHROPIC_BASE_URL": url}  # fmt: skip
    for name in ("ANTHROPIC_MODEL", "ANTHROPIC_SMALL_FAST_MODEL"):
        env.pop(name, None)
    if model is not None:
        env["ANTHROPIC_MODEL"] = model
    p = subprocess.run([agent("claude"), "-p", *args, "--output-format", "json"],
                       capture_output=True, text=True, env=env, cwd=tmp_path,
                       timeout=300)  # fmt: skip
    assert p.returncode == 0, (p.stdout[-2000:], p.stderr[-2000:])
    result = json.loads(p.stdout)
    assert not result["is_error"] and result["api_error_status"] is None, result
    return result


def codex(served, tmp_path, prompt: str) -> str:
    home = tmp_path / "codex-home"
    home.mkdir(exist_ok=True)
    (home / "config.toml").write_text(
        'model = "am"\nmodel_provider = "local"\n\n[model_providers.local]\nname = "local"\n'
        f'base_url = "http://127.0.0.1:{served.port}/v1"\nwire_api = "responses"\n'
        'env_key = "LOCAL_KEY"\n'
    )
    env = {**os.environ, **QUIET, "HOME": str(tmp_path), "CODEX_HOME": str(home),
           "LOCAL_KEY": "none"}  # fmt: skip
    p = subprocess.run(
        [agent("codex"), "exec", "--skip-git-repo-check",
         "--dangerously-bypass-approvals-and-sandbox", "--output-last-message",
         str(tmp_path / "last.txt"), prompt],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)  # fmt: skip
    assert p.returncode == 0, (p.stdout[-2000:], p.stderr[-2000:])
    assert "ERROR" not in p.stdout + p.stderr, p.stdout + p.stderr
    return (tmp_path / "last.txt").read_text().strip()


def opencode(served, tmp_path, prompt: str) -> list[dict]:
    """OpenCode, headless (its JSON events), with serve as an openai-compatible provider;
    its own state in ``tmp_path``, nothing fetched from the internet."""
    config = {"$schema": "https://opencode.ai/config.json", "model": "mlx/am",
              "share": "disabled", "autoupdate": False,
              "provider": {"mlx": {"npm": "@ai-sdk/openai-compatible", "name": "mlx-cluster",
                                   "options": {"baseURL": f"http://127.0.0.1:{served.port}/v1",
                                               "apiKey": "none"},
                                   "models": {"am": {"name": "am"}}}}}  # fmt: skip
    env = {**os.environ, **QUIET, "HOME": str(tmp_path), "OPENCODE_CONFIG_CONTENT":
           json.dumps(config), **{f"OPENCODE_DISABLE_{k}": "1" for k in ("MODELS_FETCH",
           "AUTOUPDATE", "SHARE", "LSP_DOWNLOAD", "CLAUDE_CODE", "DEFAULT_PLUGINS")},
           **{f"XDG_{k}_HOME": str(tmp_path / k.lower()) for k in ("DATA", "CONFIG",
           "CACHE", "STATE")}}  # fmt: skip
    p = subprocess.run([agent("opencode"), "run", "--format", "json", "--auto", prompt],
                       capture_output=True, text=True, env=env, cwd=tmp_path,
                       timeout=300)  # fmt: skip
    assert p.returncode == 0, (p.stdout[-2000:], p.stderr[-2000:])
    events = [json.loads(line) for line in p.stdout.splitlines() if line.strip()]
    assert not [e for e in events if e["type"] == "error"], events
    return events


def aider(served, tmp_path, prompt: str) -> str:
    """Aider, one message, no git, against serve as an OpenAI-compatible model; it sends no
    max_tokens (serve's default: what the context leaves)."""
    env = {**os.environ, **QUIET, "HOME": str(tmp_path), "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    p = subprocess.run(
        [agent("aider"), "--message", prompt, "--model", "openai/am", "--openai-api-base",
         f"http://127.0.0.1:{served.port}/v1", "--openai-api-key", "none", "--no-git",
         "--yes-always", "--no-show-model-warnings", "--no-check-update",
         "--analytics-disable", "--no-pretty", "--no-fancy-input", "--map-tokens", "0"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)  # fmt: skip
    assert p.returncode == 0, (p.stdout[-2000:], p.stderr[-2000:])
    assert "token limit" not in p.stdout, p.stdout
    return p.stdout


def test_claude_code_answers_a_one_shot_prompt(served, tmp_path):
    result = claude(served, tmp_path, QUESTION)
    assert result["result"] == ANSWER and result["num_turns"] == 1, result


def test_claude_code_with_its_own_model_names_is_answered_by_the_served_model(served, tmp_path):
    """No ANTHROPIC_MODEL, no ANTHROPIC_SMALL_FAST_MODEL: Claude Code asks for claude-*
    names, which serve --served-model-name 'claude-*' answers with the served model."""
    result = claude(served, tmp_path, QUESTION, model=None)
    assert result["result"] == ANSWER and result["num_turns"] == 1, result
    assert any(name.startswith("claude-") for name in result.get("modelUsage", {})), result


def test_claude_code_runs_the_tool_the_model_calls_and_answers_from_it(served, tmp_path):
    result = claude(served, tmp_path, RUN, "--allowedTools", "Bash(echo:*)")
    assert result["num_turns"] == 2, result  # the call, then the answer from its output
    assert result["result"] == PRINTED, result
    assert result["permission_denials"] == [], result


def test_codex_answers_a_one_shot_prompt(served, tmp_path):
    assert codex(served, tmp_path, QUESTION) == ANSWER


def test_codex_runs_the_tool_the_model_calls_and_answers_from_it(served, tmp_path):
    assert codex(served, tmp_path, RUN) == PRINTED
    assert shutil.which("bash")  # what Codex ran the command with
    assert COMMAND.endswith(OUTPUT)


@pytest.mark.parametrize("family", ["qwen2", "qwen3_5"])
def test_claude_code_shaped_turns_share_their_prompt_in_the_cache(models, tmp_path, family):
    """Two turns as Claude Code sends them (a billing line first in ``system``, new each
    request, then a long system prompt; the second turn repeats the first and adds to it), on a
    model whose template renders the system prompt: the second reads >= 90% of the first's
    prompt from the prompt cache (it read 48 of 612 with the billing line kept). Qwen3.5's
    linear attention cannot be cut back: its second turn starts from the first prompt's
    snapshot (issue 63)."""
    from tests.support.tiny import make_model

    anthropic = pytest.importorskip("anthropic")
    model = models["qwen2"] if family == "qwen2" else make_model(
        tmp_path / family, family, seed=1, chat_template=True)  # fmt: skip
    server = Served(model)
    try:
        client = anthropic.Anthropic(base_url=f"http://127.0.0.1:{server.port}", api_key="x",
                                     max_retries=0)  # fmt: skip
        guide = " ".join(f"Rule {i}: answer briefly and cite the file you read." for i in range(40))

        def turn(n: int, messages: list) -> object:
            billing = (f"x-anthropic-billing-header: cc_version=2.1.332; cc_entrypoint=cli; "
                       f"cch={n:05x}{os.urandom(4).hex()};")  # fmt: skip
            system = [
                {"type": "text", "text": billing},
                {"type": "text", "text": guide, "cache_control": {"type": "ephemeral"}},
            ]
            return client.messages.create(model=model.name, max_tokens=8, system=system,
                                          messages=messages,
                                          extra_body={"temperature": 0})  # fmt: skip

        first = [{"role": "user", "content": "Tell me about lists"}]
        one = turn(1, first)
        prompt_one = one.usage.input_tokens + one.usage.cache_read_input_tokens
        assert prompt_one > 300, one.usage
        second = [*first, {"role": "assistant", "content": one.content[0].text},
                  {"role": "user", "content": "And tuples?"}]  # fmt: skip
        two = turn(2, second)
        print(f"\n{family}: second turn read {two.usage.cache_read_input_tokens} of the first's "
              f"{prompt_one} prompt tokens from the cache")  # fmt: skip
        assert two.usage.cache_read_input_tokens >= 0.9 * prompt_one, (one.usage, two.usage)
    finally:
        assert server.stop() == 0


def test_opencode_answers_a_one_shot_prompt(served, tmp_path):
    texts = [e["part"]["text"] for e in opencode(served, tmp_path, QUESTION) if e["type"] == "text"]
    assert texts == [ANSWER]


def test_opencode_runs_the_tool_the_model_calls_and_answers_from_it(served, tmp_path):
    events = opencode(served, tmp_path, RUN)
    (use,) = [e["part"] for e in events if e["type"] == "tool_use"]
    assert use["tool"] == "bash" and use["state"]["input"]["command"] == COMMAND
    assert use["state"]["status"] == "completed" and use["state"]["output"].strip() == OUTPUT
    assert [e["part"]["text"] for e in events if e["type"] == "text"] == [PRINTED]


def test_aider_answers_a_one_shot_prompt(served, tmp_path):
    assert ANSWER in aider(served, tmp_path, QUESTION).splitlines()

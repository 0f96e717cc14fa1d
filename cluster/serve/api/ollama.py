"""Ollama's API (/api/chat, /api/generate, /api/tags, /api/show, /api/ps, /api/version), for
the tools that talk to local models through it (VS Code's Copilot, Open WebUI, the ``ollama``
clients).

A request becomes the OpenAI chat (or completions) body it means and is checked by that
dialect (cluster/serve/api/openai.py): ``options`` map onto the same sampling settings
(``num_predict`` is max_tokens, ``repeat_penalty`` and ``repeat_last_n`` mlx-lm's repetition
penalty and its window; ``num_ctx``, ``num_thread``, ``mirostat`` and other settings of
Ollama's own runner do not apply here and are ignored), ``format`` ("json" or a JSON schema)
is a response_format, ``think`` the template's switch (or reasoning_effort), tools and tool
calls are OpenAI's with the arguments as objects. Answers stream as Ollama does, one JSON
object per line (streaming is Ollama's default), and end with its counts and durations in
nanoseconds. Errors are ``{"error": "..."}``, which the ``ollama`` client raises as
ResponseError with the status.
"""

from __future__ import annotations

import json
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from cluster.core.protocol import Piece, ToolCall
from cluster.core.spec import ServeRequest
from cluster.serve.api.openai import ChatCompletions, Completions
from cluster.serve.api.shared import Answer, ApiRequest, Door, RequestError, check_object

VERSION = "0.12.6"  # the Ollama API this dialect follows (clients check a minimum version)
OPTIONS = {  # Ollama's options -> OpenAI's body fields
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
    "seed": "seed", "stop": "stop", "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty", "repeat_penalty": "repetition_penalty",
}  # fmt: skip


def served_name(body: dict, door: Door) -> dict:
    """``model`` as Ollama's clients write it: ``name:latest`` is ``name``."""
    model = body.get("model")
    if isinstance(model, str) and model.endswith(":latest") and not door.serves(model):
        return {**body, "model": model.removesuffix(":latest")}
    return body


def options(body: dict) -> dict:
    """Ollama's ``options`` as OpenAI's sampling fields."""
    given = body.get("options") or {}
    if not isinstance(given, dict):
        raise RequestError(400, "'options' must be an object")
    out = {ours: given[theirs] for theirs, ours in OPTIONS.items() if given.get(theirs) is not None}
    predict = given.get("num_predict")
    if predict is not None:
        if isinstance(predict, bool) or not isinstance(predict, int):
            raise RequestError(400, "'options.num_predict' must be an integer")
        if predict > 0:  # -1 (no limit) and -2 (fill the context): what the context leaves
            out["max_tokens"] = predict
    last = given.get("repeat_last_n")
    if isinstance(last, int) and not isinstance(last, bool) and last > 0:
        out["repetition_context_size"] = last
    return out


def response_format(value: Any) -> dict | None:
    if value in (None, ""):
        return None
    if value == "json":
        return {"type": "json_object"}
    if isinstance(value, dict):
        return {"type": "json_schema", "json_schema": {"name": "format", "schema": value}}
    raise RequestError(400, "'format' must be \"json\" or a JSON schema")


def thinking(value: Any) -> dict:
    if value is None:
        return {}
    if isinstance(value, bool):
        return {"chat_template_kwargs": {"enable_thinking": value}}
    if value in ("low", "medium", "high"):
        return {"reasoning_effort": value}
    raise RequestError(400, "'think' must be a boolean or low, medium or high")


def chat_messages(messages: Any) -> list:
    """Ollama's messages as OpenAI's: tool calls' arguments objects, a tool result's
    ``tool_name``, an assistant's ``thinking``; images are refused (text models only)."""
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "'messages' must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise RequestError(400, f"'messages[{i}]' must be an object")
        if m.get("images"):
            raise RequestError(400, f"'messages[{i}].images': images are not supported here "
                                    "(text models only)")  # fmt: skip
        one: dict[str, Any] = {"role": m.get("role"), "content": m.get("content") or ""}
        if m.get("tool_calls"):
            calls = m["tool_calls"]
            if not isinstance(calls, list):
                raise RequestError(400, f"'messages[{i}].tool_calls' must be a list")
            one["tool_calls"] = [
                {"type": "function", "function": c.get("function")} if isinstance(c, dict)
                else c for c in calls
            ]  # fmt: skip
        if isinstance(m.get("thinking"), str):
            one["reasoning_content"] = m["thinking"]
        if isinstance(m.get("tool_name"), str):
            one["name"] = m["tool_name"]
        out.append(one)
    return out


def common(body: dict) -> dict:
    """The fields /api/chat and /api/generate share, as OpenAI's."""
    out = {"model": body.get("model"), **options(body), **thinking(body.get("think"))}
    if (fmt := response_format(body.get("format"))) is not None:
        out["response_format"] = fmt
    return out


def nanoseconds(seconds: float) -> int:
    return int(seconds * 1e9)


def created_at() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def final_counts(req: ApiRequest, result: dict) -> dict:
    """Ollama's counts and durations (ns) of an ended answer."""
    usage = result.get("usage") or {}
    timings = result.get("timings") or {}
    prompt_s, decode_s = (
        timings.get("prompt_ms", 0.0) / 1000,
        timings.get("predicted_ms", 0.0) / 1000,
    )
    return {
        "done_reason": "length" if result.get("finish_reason") == "length" else "stop",
        "total_duration": nanoseconds(time.monotonic() - req.arrived),
        "load_duration": 0,
        "prompt_eval_count": usage.get("prompt_tokens", 0),
        "prompt_eval_duration": nanoseconds(prompt_s),
        "eval_count": usage.get("completion_tokens", 0),
        "eval_duration": nanoseconds(decode_s),
    }


def ollama_call(call: ToolCall) -> dict:
    try:
        arguments = json.loads(call.arguments)
    except ValueError:
        arguments = {"arguments": call.arguments}
    return {"function": {"name": call.name, "arguments": arguments}}


def error_body(e: RequestError) -> dict:
    return {"error": str(e)}


class OllamaEndpoint:
    """What Ollama's two answering routes share: streamed unless told ``"stream": false``
    (the HTTP server reads ``streams``), their stream, their error shape."""

    streams = True
    kind = ""
    any_content_type = True  # Ollama reads the body as JSON whatever it is labelled (curl -d)

    def events(self, req: ApiRequest) -> OllamaStream:
        return OllamaStream(req, self.kind)

    def error_body(self, e: RequestError) -> dict:
        return error_body(e)

    def echo(self, body: dict) -> dict:
        return {}


class OllamaChat(OllamaEndpoint):
    """POST /api/chat."""

    kind = "chat"

    def parse(self, body: Any, door: Door) -> ServeRequest:
        body = served_name(check_object(body), door)
        openai_body = {**common(body), "messages": chat_messages(body.get("messages"))}
        if body.get("tools") is not None:
            openai_body["tools"] = body["tools"]
        return ChatCompletions().parse(openai_body, door)

    def reply(self, req: ApiRequest, answer: Answer) -> dict:
        message: dict[str, Any] = {"role": "assistant", "content": answer.content}
        if answer.reasoning:
            message["thinking"] = answer.reasoning
        if answer.tool_calls:
            message["tool_calls"] = [ollama_call(c) for c in answer.tool_calls]
        return {"model": req.model, "created_at": created_at(), "message": message,
                "done": True, **final_counts(req, answer.result)}  # fmt: skip


class OllamaGenerate(OllamaEndpoint):
    """POST /api/generate: ``prompt`` (and ``system``) through the chat template, or as it is
    with ``raw``."""

    kind = "generate"

    def parse(self, body: Any, door: Door) -> ServeRequest:
        body = served_name(check_object(body), door)
        for name in ("suffix", "template", "context", "images"):
            if body.get(name):
                raise RequestError(400, f"'{name}' is not supported by this server")
        prompt = body.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise RequestError(400, "'prompt' must be a non-empty string")
        if body.get("raw"):
            return Completions().parse({**common(body), "prompt": prompt}, door)
        messages = [{"role": "user", "content": prompt}]
        if isinstance(body.get("system"), str):
            messages.insert(0, {"role": "system", "content": body["system"]})
        return ChatCompletions().parse({**common(body), "messages": messages}, door)

    def reply(self, req: ApiRequest, answer: Answer) -> dict:
        out = {"model": req.model, "created_at": created_at(), "response": answer.content,
               "done": True, **final_counts(req, answer.result)}  # fmt: skip
        if answer.reasoning:
            out["thinking"] = answer.reasoning
        return out


class OllamaStream:
    """One JSON object per line (``ndjson``): each piece of text, each tool call, then the
    end with its counts; a failure mid-answer is ``{"error": ...}``."""

    done = b""
    keepalive = b""  # a blank line is not JSON to Ollama's clients: nothing is sent
    ndjson = True

    def __init__(self, req: ApiRequest, kind: str):
        self.req = req
        self.kind = kind

    def chunk(self, text: str = "", channel: str = "content", **more) -> tuple:
        out: dict[str, Any] = {"model": self.req.model, "created_at": created_at()}
        if self.kind == "chat":
            key = "thinking" if channel == "reasoning" else "content"
            out["message"] = {"role": "assistant", "content": "", key: text, **more}
        else:
            out["response"] = "" if channel == "reasoning" else text
            if channel == "reasoning":
                out["thinking"] = text
        return None, {**out, "done": False}

    def start(self):
        return []

    def piece(self, piece: Piece):
        if piece.text:
            yield self.chunk(piece.text, piece.channel)

    def tool_call(self, call: ToolCall):
        if self.kind == "chat":
            yield self.chunk(tool_calls=[ollama_call(call)])

    def end(self, answer: Answer):
        _, last = self.chunk()
        yield None, {**last, "done": True, **final_counts(self.req, answer.result)}

    def fail(self, e: RequestError):
        yield None, error_body(e)


def is_ollama(path: str) -> bool:
    return path.startswith("/api/")


class ModelCard:
    """What Ollama's /api/tags, /api/show and /api/ps say of the served model, read from the
    launcher's copy of its config (when it has one): its family, context and capabilities,
    which clients (VS Code's Copilot) read to decide what to send."""

    def __init__(self, model_id: str, model: str):
        self.name = model_id
        path = Path(model).expanduser()
        config = read_json(path / "config.json")
        tokenizer = read_json(path / "tokenizer_config.json")
        template = str(tokenizer.get("chat_template") or "")
        if (path / "chat_template.jinja").exists():
            template += (path / "chat_template.jinja").read_text(errors="replace")
        text = config.get("text_config") or config
        self.family = str(config.get("model_type") or "unknown")
        self.context = text.get("max_position_embeddings") or config.get("max_position_embeddings")
        self.size = (
            sum(f.stat().st_size for f in path.glob("*.safetensors")) if path.is_dir() else 0
        )
        quant = config.get("quantization") or {}
        self.quantization = (
            f"{quant['bits']}-bit" if isinstance(quant, dict) and "bits" in quant else ""
        )
        self.capabilities = ["completion"]
        if "tools" in template:
            self.capabilities.append("tools")
        if "<think>" in template or "enable_thinking" in template or "reasoning" in template:
            self.capabilities.append("thinking")
        if "vision_config" in config:
            self.capabilities.append("vision")
        self.template = template

    def details(self) -> dict:
        return {"parent_model": "", "format": "safetensors", "family": self.family,
                "families": [self.family], "parameter_size": "",
                "quantization_level": self.quantization}  # fmt: skip

    def entry(self) -> dict:
        return {"name": self.name, "model": self.name, "modified_at": created_at(),
                "size": self.size, "digest": "", "details": self.details()}  # fmt: skip

    def tags(self) -> dict:
        return {"models": [self.entry()]}

    def ps(self) -> dict:
        far = "9999-12-31T23:59:59Z"  # serve keeps the model loaded until it stops
        return {"models": [{**self.entry(), "expires_at": far, "size_vram": self.size,
                            "context_length": self.context}]}  # fmt: skip

    def show(self, body: Any, door: Door) -> dict:
        body = served_name(check_object(body), door)
        name = body.get("model", body.get("name"))
        if not isinstance(name, str) or not door.serves(name):
            raise RequestError(404, f"model {str(name)[:200]!r} not found; this server serves "
                                    f"{self.name!r}", "not_found_error")  # fmt: skip
        info: dict[str, Any] = {"general.architecture": self.family}
        if self.context:
            info[f"{self.family}.context_length"] = self.context
        return {"modelfile": "", "parameters": "", "template": self.template,
                "details": self.details(), "model_info": info,
                "capabilities": self.capabilities, "modified_at": created_at()}  # fmt: skip


def read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}

"""Ollama's command lines: its server's settings and the clients that make it load. Pure.

Ollama's server (`ollama serve`, `ollama.service`) loads a model only when a
client asks, into its own process: the footprint is the server's, the client
only names the model.

- `server_settings(argv, env, home=...)`: the server's unit. Its argv (through
  shell.first_command: env/nice/`sh -c`) must be `ollama serve` (or its alias
  `ollama start`); its Environment= gives OLLAMA_MODELS, OLLAMA_CONTEXT_LENGTH,
  OLLAMA_NUM_PARALLEL, OLLAMA_FLASH_ATTENTION, OLLAMA_KV_CACHE_TYPE,
  OLLAMA_MAX_LOADED_MODELS, OLLAMA_GPU_OVERHEAD and OLLAMA_HOST, read as
  Ollama's envconfig reads them (spaces and quotes trimmed; a number that does
  not parse is Ollama's default, as Ollama itself does, and a note says so; one
  past any real value, such as more than MAX_PARALLEL sequences, is an
  OllamaError). Without OLLAMA_MODELS the models are in `$HOME/.ollama/models`:
  HOME from the unit's Environment=, else `home`, the service user's home from
  passwd, which only the caller can look up (PACKAGED_HOME, /usr/share/ollama,
  for the packaged `ollama.service`, which runs as user `ollama`).
  -> OllamaServer, or None for anything else.
- `client_loads(argv, env)` / `client_load(argv, env)`: a unit (ExecStart=,
  ExecStartPost=) that makes the server load: `ollama run MODEL [PROMPT]
  [--keepalive D]`, or curl/wget posting JSON with a "model" to /api/generate,
  /api/chat, /api/embed(dings) or the OpenAI-style /v1/ endpoints; every
  command of a `sh -c` script is looked at (`sleep 20; curl ...`, split by
  shell.commands). The body comes from -d/--data/--data-raw/--data-binary/--json
  (curl) or --post-data/--body-data (wget), bounded; a body from a file (`-d @f`,
  --post-file) is not read, and the load says so (model None). A request with
  keep_alive 0 and no prompt unloads: not a load. -> OllamaLoad(s).
- `serves(server, load)`: whether that client asks that server.
- `parse_reference(text)`: `name[:tag]`, `namespace/name[:tag]`,
  `host/namespace/name[:tag]` by Ollama's own grammar (types/model/name.go:
  each part's charset and length; no "/" or ".." can get in) ->
  `manifests/<host>/<namespace>/<name>/<tag>` under the models directory.

OllamaError (a SpecError) names the variable or field for values that make no
load (a bad model name, a body that is not JSON, a relative OLLAMA_MODELS).
Reading the manifest and the model, and the footprint, are foresight/ollama.py's.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from ..text import quoted
from .loadspec import SpecError
from .shell import commands, first_command

GiB = 1 << 30

# The default context: 2048 until v0.6.7 (April 2025, "config: update default context
# length to 4096"), 4096 until v0.15.5, and since then a tier by the GPU memory (server
# /routes.go, Serve: "vram-based default context"; docs/context-length.mdx: "< 24 GiB VRAM:
# 4k context, 24-48 GiB: 32k, >= 48 GiB: 256k"), with 47/23 GiB as the thresholds in the
# code. OLLAMA_CONTEXT_LENGTH (envconfig.ContextLength, default 0: the tier) replaces it.
# On a unified-memory machine the GPU's memory is the whole pool: a DGX Spark gets 262144,
# capped at each model's trained context.
DEFAULT_CONTEXT = ((47 * GiB, 262144), (23 * GiB, 32768), (0, 4096))


DEFAULT_NUM_PARALLEL = 1  # envconfig.NumParallel since v0.9.6 ("Reduce default parallelism to 1")


DEFAULT_ADDRESS = "127.0.0.1:11434"  # envconfig.Host


PACKAGED_HOME = "/usr/share/ollama"  # install.sh: useradd -r -m -d /usr/share/ollama ollama


PACKAGED_USER = "ollama"


DEFAULT_HOST = "registry.ollama.ai"  # types/model/name.go DefaultName


DEFAULT_NAMESPACE = "library"


DEFAULT_TAG = "latest"


MAX_BODY = 64 << 10  # a request body in a command line


MAX_REFERENCE = 600  # a model reference: 350 (host) + 3 x 80 + separators


MAX_TOKENS = 1 << 32  # a context length past any model's


MAX_PARALLEL = 256  # sequences: llama.cpp's LLAMA_MAX_SEQ (64 in older builds)


_UINT = re.compile(r"[0-9]{1,20}")  # strconv.ParseUint(s, 10, 64): digits only, no sign


_GO_TRUE = ("1", "t", "T", "TRUE", "true", "True")  # strconv.ParseBool


_GO_FALSE = ("0", "f", "F", "FALSE", "false", "False")


_DIGEST = re.compile(r"sha256[:-]([0-9a-fA-F]{64})")  # manifest.BlobsPath


_DURATION_PART = re.compile(r"(\d+\.?\d*|\.\d+)(ns|us|\u00b5s|\u03bcs|ms|s|m|h)")


_DURATION_UNIT = {
    "ns": 1e-9,
    "us": 1e-6,
    "\u00b5s": 1e-6,
    "\u03bcs": 1e-6,
    "ms": 1e-3,
    "s": 1.0,
    "m": 60.0,
    "h": 3600.0,
}


ENDPOINTS = {
    "/api/generate": "generate",
    "/api/chat": "chat",
    "/api/embed": "embed",
    "/api/embeddings": "embed",
    "/v1/chat/completions": "openai",
    "/v1/completions": "openai",
    "/v1/embeddings": "openai",
}


class OllamaError(SpecError):
    """A setting, model reference or request that makes no load; str() names it."""


def _var(env: Mapping[str, str], key: str) -> str:
    """envconfig.Var: the value with spaces, then quotes, trimmed."""
    return env.get(key, "").strip().strip("\"'")


@dataclass(frozen=True)
class OllamaServer:
    binary: str
    models: str | None  # the models directory; None: not known (then `models_rule` says why)
    models_rule: str
    context_length: int | None  # OLLAMA_CONTEXT_LENGTH; None (or 0 given): Ollama's default
    num_parallel: int = DEFAULT_NUM_PARALLEL
    flash_attention: str = "auto"  # "on", "off" (OLLAMA_FLASH_ATTENTION given) or "auto"
    kv_cache_type: str = ""  # OLLAMA_KV_CACHE_TYPE, lowercased; "": f16
    max_loaded_models: int = 0  # 0: MODELS_PER_GPU per GPU
    gpu_overhead: int = 0  # OLLAMA_GPU_OVERHEAD, bytes kept free per GPU
    address: str = DEFAULT_ADDRESS  # host:port it listens on (OLLAMA_HOST)
    notes: tuple[str, ...] = ()


def _uint(env: Mapping[str, str], key: str, default: int, notes: list[str], cap: int) -> int:
    raw = _var(env, key)
    if not raw:
        return default
    if len(raw) > 20 or not _UINT.fullmatch(raw) or int(raw) >= 1 << 64:
        notes.append(f"{key} {quoted(raw)}: not a number; Ollama uses its default, {default}")
        return default
    value = int(raw)
    if value > cap:
        raise OllamaError(f"{key} {quoted(raw)}: must be at most {cap}")
    return value


def models_dir(env: Mapping[str, str], home: str | None) -> tuple[str | None, str]:
    """(the models directory or None, whence): OLLAMA_MODELS, else $HOME/.ollama/models, HOME
    from the unit's Environment= or else `home` (the service user's, from passwd)."""
    models = _var(env, "OLLAMA_MODELS")
    if models:
        if not os.path.isabs(models):
            raise OllamaError(f"OLLAMA_MODELS {quoted(models)}: not an absolute path")
        return models, "OLLAMA_MODELS"
    for where, value in (("HOME", env.get("HOME", "")), ("the service user's home", home or "")):
        if value:
            if not os.path.isabs(value):
                raise OllamaError(f"{where} {quoted(value)}: not an absolute path")
            return os.path.join(value, ".ollama", "models"), f"~/.ollama/models of {value}"
    return None, "no OLLAMA_MODELS, and the service user's home is not known"


def host_address(raw: str, *, connect: bool = False) -> str:
    """envconfig.Host as 'host:port' (OLLAMA_HOST; default 127.0.0.1:11434). `connect`: the
    address a client dials (ConnectableHost: 0.0.0.0 and :: are the loopback)."""
    s = raw.strip().strip("\"'")
    scheme, sep, hostport = s.partition("://")
    default_port = "11434"
    if not sep:
        scheme, hostport = "http", s
    elif scheme == "http":
        default_port = "80"
    elif scheme == "https":
        default_port = "443"
    hostport = hostport.split("/", 1)[0]
    host, port = _split_host_port(hostport)
    if host is None:
        host, port = "127.0.0.1", default_port
        bare = hostport.strip("[]")
        if bare:
            host = bare
    if not (port.isascii() and port.isdigit()) or int(port) > 65535:
        port = default_port
    if connect and host in ("0.0.0.0", "::"):
        host = "127.0.0.1" if host == "0.0.0.0" else "::1"
    return _join(host, port)


def _split_host_port(hostport: str) -> tuple[str | None, str]:
    """net.SplitHostPort: (host, port), or (None, "") when there is no port."""
    if hostport.startswith("["):
        end = hostport.find("]")
        if end < 0 or not hostport[end + 1 :].startswith(":"):
            return None, ""
        return hostport[1:end], hostport[end + 2 :]
    host, sep, port = hostport.rpartition(":")
    if not sep or ":" in host:
        return None, ""
    return host, port


def _join(host: str, port: str) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def server_settings(
    argv: Sequence[str], env: Mapping[str, str] | None = None, *, home: str | None = None
) -> OllamaServer | None:
    """The settings of `ollama serve` (argv and the unit's Environment=); None for anything
    else. `home`: the service user's home from passwd (PACKAGED_HOME for the packaged unit),
    where the models are when neither OLLAMA_MODELS nor HOME is set."""
    env = env or {}
    args = first_command(argv)
    if len(args) < 2 or os.path.basename(args[0]) != "ollama" or args[1] not in ("serve", "start"):
        return None
    notes: list[str] = []
    models, models_rule = models_dir(env, home)
    ctx = _uint(env, "OLLAMA_CONTEXT_LENGTH", 0, notes, MAX_TOKENS)
    parallel = _uint(env, "OLLAMA_NUM_PARALLEL", DEFAULT_NUM_PARALLEL, notes, MAX_PARALLEL)
    max_loaded = _uint(env, "OLLAMA_MAX_LOADED_MODELS", 0, notes, 1 << 16)
    overhead = _uint(env, "OLLAMA_GPU_OVERHEAD", 0, notes, (1 << 64) - 1)
    fa = "auto"
    raw = _var(env, "OLLAMA_FLASH_ATTENTION")
    if raw:
        # envconfig.BoolWithDefault: a value ParseBool refuses counts as true.
        fa = "off" if raw in _GO_FALSE else "on"
        if raw not in _GO_TRUE + _GO_FALSE:
            notes.append(
                f"OLLAMA_FLASH_ATTENTION {quoted(raw)}: not a boolean; Ollama takes it as on"
            )
    return OllamaServer(
        binary=args[0],
        models=models,
        models_rule=models_rule,
        context_length=ctx or None,
        num_parallel=max(parallel, 1),  # sched.go: max(NumParallel, 1)
        flash_attention=fa,
        kv_cache_type=_var(env, "OLLAMA_KV_CACHE_TYPE").lower(),
        max_loaded_models=max_loaded,
        gpu_overhead=overhead,
        address=host_address(_var(env, "OLLAMA_HOST")),
        notes=tuple(notes),
    )


def first_server(
    command_lines: Iterable[Sequence[str]],
    env: Mapping[str, str] | None = None,
    *,
    home: str | None = None,
) -> OllamaServer | None:
    """The first command line (ExecStart, then running processes) that is `ollama serve`."""
    for argv in command_lines:
        server = server_settings(argv, env, home=home)
        if server is not None:
            return server
    return None


def default_context(gpu_memory: int, overhead: int = 0) -> int:
    """Ollama's num_ctx when nothing sets it, for this much GPU memory (unified: MemTotal).
    As Ollama's uint64 arithmetic: an overhead over the memory wraps to a huge figure."""
    vram = (gpu_memory - overhead) % (1 << 64)
    return next(ctx for floor, ctx in DEFAULT_CONTEXT if vram >= floor)


@dataclass(frozen=True)
class OllamaLoad:
    model: str | None  # the reference as given; None: not known (`notes` say why)
    via: str  # "ollama run", "curl /api/generate", ...
    num_ctx: int | None = None  # the request's options.num_ctx
    num_batch: int | None = None  # ... and options.num_batch
    keep_alive: str | None = None  # as given ("5m", "-1", "0")
    address: str | None = None  # host:port it asks; None: not known
    notes: tuple[str, ...] = ()


def client_loads(argv: Sequence[str], env: Mapping[str, str] | None = None) -> list[OllamaLoad]:
    """Every load the command line asks an Ollama server for, in order (most have one)."""
    loads: list[OllamaLoad] = []
    seen: set[tuple[str, ...]] = set()
    for args in commands(argv):
        if not args or tuple(args) in seen:
            continue
        seen.add(tuple(args))
        base = os.path.basename(args[0])
        load = None
        if base == "ollama":
            load = _ollama_run(args, env or {})
        elif base == "curl":
            load = _curl(args)
        elif base == "wget":
            load = _wget(args)
        if load is not None:
            loads.append(load)
    return loads


def client_load(argv: Sequence[str], env: Mapping[str, str] | None = None) -> OllamaLoad | None:
    """The first load the command line asks an Ollama server for; None if it asks none."""
    loads = client_loads(argv, env)
    return loads[0] if loads else None


def first_client(
    command_lines: Iterable[Sequence[str]], env: Mapping[str, str] | None = None
) -> OllamaLoad | None:
    for argv in command_lines:
        load = client_load(argv, env)
        if load is not None:
            return load
    return None


# `ollama run`'s flags (cmd/cmd.go): those that take a value; --think takes one only as
# --think=V (NoOptDefVal), the rest are booleans.
_RUN_VALUE_FLAGS = ("--keepalive", "--format", "--dimensions")


def _ollama_run(args: list[str], env: Mapping[str, str]) -> OllamaLoad | None:
    if args[1:2] != ["run"]:
        return None  # pull and create load nothing; stop, rm and ps unload or only look
    positional: list[str] = []
    keep_alive = None
    i = 2
    while i < len(args):
        arg = args[i]
        i += 1
        if arg == "--":
            positional += args[i:]
            break
        if arg.startswith("-") and len(arg) > 1:
            flag, eq, value = arg.partition("=")
            if flag in _RUN_VALUE_FLAGS and not eq:
                if i >= len(args):
                    raise OllamaError(f"ollama run {flag} needs a value")
                value = args[i]
                i += 1
            if flag == "--keepalive":
                if _duration(value) is None:
                    raise OllamaError(f"ollama run --keepalive {quoted(value)}: not a duration")
                keep_alive = value
            continue
        positional.append(arg)
    if not positional:
        raise OllamaError("ollama run: no model named")
    _check_reference(positional[0], "ollama run")
    notes = []
    if len(positional) == 1:
        notes.append("no prompt: it still loads the model (the prompt is read from stdin)")
    address = host_address(_var(env, "OLLAMA_HOST"), connect=True)
    return OllamaLoad(
        positional[0], "ollama run", keep_alive=keep_alive, address=address, notes=tuple(notes)
    )


# curl's short options that take a value (the value may be attached: -d'{...}', -XPOST).
_CURL_SHORT_VALUE = set("AbcCdDeEFHKmoPQrTuUwxXYyz")


_CURL_DATA = ("--data", "--data-raw", "--data-binary", "--data-ascii", "--json")


_CURL_LONG_VALUE = (
    *_CURL_DATA,
    "--url",
    "--request",
    "--header",
    "--user-agent",
    "--output",
    "--max-time",
    "--connect-timeout",
    "--retry",
    "--retry-delay",
    "--retry-max-time",
    "--write-out",
    "--user",
    "--cookie",
    "--cookie-jar",
    "--config",
    "--proxy",
    "--form",
    "--data-urlencode",
    "--unix-socket",
    "--resolve",
    "--connect-to",
    "--cacert",
    "--cert",
    "--key",
    "--interface",
    "--limit-rate",
    "--referer",
    "--range",
    "--upload-file",
    "--dump-header",
    "--stderr",
    "--trace",
    "--trace-ascii",
    "--variable",
    "--expand-data",
)


def _curl(args: list[str]) -> OllamaLoad | None:
    """curl URL -d BODY: the body of a POST to one of Ollama's endpoints."""
    urls: list[str] = []
    parts: list[tuple[str, str]] = []  # (option, value), in order
    get = False
    method = ""
    i = 1
    while i < len(args):
        arg = args[i]
        i += 1
        if arg.startswith("--"):
            if arg in _CURL_LONG_VALUE:
                if i >= len(args):
                    raise OllamaError(f"curl {arg} needs a value")
                value = args[i]
                i += 1
                if arg in _CURL_DATA:
                    parts.append((arg, value))
                elif arg == "--url":
                    urls.append(value)
                elif arg == "--request":
                    method = value
            elif arg == "--get":
                get = True
            continue
        if arg.startswith("-") and len(arg) > 1:
            for j, ch in enumerate(arg[1:], 1):
                if ch == "G":
                    get = True
                if ch in _CURL_SHORT_VALUE:
                    value = arg[j + 1 :]
                    if not value:
                        if i >= len(args):
                            raise OllamaError(f"curl -{ch} needs a value")
                        value = args[i]
                        i += 1
                    if ch == "d":
                        parts.append(("-d", value))
                    elif ch == "X":
                        method = value
                    break
            continue
        urls.append(arg)
    # Ollama's endpoints answer POST only: -X GET with a body loads nothing.
    return _request("curl", urls, parts, get=get or method.upper() not in ("", "POST"))


_WGET_SHORT_VALUE = set("OoaetTwPUiBlQARDIX")


_WGET_DATA = ("--post-data", "--body-data", "--post-file", "--body-file")


def _wget(args: list[str]) -> OllamaLoad | None:
    urls: list[str] = []
    parts: list[tuple[str, str]] = []
    i = 1
    while i < len(args):
        arg = args[i]
        i += 1
        if arg.startswith("--"):
            flag, eq, value = arg.partition("=")
            if flag in _WGET_DATA:
                if not eq:
                    if i >= len(args):
                        raise OllamaError(f"wget {flag} needs a value")
                    value = args[i]
                    i += 1
                if flag.endswith("-file"):
                    value = "@" + value
                parts.append((flag, value))
            continue
        if arg.startswith("-") and len(arg) > 1:
            for j, ch in enumerate(arg[1:], 1):
                if ch in _WGET_SHORT_VALUE:
                    if not arg[j + 1 :]:
                        i += 1
                    break
            continue
        urls.append(arg)
    return _request("wget", urls, parts, get=False)


def _endpoint(url: str) -> tuple[str, str, str] | None:
    """(endpoint kind, path, host:port) of a URL that names one of Ollama's endpoints."""
    if len(url) > 4096:
        return None
    text = url if "://" in url else "http://" + url  # curl and wget default to http
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError:
        return None
    path = parts.path.rstrip("/")
    for suffix, kind in ENDPOINTS.items():
        if path.endswith(suffix):
            host = parts.hostname or "localhost"
            if port is None:
                port = 443 if parts.scheme == "https" else 80
            return kind, suffix, _join(host, str(port))
    return None


def _request(
    tool: str, urls: list[str], parts: list[tuple[str, str]], *, get: bool
) -> OllamaLoad | None:
    target = next((e for e in map(_endpoint, urls) if e is not None), None)
    if target is None or get or not parts:
        return None  # not an Ollama endpoint, or not a POST with a body
    kind, path, address = target
    via = f"{tool} {path}"
    # curl joins several -d with '&' (and --json with nothing); a file is not read.
    body = ""
    for option, value in parts:
        if value.startswith("@") and option not in ("--data-raw",):
            what = "stdin" if value == "@-" else f"file {quoted(value[1:])}"
            return OllamaLoad(None, via, address=address, notes=(f"body from {what}: not read",))
        if body and option != "--json":
            body += "&"
        body += value
        if len(body) > MAX_BODY:
            raise OllamaError(f"{via}: request body over {MAX_BODY} bytes")
    return _body(via, kind, body, address)


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not JSON")


def strict_json(text: str | bytes) -> Any:
    """json.loads without NaN/Infinity (Go refuses them) and without a recursion crash."""
    return json.loads(text, parse_constant=_reject_constant)


def _body(via: str, kind: str, text: str, address: str) -> OllamaLoad | None:
    try:
        body = strict_json(text)
    except (ValueError, RecursionError):
        raise OllamaError(f"{via}: the request body is not JSON") from None
    if not isinstance(body, dict):
        raise OllamaError(f"{via}: the request body is not a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise OllamaError(f'{via}: no "model" in the request body')
    _check_reference(model, via)
    options = body.get("options") if kind != "openai" else None
    if options is not None and not isinstance(options, dict):
        raise OllamaError(f'{via}: "options" is not a JSON object')
    num_ctx = int_option(options or {}, "num_ctx", via)
    num_batch = int_option(options or {}, "num_batch", via)
    keep = body.get("keep_alive") if kind != "openai" else None
    seconds = None
    if keep is not None:
        seconds = _keep_alive(keep, via)
    asks = body.get("prompt") if kind == "generate" else body.get("messages")
    if kind == "embed":
        asks = body.get("input", body.get("prompt"))
    if seconds == 0 and not asks and kind in ("generate", "chat"):
        return None  # keep_alive 0 and nothing to answer: the request unloads the model
    notes = []
    if seconds == 0:
        notes.append("keep_alive 0: loaded for this request only")
    return OllamaLoad(
        model,
        via,
        num_ctx=num_ctx,
        num_batch=num_batch,
        keep_alive=None if keep is None else str(keep),
        address=address,
        notes=tuple(notes),
    )


def _check_reference(model: str, via: str) -> None:
    try:
        parse_reference(model)
    except OllamaError as e:
        raise OllamaError(f"{via}: {e}") from None


def int_option(options: Mapping[str, Any], key: str, where: str) -> int | None:
    """api.Options.FromMap for an integer option: a JSON number (a fraction is truncated),
    null is unset; anything else fails the request."""
    value = options.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise OllamaError(f"{where}: option {key} {quoted(value)} must be an integer")
    if not -MAX_TOKENS <= value <= MAX_TOKENS:
        raise OllamaError(f"{where}: option {key} {quoted(value)}: out of range")
    return int(value)


def _duration(text: str) -> float | None:
    """Go's time.ParseDuration in seconds (negative: forever); None if it is not one."""
    sign = -1.0 if text.startswith("-") else 1.0
    s = text[1:] if text[:1] in ("+", "-") else text
    if s == "0":
        return 0.0
    if not s or len(s) > 64:
        return None
    pos, total = 0, 0.0
    for m in _DURATION_PART.finditer(s):
        if m.start() != pos:
            return None
        total += float(m.group(1)) * _DURATION_UNIT[m.group(2)]
        pos = m.end()
    if pos != len(s):
        return None
    return -math.inf if sign < 0 and total else total


def _keep_alive(value: Any, where: str) -> float:
    """api.Duration: a number of seconds or a Go duration; negative is forever."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise OllamaError(f"{where}: keep_alive {quoted(value)}: not a duration")
    if isinstance(value, str):
        seconds = _duration(value)
        if seconds is None:
            raise OllamaError(f"{where}: keep_alive {quoted(value)}: not a duration")
        return seconds
    return -math.inf if value < 0 else float(value)


def serves(server: OllamaServer, load: OllamaLoad) -> bool:
    """Whether `load` asks `server` (by address: a server on 0.0.0.0 or :: takes any host of
    its port; localhost and the loopback addresses are one host). No address: assumed so."""
    if load.address is None:
        return True
    s_host, _, s_port = server.address.rpartition(":")
    l_host, _, l_port = load.address.rpartition(":")
    if s_port != l_port:
        return False
    s_host, l_host = s_host.strip("[]"), l_host.strip("[]")
    loopback = ("localhost", "::1", "ip6-localhost")
    if s_host in ("0.0.0.0", "::", "") or s_host == l_host:  # "": all interfaces (":11434")
        return True
    return (s_host in loopback or s_host.startswith("127.")) and (
        l_host in (*loopback, "") or l_host.startswith("127.")
    )


@dataclass(frozen=True)
class Reference:
    host: str
    namespace: str
    model: str
    tag: str

    @property
    def display(self) -> str:
        """As Ollama shows it (DisplayShortest): qwen3:30b, me/x:latest, host/ns/x:tag."""
        if self.host.lower() != DEFAULT_HOST:
            return f"{self.host}/{self.namespace}/{self.model}:{self.tag}"
        if self.namespace.lower() != DEFAULT_NAMESPACE:
            return f"{self.namespace}/{self.model}:{self.tag}"
        return f"{self.model}:{self.tag}"

    def manifest(self, models: str) -> str:
        return os.path.join(models, "manifests", self.host, self.namespace, self.model, self.tag)


_PART_MAX = {"host": 350, "namespace": 80, "model": 80, "tag": 80}


_PART_EXTRA = {"host": "-_.:", "namespace": "-_", "model": "-_.", "tag": "-_."}


def _valid_part(kind: str, s: str) -> bool:
    """types/model/name.go isValidPart: a letter, digit or _ first, then those and a few."""
    if not 1 <= len(s) <= _PART_MAX[kind] or not s.isascii():
        return False
    ok = set(_PART_EXTRA[kind])
    return (s[0].isalnum() or s[0] == "_") and all(c.isalnum() or c == "_" or c in ok for c in s)


def parse_reference(text: str) -> Reference:
    """A model reference by Ollama's ParseName, with its defaults; OllamaError if not valid.

    Every part is checked against its charset (no "/", nothing but letters, digits and
    -_.: where Ollama allows them, never a "." first), so none can leave the manifests tree.
    """
    if not isinstance(text, str) or not text or len(text) > MAX_REFERENCE:
        raise OllamaError(f"model {quoted(text)}: not a model name")
    s = text
    tag = model = namespace = host = ""
    if s.rfind(":") > s.rfind("/"):
        s, _, tag = s.rpartition(":")
        tag = tag or "!"  # promised by ':', missing: invalid
    before, slash, model = s.rpartition("/")
    if slash:
        model = model or "!"
        before, slash, namespace = before.rpartition("/")  # no "/": ("", "", all of it)
        namespace = namespace or "!"
        if slash:
            host = before.partition("://")[2] if "://" in before else before
            host = host or "!"
    ref = Reference(host or DEFAULT_HOST, namespace or DEFAULT_NAMESPACE, model, tag or DEFAULT_TAG)
    for kind in ("host", "namespace", "model", "tag"):
        if not _valid_part(kind, getattr(ref, kind)):
            raise OllamaError(f"model {quoted(text)}: not a valid model name ({kind})")
    return ref


def blob_name(digest: object) -> str | None:
    """sha256:HEX (or sha256-HEX) -> the blob's file name, sha256-HEX; None if not one."""
    if not isinstance(digest, str):
        return None
    m = _DIGEST.fullmatch(digest)  # not re.match and $: it takes a trailing newline
    return f"sha256-{m.group(1)}" if m else None

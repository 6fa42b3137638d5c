"""Ollama: the server's settings, the clients that make it load, a real models directory.

The layout is Ollama's own (manifests/<host>/<namespace>/<model>/<tag> naming
sha256 blobs), written here with sparse synthetic GGUFs of real models'
shapes (lab/synth.py). Each prediction is checked against estimate.py run
directly on the same GGUF with the settings Ollama gives its runner.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from pathlib import Path
from typing import Any

import pytest

from lab import synth
from lab.accounts import User
from spark_guard.core.argv import ollama as ollama_argv
from spark_guard.core.argv.loadspec import Settings, SpecError
from spark_guard.core.argv.ollama import (
    OllamaError,
    OllamaLoad,
    OllamaServer,
    client_load,
    client_loads,
    parse_reference,
    server_settings,
)
from spark_guard.core.quantities import format_size
from spark_guard.foresight import ollama
from spark_guard.foresight.estimate import estimate
from spark_guard.foresight.gguf import read_model
from spark_guard.foresight.predict import PENDING, Prediction, Predictor

GiB = 1 << 30
MEM_TOTAL = 128 * GiB
Q = synth.Q

SMALL = {
    # A vision projector: only its tensor bytes count (as llama-server's --mmproj).
    "projector": synth.Spec(
        "projector", "clip", 4, 1152, 16, 16, 72, 72, 0, 1, n_ff=4304, weight_type=Q.F16
    ),
    "embed": synth.Spec(
        "embed", "qwen3", 4, 1024, 16, 8, 64, 64, 32768, 1000, n_ff=3072, extra={"pooling_type": 1}
    ),
    "next": synth.Spec("next", "qwen3next", 4, 1024, 16, 2, 128, 128, 262144, 1000, n_ff=3072),
}


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = {}
    specs = {"qwen3": synth.SPECS["qwen3-30b-a3b"], "gemma3": synth.SPECS["gemma-3-27b"], **SMALL}
    for key, spec in specs.items():
        d = tmp_path_factory.mktemp(key)
        out[key] = synth.write(spec, d)
    return out


def digest_of(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()


def layer(media: str, name: str) -> dict[str, Any]:
    return {"mediaType": media, "digest": f"sha256:{digest_of(name)}", "size": 1}


class Layout:
    """A models directory: blobs hard-linked from the synthetic GGUFs (sparse, no copy)."""

    def __init__(self, models: Path, ggufs: dict[str, Path]) -> None:
        self.models = models
        (models / "blobs").mkdir(parents=True)
        for key, path in ggufs.items():
            os.link(path, self.blob(key))

    def blob(self, name: str) -> Path:
        return self.models / "blobs" / f"sha256-{digest_of(name)}"

    def params(self, name: str, values: object) -> None:
        self.blob(name).write_text(json.dumps(values))

    def manifest(self, ref: str, layers: list[dict[str, Any]] | str | bytes) -> Path:
        path = Path(parse_reference(ref).manifest(str(self.models)))
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(layers, bytes):
            path.write_bytes(layers)
        else:
            text = layers if isinstance(layers, str) else json.dumps({"layers": layers})
            path.write_text(text)
        return path

    def server(self, **env: str) -> OllamaServer:
        got = server_settings(
            ["/usr/bin/ollama", "serve"], {"OLLAMA_MODELS": str(self.models), **env}
        )
        assert got is not None
        return got


@pytest.fixture
def layout(tmp_path: Path, ggufs: dict[str, Path]) -> Layout:
    lay = Layout(tmp_path / "models", ggufs)
    lay.manifest("qwen3:30b", [layer(ollama.MEDIA_MODEL, "qwen3")])
    lay.params("gemma-params", {"num_ctx": 8192, "stop": ["<end_of_turn>"], "temperature": 1})
    lay.manifest(
        "gemma3:27b",
        [
            layer(ollama.MEDIA_MODEL, "gemma3"),
            layer(ollama.MEDIA_PROJECTOR, "projector"),
            layer("application/vnd.ollama.image.license", "license"),
            layer(ollama.MEDIA_PARAMS, "gemma-params"),
        ],
    )
    return lay


def load(model: str | None, **kw: Any) -> OllamaLoad:
    return OllamaLoad(model, "ollama run", **kw)


def answer(predictor: Predictor, server: OllamaServer, got: OllamaLoad, **kw: Any) -> Prediction:
    """Ask without waiting until the answer is there (the guard's way); within 5 s."""
    give_up = time.monotonic() + 5
    while True:
        p = ollama.predict(predictor, server, got, MEM_TOTAL, wait=False, **kw)
        if not p.pending:
            return p
        assert p.source == PENDING
        assert time.monotonic() < give_up, "still pending after 5 s"
        time.sleep(0.02)


# --- the server's settings ----------------------------------------------------------------


def test_the_server_unit_and_its_environment():
    env = {
        "OLLAMA_MODELS": ' "/srv/ollama/models" ',  # envconfig.Var trims spaces, then quotes
        "OLLAMA_CONTEXT_LENGTH": "16384",
        "OLLAMA_NUM_PARALLEL": "4",
        "OLLAMA_FLASH_ATTENTION": "1",
        "OLLAMA_KV_CACHE_TYPE": "Q8_0",
        "OLLAMA_MAX_LOADED_MODELS": "2",
        "OLLAMA_GPU_OVERHEAD": "1073741824",
        "OLLAMA_HOST": "0.0.0.0:11500",
    }
    got = server_settings(["/usr/local/bin/ollama", "serve"], env)
    assert got == OllamaServer(
        binary="/usr/local/bin/ollama",
        models="/srv/ollama/models",
        models_rule="OLLAMA_MODELS",
        context_length=16384,
        num_parallel=4,
        flash_attention="on",
        kv_cache_type="q8_0",
        max_loaded_models=2,
        gpu_overhead=GiB,
        address="0.0.0.0:11500",
    )


@pytest.mark.parametrize(
    "argv",
    [
        ["ollama", "serve"],
        ["/usr/bin/ollama", "start"],  # serve's alias
        ["/usr/bin/env", "OLLAMA_DEBUG=1", "/usr/bin/ollama", "serve"],
        ["/bin/sh", "-c", "exec /usr/bin/ollama serve >>/var/log/ollama.log 2>&1"],
        ["nice", "-n", "5", "ollama", "serve"],
    ],
)
def test_ollama_serve_behind_wrappers(argv):
    got = server_settings(argv, {}, home=ollama_argv.PACKAGED_HOME)
    assert got is not None and got.models == "/usr/share/ollama/.ollama/models"
    assert got.models_rule == "~/.ollama/models of /usr/share/ollama"
    assert (got.context_length, got.num_parallel, got.flash_attention, got.kv_cache_type) == (
        None,
        1,
        "auto",
        "",
    )
    assert got.address == ollama_argv.DEFAULT_ADDRESS and got.notes == ()


@pytest.mark.parametrize(
    "argv",
    [
        ["ollama", "run", "qwen3"],
        ["ollama", "pull", "qwen3"],
        ["ollama"],
        ["llama-server", "-m", "/m/x.gguf"],
        ["/bin/sh", "-c", "sleep 5; ollama serve"],  # not what the unit's main process is
    ],
)
def test_other_commands_are_not_a_server(argv):
    assert server_settings(argv, {}) is None


def test_where_the_models_are():
    serve = ["ollama", "serve"]
    home = server_settings(serve, {}, home="/home/ann")
    assert home is not None and home.models == "/home/ann/.ollama/models"
    # HOME in the unit's Environment= is what Ollama's os.UserHomeDir() sees.
    env_home = server_settings(serve, {"HOME": "/var/lib/ollama"}, home="/home/ann")
    assert env_home is not None and env_home.models == "/var/lib/ollama/.ollama/models"
    unknown = server_settings(serve, {})
    assert unknown is not None and unknown.models is None
    assert unknown.models_rule == "no OLLAMA_MODELS, and the service user's home is not known"
    with pytest.raises(OllamaError, match=r"^OLLAMA_MODELS 'models': not an absolute path$"):
        server_settings(serve, {"OLLAMA_MODELS": "models"})
    with pytest.raises(OllamaError, match=r"^HOME '~': not an absolute path$"):
        server_settings(serve, {"HOME": "~"})


def test_numbers_ollama_cannot_parse_are_its_defaults_and_absurd_ones_are_refused():
    serve = ["ollama", "serve"]
    got = server_settings(
        serve,
        {
            "OLLAMA_NUM_PARALLEL": "four",
            "OLLAMA_CONTEXT_LENGTH": "-8192",  # ParseUint: no sign
            "OLLAMA_MAX_LOADED_MODELS": "+2",
            "OLLAMA_FLASH_ATTENTION": "yes",  # ParseBool refuses it; envconfig takes it as true
        },
        home="/h",
    )
    assert got is not None
    assert (got.num_parallel, got.context_length, got.max_loaded_models) == (1, None, 0)
    assert got.flash_attention == "on"
    assert got.notes == (
        "OLLAMA_CONTEXT_LENGTH '-8192': not a number; Ollama uses its default, 0",
        "OLLAMA_NUM_PARALLEL 'four': not a number; Ollama uses its default, 1",
        "OLLAMA_MAX_LOADED_MODELS '+2': not a number; Ollama uses its default, 0",
        "OLLAMA_FLASH_ATTENTION 'yes': not a boolean; Ollama takes it as on",
    )
    for value, fa in (("0", "off"), ("false", "off"), ("F", "off"), ("TRUE", "on"), ("", "auto")):
        s = server_settings(serve, {"OLLAMA_FLASH_ATTENTION": value}, home="/h")
        assert s is not None and s.flash_attention == fa, value
    zero = server_settings(
        serve, {"OLLAMA_CONTEXT_LENGTH": "0", "OLLAMA_NUM_PARALLEL": "0"}, home="/h"
    )
    assert zero is not None and (zero.context_length, zero.num_parallel) == (None, 1)
    with pytest.raises(OllamaError, match=r"^OLLAMA_NUM_PARALLEL '100000': must be at most 256$"):
        server_settings(serve, {"OLLAMA_NUM_PARALLEL": "100000"}, home="/h")
    with pytest.raises(OllamaError, match=r"^OLLAMA_CONTEXT_LENGTH '8589934592': must be at most"):
        server_settings(serve, {"OLLAMA_CONTEXT_LENGTH": str(1 << 33)}, home="/h")
    assert issubclass(OllamaError, SpecError)


def test_numbers_past_uint64_are_not_numbers_to_ollama():
    got = server_settings(["ollama", "serve"], {"OLLAMA_CONTEXT_LENGTH": "9" * 20}, home="/h")
    assert got is not None and got.context_length is None
    assert got.notes[0].startswith("OLLAMA_CONTEXT_LENGTH '99999999999999999999': not a number")


def test_the_default_context_follows_the_gpu_memory():
    assert ollama_argv.default_context(128 * GiB) == 262144  # a DGX Spark: the whole pool
    assert ollama_argv.default_context(47 * GiB) == 262144
    assert ollama_argv.default_context(47 * GiB - 1) == 32768
    assert ollama_argv.default_context(24 * GiB) == 32768
    assert ollama_argv.default_context(16 * GiB) == 4096
    assert ollama_argv.default_context(128 * GiB, overhead=100 * GiB) == 32768
    # Ollama's uint64 subtraction wraps: an overhead over the memory is a huge figure.
    assert ollama_argv.default_context(8 * GiB, overhead=9 * GiB) == 262144


@pytest.mark.parametrize(
    ("raw", "connect", "address"),
    [
        ("", False, "127.0.0.1:11434"),
        ("0.0.0.0", False, "0.0.0.0:11434"),
        ("0.0.0.0", True, "127.0.0.1:11434"),
        ("0.0.0.0:8080", False, "0.0.0.0:8080"),
        ("http://example.com", False, "example.com:80"),
        ("https://example.com", False, "example.com:443"),
        ("example.com:abc", False, "example.com:11434"),
        ("[::1]:11500", False, "[::1]:11500"),
        ("::", True, "[::1]:11434"),
        (":11434", False, ":11434"),
        ("'127.0.0.1:11500/'", False, "127.0.0.1:11500"),
    ],
)
def test_ollama_host_as_envconfig_reads_it(raw, connect, address):
    assert ollama_argv.host_address(raw, connect=connect) == address


# --- the clients --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "model", "keep_alive"),
    [
        (["/usr/bin/ollama", "run", "qwen3:30b"], "qwen3:30b", None),
        (["ollama", "run", "qwen3:30b", "say hi"], "qwen3:30b", None),
        (["ollama", "run", "--keepalive", "1h", "qwen3"], "qwen3", "1h"),
        (["ollama", "run", "qwen3", "--keepalive=-1m", "hi"], "qwen3", "-1m"),
        (["ollama", "run", "--verbose", "--think", "qwen3", "hi"], "qwen3", None),
        (["ollama", "run", "--format", "json", "me/model:q4", "hi"], "me/model:q4", None),
        (["ollama", "run", "--keepalive", "0", "qwen3", "hi"], "qwen3", "0"),
        (["env", "OLLAMA_HOST=127.0.0.1:11434", "ollama", "run", "qwen3"], "qwen3", None),
        (["/bin/sh", "-c", "sleep 20 && exec ollama run qwen3:8b ''"], "qwen3:8b", None),
        (["bash", "-c", "until ollama ps; do sleep 1; done; ollama run qwen3 x"], "qwen3", None),
    ],
)
def test_ollama_run_in_its_forms(argv, model, keep_alive):
    got = client_load(argv, {})
    assert got is not None and got.via == "ollama run"
    assert (got.model, got.keep_alive, got.num_ctx) == (model, keep_alive, None)
    assert got.address == "127.0.0.1:11434"


def test_ollama_run_asks_the_server_its_ollama_host_names():
    got = client_load(["ollama", "run", "qwen3"], {"OLLAMA_HOST": "0.0.0.0:11500"})
    assert got is not None and got.address == "127.0.0.1:11500"
    assert got.notes == ("no prompt: it still loads the model (the prompt is read from stdin)",)


@pytest.mark.parametrize(
    "argv",
    [
        ["ollama", "pull", "qwen3"],  # downloads, loads nothing
        ["ollama", "stop", "qwen3"],
        ["ollama", "ps"],
        ["ollama", "serve"],
        ["sleep", "infinity", "ollama", "run", "qwen3"],
    ],
)
def test_commands_that_load_nothing(argv):
    assert client_load(argv) is None


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["ollama", "run"], "ollama run: no model named"),
        (["ollama", "run", "--verbose"], "ollama run: no model named"),
        (["ollama", "run", "qwen3", "--keepalive"], "ollama run --keepalive needs a value"),
        (["ollama", "run", "--keepalive", "soon", "qwen3"], "ollama run --keepalive 'soon': not"),
        (
            ["ollama", "run", "../../etc/passwd"],
            "ollama run: model '../../etc/passwd': not a valid",
        ),
    ],
)
def test_ollama_run_that_cannot_load_is_named(argv, error):
    with pytest.raises(OllamaError, match=f"^{error}"):
        client_load(argv)


BODY = '{"model": "qwen3:30b", "keep_alive": -1, "options": {"num_ctx": 32768, "num_batch": 256}}'


@pytest.mark.parametrize(
    "argv",
    [
        ["curl", "http://localhost:11434/api/generate", "-d", BODY],
        ["/usr/bin/curl", "-sS", "-X", "POST", "localhost:11434/api/generate", "--data", BODY],
        ["curl", "-sfXPOST", "http://localhost:11434/api/chat/", "--data-raw", BODY],
        ["curl", "--url", "http://localhost:11434/api/generate", "--data-binary", BODY],
        ["curl", "-H", "Content-Type: application/json", f"-d{BODY}", "localhost:11434/api/chat"],
        ["curl", "--json", BODY, "http://localhost:11434/api/generate"],
        ["wget", "-qO-", f"--post-data={BODY}", "http://localhost:11434/api/generate"],
        ["wget", "-O", "/dev/null", "--post-data", BODY, "localhost:11434/api/generate"],
        ["/bin/sh", "-c", f"sleep 30; curl -s localhost:11434/api/generate -d '{BODY}' >/dev/null"],
        ["env", "A=1", "bash", "-c", f"exec curl -XPOST localhost:11434/api/chat -d '{BODY}' 2>&1"],
    ],
)
def test_curl_and_wget_preloads(argv):
    got = client_load(argv)
    assert got is not None
    assert (got.model, got.num_ctx, got.num_batch, got.keep_alive) == (
        "qwen3:30b",
        32768,
        256,
        "-1",
    )
    assert got.address == "localhost:11434"
    assert got.via.split()[0] in ("curl", "wget")
    assert got.via.split()[1] in ("/api/generate", "/api/chat")


def test_the_documented_preload_and_other_endpoints():
    got = client_load(["curl", "http://10.0.0.5:11500/api/generate", "-d", '{"model": "llama3.2"}'])
    assert got == OllamaLoad("llama3.2", "curl /api/generate", address="10.0.0.5:11500")
    embed = client_load(
        ["curl", "https://ai.lan/api/embed", "-d", '{"model":"bge-m3","input":"x"}']
    )
    assert embed is not None and (embed.model, embed.address) == ("bge-m3", "ai.lan:443")
    oai = client_load(
        [
            "curl",
            "http://localhost:11434/v1/chat/completions",
            "-d",
            '{"model": "qwen3", "messages": []}',
        ]
    )
    assert oai is not None and (oai.model, oai.via) == ("qwen3", "curl /v1/chat/completions")


def test_a_script_with_two_preloads_gives_both():
    script = (
        'curl localhost:11434/api/generate -d \'{"model": "a"}\' && '
        'curl localhost:11434/api/generate -d \'{"model": "b", "keep_alive": "24h"}\''
    )
    got = client_loads(["/bin/bash", "-c", script])
    assert [(x.model, x.keep_alive) for x in got] == [("a", None), ("b", "24h")]


@pytest.mark.parametrize(
    "argv",
    [
        ["curl", "http://localhost:11434/api/tags"],  # lists, loads nothing
        ["curl", "-G", "http://localhost:11434/api/generate", "-d", '{"model": "qwen3"}'],
        ["curl", "http://localhost:11434/api/generate"],  # no body: Ollama answers 400
        ["curl", "-X", "GET", "localhost:11434/api/generate", "-d", '{"model": "qwen3"}'],
        ["curl", "http://localhost:11434/api/pull", "-d", '{"model": "qwen3"}'],
        # keep_alive 0 with nothing to answer: the request unloads the model.
        ["curl", "localhost:11434/api/generate", "-d", '{"model": "qwen3", "keep_alive": 0}'],
        [
            "curl",
            "localhost:11434/api/chat",
            "-d",
            '{"model": "q", "messages": [], "keep_alive": "0s"}',
        ],
        ["/bin/sh", "-c", "x" * 9000 + '; curl localhost:11434/api/generate -d \'{"model": "q"}\''],
    ],
)
def test_requests_that_load_nothing(argv):
    assert client_load(argv) is None


def test_a_request_that_answers_with_keep_alive_0_still_loads():
    body = '{"model": "qwen3", "prompt": "hi", "keep_alive": 0}'
    got = client_load(["curl", "localhost:11434/api/generate", "-d", body])
    assert got is not None and got.notes == ("keep_alive 0: loaded for this request only",)


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (
            ["curl", "localhost:11434/api/generate", "-d", "@/etc/ollama/preload.json"],
            "file '/etc/ollama/preload.json'",
        ),
        (["curl", "localhost:11434/api/generate", "--data-binary", "@-"], "stdin"),
        (["curl", "--json", "@body.json", "localhost:11434/api/chat"], "file 'body.json'"),
        (
            ["wget", "--post-file=/srv/body.json", "localhost:11434/api/generate"],
            "file '/srv/body.json'",
        ),
    ],
)
def test_a_body_from_a_file_is_not_read_and_says_so(argv, said):
    got = client_load(argv)
    assert got is not None and got.model is None
    assert got.notes == (f"body from {said}: not read",)
    server = server_settings(["ollama", "serve"], {}, home="/h")
    assert server is not None
    p = ollama.predict(Predictor(), server, got, MEM_TOTAL)
    assert p.bytes is None and p.source == f"ollama: {got.via}: body from {said}: not read"


@pytest.mark.parametrize(
    ("body", "error"),
    [
        ("{model: qwen3}", "the request body is not JSON"),
        ('["qwen3"]', "the request body is not a JSON object"),
        ('{"prompt": "hi"}', 'no "model" in the request body'),
        ('{"model": 7}', 'no "model" in the request body'),
        ('{"model": "q", "options": [1]}', '"options" is not a JSON object'),
        ('{"model": "q", "options": {"num_ctx": "8k"}}', "option num_ctx '8k' must be an integer"),
        (
            '{"model": "q", "options": {"num_ctx": true}}',
            "option num_ctx 'True' must be an integer",
        ),
        ('{"model": "q", "options": {"num_ctx": NaN}}', "the request body is not JSON"),
        ('{"model": "q", "options": {"num_ctx": 1e300}}', "option num_ctx '1e+300': out of range"),
        ('{"model": "q", "keep_alive": "forever"}', "keep_alive 'forever': not a duration"),
        ('{"model": "q", "keep_alive": "-1"}', "keep_alive '-1': not a duration"),  # Go: no unit
        ('{"model": "../../etc/passwd"}', "model '../../etc/passwd': not a valid model name"),
        ("[" * 50000, "the request body is not JSON"),
        ('{"model": "q", "x": "' + "y" * (70 << 10) + '"}', "request body over 65536 bytes"),
    ],
)
def test_bad_request_bodies_are_named(body, error):
    with pytest.raises(OllamaError, match=f"^curl /api/generate: {re.escape(error)}"):
        client_load(["curl", "http://localhost:11434/api/generate", "-d", body])


def test_request_options_as_ollama_reads_them():
    def ctx(options: str) -> int | None:
        body = f'{{"model": "q", "options": {options}}}'
        got = client_load(["curl", "localhost:11434/api/generate", "-d", body])
        assert got is not None
        return got.num_ctx

    assert ctx('{"num_ctx": 8192.9}') == 8192  # Go's int64(float64): truncated
    assert ctx('{"num_ctx": null}') is None
    assert ctx('{"num_ctx": -1}') == -1  # the scheduler makes it 4
    assert ctx('{"temperature": 0}') is None


def test_which_server_a_client_asks():
    server = server_settings(["ollama", "serve"], {"OLLAMA_HOST": "0.0.0.0"}, home="/h")
    local = server_settings(["ollama", "serve"], {}, home="/h")
    other_port = server_settings(["ollama", "serve"], {"OLLAMA_HOST": "127.0.0.1:11500"}, home="/h")
    assert server is not None and local is not None and other_port is not None
    for address in ("localhost:11434", "127.0.0.1:11434", "10.1.2.3:11434", None):
        assert ollama_argv.serves(server, load("q", address=address))
    assert ollama_argv.serves(local, load("q", address="localhost:11434"))
    assert ollama_argv.serves(local, load("q", address="[::1]:11434"))
    assert not ollama_argv.serves(local, load("q", address="10.1.2.3:11434"))
    assert not ollama_argv.serves(other_port, load("q", address="localhost:11434"))


# --- model references ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "parts", "display"),
    [
        ("qwen3", ("registry.ollama.ai", "library", "qwen3", "latest"), "qwen3:latest"),
        ("qwen3:30b-a3b", ("registry.ollama.ai", "library", "qwen3", "30b-a3b"), "qwen3:30b-a3b"),
        (
            "me/my.model:q4_K_M",
            ("registry.ollama.ai", "me", "my.model", "q4_K_M"),
            "me/my.model:q4_K_M",
        ),
        (
            "hf.co/bartowski/Qwen3-8B-GGUF:Q4_K_M",
            ("hf.co", "bartowski", "Qwen3-8B-GGUF", "Q4_K_M"),
            None,
        ),
        (
            "https://reg.lan:5000/team/m:v1",
            ("reg.lan:5000", "team", "m", "v1"),
            "reg.lan:5000/team/m:v1",
        ),
        ("reg.lan:5000/team/m", ("reg.lan:5000", "team", "m", "latest"), None),
    ],
)
def test_model_references(text, parts, display):
    ref = parse_reference(text)
    assert (ref.host, ref.namespace, ref.model, ref.tag) == parts
    assert ref.manifest("/m") == "/m/manifests/" + "/".join(parts)
    if display is not None:
        assert ref.display == display


@pytest.mark.parametrize(
    "text",
    [
        "",
        "..",
        "../../etc/passwd",
        "a/../../b",
        "library/..:latest",
        "qwen3:../../x",
        "qwen3:",
        ":latest",
        "/qwen3",
        "ns//m",
        "a/b/c/d",
        ".hidden",
        "-rf",
        "my model",
        "qwen3\n",
        "q\u00fcen",
        "ns.x/m",  # no "." in a namespace
        "m:t:u",
        "x" * 81,
        "h" * 700,
    ],
)
def test_references_that_are_not_model_names(text):
    with pytest.raises(OllamaError, match="not a"):
        parse_reference(text)


def test_digests():
    hexa = "ab" * 32
    assert ollama_argv.blob_name(f"sha256:{hexa}") == f"sha256-{hexa}"
    assert ollama_argv.blob_name(f"sha256-{hexa.upper()}") == f"sha256-{hexa.upper()}"
    bad: list[object] = [f"sha256:{hexa[:-1]}", f"sha256:{hexa}0", "sha256:" + "g" * 64]
    bad += [f"sha512:{hexa}"]
    bad += [f"sha256:../../{hexa[6:]}", f"sha256:{hexa}/..", f"sha256:{hexa}\n", None, 5]
    for digest in bad:
        assert ollama_argv.blob_name(digest) is None, digest


# --- the files and the footprint ----------------------------------------------------------


def expected(gguf: Path, **settings: Any) -> int:
    base = {"kv_unified": False, "flash_attn": "auto", "n_parallel": 1}
    return estimate(read_model(str(gguf)), Settings(**{**base, **settings})).total


def test_a_load_is_llama_cpps_estimate_with_ollamas_settings(layout, ggufs):
    server = layout.server()
    p = answer(Predictor(), server, load("qwen3:30b"))
    # A Spark's 128 GiB: Ollama's default 262144, capped at the model's trained 40960; its
    # automatic batch for a context past 32768 is 2048.
    total = expected(ggufs["qwen3"], n_ctx=40960, n_ubatch=2048)
    assert p.bytes == total and p.estimate is not None and p.estimate.total == total
    blob = f"sha256-{digest_of('qwen3')}"
    assert p.source == (
        f"ollama qwen3:30b -> blobs/{blob[:19]}... (GGUF), ctx 40960 x 1, KV f16: "
        f"{format_size(total)}"
    )
    assert (
        p.spec is not None and p.spec.kind == "ollama" and p.spec.model == str(layout.blob("qwen3"))
    )
    assert p.spec.rule == (
        "ctx 262144 (Ollama's default for 128.0GiB of GPU memory), the model's trained 40960"
    )


@pytest.mark.parametrize(
    ("env", "got", "settings"),
    [
        ({"OLLAMA_CONTEXT_LENGTH": "8192"}, load("qwen3:30b"), {"n_ctx": 8192, "n_ubatch": 1024}),
        (
            {"OLLAMA_CONTEXT_LENGTH": "8192", "OLLAMA_NUM_PARALLEL": "4"},
            load("qwen3:30b"),
            {"n_ctx": 32768, "n_parallel": 4, "n_ubatch": 1024},
        ),
        ({"OLLAMA_CONTEXT_LENGTH": "4096"}, load("qwen3"), {"n_ctx": 4096, "n_ubatch": 512}),
        (
            {"OLLAMA_CONTEXT_LENGTH": "4096", "OLLAMA_FLASH_ATTENTION": "0"},
            load("qwen3:30b"),
            {"n_ctx": 4096, "flash_attn": "off"},
        ),
        (
            {"OLLAMA_FLASH_ATTENTION": "1", "OLLAMA_KV_CACHE_TYPE": "q8_0"},
            load("qwen3:30b", num_ctx=16384),
            {
                "n_ctx": 16384,
                "flash_attn": "on",
                "cache_type_k": "q8_0",
                "cache_type_v": "q8_0",
                "n_ubatch": 1024,
            },
        ),
        (
            {"OLLAMA_FLASH_ATTENTION": "1", "OLLAMA_KV_CACHE_TYPE": "f32"},
            load("qwen3:30b", num_ctx=2, num_batch=128),
            {
                "n_ctx": 4,
                "flash_attn": "on",
                "cache_type_k": "f32",
                "cache_type_v": "f32",
                "n_ubatch": 128,
            },
        ),
    ],
)
def test_the_settings_ollama_passes_its_runner(layout, ggufs, env, got, settings):
    server = layout.server(**env)
    if got.model == "qwen3":
        layout.manifest("qwen3", [layer(ollama.MEDIA_MODEL, "qwen3")])
    p = answer(Predictor(), server, got)
    assert p.spec is not None and p.spec.settings == Settings(
        **{"kv_unified": False, "flash_attn": "auto", "n_parallel": 1, **settings}
    )
    assert p.bytes == expected(ggufs["qwen3"], **settings)


def test_a_quantized_kv_cache_counts_only_with_flash_attention_on(layout):
    for env, note in (
        ({}, "OLLAMA_FLASH_ATTENTION is not on"),
        (
            {"OLLAMA_FLASH_ATTENTION": "1", "OLLAMA_KV_CACHE_TYPE": "q5_1"},
            "Ollama before 0.30 drops it",
        ),
    ):
        server = layout.server(
            OLLAMA_CONTEXT_LENGTH="4096", **{"OLLAMA_KV_CACHE_TYPE": "q8_0", **env}
        )
        p = answer(Predictor(), server, load("qwen3:30b"))
        assert p.spec is not None and p.spec.settings.cache_type_k == "f16"
        kv = server.kv_cache_type
        assert f"OLLAMA_KV_CACHE_TYPE {kv}: {note}; counted as f16, the larger" in p.spec.notes
    odd = answer(Predictor(), layout.server(OLLAMA_KV_CACHE_TYPE="fp8"), load("qwen3:30b"))
    assert odd.spec is not None and odd.spec.settings.cache_type_k == "f16"
    assert "OLLAMA_KV_CACHE_TYPE 'fp8': unknown to llama.cpp; counted as f16" in odd.spec.notes


def test_the_request_beats_the_params_blob_which_beats_the_server(layout):
    server = layout.server(OLLAMA_CONTEXT_LENGTH="4096")
    predictor = Predictor()
    by_params = answer(predictor, server, load("gemma3:27b"))
    assert by_params.spec is not None and by_params.spec.settings.n_ctx == 8192
    assert by_params.spec.rule == "ctx 8192 (the model's params num_ctx)"
    by_request = answer(predictor, server, load("gemma3:27b", num_ctx=16384))
    assert by_request.spec is not None and by_request.spec.settings.n_ctx == 16384
    assert by_request.spec.rule == "ctx 16384 (the request's num_ctx)"


def test_a_vision_model_counts_its_projector_and_at_least_2048_cells(layout, ggufs):
    p = answer(Predictor(), layout.server(), load("gemma3:27b", num_ctx=512))
    projector = read_model(str(ggufs["projector"])).tensor_bytes
    assert projector > 0
    settings: dict[str, Any] = {"n_ctx": 2048, "n_ubatch": 512, "mmproj_bytes": projector}
    assert p.spec is not None and p.spec.settings == Settings(
        kv_unified=False, flash_attn="auto", n_parallel=1, **settings
    )
    assert p.spec.mmproj == str(layout.blob("projector"))
    assert p.bytes == expected(ggufs["gemma3"], **settings)
    assert "(GGUF) + projector, ctx 2048 x 1" in p.source
    assert p.spec.rule == "ctx 512 (the request's num_ctx), at least 2048 for a vision model"


def test_embedding_and_single_sequence_models_run_one_sequence(layout, ggufs):
    layout.manifest("bge:latest", [layer(ollama.MEDIA_MODEL, "embed")])
    layout.manifest("next:latest", [layer(ollama.MEDIA_MODEL, "next")])
    server = layout.server(OLLAMA_NUM_PARALLEL="4", OLLAMA_CONTEXT_LENGTH="65536")
    embed = answer(Predictor(), server, load("bge"))
    # Trained 32768 caps it; one sequence; the embedding batch, at most the context.
    assert embed.spec is not None and embed.spec.settings == Settings(
        n_ctx=32768, n_parallel=1, kv_unified=False, n_ubatch=2048
    )
    assert "OLLAMA_NUM_PARALLEL 4: Ollama runs qwen3 with 1" in embed.spec.notes
    assert embed.bytes == expected(ggufs["embed"], n_ctx=32768, n_ubatch=2048)
    nxt = answer(Predictor(), server, load("next"))
    assert nxt.spec is not None and (nxt.spec.settings.n_ctx, nxt.spec.settings.n_parallel) == (
        65536,
        1,
    )
    assert nxt.spec.settings.n_ubatch == 2048


def test_a_smaller_gpu_gets_ollamas_smaller_default(layout):
    p = answer(Predictor(), layout.server(), load("qwen3:30b"), gpu_memory=16 * GiB)
    assert p.spec is not None and p.spec.settings.n_ctx == 4096 and p.spec.settings.n_ubatch == 512
    assert p.spec.rule == "ctx 4096 (Ollama's default for 16.0GiB of GPU memory)"


def test_what_cannot_be_predicted_says_why(layout):
    server = layout.server()
    p = answer(Predictor(), server, load("qwen3:8b"))  # never pulled
    manifest = parse_reference("qwen3:8b").manifest(str(layout.models))
    assert p.bytes is None and p.source == f"{manifest}: No such file or directory"
    nowhere = server_settings(["ollama", "serve"], {})
    assert nowhere is not None
    p = ollama.predict(Predictor(), nowhere, load("qwen3"), MEM_TOTAL)
    assert p.source == (
        "ollama: models directory unknown: no OLLAMA_MODELS,"
        " and the service user's home is not known"
    )
    p = ollama.predict(Predictor(), server, load("../x"), MEM_TOTAL)
    assert p.source == "ollama: model '../x': not a valid model name (namespace)"


@pytest.mark.parametrize(
    ("manifest", "error"),
    [
        ([layer(ollama.MEDIA_PROJECTOR, "projector")], "no GGUF model layer"),
        ([{"mediaType": ollama.MEDIA_MODEL, "digest": "sha256:" + "zz" * 32}], "layer 0: no media"),
        ([{"mediaType": ollama.MEDIA_MODEL, "digest": "sha256:../../../../etc/passwd"}], "layer 0"),
        ([{"mediaType": ollama.MEDIA_MODEL}], "layer 0: no media type or no sha256 digest"),
        ([layer(ollama.MEDIA_MODEL, "qwen3"), "x"], "layer 1: no media type or no sha256 digest"),
        ('{"layers": {"a": 1}}', "manifest has no list of layers"),
        ("not json", "manifest is not JSON"),
        ("[" * 300000, "manifest over 262144 bytes"),
        ("[" * 100000, "manifest is not JSON"),
        (b"\xff\xfe", "manifest is not JSON"),
        ([layer(ollama.MEDIA_MODEL, "qwen3")] * 1025, "manifest has over 1024 layers"),
        ([layer(ollama.MEDIA_MODEL, "params-bad")], "not a GGUF file"),
        (
            [layer(ollama.MEDIA_MODEL, "qwen3"), layer(ollama.MEDIA_PARAMS, "params-bad")],
            "must be an integer",
        ),
        (
            [layer(ollama.MEDIA_MODEL, "qwen3"), layer(ollama.MEDIA_PARAMS, "qwen3")],
            "params over 65536 bytes",
        ),
        (
            [layer(ollama.MEDIA_MODEL, "qwen3"), layer(ollama.MEDIA_PARAMS, "junk")],
            "params is not JSON",
        ),
        (
            [layer(ollama.MEDIA_MODEL, "qwen3"), layer(ollama.MEDIA_PARAMS, "list")],
            "params is not a JSON object",
        ),
    ],
)
def test_manifest_problems_are_named(layout, manifest, error):
    layout.params("params-bad", {"num_ctx": "eight thousand"})
    layout.params("list", [1, 2])
    layout.blob("junk").write_text("num_ctx 8192")
    layout.manifest("bad:latest", manifest)
    p = answer(Predictor(), layout.server(), load("bad"))
    assert p.bytes is None and error in p.source
    assert p.source.startswith(str(layout.models)), p.source  # names its file


def test_a_huge_manifest_or_params_blob_is_read_bounded(layout):
    path = layout.manifest("huge:latest", "")
    os.truncate(path, 1 << 40)  # a sparse terabyte
    t = time.monotonic()
    p = answer(Predictor(), layout.server(), load("huge"))
    assert p.source == f"{path}: manifest over 262144 bytes" and time.monotonic() - t < 2
    layout.manifest(
        "huge:latest", [layer(ollama.MEDIA_MODEL, "qwen3"), layer(ollama.MEDIA_PARAMS, "big")]
    )
    layout.blob("big").write_text("")
    os.truncate(layout.blob("big"), 1 << 40)
    p = answer(Predictor(), layout.server(), load("huge"))
    assert p.source == f"{layout.blob('big')}: params over 65536 bytes"


def test_a_fifo_as_manifest_or_blob_is_refused_at_once(layout):
    fifo_manifest = Path(parse_reference("fifo").manifest(str(layout.models)))
    fifo_manifest.parent.mkdir(parents=True)
    os.mkfifo(fifo_manifest)  # no writer, ever
    os.mkfifo(layout.blob("fifo-blob"))
    layout.manifest("fifo2:latest", [layer(ollama.MEDIA_MODEL, "fifo-blob")])
    layout.manifest("dir:latest", "")
    dir_manifest = Path(parse_reference("dir").manifest(str(layout.models)))
    dir_manifest.unlink()
    dir_manifest.mkdir()
    predictor = Predictor()
    t = time.monotonic()
    first = ollama.predict(predictor, layout.server(), load("fifo"), MEM_TOTAL, wait=False)
    assert time.monotonic() - t < 0.1 and first.bytes is None
    assert (
        answer(predictor, layout.server(), load("fifo")).source
        == f"{fifo_manifest}: not a regular file"
    )
    blob = answer(predictor, layout.server(), load("fifo2")).source
    assert blob == f"{layout.blob('fifo-blob')}: not a regular file"
    assert (
        answer(predictor, layout.server(), load("dir")).source
        == f"{dir_manifest}: not a regular file"
    )
    assert time.monotonic() - t < 2


def test_the_last_model_layer_and_the_first_projector_are_loaded(layout, ggufs):
    layout.manifest(
        "two:latest",
        [
            layer(ollama.MEDIA_MODEL, "embed"),
            layer(ollama.MEDIA_PROJECTOR, "projector"),
            layer(ollama.MEDIA_PROJECTOR, "next"),
            layer(ollama.MEDIA_MODEL, "qwen3"),
            layer(ollama.MEDIA_DRAFT, "embed"),
        ],
    )
    got = ollama.read(parse_reference("two").manifest(str(layout.models)))
    assert got.model_path == str(layout.blob("qwen3"))
    assert got.projector_path == str(layout.blob("projector"))
    assert got.notes == ("a draft model layer: not counted",)
    assert got.model.tensor_bytes == read_model(str(ggufs["qwen3"])).tensor_bytes


# --- as a real unprivileged user ----------------------------------------------------------


@pytest.mark.root
def test_her_models_are_read_with_her_rights_and_root_only_files_stay_unknown(
    mallory: User, public_dir: Path
):
    models = mallory.home / "ollama-models"
    mallory.sh(f"mkdir -p {models}/blobs")
    # Her own model, hers on disk (written by root here, then given to her).
    work = public_dir / "work"
    work.mkdir()
    mine = synth.write(SMALL["embed"], work)
    hexa = digest_of("mine")
    os.rename(mine, models / "blobs" / f"sha256-{hexa}")
    os.chown(models / "blobs" / f"sha256-{hexa}", mallory.uid, mallory.gid)
    # Root's: a shadow-like file, and a real GGUF only root may read.
    shadow = public_dir / "shadow"
    shadow.write_text("root:$y$j9T$secret:19000:0:99999:7:::\n")
    secret = synth.write(SMALL["next"], public_dir)
    for f in (shadow, secret):
        f.chmod(0o600)
    secret_hex = digest_of("secret")
    m = f"{models}/manifests/registry.ollama.ai/library"
    own = json.dumps({"layers": [{"mediaType": ollama.MEDIA_MODEL, "digest": f"sha256:{hexa}"}]})
    stolen = json.dumps(
        {"layers": [{"mediaType": ollama.MEDIA_MODEL, "digest": f"sha256:{secret_hex}"}]}
    )
    absent = json.dumps(
        {"layers": [{"mediaType": ollama.MEDIA_MODEL, "digest": "sha256:" + "0" * 64}]}
    )
    mallory.sh(
        f"mkdir -p {m}/mine {m}/shadow {m}/secret {m}/absent {m}/gone\n"
        f"printf '%s' '{own}' > {m}/mine/latest\n"
        f"ln -s {shadow} {m}/shadow/latest\n"  # her manifest is root's file
        f"printf '%s' '{stolen}' > {m}/secret/latest\n"
        f"ln -s {secret} {models}/blobs/sha256-{secret_hex}\n"  # her blob is root's GGUF
        f"printf '%s' '{absent}' > {m}/absent/latest\n"
    )
    server = server_settings(["ollama", "serve"], {"OLLAMA_MODELS": str(models)})
    assert server is not None
    predictor = Predictor()

    def ask(model: str, owner: int | None) -> Prediction:
        give_up = time.monotonic() + 5
        while True:
            p = ollama.predict(predictor, server, load(model), MEM_TOTAL, owner=owner, wait=False)
            if not p.pending:
                return p
            assert time.monotonic() < give_up
            time.sleep(0.02)

    ok = ask("mine", mallory.uid)
    assert ok.bytes == expected(models / "blobs" / f"sha256-{hexa}", n_ctx=32768, n_ubatch=2048)
    said = {}
    for model in ("shadow", "secret", "absent", "gone"):
        p = ask(model, mallory.uid)
        assert p.bytes is None
        said[model] = (
            p.source.replace(str(models), "MODELS").replace(secret_hex, "H").replace("0" * 64, "H")
        )
    one = f"cannot open the model (missing, or unreadable to uid {mallory.uid})"
    assert said == {
        "shadow": f"MODELS/manifests/registry.ollama.ai/library/shadow/latest: {one}",
        "secret": f"MODELS/blobs/sha256-H: {one}",
        "absent": f"MODELS/blobs/sha256-H: {one}",
        "gone": f"MODELS/manifests/registry.ollama.ai/library/gone/latest: {one}",
    }
    # Root itself would have told them apart: the test is not blind.
    assert ask("shadow", None).source.endswith("shadow/latest: manifest is not JSON")
    assert ask("secret", None).bytes is not None

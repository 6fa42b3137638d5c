"""LM Studio: where a load's model is, and what the load will hold.

LM Studio runs llama.cpp on Linux, in its own server process: the app run
headless (`--run-as-service`), or the `llmster` daemon (`lms daemon up` starts
it; `lms server start` only opens its HTTP port). A client, `lms load KEY`,
asks that server to load the model, so the memory appears in the *server's*
unit, not in the client's. One exception: any `lms` command that finds no
server running starts one itself, detached, from
`<LM Studio home>/.internal/{llmster,app}-install-location.json`
(lmstudio-js, findOrStartLlmster): then the server runs in the client's cgroup.

Reading `lms load` and the servers' command lines is core/argv/lmstudio.py's; this
module finds the model a load names and says what it will hold:

    predict(predictor, load, mem_total, *, owner, home, env=None, wait=True) -> Prediction
        The footprint of `load` on the LM Studio of `home` (the home of the user whose
        server will load it: the server unit's owner, usually the client's too) and
        `env` (that server's environment, for LMSTUDIO_HOME). The key is resolved to
        its GGUF off the caller's thread with `owner`'s file rights (Predictor.run),
        then the GGUF (and its projector) is read like any model and estimated as
        llama.cpp would hold it with LM Studio's settings. Like Predictor.predict:
        `wait=False` never blocks (a pending Prediction until the answers are there).
    resolve(load, home, env=None, deadline=None) -> Found
        predict's job, with the caller's rights: where LM Studio keeps the model,
        which file, and the per-model load config. ModelFileError (one line) if it cannot.

Where LM Studio looks (lmstudio-js, lms-common-server findLMStudioHome, and lms
src/modelsFolder.ts): its home is $LMSTUDIO_HOME, else the path in
`~/.lmstudio-home-pointer`, else `~/.cache/lm-studio` if it exists (older
installs), else `~/.lmstudio`; models are under settings.json's `downloadsFolder`,
else `<home>/models`, as `<publisher>/<repo>/<file>.gguf`. Per-model load settings
are in `<home>/.internal/user-concrete-model-default-config/<publisher>/<repo>/<file>.json`.
docs/estimator.md ("LM Studio") says how a key is matched and which defaults apply.

Every path, name and value here is a user's text: keys are checked (no '..', no
shell variables, bounded), JSON files are read bounded, regular files only, and
directories are listed bounded, all with the reader's rights only.
"""

from __future__ import annotations

import json
import os
import re
import stat
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ..core.argv.lmstudio import MAX_TOKENS, LmsLoad
from ..core.argv.loadspec import LoadSpec, Settings
from ..core.quantities import format_size
from ..core.text import quoted
from ..system.safefs import UnsafePath, read_regular
from .estimate import CACHE_TYPES
from .gguf import READ_SECONDS
from .modelfile import ModelFileError, ModelOpenError, ModelTimeout, ModelUnreadable
from .predict import PENDING, Prediction, Predictor

# LM Studio's load defaults, from its config schema (lmstudio-js,
# packages/lms-kv-config/src/schema.ts, scope "llm.load"): numParallelSessions 4,
# useUnifiedKvCache true, llama.flashAttention false, llama.physicalBatchSize (n_ubatch)
# 512, K/V cache types f16 unless checked otherwise. contextLength is 2048 there but marked
# machineDependent: the app sets it per machine, and loads without a setting come up at
# 4096 (lmstudio-bug-tracker #1806, zed #33938: loaded_context_length 4096). The larger
# of the two is taken, so the estimate does not fall short of a real load.
DEFAULT_CONTEXT = 4096
DEFAULT_PARALLEL = 4
DEFAULT_UNIFIED = True
DEFAULT_FLASH_ATTN = False
DEFAULT_UBATCH = 512

POINTER = ".lmstudio-home-pointer"
CONFIG_DIR = (".internal", "user-concrete-model-default-config")
HUB_DIR = ("hub", "models")

MAX_KEY = 1024  # characters of a model key or path
MAX_PATH = 4096  # PATH_MAX: a folder named in LM Studio's files
MAX_NAME = 255  # one path component
MAX_POINTER = 4 << 10  # ~/.lmstudio-home-pointer: one path
MAX_SETTINGS = 256 << 10  # settings.json: LM Studio's are a few kB
MAX_CONFIG = 256 << 10  # a per-model config: a chat template at most, tens of kB
MAX_YAML = 64 << 10  # a hub model.yaml: a few kB
MAX_ENTRIES = 4096  # entries of one directory listed
# Entries listed in all for one resolve: a user's 4,095 symlinks to one folder of 4,095
# files were each listed and kept, 928 MiB; no folder is listed twice either.
MAX_TOTAL_ENTRIES = 4 * MAX_ENTRIES
MAX_MODEL_DIRS = 16384  # <publisher>/<repo> folders looked at in all
MAX_LISTED = 64  # candidate folders whose files are listed to tell models apart
MAX_NAMED = 5  # candidates named in an answer

_SHARD = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
_YAML_SOURCE = re.compile(r"^\s*(?:-\s*)?(user|repo)\s*:\s*[\"']?([^\"'\s#]+)", re.MULTILINE)


# The per-model config's load fields this reads ("llm.load.*" in the schema above).
_CONFIG_KEYS = {
    "llm.load.contextLength": "context_length",
    "llm.load.numParallelSessions": "parallel",
    "llm.load.useUnifiedKvCache": "unified",
    "llm.load.llama.flashAttention": "flash_attn",
    "llm.load.llama.kCacheQuantizationType": "cache_k",
    "llm.load.llama.vCacheQuantizationType": "cache_v",
    "llm.load.llama.physicalBatchSize": "ubatch",
    "llm.load.llama.tryMmap": "mmap",
}


# --- command lines ---------------------------------------------------------------------------


# --- where LM Studio keeps a model -------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    """A model's own load settings in LM Studio (None: not set there)."""

    path: str = ""  # the file they came from; "" if there is none
    context_length: int | None = None
    parallel: int | None = None
    unified: bool | None = None
    flash_attn: bool | None = None
    cache_k: str | None = None
    cache_v: str | None = None
    ubatch: int | None = None
    mmap: bool | None = None
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Found:
    """Where a key led: the model file and what LM Studio will load it with."""

    key: str
    model: str  # the GGUF (the first shard of a split model; the reader takes all)
    mmproj: str | None  # the vision projector beside it, which LM Studio loads with it
    rule: str  # how the key was matched
    folder: str  # the models folder
    config: Config = field(default_factory=Config)
    notes: tuple[str, ...] = ()

    @property
    def cost(self) -> int:
        """Rough bytes held (Predictor keeps answers bounded by it)."""
        return (
            1024
            + 2 * (len(self.key) + len(self.model) + len(self.folder))
            + sum(len(n) for n in (*self.notes, *self.config.notes))
        )


def _tick(deadline: float, where: str) -> None:
    if time.monotonic() > deadline:
        raise ModelTimeout(f"{where}: LM Studio's folders read past the deadline")


def _absolute(raw: str, where: str) -> str:
    """A folder named in a user's file or environment: absolute, plain, bounded."""
    if len(raw) > MAX_PATH or "\0" in raw or "\n" in raw:
        raise ModelFileError(f"{where}: {quoted(raw)}: not a path")
    if not os.path.isabs(raw):
        raise ModelFileError(f"{where}: {quoted(raw)}: not an absolute path")
    if ".." in raw.split("/"):
        raise ModelFileError(f"{where}: {quoted(raw)}: '..' is not followed")
    return os.path.normpath(raw)


def _read_text(path: str, limit: int) -> str | None:
    """A small file of LM Studio's, read bounded; None if it is not there or not readable
    (one answer for both: LM Studio itself then goes on without it)."""
    try:
        data = read_regular(path, limit + 1)
    except UnsafePath:
        raise ModelFileError(f"{path}: not a regular file") from None
    except OSError:
        return None
    if len(data) > limit:
        raise ModelFileError(f"{path}: over {limit} bytes (LM Studio's own are a few kB)")
    return data.decode("utf-8", errors="replace")


def _is_dir(path: str) -> bool:
    try:
        return stat.S_ISDIR(os.stat(path).st_mode)
    except OSError:
        return False


def lmstudio_home(home: str, env: Mapping[str, str] | None = None) -> tuple[str, str]:
    """(LM Studio's home, whence), looked up as findLMStudioHome does."""
    raw = (env or {}).get("LMSTUDIO_HOME")
    if raw:
        return _absolute(raw, "LMSTUDIO_HOME"), "LMSTUDIO_HOME"
    pointer = os.path.join(home, POINTER)
    text = _read_text(pointer, MAX_POINTER)
    if text is not None and text.strip():
        return _absolute(text.strip(), pointer), pointer
    legacy = os.path.join(home, ".cache", "lm-studio")
    if _is_dir(legacy):
        return legacy, "the older ~/.cache/lm-studio"
    return os.path.join(home, ".lmstudio"), "the default ~/.lmstudio"


def models_folder(lm_home: str) -> tuple[str, str]:
    """(the models folder, whence): settings.json's downloadsFolder, else <home>/models."""
    default = os.path.join(lm_home, "models")
    settings = os.path.join(lm_home, "settings.json")
    text = _read_text(settings, MAX_SETTINGS)
    if text is None:
        return default, "LM Studio's default"
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):
        return default, f"LM Studio's default ({settings} is not JSON)"
    folder = data.get("downloadsFolder") if isinstance(data, dict) else None
    if not isinstance(folder, str):  # lms does the same (src/modelsFolder.ts)
        return default, "LM Studio's default"
    return _absolute(folder, f"{settings}: downloadsFolder"), f"downloadsFolder in {settings}"


def _component(part: str, key: str) -> str:
    if part in ("", ".") or len(part) > MAX_NAME:
        raise ModelFileError(
            f"model key {quoted(key)}: {quoted(part)} is not a folder or file name"
        )
    if part == "..":
        raise ModelFileError(f"model key {quoted(key)}: '..' is not followed")
    return part


def _check_key(key: str) -> str:
    if len(key) > MAX_KEY or "\0" in key:
        raise ModelFileError(
            f"model key {quoted(key)}: not a model key (over {MAX_KEY} characters?)"
        )
    if "$" in key or "`" in key:
        raise ModelFileError(f"model key {quoted(key)}: it comes from the shell, not known here")
    if not key.strip():
        raise ModelFileError("model key '': empty")
    if ".." in key.split("/"):
        raise ModelFileError(f"model key {quoted(key)}: '..' is not followed")
    return key.strip()


class _Folders:
    """Directory listings for one resolve: bounded, with the caller's rights, cached."""

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        self._cache: dict[tuple[str, bool], list[tuple[str, bool]]] = {}
        # (st_dev, st_ino, dirs_only) of the folders listed: each at most once each way
        self._listed: set[tuple[int, int, bool]] = set()
        self._spent = 0  # entries listed in all

    def entries(
        self, path: str, *, root: bool = False, dirs_only: bool = False
    ) -> list[tuple[str, bool]]:
        """(name, is a directory) of `path`; [] if it cannot be listed, or ModelOpenError for
        the models folder itself (`root`), which then cannot be opened whatever the reason.
        `dirs_only`: its folders only (a walk to <publisher>/<repo> keeps no file names)."""
        key = (path, dirs_only)
        if key in self._cache:
            return self._cache[key]
        _tick(self.deadline, path)
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = os.open(path, flags)
        except OSError as e:
            if root:
                raise ModelOpenError(path, e) from None
            self._cache[key] = []
            return []
        out: list[tuple[str, bool]] = []
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino, dirs_only) in self._listed:
                # A folder reached again (a symlink to one listed already) is not followed
                # twice: what it holds was seen where it was first reached.
                self._cache[key] = out
                return out
            self._listed.add((st.st_dev, st.st_ino, dirs_only))
            with os.scandir(fd) as it:
                for n, entry in enumerate(it):
                    if n >= MAX_ENTRIES:
                        raise ModelFileError(f"{path}: over {MAX_ENTRIES} entries: not searched")
                    self._spent += 1
                    if self._spent > MAX_TOTAL_ENTRIES:
                        raise ModelFileError(
                            f"{path}: over {MAX_TOTAL_ENTRIES} entries listed in all: not searched"
                        )
                    if n % 256 == 255:
                        _tick(self.deadline, path)
                    try:
                        is_dir = entry.is_dir()  # follows a symlink, with these rights
                    except OSError:
                        is_dir = False
                    if is_dir or not dirs_only:
                        out.append((entry.name, is_dir))
        except OSError as e:
            raise ModelUnreadable(f"{path}: cannot list: {e.strerror}") from None
        finally:
            os.close(fd)
        out.sort()  # one order, whatever the filesystem's
        self._cache[key] = out
        return out


@dataclass(frozen=True)
class _Dir:
    publisher: str
    repo: str

    @property
    def name(self) -> str:
        return f"{self.publisher}/{self.repo}"

    @property
    def short(self) -> str:
        """The repo as LM Studio keys it: lower case, without its -GGUF suffix."""
        r = self.repo.lower()
        for suffix in ("-gguf", "_gguf", ".gguf"):
            if r.endswith(suffix) and len(r) > len(suffix):
                return r[: -len(suffix)]
        return r

    def names(self) -> set[str]:
        p = self.publisher.lower()
        return {f"{p}/{self.repo.lower()}", f"{p}/{self.short}", self.repo.lower(), self.short}


@dataclass(frozen=True)
class _Files:
    models: tuple[str, ...]  # file names: single files and the first shard of split ones
    projectors: tuple[str, ...]


def _files(names: Iterable[tuple[str, bool]]) -> _Files:
    ggufs = sorted(n for n, is_dir in names if not is_dir and n.lower().endswith(".gguf"))
    projectors = tuple(n for n in ggufs if "mmproj" in n.lower())
    models: dict[str, None] = {}
    for n in ggufs:
        if n in projectors:
            continue
        m = _SHARD.match(n)
        first = f"{m.group('stem')}-00001-of-{m.group('count')}.gguf" if m else n
        models[first] = None
    return _Files(tuple(models), projectors)


def _named(dirs: Sequence[_Dir] | Sequence[str]) -> str:
    names = [d.name if isinstance(d, _Dir) else d for d in dirs]
    more = f" and {len(names) - MAX_NAMED} more" if len(names) > MAX_NAMED else ""
    return ", ".join(names[:MAX_NAMED]) + more


def _subsequence(pattern: str, text: str) -> bool:
    """The `fuzzy` package's match, as lms uses it: every character, in order."""
    it = iter(text)
    return all(c in it for c in pattern)


def _hub_sources(text: str) -> list[tuple[str, str]]:
    """(user, repo) of the Hugging Face sources of a hub model.yaml (`base: - key: ...
    sources: - type: huggingface / user: U / repo: R`), in order; a line scan, no YAML."""
    pairs: list[tuple[str, str]] = []
    user: str | None = None
    for m in _YAML_SOURCE.finditer(text):
        if m.group(1) == "user":
            user = m.group(2)
        elif user is not None:
            pairs.append((user, m.group(2)))
            user = None
        if len(pairs) >= 16:
            break
    return pairs


def resolve(
    load: LmsLoad,
    home: str,
    env: Mapping[str, str] | None = None,
    deadline: float | None = None,
) -> Found:
    """The GGUF `load` would have LM Studio load, found with the caller's file rights."""
    if deadline is None:
        deadline = time.monotonic() + READ_SECONDS
    if load.key is None:
        raise ModelFileError("lms load without a model key: it asks which model, on a terminal")
    key = _check_key(load.key)
    lm_home, home_from = lmstudio_home(home, env)
    folder, folder_from = models_folder(lm_home)
    notes: tuple[str, ...] = (
        f"LM Studio home {lm_home} ({home_from}); models in {folder} ({folder_from})",
    )
    folders = _Folders(deadline)
    if key.lower().endswith(".gguf") or load.exact:
        publisher, repo, name = _path_key(key, folder, load.exact)
        rule = "path"
        where = os.path.join(folder, publisher, repo)
        listed = folders.entries(where)
        model = name
        m = _SHARD.match(name)
        if m:
            model = f"{m.group('stem')}-00001-of-{m.group('count')}.gguf"
        files = _files(listed)
    else:
        name_part, _, variant = key.partition("@")
        chosen, rule = _match(name_part, folder, lm_home, folders)
        publisher, repo = chosen.publisher, chosen.repo
        where = os.path.join(folder, publisher, repo)
        files = _files(folders.entries(where))
        models = [f for f in files.models if variant.lower() in f.lower()] if variant else []
        models = models or list(files.models)
        if len(models) != 1:
            raise ModelFileError(
                f"{where} holds {len(models)} GGUF models ({_named(models)}): which one lms"
                " loads for the key is not known (LM Studio's choice is not documented);"
                " the key can name the file, or a quantization after '@'"
            )
        model = models[0]
    mmproj = None
    if files.projectors:
        mmproj = _largest(where, files.projectors)
        if len(files.projectors) > 1:
            notes += (f"{len(files.projectors)} projector files beside it: the largest counted",)
    config = _config(lm_home, (publisher, repo, model))
    return Found(
        key=key,
        model=os.path.join(where, model),
        mmproj=os.path.join(where, mmproj) if mmproj else None,
        rule=rule,
        folder=folder,
        config=config,
        notes=notes,
    )


def _path_key(key: str, folder: str, exact: bool) -> tuple[str, str, str]:
    """(publisher, repo, file) of a key that is a model's path: `publisher/repo/file.gguf`,
    relative to the models folder (as lms shows it) or absolute inside it."""
    rel = key
    if os.path.isabs(key):
        inside = folder.rstrip("/") + "/"
        if not os.path.normpath(key).startswith(inside):
            raise ModelFileError(
                f"{quoted(key)}: not in LM Studio's models folder {folder} (lms loads from there)"
            )
        rel = os.path.normpath(key)[len(inside) :]
    parts = rel.split("/")
    if len(parts) != 3 or not parts[2].lower().endswith(".gguf"):
        why = "--exact takes a model's path" if exact else "a model's path is"
        raise ModelFileError(f"model key {quoted(key)}: {why} publisher/repo/file.gguf")
    publisher, repo, name = (_component(p, key) for p in parts)
    return publisher, repo, name


def _match(key: str, folder: str, lm_home: str, folders: _Folders) -> tuple[_Dir, str]:
    """The <publisher>/<repo> folder a key names, by the first rule that finds any:
    its name (publisher/repo or repo, case and a -GGUF suffix aside), a hub model.yaml's
    sources, its last component, then lms's own fuzzy match. Several: no answer."""
    parts = key.split("/")
    if len(parts) > 2:
        raise ModelFileError(
            f"model key {quoted(key)}: neither publisher/repo nor a path to a .gguf"
        )
    for p in parts:
        _component(p, key)
    dirs: list[_Dir] = []
    for publisher, is_dir in folders.entries(folder, root=True, dirs_only=True):
        if not is_dir or publisher.startswith("."):
            continue
        for repo, repo_is_dir in folders.entries(os.path.join(folder, publisher), dirs_only=True):
            if repo_is_dir and not repo.startswith("."):
                dirs.append(_Dir(publisher, repo))
                if len(dirs) > MAX_MODEL_DIRS:
                    raise ModelFileError(
                        f"{folder}: over {MAX_MODEL_DIRS} model folders: not searched"
                    )
    wanted = key.lower()
    rules: list[tuple[str, list[_Dir]]] = [("by name", [d for d in dirs if wanted in d.names()])]
    if len(parts) == 2:
        yaml = os.path.join(lm_home, *HUB_DIR, parts[0], parts[1], "model.yaml")
        text = _read_text(yaml, MAX_YAML)
        sources = _hub_sources(text) if text else []
        hub = [
            d
            for user, repo in sources
            for d in dirs
            if (d.publisher.lower(), d.repo.lower()) == (user.lower(), repo.lower())
        ]
        rules.append(("by its hub model.yaml", list(dict.fromkeys(hub))))
        last = parts[1].lower()
        rules.append(
            ("by its last component", [d for d in dirs if last in (d.short, d.repo.lower())])
        )
    fuzzy = [
        d
        for d in dirs
        if any(_subsequence(wanted, k) for k in (f"{d.publisher.lower()}/{d.short}", d.short))
    ]
    rules.append(("by lms's fuzzy match", fuzzy))
    for rule, found in rules:
        if not found:
            continue
        if len(found) > MAX_LISTED:
            raise ModelFileError(
                f"model key {quoted(key)} matches {len(found)} model folders ({rule})"
            )
        with_models = [
            d
            for d in found
            if _files(folders.entries(os.path.join(folder, d.publisher, d.repo))).models
        ]
        if len(with_models) == 1:
            return with_models[0], rule
        if len(with_models) > 1:
            raise ModelFileError(
                f"model key {quoted(key)} matches {len(with_models)} models ({rule}):"
                f" {_named(with_models)}; which one lms loads is not known"
            )
    raise ModelFileError(f"model key {quoted(key)}: no GGUF model in {folder} matches it")


def _largest(where: str, names: Sequence[str]) -> str:
    def size(name: str) -> int:
        try:
            return os.stat(os.path.join(where, name)).st_size
        except OSError:
            return -1

    return max(names[:MAX_LISTED], key=size)


def _config(lm_home: str, rel: tuple[str, str, str]) -> Config:
    """The model's own load settings in LM Studio, where it keeps them (as the app writes
    them: `load.fields`, a list of {key, value}; a checkbox value is {checked, value})."""
    path = os.path.join(lm_home, *CONFIG_DIR, *rel[:2], rel[2] + ".json")
    text = _read_text(path, MAX_CONFIG)
    if text is None:
        return Config()
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):
        return Config(path, notes=(f"{path}: not JSON, left out",))
    load = data.get("load") if isinstance(data, dict) else None
    fields = load.get("fields") if isinstance(load, dict) else None
    values: dict[str, Any] = {}
    notes: list[str] = []
    for item in fields if isinstance(fields, list) else []:
        if not isinstance(item, dict) or item.get("key") not in _CONFIG_KEYS:
            continue
        name = _CONFIG_KEYS[item["key"]]
        value = item.get("value")
        if isinstance(value, dict) and "value" in value:  # {checked, value}
            if value.get("checked") is False:
                continue
            value = value["value"]
        good = _config_value(name, value)
        if good is None:
            notes.append(f"{path}: {item['key']} {quoted(str(value), 32)} left out")
        else:
            values[name] = good
    return Config(path, notes=tuple(notes[:MAX_NAMED]), **values)


def _config_value(name: str, value: Any) -> Any:
    if name in ("unified", "flash_attn", "mmap"):
        return value if isinstance(value, bool) else None
    if name in ("cache_k", "cache_v"):
        return value.lower() if isinstance(value, str) and value.lower() in CACHE_TYPES else None
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if not float(value).is_integer():
        return None
    high = 1023 if name == "parallel" else MAX_TOKENS
    return int(value) if 1 <= value <= high else None


# --- the footprint -----------------------------------------------------------------------------


def settings(load: LmsLoad, config: Config) -> tuple[Settings, str]:
    """The llama.cpp settings LM Studio loads with, and where the context length came from:
    the command line, then the model's own config, then LM Studio's defaults."""
    if load.context_length is not None:
        n_ctx, whence = load.context_length, "--context-length"
    elif config.context_length is not None:
        n_ctx, whence = config.context_length, "the model's LM Studio config"
    else:
        n_ctx, whence = DEFAULT_CONTEXT, "LM Studio's default"
    flash = config.flash_attn if config.flash_attn is not None else DEFAULT_FLASH_ATTN
    s = Settings(
        n_ctx=n_ctx,
        n_parallel=load.parallel or config.parallel or DEFAULT_PARALLEL,
        kv_unified=config.unified if config.unified is not None else DEFAULT_UNIFIED,
        cache_type_k=config.cache_k or "f16",
        cache_type_v=config.cache_v or "f16",
        flash_attn="on" if flash else "off",
        n_ubatch=config.ubatch or DEFAULT_UBATCH,
        no_mmap=config.mmap is False,
    )
    return s, whence


def predict(
    predictor: Predictor,
    load: LmsLoad,
    mem_total: int,
    *,
    owner: int | None,
    home: str,
    env: Mapping[str, str] | None = None,
    wait: bool = True,
) -> Prediction:
    """What `load` will hold in the LM Studio server of `home` (see the module's doc)."""
    key = load.key if load.key is None or len(load.key) <= 200 else load.key[:200] + "..."
    said = f"lms load {key}" if key is not None else "lms load"
    if not load.loads:
        why = "--estimate-only (LM Studio's own estimate)" if load.estimate_only else "--help"
        return Prediction(0, f"lms load {why}: loads nothing")
    if load.remote:
        host = quoted(load.host or "")
        return Prediction(None, f"{said} --host {host}: loads on that machine, if it is another")
    lm_env = {k: v for k, v in (env or {}).items() if k == "LMSTUDIO_HOME"}
    name = f"{said} (--exact {load.exact}) for the LM Studio of {home} {sorted(lm_env.items())}"

    def job(deadline: float) -> Found:
        return resolve(load, home, lm_env, deadline)

    got = predictor.run(name, owner, job, wait=wait)
    if got is None:
        return Prediction(None, PENDING, pending=True)
    if isinstance(got, str):
        return Prediction(None, f"{said}: {got}")
    assert isinstance(got, Found)
    draft: Found | None = None
    if load.draft_model:
        # --speculative-draft-model: a key of the same models folder, found the same way.
        aside = replace(load, key=load.draft_model, exact=False, draft_model=None)

        def draft_job(deadline: float) -> Found:
            return resolve(aside, home, lm_env, deadline)

        found = predictor.run(f"draft {name} {aside.key}", owner, draft_job, wait=wait)
        if found is None:
            return Prediction(None, PENDING, pending=True)
        if isinstance(found, str):
            return Prediction(None, f"{said} --speculative-draft-model: {found}")
        assert isinstance(found, Found)
        draft = found
    s, whence = settings(load, got.config)
    spec = LoadSpec(
        kind="lmstudio",
        binary=os.path.basename(load.binary),
        model=got.model,
        mmproj=got.mmproj,
        settings=s,
        notes=(*load.notes, *got.notes, *got.config.notes),
        draft=draft.model if draft else None,
        # Its own context as llama.cpp makes a draft's: the main one's settings, f16 KV
        # (LM Studio does not say otherwise: approximate).
        draft_settings=replace(s, cache_type_k="f16", cache_type_v="f16") if draft else None,
    )
    p = predictor.for_spec(spec, mem_total, owner=owner, wait=wait)
    shown = f"{said} → {got.model} ({got.rule})"
    if p.pending or p.estimate is None:
        return p if p.pending else replace(p, source=f"{shown}: {p.source}")
    if draft is not None:
        shown += f" with draft {os.path.basename(draft.model)}"
    source = f"{shown}, ctx {p.estimate.n_ctx} ({whence}): {format_size(p.estimate.total)}"
    return replace(p, source=source)

"""A loader container's footprint before it allocates: its command, its mounts, its model.

A container's command (the engine's Path + Args) is read by the same load specs
as a unit's ExecStart= (core/argv/loadspec.py: llama-server and the rest of llama.cpp,
vLLM's --gpu-memory-utilization as a share of MemTotal, SGLang, TGI...), and
predicted by the same Predictor.for_spec. What differs is where its model is:

- A path in the command is the container's. It is mapped to the host through
  the container's mounts: the longest mount destination that is a prefix of it,
  component by component (`/models` holds `/models/x.gguf`, not
  `/models2/x.gguf`), gives the host's source, and the rest of the path is
  appended to it. A path in no mount is in the image's own filesystem, which
  the guard does not read: no prediction from the file (a rule that needs none,
  --gpu-memory-utilization, still gives one). A relative path, or one with a
  `..` anywhere, is refused, never resolved: `..` after a directory that is a
  symlink inside the container means something else than the text says.
- The host file belongs to whoever made the mount: anyone in the docker group,
  who can make any file and any symlink, root's included (a container runs as
  root). So it is read with the guard's own rights (root), the mount's source
  walked from / one component at a time with O_NOFOLLOW (a symlink there, even
  one root owns, means no prediction), and the rest resolved beneath the source
  as openat2's RESOLVE_BENEATH would (beneath.open_beneath): a relative symlink is
  followed while it stays beneath the mount (a Hugging Face cache's snapshot
  files point into `../../blobs/`), one that climbs out or is absolute (inside
  the container it names the container's root) means no prediction. The file
  must be a regular file before it is opened (lstat, then fstat of what was
  opened): a device a container made with mknod is never opened.
- The read runs as a unit's model does: off the loop on the Predictor's worker
  thread (Predictor.run), within its deadline, its header cached by path and
  identity, its answer kept a while; `wait=False` gives a pending Prediction
  until it is there.
- A safetensors directory (TGI's --model-id) is not read: its reader follows
  symlinks by design (Hugging Face caches are symlinks). TGI's share of the
  memory is still its footprint; the source says the weights were not read.

The hook into predict.py is Predictor.for_spec's `read` (predict.ModelRead): the
spec keeps the path as the container names it (the shown source says that
path), and only this module's reader knows the mounts. The mapping
(`host_path`) is pure.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence
from dataclasses import replace

from ..system import beneath, safefs
from ..system.engine import Container
from .gguf import HeaderCache, Model, read_model
from .modelfile import ModelFileError, ModelOpenError
from .predict import Held, Prediction, Predictor, parse_environment
from .safetensors import Model as SafetensorsModel

READ_NAME = "{host} (a container's mount)"  # the Predictor.run name of a read: its own kind


class MountError(ValueError):
    """A path in a container that does not lead to a host file the guard reads; str() says
    why, naming the path."""


def _components(path: str) -> list[str]:
    """The names of absolute `path`, without empty ones and `.`; MountError for `..`."""
    parts = [p for p in path.split("/") if p and p != "."]
    if ".." in parts:
        raise MountError(f"{path}: '..' is not followed in a container's path")
    return parts


def host_path(mounts: Sequence[tuple[str, str]], inside: str) -> str:
    """Where `inside` (a path in the container) is on the host, through `mounts` ((source
    on the host, destination inside) pairs, as Container holds them). Pure.

    MountError if it is relative, has a `..`, is in no mount (the image's own files), or
    its mount's source is not an absolute host path (a tmpfs has none)."""
    source, rest = in_mount(mounts, inside)
    return source + ("/" + rest if rest else "")


def in_mount(mounts: Sequence[tuple[str, str]], inside: str) -> tuple[str, str]:
    """(the host source of the mount `inside` is in, the rest of the path below it), as
    host_path says; the read resolves the rest beneath the source (beneath.open_beneath)."""
    if not inside.startswith("/"):
        raise MountError(f"{inside}: a relative path in a container is not resolved")
    parts = _components(inside)
    best: tuple[int, str] | None = None  # (destination's length in components, source)
    for source, destination in mounts:
        if not destination.startswith("/"):
            continue
        try:
            dest = _components(destination)
        except MountError:
            continue  # the engine cleans destinations; one with '..' matches nothing
        if parts[: len(dest)] == dest and (best is None or len(dest) > best[0]):
            best = (len(dest), source)
    if best is None:
        raise MountError(
            f"{inside}: in no mount of the container (the image's own files are not read)"
        )
    depth, source = best
    if not source.startswith("/"):
        raise MountError(f"{inside}: its mount's source {source!r} is not a path on the host")
    try:
        base = _components(source)
    except MountError:
        raise MountError(f"{inside}: its mount's source {source}: '..' is not followed") from None
    return "/" + "/".join(base), "/".join(parts[depth:])


# --- the read, on the Predictor's worker thread ---------------------------------------------


def _symlink(host: str, name: str) -> ModelFileError:
    return ModelFileError(f"{host}: {name!r} is a symlink, not followed in a container's mount")


def _open_beneath(source: str, rest: str, shown: str) -> tuple[int, os.stat_result]:
    """The regular file at `rest` beneath mount source `source` (beneath.open_beneath: a
    symlink is followed only while it stays beneath the mount, as a Hugging Face cache's
    snapshot files point into its blobs), its last component opened with no symlink
    followed; a FIFO, device or directory refused before it is opened."""
    try:
        dir_fd, name = beneath.open_beneath(source, rest)
    except safefs.UnsafePath as e:
        raise ModelFileError(f"{shown}: {e.strerror} in a container's mount") from None
    except OSError as e:
        raise ModelOpenError(shown, e) from None
    try:
        return _open_file(name, dir_fd, shown)
    finally:
        os.close(dir_fd)


def _open_file(name: str, dir_fd: int, shown: str) -> tuple[int, os.stat_result]:
    """An fd of regular file `name` in `dir_fd` and its stat (safefs.open_regular, no
    symlink followed); a symlink, FIFO, device or directory is refused before it is opened."""
    try:
        return safefs.open_regular(name, dir_fd=dir_fd, nofollow=True, shown=shown)
    except safefs.UnsafePath as e:
        raise ModelFileError(e.strerror) from None
    except OSError as e:
        if e.errno == errno.ELOOP:  # a symlink, or swapped for one since the stat
            raise _symlink(shown, name) from None
        raise ModelOpenError(shown, e) from None


def read_mounted(
    source: str, rest: str, *, deadline: float, cache: HeaderCache | None = None
) -> Model:
    """The GGUF model at `rest` beneath mount source `source` (all its shards, each by its
    own name beside it, each resolved beneath the mount), as gguf.read_model reads one;
    ModelFileError for the first problem, naming its file. With the caller's rights: the
    Predictor's worker, the guard's (root)."""
    shown = source + "/" + rest if rest else source
    if not rest:  # a file mounted as itself (-v /srv/m.gguf:/m.gguf): beneath its folder
        source, rest = os.path.dirname(source), os.path.basename(source)
    folder = os.path.dirname(rest)
    return read_model(
        shown,
        deadline=deadline,
        cache=cache,
        opener=lambda p: _open_beneath(source, os.path.join(folder, os.path.basename(p)), p),
    )


def predict_container(
    predictor: Predictor,
    container: Container,
    mem_total: int,
    *,
    wait: bool,
    owner: int | None = None,
) -> Prediction | None:
    """The footprint of `container`'s loader, as Predictor.predict gives a unit's; None when
    its command is no loader this knows. `wait=False`: never block; a pending Prediction
    while the model is read (ask again later), as Predictor.predict. `owner`: a user's
    rootless container, whose mounts are her files, read with her rights."""
    found: dict[str, str] = {}  # the container's paths read, and where they are on the host

    def read(path: str, kind: str, wait: bool) -> Model | SafetensorsModel | Held | str | None:
        try:
            source, rest = in_mount(container.mounts, path)
        except MountError as e:
            return str(e)
        host = source + "/" + rest if rest else source
        if kind != "gguf":
            return (
                f"{path}: a model directory in a container is not read yet (safetensors' "
                "reader follows symlinks)"
            )

        def job(deadline: float) -> Model:
            return read_mounted(source, rest, deadline=deadline, cache=predictor.headers)

        got = predictor.run(READ_NAME.format(host=host), owner, job, wait=wait)
        if got is None:
            return None
        if isinstance(got, str):
            return f"{path}: {got}"
        if not isinstance(got, Model):  # the name is this module's own: never another's read
            return f"{path}: {host}: not read"
        found[path] = host
        return got

    env = parse_environment(container.environment)
    p = predictor.predict([container.command], env, mem_total, wait=wait, read=read)
    if p is None or p.estimate is None or p.spec is None or p.spec.model not in found:
        return p
    return replace(p, source=f"{p.source}; {p.spec.model} is the host's {found[p.spec.model]}")

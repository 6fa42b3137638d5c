"""A loader's footprint before it allocates: its command line, its model's header, the estimate.

The sensor asks once per run of a unit; headers are cached by (path, size,
mtime), so a model read at boot is not read again. A missing or unreadable
model is not an error of the guard: the prediction says why there is none,
the unit is "footprint unknown" and the trend guards it instead.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from .config import format_size
from .estimate import Estimate, EstimateError, estimate
from .gguf import GgufError, Model, read_model
from .loadspec import LoadSpec, SpecError, first_spec


@dataclass(frozen=True)
class Prediction:
    bytes: int | None
    source: str  # how it was found, or why there is none
    spec: LoadSpec | None = None
    estimate: Estimate | None = None

    @property
    def known(self) -> bool:
        return self.bytes is not None


def parse_environment(assignments: Iterable[str]) -> dict[str, str]:
    """systemd's Environment= list ('K=V' strings) as a mapping."""
    env = {}
    for item in assignments:
        key, sep, value = item.partition("=")
        if sep:
            env[key] = value
    return env


class Predictor:
    def __init__(self, cache_size: int = 64) -> None:
        self._models: dict[tuple[str, int, int], Model] = {}
        self.cache_size = cache_size

    def model(self, path: str) -> Model:
        try:
            st = os.stat(path)
        except OSError as e:
            raise GgufError(f"{path}: {e.strerror}") from None
        key = (path, st.st_size, st.st_mtime_ns)
        model = self._models.get(key)
        if model is None:
            if len(self._models) >= self.cache_size:
                self._models.pop(next(iter(self._models)))
            model = self._models[key] = read_model(path)
        return model

    def predict(
        self,
        command_lines: Sequence[Sequence[str]],
        environment: Mapping[str, str],
        mem_total: int,
    ) -> Prediction | None:
        """None when no command line is a loader this knows (the config must say)."""
        try:
            spec = first_spec(command_lines, environment)
        except SpecError as e:
            return Prediction(None, f"command line: {e}")
        if spec is None:
            return None
        return self.for_spec(spec, mem_total)

    def for_spec(self, spec: LoadSpec, mem_total: int) -> Prediction:
        if spec.kind == "vllm" and spec.gpu_fraction is not None:
            need = int(mem_total * spec.gpu_fraction)
            return Prediction(need, f"vLLM --gpu-memory-utilization {spec.gpu_fraction:g}", spec)
        if not spec.model:
            return Prediction(None, f"{spec.binary}: no -m/--model given", spec)
        if not os.path.isabs(spec.model):
            return Prediction(None, f"{spec.model}: relative model path", spec)
        try:
            model = self.model(spec.model)
            settings = spec.settings
            if spec.mmproj:
                settings = replace(settings, mmproj_bytes=self.model(spec.mmproj).tensor_bytes)
            est = estimate(model, settings)
        except (GgufError, EstimateError) as e:
            return Prediction(None, str(e), spec)
        source = f"{os.path.basename(spec.model)}, ctx {est.n_ctx}: {format_size(est.total)}"
        return Prediction(est.total, source, spec, est)

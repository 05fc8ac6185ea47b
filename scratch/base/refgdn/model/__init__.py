"""A Qwen3-Next-style hybrid decoder (GDN + gated attention + dense/MoE MLPs + MTP head), written once
over an ops namespace (``refgdn`` for the float64 oracle, ``fast`` for the serving model), with
Hugging Face parameter names and config fields. API summary: /work/notes/model_api.md and
:mod:`refgdn.model.core`.
"""
from .cache import KVCache, ModelCache, StepMetadata, build_step_metadata
from .config import FULL, LINEAR, PRESETS, Qwen3NextConfig
from .core import Qwen3NextModel

__all__ = ["Qwen3NextConfig", "Qwen3NextModel", "ModelCache", "KVCache", "StepMetadata", "build_step_metadata",
           "PRESETS", "LINEAR", "FULL"]

"""workbench: a notebook-first, visual compilation workbench for PyTorch LLMs."""

from .api import Workbench
from .models import LoadedModel, ModelSpecError, load_model
from .pipeline.config import ConfigError
from .pipeline.interface import Stages, TransformError

__all__ = ["Workbench", "LoadedModel", "ModelSpecError", "load_model", "ConfigError", "Stages", "TransformError"]

"""Typed settings. params.yaml is parsed and validated here, and only here.

Each section is a pydantic model that rejects unknown keys; `load_config` turns the first
validation failure into one ConfigError line naming the key, the value and what is allowed.
The sections live beside their concept (data, model, train, checkpoint, monitoring, sweep,
production); this package's names are the ones to import.
"""

from trainyard.config.base import MAX_INTERRUPT_GRACE_S, MAX_JOB_S, MAX_WAIT_S, Section
from trainyard.config.checkpoint import CheckpointConfig, StorageConfig
from trainyard.config.data import BUNDLED_DIGITS, DATA_DIR, MAX_IMAGE_SIDE, DataConfig, SplitConfig
from trainyard.config.loading import config_from_dict, load_config
from trainyard.config.model import BUILT_IN_TASKS, DEFAULT_MODEL, ModelConfig, TaskConfig
from trainyard.config.monitoring import StragglersConfig, TrackingConfig
from trainyard.config.overrides import apply_override, set_key
from trainyard.config.production import (
    InferenceConfig,
    PromoteConfig,
    RegistryConfig,
    RetrainConfig,
)
from trainyard.config.settings import TrainyardConfig
from trainyard.config.sweep import SearchParam, SweepConfig
from trainyard.config.train import MAX_EPOCHS, TrainConfig

__all__ = [
    "BUILT_IN_TASKS",
    "BUNDLED_DIGITS",
    "DATA_DIR",
    "DEFAULT_MODEL",
    "MAX_EPOCHS",
    "MAX_IMAGE_SIDE",
    "MAX_INTERRUPT_GRACE_S",
    "MAX_JOB_S",
    "MAX_WAIT_S",
    "CheckpointConfig",
    "DataConfig",
    "InferenceConfig",
    "ModelConfig",
    "PromoteConfig",
    "RegistryConfig",
    "RetrainConfig",
    "SearchParam",
    "Section",
    "SplitConfig",
    "StorageConfig",
    "StragglersConfig",
    "SweepConfig",
    "TaskConfig",
    "TrackingConfig",
    "TrainConfig",
    "TrainyardConfig",
    "apply_override",
    "config_from_dict",
    "load_config",
    "set_key",
]

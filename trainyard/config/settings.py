"""The whole settings: every section, and the rule that a sweep's space fits them."""

from __future__ import annotations

import copy

from pydantic import ValidationError, model_validator

from trainyard.config.base import Section
from trainyard.config.checkpoint import CheckpointConfig, StorageConfig
from trainyard.config.data import DataConfig, SplitConfig
from trainyard.config.messages import unsearchable
from trainyard.config.model import ModelConfig, TaskConfig
from trainyard.config.monitoring import StragglersConfig, TrackingConfig
from trainyard.config.overrides import set_key
from trainyard.config.production import (
    InferenceConfig,
    PromoteConfig,
    RegistryConfig,
    RetrainConfig,
)
from trainyard.config.sweep import SweepConfig
from trainyard.config.train import TrainConfig


class TrainyardConfig(Section):
    task: TaskConfig = TaskConfig()
    data: DataConfig = DataConfig()
    split: SplitConfig = SplitConfig()
    model: ModelConfig = ModelConfig()
    train: TrainConfig = TrainConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    storage: StorageConfig = StorageConfig()
    tracking: TrackingConfig = TrackingConfig()
    stragglers: StragglersConfig = StragglersConfig()
    sweep: SweepConfig = SweepConfig()
    promote: PromoteConfig = PromoteConfig()
    registry: RegistryConfig = RegistryConfig()
    retrain: RetrainConfig = RetrainConfig()
    inference: InferenceConfig = InferenceConfig()

    @model_validator(mode="after")
    def _space_fits_settings(self) -> TrainyardConfig:
        """Every value a trial may get is a valid setting: checked here, before any trial."""
        base = self.model_dump(mode="json", exclude={"sweep"})
        for key, param in self.sweep.space.items():
            for value in param.values_to_check():
                raw = copy.deepcopy(base)
                set_key(raw, key, value)
                try:
                    TrainyardConfig.model_validate({**raw, "sweep": {"space": {}}})
                except ValidationError as exc:
                    raise ValueError(
                        unsearchable(TrainyardConfig, key, value, exc.errors()[0])
                    ) from None
        return self

    @property
    def global_batch_size(self) -> int:
        return self.train.batch_size * self.train.data_workers * self.train.grad_accum_steps

    @property
    def scaled_lr(self) -> float:
        """Linear scaling rule (Goyal et al. 2017): lr grows with the global batch."""
        return self.train.lr * self.global_batch_size / self.train.lr_reference_batch_size

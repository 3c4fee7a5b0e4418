"""Training: validated configuration and the jitted (async) train step."""

from pallas_emb.train.config import TrainConfig, validate_config
from pallas_emb.train.step import Trainer, TrainState, make_trainer

__all__ = ["TrainConfig", "TrainState", "Trainer", "make_trainer", "validate_config"]

"""Training DFlash drafters: data (corpus, self-distillation), the block-parallel
objective, the training loop, and the ``dflash-torch train`` command."""

from .objective import batch_loss, block_attention_mask, default_gamma, sample_anchors
from .trainer import TrainConfig, Trainer, export_drafter

__all__ = ["TrainConfig", "Trainer", "batch_loss", "block_attention_mask", "default_gamma", "export_drafter", "sample_anchors"]

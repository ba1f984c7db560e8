"""Training: configs, data, checkpoints and the trainer behind ``archlab train``."""

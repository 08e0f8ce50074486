"""Training: the trainer, the jitted step, its state, the loss, optimizers, metrics and FLOPs."""

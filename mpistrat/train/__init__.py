"""Training on top of the strategies: checkpoints and optimizers."""

"""The Lightning layer: the LightningModule, optimizers, callbacks, progress, checkpoint IO and FSDP."""

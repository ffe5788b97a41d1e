"""Example recommendation models (LightningModules with TorchRec embedding tables) and their configs."""

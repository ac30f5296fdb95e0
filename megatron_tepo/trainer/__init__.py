"""The RL trainer: composes the actor, a rollout engine, rewards and the losses."""
from .loop import Task, evaluate, generate_groups, sync_weights, train

__all__ = ["Task", "train", "generate_groups", "evaluate", "sync_weights"]

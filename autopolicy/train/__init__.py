"""Training and evaluation on optax, with loss scaling added when the policy needs it."""

from autopolicy.train import losses, metrics
from autopolicy.train.loop import History, evaluate, fit, predict, resolve_loss_scale

__all__ = ["fit", "evaluate", "predict", "History", "resolve_loss_scale", "losses", "metrics"]

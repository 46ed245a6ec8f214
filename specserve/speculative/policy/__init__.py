"""The adaptive speculation policy: cost model, calibration, bandit and controller (interface.py)."""

from specserve.speculative.policy.controller import SpecController
from specserve.speculative.policy.interface import Batch, StepOutcome

__all__ = ["Batch", "SpecController", "StepOutcome"]

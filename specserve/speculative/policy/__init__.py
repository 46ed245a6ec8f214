"""The adaptive speculation policy: cost model, calibration, goodput table and controller (interface.py)."""

from specserve.speculative.policy.controller import SpecController
from specserve.speculative.policy.interface import Batch

__all__ = ["Batch", "SpecController"]

"""Offline policy tuning: trace capture and import, a simulator sharing the store's tier
and policy classes, bounds (Belady's MIN, LRU miss-ratio curves), and a tuner."""

from .cost import CostModel, StepTime
from .engine import SimConfig, SimResult, Simulator, simulate
from .datasets import import_criteo, import_movielens, import_npy
from ..observe.trace import Trace, TraceRecorder, TraceWriter, load_trace, write_trace

__all__ = ["CostModel", "SimConfig", "SimResult", "Simulator", "StepTime", "Trace", "TraceRecorder",
           "TraceWriter", "import_criteo", "import_movielens", "import_npy", "load_trace", "simulate", "write_trace"]

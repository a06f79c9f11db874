"""The memory planner: per-GPU memory for every strategy, and the flowchart walk that picks one."""

from finetune.plan.types import Candidate, MemoryBreakdown, Plan

__all__ = ["Candidate", "MemoryBreakdown", "Plan"]

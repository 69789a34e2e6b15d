"""Ready-made plans, each written only with the plan primitives."""

from chronotope.compile.timeline import Timeline, timeline
from chronotope.graph.axes import batch_dims, sequence_dims
from chronotope.plan.steps import actions
from chronotope.policies.config import POLICIES, ParallelConfig, make
from chronotope.policies.interlaced import interlaced
from chronotope.policies.mesh import (
    context_parallel,
    data_parallel,
    expert_parallel,
    mesh,
    sequence_parallel,
    tensor_parallel,
)
from chronotope.policies.pipeline import MULTI_STAGE, SCHEDULES, pipeline, read_schedule
from chronotope.policies.zero import zero

__all__ = ["MULTI_STAGE", "POLICIES", "ParallelConfig", "SCHEDULES", "Timeline", "actions",
           "batch_dims", "context_parallel", "data_parallel", "expert_parallel", "interlaced",
           "make", "mesh", "pipeline",
           "read_schedule", "sequence_parallel", "sequence_dims", "tensor_parallel", "timeline",
           "zero"]

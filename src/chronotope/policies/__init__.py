"""Ready-made plans, each written only with the plan primitives."""

from chronotope.policies.data_parallel import batch_dims, data_parallel

__all__ = ["batch_dims", "data_parallel"]

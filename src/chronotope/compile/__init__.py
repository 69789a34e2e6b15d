"""From a checked plan to per-rank programs: materialize communication, generate code."""

from chronotope.compile.buckets import BUCKET_MB
from chronotope.compile.materialize import materialize
from chronotope.compile.program import Program
from chronotope.cost.network import Cluster, cluster_for
from chronotope.errors import PlanError
from chronotope.plan.pause import collector_paused
from chronotope.plan.plan import Plan

COMMS = ("rvd", "p2p")


def compile(plan: Plan, comm: str = "rvd",  # noqa: A001  (the public name ``ct.compile``)
            cluster: Cluster | str | None = None, bucket_mb: float = BUCKET_MB) -> Program:
    """Check ``plan`` and derive every rank's program, communication included.

    ``comm="rvd"`` makes a layout change that no single collective does by the
    cheapest path of collectives and messages under ``cluster``'s cost model (a
    preset name, a profile file, or a ``Cluster``; default: DGX A100 nodes);
    ``"p2p"`` keeps per-reader messages (single collectives are found either way).
    Gradient reductions start in buckets of ``bucket_mb`` MiB as the backward makes
    them (``compile/buckets.py``).
    """
    if bucket_mb <= 0:
        raise PlanError(f"bucket_mb must be positive, got {bucket_mb}")
    if comm not in COMMS:
        raise PlanError(f"unknown comm {comm!r}: use one of {', '.join(COMMS)}")
    if comm == "p2p":
        cluster = None
    elif not isinstance(cluster, Cluster):
        cluster = cluster_for(plan.ndevices, cluster)
    if cluster is not None and cluster.ndevices < plan.ndevices:
        raise PlanError(f"cluster {cluster.name} has {cluster.ndevices} devices and the plan "
                        f"uses {plan.ndevices}: profile as many (`chronotope profile --devices "
                        f"{plan.ndevices}`) or name a larger preset")
    checked = plan.check()
    with collector_paused():
        return materialize(checked, cluster, bucket_mb)


__all__ = ["COMMS", "Program", "compile", "materialize"]

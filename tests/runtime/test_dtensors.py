"""Trained parameters as DTensors, with the placements their layouts have."""

import functools
import warnings

import pytest
import torch

import chronotope as ct
from chronotope.models import get_workload
from chronotope.policies import mesh
from chronotope.runtime import checkpoint
from chronotope.runtime.launch import spawn
from chronotope.runtime.train import train

pytestmark = pytest.mark.slow


@functools.cache
def gpt():
    w = get_workload("gpt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return w, ct.capture(w)


def _wrapped(rank, placed, path):
    """On each rank: its parameters as DTensors, read back whole."""
    return {name: ([str(p) for p in t.placements], t.to_local().shape, t.full_tensor())
            for name, t in placed.dtensors(path, placed_only=True).items()}


def test_a_checkpoints_weights_come_back_as_dtensors_placed_as_the_plan_holds_them(tmp_path):
    w, graph = gpt()
    program = ct.compile(mesh(graph, dp=2, tp=2))
    train(program, w, [tuple(w.inputs) + tuple(w.targets)] * 2, 2,
          save=str(tmp_path / "ck"))
    placed = ct.placements(program)
    # a fused q/k/v projection cut head by head is no placement: refused, named
    assert "h.0.attn.c_attn.weight" in placed.refused
    with pytest.raises(ct.ChronotopeError, match=r"h.0.attn.c_attn.weight \(shape \[192, 64\]\) "
                                                 r"is held as regions no DTensor placement"):
        placed.dtensors(tmp_path / "ck")
    column, row = placed.params["h.0.mlp.c_fc.weight"], placed.params["h.0.mlp.c_proj.weight"]
    assert (column.mesh, column.placements) == ((2, 2), ("R", "S(0)")), column
    assert (row.mesh, row.placements) == ((2, 2), ("R", "S(1)")), row
    every = spawn(_wrapped, 4, (placed, str(tmp_path / "ck")))
    weights = checkpoint.consolidate(tmp_path / "ck")
    for rank, got in enumerate(every):
        assert got.keys() == placed.params.keys()  # every rank holds a part of each
        for name, (_, local, whole) in got.items():
            assert torch.equal(whole, weights[name]), (rank, name)
            assert tuple(local) == ct.Mask(placed.held[rank][name]).shape, (rank, name)

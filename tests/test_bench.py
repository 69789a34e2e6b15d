"""The layout-change benchmark's measured side: its paths and DTensor's, on gloo."""

import pytest

from chronotope import bench
from chronotope.compile.rvd import RVD, Layout
from chronotope.compile.rvd_search import p2p, search

pytestmark = pytest.mark.slow


def test_measured_cases_time_both_paths_and_dtensor():
    cases = []
    for src, dst in ((RVD(1, 4, (1,)), RVD(4, 1, (1,))),):
        a, b = Layout(src, (0, 1, 2, 3)), Layout(dst, (0, 1, 2, 3))
        cases.append({"case": f"{src}={dst}", "paths": (p2p(a, b, (4096,)),
                                                      search(a, b, (4096,)))})
    bench.measure(cases, 4096, repeats=1, dtensor=True)
    for case in cases:
        assert all(case[k] > 0 for k in ("p2p_measured_s", "rvd_measured_s",
                                         "dtensor_measured_s"))
    assert "paths" not in bench.public(cases[0])

"""What the search tests share."""

import warnings

import chronotope as ct


def capture(w: ct.Workload) -> ct.Graph:
    """The graph of ``w``, without the capture's warnings."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ct.capture(w)

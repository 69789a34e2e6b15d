"""Vision, normalization and selection ops: each is split along every dim its signature
lets split (the other ops replicated) and trains exactly like one device."""


import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from tests.graph.op_testing import (
    Case,
    layer,
    per_op_tests,
    split_one,
    the_op,
    trains_like_one_device,
)


def _index(shape: tuple[int, ...], high: int, seed: int) -> torch.Tensor:
    return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(seed))


class Gain(nn.Module):
    def __init__(self, shape: tuple[int, ...]) -> None:
        super().__init__()
        self.g = nn.Parameter(torch.rand(shape) + 0.5)


def _shifted(m: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """Shifted right by one along dim 1, as decoders shift their labels."""
    out = h.new_zeros(h.shape)
    out[:, 1:] = h[:, :-1]
    return out


def _marked(m: nn.Module, h: torch.Tensor) -> torch.Tensor:
    out = h * 2
    out[:, 0] = 1.0
    return out


EDGES = torch.tensor([0.6, 1.0, 1.4])
ROW_EDGES = torch.sort(torch.rand(4, 3, generator=torch.Generator().manual_seed(5)) + 0.5)[0]
IDX = _index((4, 2, 2), 6, 1)  # along the last dim of a (4, 2, 6) tensor
ROWS = _index((6,), 4, 2)
PUT = (_index((6,), 4, 3), _index((6,), 2, 4))

CASES = {
    "conv1d": layer(lambda: nn.Conv1d(4, 6, 3, padding=1), (4, 4, 8), "conv", ("n", "k", "o")),
    "conv2d": layer(lambda: nn.Conv2d(4, 6, 3, stride=2, padding=1, dilation=1), (4, 4, 7, 7),
                    "conv", ("n", "k", "o")),
    "conv2d-groups": layer(lambda: nn.Conv2d(4, 6, 3, groups=2), (4, 4, 6, 6), "conv",
                           ("n", "g")),
    "conv2d-depthwise": layer(lambda: nn.Conv2d(4, 4, 3, groups=4, bias=False), (4, 4, 6, 6),
                              "conv", ("n", "g")),
    "conv2d-unbatched": layer(lambda: nn.Conv2d(4, 6, 3), (4, 6, 6), "conv", ("k", "o")),
    "conv3d": layer(lambda: nn.Conv3d(2, 4, 2, padding=1), (2, 2, 3, 4, 4), "conv",
                    ("n", "k", "o")),
    "conv_transpose1d-groups": layer(lambda: nn.ConvTranspose1d(4, 6, 3, groups=2),
                                     (2, 4, 5), "conv", ("n", "g")),
    "conv_transpose2d": layer(lambda: nn.ConvTranspose2d(4, 6, 2, stride=2), (2, 4, 3, 3),
                              "conv_transpose", ("n", "k", "o")),
    "conv_transpose3d": layer(lambda: nn.ConvTranspose3d(2, 4, 2), (2, 2, 2, 3, 3),
                              "conv_transpose", ("n", "k", "o")),
    "max_pool1d": Case((2, 4, 8), lambda m, h: F.max_pool1d(h, 2), "pool", ("b0", "b1")),
    "max_pool2d": Case((2, 4, 6, 6), lambda m, h: F.max_pool2d(h, 3, stride=2, padding=1),
                       "pool", ("b0", "b1")),
    "max_pool2d-indices": Case((2, 4, 6, 6), lambda m, h: tuple(
        F.max_pool2d(h, 2, return_indices=True)), "pool", ("b0", "b1")),
    "max_pool3d": Case((2, 2, 4, 4, 4), lambda m, h: F.max_pool3d(h, 2), "pool", ("b0", "b1")),
    "avg_pool1d": Case((2, 4, 8), lambda m, h: F.avg_pool1d(h, 3, stride=2), "pool",
                       ("b0", "b1")),
    "avg_pool2d": Case((2, 4, 6, 6), lambda m, h: F.avg_pool2d(h, 2, padding=1), "pool",
                       ("b0", "b1")),
    "avg_pool3d": Case((2, 2, 4, 4, 4), lambda m, h: F.avg_pool3d(h, 2), "pool", ("b0", "b1")),
    "adaptive_avg_pool2d": Case((2, 4, 5, 7), lambda m, h: F.adaptive_avg_pool2d(h, (2, 3)),
                                "pool", ("b0", "b1")),
    "adaptive_max_pool2d": Case((2, 4, 5, 7), lambda m, h: tuple(F.adaptive_max_pool2d(
        h, 3, return_indices=True)), "pool",
                                ("b0", "b1")),
    "adaptive_avg_pool1d-unbatched": Case((4, 9), lambda m, h: F.adaptive_avg_pool1d(h, 4),
                                          "pool", ("b0",)),
    "lp_pool2d": Case((2, 4, 6, 6), lambda m, h: F.lp_pool2d(h, 2, 2), "pool", ("b0", "b1"),
                      frontends=("fx",)),
    "interpolate-nearest": Case((2, 4, 3, 3), lambda m, h: F.interpolate(h, scale_factor=2),
                                "interpolate", ("b0", "b1")),
    "interpolate-bilinear": Case((2, 4, 3, 5), lambda m, h: F.interpolate(
        h, size=(5, 4), mode="bilinear", align_corners=False), "interpolate", ("b0", "b1")),
    "upsample-trilinear": layer(lambda: nn.Upsample(scale_factor=2, mode="trilinear"),
                                (2, 2, 2, 3, 3), "interpolate", ("b0", "b1")),
    "group_norm": layer(lambda: nn.GroupNorm(2, 4), (2, 4, 3, 3), "group_norm", ("n", "g")),
    "group_norm-one-group": layer(lambda: nn.GroupNorm(1, 4), (2, 4, 3), "group_norm", ("n",)),
    "group_norm-per-channel": layer(lambda: nn.GroupNorm(4, 4), (2, 4, 3, 3), "group_norm",
                                    ("n", "g")),
    "batch_norm-eval": layer(lambda: nn.BatchNorm2d(4).eval(), (2, 4, 2, 4), "batch_norm",
                             ("n", "c", "s0", "s1")),
    "topk": Case((4, 2, 6), lambda m, h: tuple(torch.topk(h, 2, dim=-1)), "topk", ("d0", "d1")),
    "topk-dim0": Case((4, 2, 6), lambda m, h: tuple(h.topk(3, dim=0, largest=False)), "topk",
                      ("d1", "d2")),
    "sort": Case((4, 2, 6), lambda m, h: tuple(torch.sort(h, dim=1, descending=True)), "sort",
                 ("d0", "d2")),
    "argsort": Case((4, 2, 6), lambda m, h: (h, torch.argsort(h, dim=-1)), "argsort",
                    ("d0", "d1")),
    "histc": Case((4, 6), lambda m, h: (h, torch.histc(h.detach(), bins=4, min=0.0, max=2.0)),
                  "histc", ("d0", "d1")),
    "gather": Case((4, 2, 6), lambda m, h: torch.gather(h, 2, IDX), "gather", ("d0", "d1", "o")),
    "gather-narrow-index": Case((4, 2, 6), lambda m, h: torch.gather(h, 2, IDX[:, :1]), "gather",
                                ("d0", "o")),
    "scatter": Case((4, 2, 6), lambda m, h: torch.zeros_like(h).scatter(2, IDX, h[:, :, :2]),
                    "scatter", ("d0", "d1")),
    "scatter_add": Case((4, 2, 6), lambda m, h: h.scatter_add(2, IDX, h[:, :, 1:3]),
                        "scatter_add", ("d0", "d1", "i")),
    "index_select": Case((4, 2, 6), lambda m, h: torch.index_select(h, 0, ROWS), "index_select",
                         ("t0", "d1", "d2")),
    "index_add": Case((4, 2, 6), lambda m, h: h.index_add(0, ROWS, h[:1].expand(6, 2, 6)),
                      "index_add", ("t0", "d1", "d2")),
    "index_put": Case((4, 2, 6), lambda m, h: h.index_put(PUT, h[0, 0]), "index_put", ("r0",)),
    "index_put-accumulate": Case((4, 2, 6), lambda m, h: h.index_put(
        PUT, h[1, :2].repeat(3, 1), accumulate=True), "index_put", ("t0", "r0")),
    "cumsum": Case((4, 2, 6), lambda m, h: torch.cumsum(h, dim=1), "cumsum", ("d0", "d2")),
    "kthvalue": Case((4, 2, 6), lambda m, h: tuple(torch.kthvalue(h, 2, dim=1)), "kthvalue",
                     ("d0", "d2")),
    "median-keepdim": Case((4, 2, 6), lambda m, h: tuple(h.median(dim=-1, keepdim=True)),
                           "median", ("d0", "d1")),
    "cummax": Case((4, 2, 6), lambda m, h: tuple(torch.cummax(h, dim=2)), "cumulative",
                   ("d0", "d1")),
    "logcumsumexp": Case((4, 2, 6), lambda m, h: torch.logcumsumexp(h, dim=0), "cumulative",
                         ("d1", "d2")),
    "searchsorted": Case((4, 6), lambda m, h: (h, torch.searchsorted(EDGES, h)), "searchsorted",
                         ("d0", "d1")),
    "searchsorted-rows": Case((4, 6), lambda m, h: (h, torch.searchsorted(ROW_EDGES, h)),
                              "searchsorted", ("d0", "d1")),
    "bucketize": Case((4, 6), lambda m, h: (h, torch.bucketize(h, EDGES)), "bucketize",
                      ("d0", "d1")),
    "pixel_shuffle": Case((2, 8, 3, 3), lambda m, h: F.pixel_shuffle(h, 2), "pixel_shuffle",
                          ("b0", "c")),
    "pixel_unshuffle": Case((2, 2, 4, 4), lambda m, h: F.pixel_unshuffle(h, 2),
                            "pixel_unshuffle", ("b0", "c")),
    "unfold": Case((2, 4, 5, 5), lambda m, h: F.unfold(h, 3, padding=1, stride=2), "unfold",
                   ("n", "c")),
    "fold": Case((2, 8, 9), lambda m, h: F.fold(h, (4, 4), 2), "fold", ("n", "c")),
    "instance_norm": layer(lambda: nn.InstanceNorm2d(4, affine=True), (2, 4, 3, 3),
                           "instance_norm", ("n", "c")),
    "instance_norm-running-eval": layer(lambda: nn.InstanceNorm1d(4, track_running_stats=True)
                                        .eval(), (2, 4, 6), "instance_norm", ("n", "c", "s0")),
    "setitem-shift": Case((4, 2, 6), _shifted, "setitem", ("d0", "d2"), frontends=("fx",)),
    "setitem-scalar": Case((4, 2, 6), _marked, "setitem", ("d0", "d2"), frontends=("fx",)),
    "weight_norm": Case((4, 3, 2), lambda m, h: torch._weight_norm(h, m.g, 0), "weight_norm",
                        ("w",), inner=lambda: Gain((4, 1, 1))),
    "weight_norm-last": Case((4, 3, 2), lambda m, h: torch._weight_norm(h, m.g, 2),
                             "weight_norm", ("w",), inner=lambda: Gain((1, 1, 2))),
}


test_signature_names_the_dims_that_split, test_split_along_each_dim_trains_like_one_device = \
    per_op_tests(CASES)


CONVS = {(1, False): nn.Conv1d, (2, False): nn.Conv2d, (1, True): nn.ConvTranspose1d,
         (2, True): nn.ConvTranspose2d}


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spatial=st.sampled_from([1, 2]), transposed=st.booleans(), groups=st.sampled_from([1, 2]),
       channels=st.sampled_from([(2, 2), (2, 4), (4, 2)]), kernel=st.integers(1, 3),
       stride=st.integers(1, 2), padding=st.integers(0, 1), dilation=st.integers(1, 2),
       bias=st.booleans())
def test_random_convolutions_split_along_every_dim(spatial, transposed, groups, channels, kernel,
                                                   stride, padding, dilation, bias):
    """Any convolution, split along each dim its signature lets split, trains like one device."""
    cin, cout = (c * groups for c in channels)
    kind = CONVS[(spatial, transposed)]
    case = layer(lambda: kind(cin, cout, kernel, stride=stride, padding=padding,
                              dilation=dilation, groups=groups, bias=bias),
                 (2, cin, *[6] * spatial), "conv", ())
    w, graph = case.captured("fx")
    op = the_op(graph, "conv" if groups > 1 or not transposed else "conv_transpose")
    dims = op.signature.splittable()
    assert {"n", "g"} <= set(dims) if groups > 1 else {"n", "k", "o"} <= set(dims)
    for dim in dims:
        trains_like_one_device(split_one(graph, op, dim), w, steps=1)

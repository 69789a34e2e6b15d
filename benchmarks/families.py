"""Every causal language model family transformers has, built from one tiny generic
config (the zoo's ``DECODER``, 4 experts where the family has them), captured and trained
two steps on two ranks under each policy against one device: which are equal to it, which
are refused (and why), which do not build from that config at all. The zoo
(``benchmarks/zoo.py``) holds tuned configs of some of them; this is the wide net.

    python benchmarks/families.py [--policies dp tp ep] [--limit 90] [--only Llama Mixtral]
"""

import argparse
import signal
import sys
import time
import warnings
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests.zoo package

import torch  # noqa: E402
import transformers  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from tests.zoo.harness import POLICIES, capture, check, first_line  # noqa: E402
from tests.zoo.models import DECODER, _causal_lm  # noqa: E402

OUTCOMES = ("ok", "mismatch", "refused", "error", "capture", "not built", "past")


class _Late(BaseException):  # (past the checks, which record every Exception)
    """A family past its time limit."""


def _late(*_: object) -> None:
    raise _Late


def families() -> list[str]:
    """The families with a ``...ForCausalLM`` and a config of the same name."""
    return sorted(name.removesuffix("ForCausalLM") for name in dir(transformers)
                  if name.endswith("ForCausalLM") and
                  hasattr(transformers, name.removesuffix("ForCausalLM") + "Config"))


# A Mixture-of-Experts family's experts, as its config may name them: 4, top-2, narrow.
EXPERTS = dict(num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2,
               moe_intermediate_size=32, shared_expert_intermediate_size=32)


def factory(name: str):
    model, config = (getattr(transformers, name + s) for s in ("ForCausalLM", "Config"))
    try:
        fields = {**DECODER, **EXPERTS}
        config(**fields)
    except Exception:  # noqa: BLE001  (a config that checks its fields: the decoder's alone)
        fields = dict(DECODER)
    return lambda: _causal_lm(name.lower(), model, config(**fields), 0, None)


def sweep(name: str, policies: list[str]) -> list[str]:
    """One cell per policy: ok, mismatch, refused or error (with its first line), or why
    the family did not build or capture."""
    make = factory(name)
    try:
        w = make()
        w.model(**w.kwargs)
    except Exception as e:  # noqa: BLE001  (a config this generic does not fit every family)
        return [f"not built: {first_line(e)}"] * len(policies)
    try:
        graph = capture(w)
    except Exception as e:  # noqa: BLE001
        return [f"capture: {first_line(e)}"] * len(policies)
    cells = []
    for policy in policies:
        o = check(name.lower(), policy, graph, factory=make)
        cells.append(f"{o.status}" + (f" {max(o.loss_rel_diff, o.param_rel_diff):.1e}"
                                      if o.status in ("ok", "mismatch") else f": {o.error}"))
    return cells


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--policies", nargs="+", choices=list(POLICIES), default=["dp", "tp"])
    p.add_argument("--limit", type=int, default=90, help="seconds per family")
    p.add_argument("--only", nargs="+", help="these families alone")
    args = p.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    transformers.logging.set_verbosity_error()
    signal.signal(signal.SIGALRM, _late)
    err = Console(stderr=True)
    rows = []
    for name in args.only or families():
        start = time.perf_counter()
        signal.alarm(args.limit)
        try:
            cells = sweep(name, args.policies)
        except _Late:
            cells = [f"past {args.limit} s"] * len(args.policies)
        finally:
            signal.alarm(0)
        rows.append((name, cells))
        err.print(f"{name}: {' | '.join(cells)} ({time.perf_counter() - start:.0f} s)",
                  highlight=False)
    table = Table(title=f"causal-LM families of transformers {transformers.__version__}: "
                        "2 steps on 2 ranks vs one device")
    for column in ("outcome", *args.policies):
        table.add_column(column)
    counts = [Counter(next(k for k in OUTCOMES if cells[i].startswith(k)) for _, cells in rows)
              for i in range(len(args.policies))]
    for outcome in OUTCOMES:
        table.add_row(outcome, *(str(c[outcome]) for c in counts))
    Console().print(table)
    bad = [(n, c) for n, c in rows if any(x.startswith(("mismatch", "error")) for x in c)]
    for name, cells in bad:
        print(f"{name}: {' | '.join(cells)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

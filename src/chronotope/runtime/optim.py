"""The optimizer every rank runs over its parameter regions, and its learning-rate schedule.

Any ``torch.optim`` optimizer and ``torch.optim.lr_scheduler`` scheduler (or a user's
own, by class or import path), described once so that the ranks, the single-device
reference and a user's own PyTorch loop (``build`` on ``model.parameters()``,
``scheduler`` on that) train with the same groups and rates. Classes travel to worker
processes by name, so a description is picklable.

A rank's optimizer sees only the regions it updates. That equals one device's update
when the optimizer is elementwise (each element's update reads only its own gradient
and state: SGD, the Adam family, RMSprop, ...); any other optimizer is refused for a
plan that splits one of its parameters.
"""

from __future__ import annotations

import importlib
import inspect
import warnings
from collections.abc import Iterable, Mapping
from functools import cache
from typing import Any

import torch
from torch import nn
from torch.optim import lr_scheduler

from chronotope.compile.program import Program
from chronotope.errors import ChronotopeError

# The built-in schedules, besides any torch.optim.lr_scheduler class.
LR_SCHEDULES = ("constant", "cosine")
# torch.optim's optimizers whose update of an element reads only that element's gradient
# and state: on a region of a parameter they do what they do on the whole of it.
ELEMENTWISE = frozenset({"SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad",
                         "Adadelta", "RMSprop", "Rprop", "ASGD"})
# What ``step()`` without a closure (each rank's) cannot run at all.
UNSTEPPABLE = {"LBFGS": "it re-evaluates the loss through a closure each step",
               "SparseAdam": "it takes only sparse gradients"}


class OptimError(ChronotopeError):
    """An optimizer or schedule that cannot be found, built, or run under a plan."""


def resolve_class(spec: str | type, namespace: Any, what: str) -> type:
    """The class ``spec`` names: the class itself, a name in ``namespace`` (any case:
    ``adamw``), ``module.Class``, ``module:Class`` or ``path/to/file.py:Class``."""
    if isinstance(spec, type):
        return spec
    return _resolved(spec, namespace.__name__, what)


@cache
def _resolved(spec: str, namespace: str, what: str) -> type:
    module = importlib.import_module(namespace)
    names = {n.lower(): n for n in dir(module) if isinstance(getattr(module, n), type)}
    if spec.lower() in names:
        return getattr(module, names[spec.lower()])
    path, colon, name = spec.rpartition(":") if ":" in spec else spec.rpartition(".")
    found: Any = None
    try:
        if path.endswith(".py"):
            from chronotope.models import load_function
            found = load_function(spec)
        elif path:
            found = getattr(importlib.import_module(path), name, None)
    except (ImportError, ChronotopeError) as e:
        raise OptimError(f"cannot load {what} {spec!r}: {e}") from e
    if not isinstance(found, type):
        raise OptimError(f"unknown {what} {spec!r}: give a class of {namespace} "
                         f"({', '.join(sorted(v for v in names.values() if v[0].isupper())[:8])}"
                         ", ...) or an import path, module.Class or file.py:Class")
    return found


def _torchs(cls: type) -> bool:
    """Whether torch ships the class (``torch.optim`` or its ``lr_scheduler``)."""
    return cls.__module__.startswith("torch.optim")


def _name(cls: type) -> str:
    """How a class is written down: torch's by their short name, others by import path."""
    return cls.__name__ if _torchs(cls) else f"{cls.__module__}.{cls.__qualname__}"


def step_schedule(scheduler: lr_scheduler.LRScheduler, metric: float | None) -> None:
    """One optimizer step done (or skipped, as fp16's loss scaling skips one on every
    rank): ``scheduler`` moves on, a ``ReduceLROnPlateau`` on ``metric``, without torch's
    warning that no optimizer step came first."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*lr_scheduler.step.*")
        if not isinstance(scheduler, lr_scheduler.ReduceLROnPlateau):
            scheduler.step()
        elif metric is None:
            raise OptimError("ReduceLROnPlateau steps on the loss: train with ct.train "
                             "(chronotope train), which gives it each step's loss")
        else:
            scheduler.step(metric)


class Optim:
    """Which optimizer, its hyper-parameters and learning-rate schedule.

    ``optimizer``: a ``torch.optim.Optimizer`` class or its name (``"adamw"``,
    ``"torch.optim.Adam"``, ``"my_pkg.Lion"``, ``"file.py:Lion"``); ``options`` are its
    keyword arguments (``momentum=0.9``, ``betas=(0.9, 0.95)``). Weight decay skips
    1-D parameters (biases, norm scales) unless ``decay_all``: a region of a parameter has
    the parameter's number of dims, so every rank groups its regions as one device groups
    the whole parameters. ``clip``: the largest global gradient norm, as
    ``torch.nn.utils.clip_grad_norm_``.

    ``schedule``: ``"constant"``, ``"cosine"`` (from ``lr`` down to ``min_lr`` over the
    run) or a ``torch.optim.lr_scheduler`` class or its name, built with
    ``schedule_options``; ``warmup`` steps of linear warmup (``LinearLR``) come first
    (``SequentialLR``). ``elementwise``: a class torch does not ship may say that its
    update of each element reads only that element's gradient and state, so that plans
    may split its parameters.
    """

    def __init__(self, optimizer: str | type = "sgd", lr: float = 0.1, *,
                 weight_decay: float = 0.0, clip: float | None = None,
                 schedule: str | type = "constant", warmup: int = 0, min_lr: float = 0.0,
                 schedule_options: Mapping[str, Any] | None = None, decay_all: bool = False,
                 elementwise: bool | None = None, **options: Any) -> None:
        self.optimizer, self.lr, self.weight_decay, self.clip = optimizer, lr, weight_decay, clip
        self.schedule, self.warmup, self.min_lr = schedule, warmup, min_lr
        self.schedule_options = dict(schedule_options or {})
        self.decay_all, self.options = decay_all, dict(options)
        self._elementwise = elementwise
        if warmup < 0:
            raise OptimError(f"warmup must be at least 0 steps, not {warmup}")
        if self.cls.__name__ in UNSTEPPABLE and _torchs(self.cls):
            raise OptimError(f"{self.name} cannot train a plan: "
                             f"{UNSTEPPABLE[self.cls.__name__]}")
        if not (isinstance(schedule, str) and schedule in LR_SCHEDULES):
            resolve_class(schedule, lr_scheduler, "learning-rate schedule")
        elif self.schedule_options:
            raise OptimError(f"schedule options {sorted(self.schedule_options)} are for a "
                             f"torch.optim.lr_scheduler class, not the {schedule!r} schedule")
        if weight_decay and not self.decays:
            raise OptimError(f"{self.name} has no weight_decay: leave weight decay at 0")
        self.build([nn.Parameter(torch.zeros(0))])  # bad options are named now

    def __repr__(self) -> str:
        extra = "".join(f", {k}={v!r}" for k, v in self.options.items())
        return (f"Optim({self.name!r}, lr={self.lr}{extra}, weight_decay={self.weight_decay}, "
                f"clip={self.clip}, schedule={self.schedule_name!r}, warmup={self.warmup})")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Optim) and vars(self) == vars(other)

    __hash__ = None  # type: ignore[assignment]

    @property
    def cls(self) -> type[torch.optim.Optimizer]:
        return resolve_class(self.optimizer, torch.optim, "optimizer")

    @property
    def name(self) -> str:
        """The optimizer as checkpoints record it: ``sgd``, ``adamw``, ``Adagrad``, or the
        import path of a class torch does not ship."""
        name = _name(self.cls)
        return name.lower() if name in ("SGD", "AdamW") else name

    @property
    def schedule_name(self) -> str:
        if isinstance(self.schedule, str) and self.schedule in LR_SCHEDULES:
            return self.schedule
        return _name(resolve_class(self.schedule, lr_scheduler, "learning-rate schedule"))

    @property
    def decays(self) -> bool:
        """Whether the optimizer takes a weight decay (it is ``weight_decay`` then, 0 by
        default: torch's own defaults, AdamW's 0.01, are not silently applied)."""
        return "weight_decay" in inspect.signature(self.cls).parameters

    def param_groups(self, shapes: Mapping[str, tuple[int, ...]], hyper: Mapping[str, Any]
                     ) -> list[dict[str, Any]]:
        """The groups ``build`` makes of parameters of these names and shapes, each with
        ``hyper`` (a group's other settings) and its decay: what torch's
        ``get_optimizer_state_dict`` records of one device's optimizer."""
        return [{**hyper, **group, "params": [n for n, _ in group["params"]]}
                for group in self._groups([(n, len(shape)) for n, shape in shapes.items()])]

    def _groups(self, params: list[tuple[Any, int]]) -> list[dict[str, Any]]:
        """Decayed and plain groups of (parameter, its number of dims): weight decay skips
        1-D ones unless ``decay_all``; an optimizer without weight decay gets none."""
        decayed = [(p, n) for p, n in params if self.decay_all or n >= 2]
        plain = [(p, n) for p, n in params if not (self.decay_all or n >= 2)]
        return [{"params": ps, **({"weight_decay": wd} if self.decays else {})}
                for ps, wd in ((decayed, self.weight_decay), (plain, 0.0)) if ps]

    @property
    def elementwise(self) -> bool:
        """Whether a region of a parameter is updated as the whole parameter would be."""
        if self._elementwise is not None:
            return self._elementwise
        return _torchs(self.cls) and self.cls.__name__ in ELEMENTWISE

    def build(self, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        """The optimizer over ``params``: decayed and plain groups."""
        groups = [{**g, "params": [p for p, _ in g["params"]]}
                  for g in self._groups([(p, p.ndim) for p in params])]
        kwargs = {"lr": self.lr, **self.options}
        try:
            return self.cls(groups, **kwargs)
        except (TypeError, ValueError) as e:
            raise OptimError(f"cannot build {self.name} with {kwargs}: {e}") from e

    def scheduler(self, optimizer: torch.optim.Optimizer, steps: int
                  ) -> lr_scheduler.LRScheduler:
        """torch's scheduler of this schedule on ``optimizer`` over a run of ``steps``
        optimizer steps: call its ``step()`` after each one."""
        rest = max(1, steps - self.warmup)
        if self.schedule == "constant":
            main: Any = lr_scheduler.ConstantLR(optimizer, factor=1.0, total_iters=0)
        elif self.schedule == "cosine":
            main = lr_scheduler.CosineAnnealingLR(optimizer, T_max=rest, eta_min=self.min_lr)
        else:
            cls = resolve_class(self.schedule, lr_scheduler, "learning-rate schedule")
            try:
                main = cls(optimizer, **self.schedule_options)
            except (TypeError, ValueError) as e:
                raise OptimError(f"cannot build {_name(cls)} with {self.schedule_options}: "
                                 f"{e}") from e
        if not self.warmup:
            return main
        warm = lr_scheduler.LinearLR(optimizer, start_factor=1 / self.warmup, end_factor=1.0,
                                     total_iters=max(1, self.warmup - 1))
        return lr_scheduler.SequentialLR(optimizer, [warm, main], milestones=[self.warmup])

    @property
    def states(self) -> float:
        """How many weight-sized tensors of state it keeps per weight (Adam: 2), measured
        on a small parameter: what the memory estimate counts."""
        p = nn.Parameter(torch.zeros(8, 8))
        opt = self.build([p])
        p.grad = torch.ones_like(p)
        opt.step()
        return sum(v.numel() for v in opt.state[p].values()
                   if isinstance(v, torch.Tensor) and v.ndim) / p.numel()

    def check_plan(self, program: Program) -> None:
        """Refuse a non-elementwise optimizer on a plan whose ranks update parts of a
        parameter, naming one."""
        if self.elementwise:
            return
        shapes = {n: tuple(p.shape) for n, p in program.plan.graph.params.items()}
        world = program.plan.world_size
        for name, index in (r for rank in range(world) for r in program.updated(rank)):
            if tuple(index) != tuple((0, s) for s in shapes[name]):
                raise OptimError(
                    f"{self.name} is not known to be elementwise, and this plan has a rank "
                    f"update part {list(index)} of {name} (shape {list(shapes[name])}): its "
                    "update of a part may differ from its update of the whole. Use a plan "
                    "that keeps each parameter whole where it is updated (no tensor-parallel "
                    "split, no sharded optimizer state), or, if each element's update reads "
                    "only that element, say so with Optim(..., elementwise=True)")


class Rates:
    """The learning rate of each step, the same on every rank: the scheduler steps a
    stand-in optimizer of one group, whose hyper-parameters (rate, and momentum where
    a schedule cycles it) every rank copies onto its own groups, however many
    parameters (or none) it holds. One small state to checkpoint."""

    def __init__(self, optim: Optim, steps: int) -> None:
        self.stand_in = optim.build([nn.Parameter(torch.zeros(0))])
        self.scheduler = optim.scheduler(self.stand_in, steps)
        self.name = optim.schedule_name

    @property
    def lr(self) -> float:
        return float(self.stand_in.param_groups[0]["lr"])

    def apply(self, optimizer: torch.optim.Optimizer | None) -> None:
        """Give ``optimizer``'s groups this step's hyper-parameters (not their decay)."""
        if optimizer is None:
            return
        for group in optimizer.param_groups:
            group.update(self.hyper)

    def advance(self, metric: float | None = None) -> None:
        """One optimizer step done; ``metric`` for a schedule that steps on one
        (``ReduceLROnPlateau``: the step's loss)."""
        step_schedule(self.scheduler, metric)  # the stand-in takes no steps of its own

    @property
    def on_metric(self) -> bool:
        return isinstance(self.scheduler, lr_scheduler.ReduceLROnPlateau)

    @property
    def hyper(self) -> dict[str, Any]:
        """This step's group settings but the parameters and their decay."""
        return {k: v for k, v in self.stand_in.param_groups[0].items()
                if k not in ("params", "weight_decay")}

    def state_dict(self) -> dict[str, Any]:
        group = {k: v for k, v in self.stand_in.param_groups[0].items() if k != "params"}
        return {"schedule": self.name, "scheduler": self.scheduler.state_dict(),
                "group": group}

    def load(self, state: Mapping[str, Any] | None, step: int) -> None:
        """Continue at ``step`` (from 0): a schedule of the step alone is replayed, so it
        follows this run's length (a run given more steps stretches its cosine); one that
        steps on the loss takes the checkpoint's state of it."""
        if not self.on_metric:
            for _ in range(step):
                self.advance()
            return
        if state is None or state.get("schedule") != self.name:
            raise OptimError(f"{self.name} steps on the loss, and this checkpoint does not "
                             "record its state: resume under the schedule it was trained with")
        self.scheduler.load_state_dict(state["scheduler"])
        self.stand_in.param_groups[0].update(state["group"])

"""Where a run's per-step records go: a JSONL file, and TensorBoard when it is installed."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from chronotope.errors import ChronotopeError


class JsonlLog:
    """One JSON object per line and step, flushed as it comes (``chronotope plot`` reads it).
    A run resumed from an earlier step than the file reaches continues it from there: the
    lines of the steps it trains again are dropped, not repeated."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.file: Any = None

    def __call__(self, record: dict[str, Any]) -> None:
        if self.file is None:
            self._continue_before(int(record["step"]))
            self.file = open(self.path, "a")  # noqa: SIM115  (closed by close())
        self.file.write(json.dumps(_finite(record)) + "\n")
        self.file.flush()

    def _continue_before(self, step: int) -> None:
        if not self.path.is_file():
            return
        lines = self.path.read_text().splitlines(keepends=True)
        kept = [line for line in lines if _step(line) < step]
        if len(kept) < len(lines):
            partial = self.path.with_name(self.path.name + ".partial")
            partial.write_text("".join(kept))
            os.replace(partial, self.path)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def _step(line: str) -> float:
    """A metrics line's step (a line that is no record is kept: before every step)."""
    try:
        return float(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return -math.inf


class TensorBoardLog:
    """Scalars per step in a TensorBoard folder (``pip install tensorboard``)."""

    def __init__(self, folder: str | Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise ChronotopeError("--tensorboard needs the tensorboard package: pip install "
                                  "tensorboard (or chronotope[tensorboard])") from e
        self.writer = SummaryWriter(str(folder))

    def __call__(self, record: dict[str, Any]) -> None:
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)):
                self.writer.add_scalar(key, value, record["step"])
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """The records of a metrics file; a clear error naming the line that is not one."""
    records = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ChronotopeError(f"{path}:{number} is not a JSON line: {e}") from e
            if not isinstance(record, dict) or "step" not in record or "loss" not in record:
                raise ChronotopeError(f"{path}:{number} is not a step record (it needs "
                                      "'step' and 'loss')")
            records.append(record)
    return records


def _finite(record: dict[str, Any]) -> dict[str, Any]:
    """NaN and infinity as null: JSON has no words for them."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v
            for k, v in record.items()}

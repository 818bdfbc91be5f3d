"""Shared benchmark helpers: timing statistics and run metadata."""
from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Stat:
    """min / median / max of repeated measurements."""

    values: list[float] = field(default_factory=list)

    def add(self, v: float) -> None:
        self.values.append(v)

    @property
    def median(self) -> float:
        return statistics.median(self.values) if self.values else float("nan")

    def as_dict(self) -> dict:
        v = self.values
        return {"min": min(v), "median": self.median, "max": max(v), "runs": v} if v else {}

    def fmt(self, digits: int = 1) -> str:
        if not self.values:
            return "-"
        return f"{self.median:.{digits}f} [{min(self.values):.{digits}f}–{max(self.values):.{digits}f}]"


def timed(fn) -> tuple[float, object]:
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def git_commit() -> str:
    """Short commit of the source tree ("+dirty" with local changes); a tree exported
    without git history (``git archive``) names its commit in a ``COMMIT`` file."""
    root = Path(__file__).resolve().parents[2]
    stamp = root / "COMMIT"
    if stamp.is_file():
        return stamp.read_text().strip()[:12] or "unknown"
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=5)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return out.stdout.strip() + ("+dirty" if dirty else "") if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def device_info() -> dict:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import torch
    info = {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
            "torch_threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def ids_hash(ids: list[int]) -> str:
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]


def drive(engine, prompts: list[list[int]], params: list, new_run, record) -> list:
    """Add all requests and step the engine until they finish. ``new_run(t0)`` makes each
    request's record; ``record(run, output, now)`` takes each of its outputs. Records in
    prompt order."""
    t0 = time.perf_counter()
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    runs = {i: new_run(t0) for i in ids}
    while engine.has_unfinished():
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            r = runs.get(o.request_id)
            if r is not None:
                record(r, o, now)
    return [runs[i] for i in ids]


def parse_parts(text: str, choices: tuple[str, ...]) -> list[str]:
    """A benchmark's ``--parts`` list (comma-separated, each one of ``choices``); CLIError else."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in parts if p not in choices]
    if bad or not parts:
        from lodestar.cli import CLIError
        raise CLIError(f"--parts {text!r}: choose from {', '.join(choices)} (comma-separated)")
    return parts


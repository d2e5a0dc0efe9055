"""The report: measurements as dataclasses -> JSON, a text table, a markdown page, a PNG plot."""

from __future__ import annotations

import json
import math
import os
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.contenders import ALTERNATIVES, MAPPED
from bench.crash import CrashFigures
from bench.measure import Measurement
from bench.memory import MemoryFigures

MiB = 1 << 20
SLABPOOL = ("slabpool", "slabpool+batch")


@dataclass
class Target:
    """One goal of issue 5, checked against this run's numbers (never asserted by a test)."""

    name: str
    workload: str
    workers: int
    value: float
    goal: float
    met: bool | None  # None: not measured in this run
    detail: str = ""


@dataclass
class Report:
    machine: dict[str, Any]
    options: dict[str, Any]
    measurements: list[Measurement] = field(default_factory=list)
    crash: list[CrashFigures] = field(default_factory=list)
    memory: list[MemoryFigures] = field(default_factory=list)
    targets: list[Target] = field(default_factory=list)
    wall_s: float = 0.0
    leftovers: list[str] = field(default_factory=list)  # processes still alive at the end (a bug)

    # -- lookups --------------------------------------------------------------------------------

    def get(self, workload: str, contender: str, workers: int) -> Measurement | None:
        if contender == "serial":
            workers = 1
        for m in self.measurements:
            if (m.workload, m.contender, m.workers) == (workload, contender, workers) and m.status == "ok":
                return m
        return None

    def rate(self, workload: str, contender: str, workers: int) -> float:
        m = self.get(workload, contender, workers)
        return m.items_per_s if m else 0.0

    def limit(self, workload: str, workers: int) -> float:
        return workers * self.rate(workload, "serial", 1)

    def best_slabpool(self, workload: str, workers: int) -> float:
        return max(self.rate(workload, c, workers) for c in SLABPOOL)

    def best_alternative(self, workload: str, workers: int, *, pools_only: bool = False) -> tuple[str, float]:
        """The fastest alternative (pools_only: of the process pools, not one in-process session)."""
        rates = [(c, self.rate(workload, c, workers)) for c in ALTERNATIVES if not (pools_only and c == "ort-threads")]
        return max(rates, key=lambda cr: cr[1])

    def rows(self) -> list[tuple[Measurement, int]]:
        """(measurement, workers of its group): the serial reference heads every group."""
        out = []
        for wl in dict.fromkeys(m.workload for m in self.measurements):
            groups = sorted({m.workers for m in self.measurements if m.workload == wl and m.contender != "serial"})
            serial = [m for m in self.measurements if m.workload == wl and m.contender == "serial"]
            for n in groups:
                out += [(m, n) for m in serial]
                out += [(m, n) for m in self.measurements
                        if m.workload == wl and m.workers == n and m.contender != "serial"]
        return out

    # -- targets of issue 5 -----------------------------------------------------------------------

    def evaluate_targets(self) -> None:
        n = max((m.workers for m in self.measurements), default=1)
        t = self.targets
        lim = self.limit
        cnn = self.get("cnn", "slabpool", n)
        t.append(self._target("CPU-bound model >= 0.95 of limit", "cnn", n, self.rate("cnn", "slabpool", n),
                              lim("cnn", n), 0.95, _caller_share(cnn)))
        t.append(self._target("tiny model with batching >= 0.5 of limit", "mlp", n,
                              self.rate("mlp", "slabpool+batch", n), lim("mlp", n), 0.5))
        t.append(self._target("tiny model with batching >= 6x mp.Pool", "mlp", n,
                              self.rate("mlp", "slabpool+batch", n), self.rate("mlp", "mp.Pool", n), 6.0))
        t.append(self._target("tiny model with batching >= 30x ProcessPoolExecutor", "mlp", n,
                              self.rate("mlp", "slabpool+batch", n),
                              self.rate("mlp", "ProcessPoolExecutor", n), 30.0))
        sp, mp = self.rate("noop", "slabpool", n), self.rate("noop", "mp.Pool", n)
        t.append(self._target("no batching, dispatch >= 1.2x mp.Pool (no-op model)", "noop", n, sp, mp, 1.2,
                              f"{_us(sp)} vs {_us(mp)} us/task" if sp and mp else ""))
        t.append(self._target("8 MiB payload >= 0.8 of limit", "payload", n, self.rate("payload", "slabpool", n),
                              lim("payload", n), 0.8))
        best, rate = self.best_alternative("payload", n)
        pool, pool_rate = self.best_alternative("payload", n, pools_only=True)
        mine = self.rate("payload", "slabpool", n)
        vs_pool = f"; {mine / pool_rate:.2f}x the best process pool, {pool}" if mine and pool_rate else ""
        t.append(self._target("8 MiB payload >= 1.6x best alternative", "payload", n, mine, rate, 1.6,
                              f"best alternative: {best}{vs_pool}"))

    @staticmethod
    def _target(name: str, wl: str, n: int, num: float, den: float, goal: float, detail: str = "") -> Target:
        if not num or not den:
            return Target(name, wl, n, 0.0, goal, None, "not measured in this run")
        return Target(name, wl, n, num / den, goal, num / den >= goal, detail)

    # -- output ---------------------------------------------------------------------------------

    def to_json(self) -> str:
        data = asdict(self)
        data["crash"] = [{**asdict(c), "summary": c.summary} for c in self.crash]
        return json.dumps(data, indent=2)

    def table_rows(self) -> list[list[str]]:
        rows = []
        for m, n in self.rows():
            lim = self.limit(m.workload, n)
            mine = self.best_slabpool(m.workload, n)
            if m.status != "ok":
                rows.append([m.workload, str(n), m.contender, m.status, *[""] * 10, m.error[:70]])
                continue
            if m.contender in MAPPED:  # chunked runs compare with each other only
                mine = self.rate(m.workload, MAPPED[0], n)
            ratio = "" if m.contender in (*SLABPOOL, MAPPED[0]) else _x(mine / m.items_per_s if mine else 0.0)
            rows.append([
                m.workload, str(n), m.contender, f"{m.items_per_s:,.0f}", _f(m.items_per_s / lim if lim else 0),
                ratio, _us(m.items_per_s), f"{m.caller_cpu_us:,.1f}", f"{m.workers_cpu_us:,.1f}",
                _ms(m.p50_ms), _ms(m.p99_ms),
                f"{m.added_rss_bytes / MiB:,.0f}", f"{m.startup_s:.2f}", f"{m.other_cores:.2f}",
                f"{m.checked} checked",
            ])
        return rows

    HEADER = ("workload", "workers", "contender", "items/s", "/ limit", "slabpool x", "us/item",
              "caller CPU us/item", "workers CPU us/item", "p50 ms", "p99 ms", "peak RSS +MiB", "start-up s",
              "other load", "outputs")

    def text(self) -> str:
        rows = [list(self.HEADER), *self.table_rows()]
        widths = [max(len(r[i]) for r in rows) for i in range(len(self.HEADER))]
        lines = ["  ".join(c.rjust(w) if 3 <= i < len(self.HEADER) - 1 else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
                 for r in rows]
        lines.insert(1, "-" * len(lines[0]))
        return "\n".join([*lines, "", *self._text_extras()])

    def _text_extras(self) -> list[str]:
        out = ["targets (issue 5), at the largest worker count:"]
        for t in self.targets:
            verdict = {True: "MET", False: "MISSED", None: "n/a"}[t.met]
            out.append(f"  {verdict:6} {t.name}: {t.value:.2f} (goal {t.goal}) {t.detail}")
        for c in self.crash:
            s = c.summary
            out.append(f"crash ({c.workload}, {c.workers} workers): cold start {s['cold_start_s']:.3f} s, "
                       f"recovery to READY {s['recovery_ready_s']:.3f} s, to first result "
                       f"{s['recovery_serving_s']:.3f} s; {c.items_per_s_kill_per_s:,.0f} items/s with "
                       f"{c.kills} kills vs {c.items_per_s_no_kills:,.0f} without "
                       f"({s['kill_throughput_ratio']:.2f}), {c.checked} outputs checked {c.error}")
        for mem in self.memory:
            out.append(f"memory ({mem.workload}): session {mem.session_bytes / MiB:.1f} MiB, slabpool worker "
                       f"{mem.slabpool_worker_bytes / MiB:.1f} MiB private (+{mem.slabpool_worker_shm_bytes / MiB:.1f}"
                       f" MiB arena pages), overhead {mem.overhead_bytes / MiB:.1f} MiB; shm in use "
                       f"{mem.shm_in_use_peak_bytes / MiB:.1f} of {mem.shm_capacity_bytes / MiB:.0f} MiB {mem.error}")
        out.append(f"wall time {self.wall_s:.0f} s")
        if self.leftovers:
            out.append(f"LEFT BEHIND: {self.leftovers}")
        return out

    def markdown(self) -> str:
        m = self.machine
        out = [
            f"Measured {m['date']} on {m['cpu']} ({m['cores']} usable cores), Python {m['python']}, "
            f"onnxruntime {m['onnxruntime']}, numpy {m['numpy']}, load average {_load(m)}; `python -m bench"
            f"{(' ' + self.options['argv']).rstrip()}`, {self.options['seconds']} s per measurement, {self.wall_s:.0f} s in all. "
            "limit = workers x the serial (1 session, 1 thread, in-process) rate; "
            "\"slabpool x\" = the best slabpool variant's items/s over that row's; \"other load\" = cores kept "
            "busy by processes outside the bench during the timed run (the machine may be shared); \"peak RSS "
            "+MiB\" = peak RSS of the whole process tree (sampled every 0.1 s) minus the tree's RSS before "
            "that contender started, i.e. what it added (worker processes, in-process sessions, buffers); "
            "\"caller CPU\" = CPU time of the bench's own process per item (the caller's thread and the "
            "pool's threads in it: slabpool's supervisor, the executors' management threads; the whole "
            "computation for serial and ort-threads), \"workers CPU\" = that of every other process of the "
            "tree. With every core busy, the caller's CPU is taken from the workers: it bounds a CPU-bound "
            "run at (cores - caller CPU x items/s) / cores of the limit.",
            "",
            "| " + " | ".join(self.HEADER) + " |",
            "|" + "|".join("---" if i < 3 or i == len(self.HEADER) - 1 else "---:" for i in range(len(self.HEADER))) + "|",
        ]
        out += ["| " + " | ".join(r) + " |" for r in self.table_rows()]
        out += ["", "| target (issue 5) | workload | workers | measured | goal | verdict |", "|---|---|---:|---:|---:|---|"]
        for t in self.targets:
            verdict = {True: "met", False: "**missed**", None: "n/a"}[t.met]
            out.append(f"| {t.name} | {t.workload} | {t.workers} | {t.value:.2f} | {t.goal} | {verdict} {t.detail} |")
        if self.crash:
            out += ["", "| crash figures | workload | workers | cold start s | kill -> READY s | kill -> first result s "
                    "| items/s, no kills | items/s, 1 kill/s | ratio | kills | replayed | outputs checked |",
                    "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
            for c in self.crash:
                s = c.summary
                out.append(f"| {c.error or 'SIGKILL of a worker'} | {c.workload} | {c.workers} | {s['cold_start_s']:.3f} | "
                           f"{s['recovery_ready_s']:.3f} | {s['recovery_serving_s']:.3f} | "
                           f"{c.items_per_s_no_kills:,.0f} | {c.items_per_s_kill_per_s:,.0f} | "
                           f"{s['kill_throughput_ratio']:.2f} | {c.kills} | {c.replayed} | {c.checked} |")
        if self.memory:
            out += ["", "| memory (MiB) | bare process | session | slabpool worker (private) | arena pages in worker "
                    "| overhead | shm in use (peak) | shm capacity |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
            for mem in self.memory:
                out.append(f"| {mem.workload} ({mem.workers} workers) {mem.error} | {mem.bare_process_bytes / MiB:.1f} | "
                           f"{mem.session_bytes / MiB:.1f} | {mem.slabpool_worker_bytes / MiB:.1f} | "
                           f"{mem.slabpool_worker_shm_bytes / MiB:.1f} | {mem.overhead_bytes / MiB:.1f} | "
                           f"{mem.shm_in_use_peak_bytes / MiB:.1f} | {mem.shm_capacity_bytes / MiB:.0f} |")
        notes = sorted({(m.contender, m.note) for m in self.measurements if m.note})
        out += ["", "Contenders: " + "; ".join(f"**{c}**: {n}" for c, n in notes) + "."]
        return "\n".join(out) + "\n"

    def plot(self, path: Path) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        workloads = list(dict.fromkeys(m.workload for m in self.measurements))
        cols = min(3, max(1, len(workloads)))
        rows = (len(workloads) + cols - 1) // cols
        fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 4 * rows), squeeze=False)
        for ax, wl in zip(axes.flat, workloads, strict=False):
            ns = sorted({m.workers for m in self.measurements if m.workload == wl and m.contender != "serial"})
            names = dict.fromkeys(m.contender for m in self.measurements if m.workload == wl)
            for name in names:
                ys = [self.rate(wl, name, n) for n in ns]
                pts = [(n, y) for n, y in zip(ns, ys, strict=True) if y > 0]
                if pts:
                    style = "-" if name in SLABPOOL else "--" if name == "serial" else "-."
                    ax.plot(*zip(*pts, strict=True), style, marker="o", label=name,
                            linewidth=2.5 if name in SLABPOOL else 1.2)
            limit = [(n, self.limit(wl, n)) for n in ns if self.limit(wl, n)]
            if limit:
                ax.plot(*zip(*limit, strict=True), ":", color="black", label="limit")
            ax.set(title=wl, xlabel="workers", ylabel="items/s", yscale="log", xticks=ns)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        for ax in list(axes.flat)[len(workloads):]:
            ax.axis("off")
        fig.suptitle(f"slabpool bench, {self.machine['cpu']} ({self.machine['cores']} cores)", fontsize=10)
        fig.tight_layout()
        fig.savefig(path, dpi=110, format="png")
        plt.close(fig)

    def write(self, out: Path) -> list[Path]:
        """latest.json, latest.md, latest.png under `out`, each written whole (tmp + rename)."""
        out.mkdir(parents=True, exist_ok=True)
        written = []
        for name, writer in (("latest.json", self.to_json), ("latest.md", self.markdown)):
            _atomic_text(out / name, writer())
            written.append(out / name)
        tmp = out / "latest.png.tmp"
        self.plot(tmp)
        os.replace(tmp, out / "latest.png")
        written.append(out / "latest.png")
        return written


def _atomic_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _load(machine: dict[str, Any]) -> str:
    parts = [machine.get(k) for k in ("loadavg_at_start", "loadavg_at_end")]
    return " -> ".join(f"{p[0]:.1f}" for p in parts if p) or "?"


def _caller_share(m: Measurement | None) -> str:
    """How much of the cores the engine's own process took: what the workers could not use."""
    if m is None or m.status != "ok":
        return ""
    cores = m.caller_cpu_us * m.items_per_s / 1e6
    return f"the engine's process used {m.caller_cpu_us:,.0f} us of CPU per item, {cores:.2f} of a core"


def _ms(v: float) -> str:
    return "n/a" if math.isnan(v) else f"{v:.2f}"  # n/a: a pool that submits by itself


def _f(v: float) -> str:
    return f"{v:.3f}" if v < 0.1 else f"{v:.2f}"


def _x(v: float) -> str:
    return f"{v:.2f}x" if v else ""


def _us(rate: float) -> str:
    return f"{1e6 / rate:,.1f}" if rate else ""


def machine_info() -> dict[str, Any]:
    import datetime

    import numpy as np

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        import onnxruntime

        ort = onnxruntime.__version__
    except ImportError:
        ort = "?"
    return {
        "cpu": cpu,
        "cores": len(os.sched_getaffinity(0)),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "onnxruntime": ort,
        "numpy": np.__version__,
        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
    }

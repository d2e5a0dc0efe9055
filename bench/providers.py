"""Which execution providers slabpool really applies on this host, strict and with fallback.

    python -m bench.providers [--out DIR]

For every provider onnxruntime lists as available, and for CUDA (available or not), build an
Engine on a small conv net, first strict (a provider that cannot run the model must fail the
engine at construction), then with allow_fallback=True, and print what `stats()` says is in
use and whether the outputs match the CPU reference. Writes providers.json under --out.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from slabpool import Engine
from slabpool.workers.errors import SessionInitError
from tests.models import onnx_models


def probe(model: Path, provider: str, x: np.ndarray, want: np.ndarray) -> list[dict[str, Any]]:
    rows = []
    for fallback in (False, True):
        row: dict[str, Any] = {"provider": provider, "allow_fallback": fallback}
        t0 = time.monotonic()
        try:
            with Engine(model, workers=1, providers=[provider], allow_fallback=fallback) as eng:
                got = eng.infer({"image": x})["probs"]
                slot = eng.stats().slots[0]
            row.update(built=True, applied=list(slot.applied), degraded=slot.degraded,
                       max_abs_diff=float(np.abs(got - want).max()))
        except SessionInitError as exc:
            row.update(built=False, error=str(exc).splitlines()[0][:300])
        row["seconds"] = round(time.monotonic() - t0, 2)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    args = ap.parse_args(argv)
    import onnxruntime as ort

    available = ort.get_available_providers()
    with tempfile.TemporaryDirectory() as tmp:
        model = onnx_models.convnet(Path(tmp) / "convnet.onnx")
        x = np.random.default_rng(0).standard_normal((4, 3, 16, 16)).astype(np.float32)
        with Engine(model, workers=1) as eng:
            want = eng.infer({"image": x})["probs"]
        rows = [r for p in dict.fromkeys([*available, "CUDAExecutionProvider"]) for r in probe(model, p, x, want)]
    report = {"onnxruntime": ort.__version__, "available": available, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "providers.json").write_text(json.dumps(report, indent=2))
    print(f"onnxruntime {ort.__version__}; available: {available}")
    for r in rows:
        what = f"applied={r['applied']} degraded={r['degraded']} max|diff|={r['max_abs_diff']:.1e}" if r["built"] \
            else f"SessionInitError: {r['error']}"
        print(f"  {r['provider']:<28} fallback={r['allow_fallback']!s:<5} {what}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

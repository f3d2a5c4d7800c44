"""The committed stubs in generated/ are exactly what `make protos` makes from protos/."""

from __future__ import annotations

import filecmp
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_generated_stubs_match_the_protos(tmp_path: Path) -> None:
    out = tmp_path / "generated"
    subprocess.run([sys.executable, str(ROOT / "scripts/gen_protos.py"), str(out)], check=True)
    fresh = sorted(p.relative_to(out) for p in out.rglob("*") if p.is_file())
    committed = sorted(
        p.relative_to(ROOT / "generated")
        for p in (ROOT / "generated").rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    )
    assert fresh == committed, "generated/ has missing or extra files: run `make protos`"
    stale = [
        str(p) for p in fresh if not filecmp.cmp(out / p, ROOT / "generated" / p, shallow=False)
    ]
    assert not stale, f"generated/ is stale ({', '.join(stale)}): run `make protos`"

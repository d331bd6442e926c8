"""Where things are in this checkout."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
SERVICES = ROOT / "deploy" / "local" / "services.sh"

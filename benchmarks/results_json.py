"""The JSON files beside RESULTS.md: a benchmark's rows by section, each with its date, device and jax version.

A run rewrites the sections it ran and keeps the others as an earlier run left them, so that running one section
never loses another's figures. `notebooks/performance.ipynb` plots them.
"""

import json
import time
from pathlib import Path

import jax


def write_sections(path, rows_by_section: dict[str, list], **fields) -> None:
    """Replace `rows_by_section`'s sections in the JSON file `path` (created if missing), each stamped with
    today's date, the device and jax's version, and `fields`."""
    path = Path(path)
    record = json.loads(path.read_text()) if path.exists() else {"sections": {}}
    stamp = dict(date=time.strftime("%Y-%m-%d"), device=jax.devices()[0].device_kind, jax=jax.__version__)
    for section, rows in rows_by_section.items():
        record["sections"][section] = dict(stamp, **fields, rows=rows)
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {path}")

"""Records of the decode benchmark (`python -m t6.bench.decode --json PATH`) for the tokens/s columns."""

from __future__ import annotations

import json
from pathlib import Path

from t6.errors import DamagedFile, MissingFile


def load_decode_records(path: str | Path) -> list[dict]:
    """Records of `python -m t6.bench.decode --json PATH`: a list, or a dict holding it under "records"/"results"."""
    path = Path(path)
    if not path.is_file():
        raise MissingFile(
            f"decode benchmark JSON {path} does not exist (make it with python -m t6.bench.decode --json {path})"
        )
    try:
        data = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise DamagedFile(
            f"--decode-json {path} is not JSON ({err}); make it with python -m t6.bench.decode --json"
        ) from None
    if isinstance(data, dict):
        data = data.get("records", data.get("results"))
    if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
        raise DamagedFile(f'{path}: expected a list of records (or {{"records": [...]}}) from t6.bench.decode')
    for i, record in enumerate(data):
        lacking = [k for k in ("attention", "context", "tokens_per_s") if k not in record]
        if lacking:
            raise DamagedFile(f"{path}: record {i} lacks {', '.join(lacking)}")
    return data

"""The fingerprint of a reasoning-gym dataset's first problems, to tell whether they change with Python's
string-hash seed (`lit_rlhf.tasks.rgym.depends_on_hash_seed`).

Also a script (`runpy.run_path` on this file in a fresh interpreter started with a fixed PYTHONHASHSEED): it imports
nothing of lit_rlhf, so it starts in reasoning-gym's import time, not torch's, and prints the fingerprint of the
pickled (dataset name, knobs, size) given as its first argument in base64 (`encode`).
"""

from __future__ import annotations

import base64
import hashlib
import pickle
import sys
from typing import Any

ITEMS = 20
"""Problems in a fingerprint."""


def fingerprint(name: str, knobs: dict[str, Any], size: int) -> str:
    """SHA-256 of the first `ITEMS` problems (question and answer) of dataset `name` with `knobs`, seed 0, `size`
    items per instance (as the streams make them)."""
    from reasoning_gym.factory import DATASETS

    dataset_cls, config_cls = DATASETS[name]
    dataset = dataset_cls(config=config_cls(**knobs, seed=0, size=size))
    items = (dataset[i] for i in range(ITEMS))
    return hashlib.sha256("\n".join(f"{item['question']}\t{item['answer']}" for item in items).encode()).hexdigest()


def encode(name: str, knobs: dict[str, Any], size: int) -> str:
    """The script's argument for `fingerprint(name, knobs, size)`."""
    return base64.b64encode(pickle.dumps((name, knobs, size))).decode()


if __name__ == "__main__":
    print(fingerprint(*pickle.loads(base64.b64decode(sys.argv[1]))))

"""``transformers.Trainer`` with only the Accelerate patch: ``install_globally()``, no callback.

Run by ``test_accelerate_run.py`` as ``python _accelerate_trainer_script.py OUT``; the
training (a whole run, then a resume from its mid-run checkpoint) is
``_transformers_tiny.main``, which saves both endings to ``OUT/result.pt``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from swapopt_plugins.accelerate import install_globally  # noqa: E402

if __name__ == "__main__":
    print(f"install_globally: {install_globally()}", flush=True)
    import _transformers_tiny

    _transformers_tiny.main(sys.argv[1])

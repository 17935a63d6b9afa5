"""The project's test harness: helpers that the tests, the benchmarks and the demo import by name.

Installed with the project (``make setup``: an editable install), never imported by a product package
(``dynamo.*``). Paths are the repository's: the harness is for a checkout, not for a deployment.
"""

from __future__ import annotations

from pathlib import Path

# testing/src/dynamo_fpm_testing/__init__.py -> the repository root.
REPO = Path(__file__).resolve().parents[3]

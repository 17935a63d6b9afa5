"""The one-command disaggregated demo: ``python launch/demo.py [flags]`` (``make demo``).

The code is ``demo_lib.cli`` (installed with the project; run as a script, Python finds ``demo_lib`` next to
this file: no import-path set-up)."""

from __future__ import annotations

import sys

from demo_lib.cli import main

if __name__ == "__main__":
    sys.exit(main())

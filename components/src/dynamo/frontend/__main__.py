"""``python -m dynamo.frontend``: see ``dynamo.frontend.main`` and docs/worker.md."""

import os
import sys

if __name__ == "__main__":
    from dynamo.frontend.main import main

    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

"""``python -m dynamo.vllm``: see ``dynamo.vllm.main`` and docs/worker.md."""

import os
import sys

if __name__ == "__main__":
    from dynamo.vllm.main import main

    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Leave without joining the runtime's and vLLM's background threads: everything was stopped already.
    os._exit(code)

"""Exec a command with some environment variables set to free TCP ports picked now, outside the kernel's
ephemeral range so that nothing takes them before the command binds them (``dynamo.common.ports``).

    python free_port_exec.py VAR [VAR ...] -- COMMAND [ARGS ...]

Workers that a planner starts from one fixed command template each still need their own NIXL
side-channel port; this picks one at start and then becomes the command (same pid, so the planner's
SIGTERM reaches the worker directly).
"""

from __future__ import annotations

import os
import sys

from dynamo.common.ports import stable_free_port


def main(argv: list[str]) -> int:
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        print("usage: free_port_exec.py VAR [VAR ...] -- COMMAND [ARGS ...]", file=sys.stderr)
        return 2
    split = argv.index("--")
    env = dict(os.environ)
    for var in argv[:split]:
        env[var] = str(stable_free_port())
    command = argv[split + 1 :]
    os.execvpe(command[0], command, env)
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
